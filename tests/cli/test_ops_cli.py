"""The operator commands of issue 9: positions --watch / --all / --from-redis, writers prune,
read --format, doctor --repair, append on a terminal (CliRunner, real servers)."""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

import streams.ops.io_commands
from streams import Client
from streams.command import main
from streams.store.driver import run
from streams.store.writer_core import WriterCore


def cli(url: str | None, *args: str, redis_url: str | None = None) -> Result:
    argv = list(args)
    if url is not None:
        argv += ["--database-url", url]
    if redis_url is not None:
        argv += ["--redis-url", redis_url]
    return CliRunner().invoke(main, argv)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def test_positions_watch_prints_samples_with_rates(
    streams_url: str, client: Client, stream: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"n": n} for n in range(10)])
        out = ok(cli(streams_url, "positions", stream, "--watch", "--count", "2",
                     "--interval", "0.1", "--json"))  # fmt: skip
        samples = [json.loads(line) for line in out.splitlines()]
        assert len(samples) == 2
        assert samples[0][0]["rate"] is None
        assert samples[1][0]["rate"] == 0.0
        assert samples[1][0]["writers"]["w"]["state"] in ("idle", "active")
        text = ok(cli(streams_url, "positions", stream, "--watch", "--count", "2",
                      "--interval", "0.1"))  # fmt: skip
    assert text.count("STREAM") >= 2 * 2  # streams and writers tables, twice
    assert "RATE" in text and "/s" in text


def test_positions_shows_an_open_fact_and_a_group_lag(
    streams_url: str, client: Client, stream: str
) -> None:
    with client.writer(stream, instance="w") as writer, psycopg.connect(streams_url) as conn:
        writer.append({"n": 1})
        with client.reader(stream, group="g") as reader:
            list(reader.facts())
            reader.commit()
        writer.append({"n": 2})
        with writer.fact(conn) as held:
            held.add({"held": True})
            time.sleep(0.05)
            writer.heartbeat()
            (entry,) = json.loads(ok(cli(streams_url, "positions", stream, "--json")))
            assert entry["scratchpad"] == 1
            assert entry["oldest_pending_ms"] >= 50
            assert entry["writers"]["w"]["state"] == "active"
            assert entry["groups"]["g"]["lag"] == 1
            assert entry["groups"]["g"]["lag_ms"] >= 0


def test_positions_from_redis_needs_no_database(
    client: Client, stream: str, redis_url: str, redis_prefix: str, streams_url: str
) -> None:
    import streams as streams_pkg

    with (
        streams_pkg.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as rclient,
        rclient.writer(stream, instance="answering") as writer,
    ):
        last = writer.append({"n": 1}).last_id
        time.sleep(0.2)
        result = cli(None, "positions", "--from-redis", "--prefix", redis_prefix, "--json",
                     redis_url=redis_url)  # fmt: skip
        data: dict[str, Any] = json.loads(ok(result))
        assert data["prefix"] == redis_prefix
        mine = [p for p in data["positions"] if p["instance"] == "answering"]
        assert mine and mine[0]["stream"] == stream and mine[0]["new_token"] >= last
        text = ok(cli(None, "positions", "--from-redis", "--prefix", redis_prefix,
                      redis_url=redis_url))  # fmt: skip
        assert text.splitlines()[0].split() == ["STREAM", "INSTANCE", "POSITION", "ANSWER_MS"]
    # Nobody answers: non-zero exit, one clear line.
    result = cli(None, "positions", "--from-redis", "--prefix", f"{redis_prefix}-empty",
                 redis_url=redis_url)  # fmt: skip
    assert result.exit_code == 1
    assert "no POSITION answered REPLICATE" in result.stderr


def test_writers_prune_removes_old_retired_rows_only(
    streams_url: str, client: Client, stream: str
) -> None:
    with client.writer(stream, instance="old"):
        pass
    with client.writer(stream, instance="live"):
        with psycopg.connect(streams_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE streams_writers SET heartbeat_at = now() - interval '2 days' "
                "WHERE instance = 'old'"
            )
        out = json.loads(ok(cli(streams_url, "writers", "prune", stream, "--older-than", "1d",
                                "--json")))  # fmt: skip
        assert out == {stream: ["old"]}
        assert set(client.positions(stream).writers) == {"live"}


def test_doctor_repair_fixes_a_sequence_and_retires_an_expired_writer(
    streams_url: str, client: Client, stream: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        last = writer.append_batch([{"n": n} for n in range(5)]).last_id
    info = client.stream(stream)
    with psycopg.connect(streams_url) as conn:
        dead = WriterCore(stream, "dead", lease_seconds=0.5, max_payload_bytes=1 << 20)
        run(conn, dead.register())  # and never heartbeats again
        conn.execute(f"SELECT setval('{info.sequence_name}', 1)")
        conn.commit()
    time.sleep(0.7)
    result = cli(streams_url, "doctor", "--repair", "--json")
    data = json.loads(result.stdout)
    repaired = data["repaired"]
    assert f"stream {stream}: retired writer dead (lease expired)" in repaired
    assert f"stream {stream}: sequence moved to {last}" in repaired
    checks = {c["name"]: c for c in data["checks"]}
    assert checks[f"stream {stream}: sequence"]["ok"] is True
    assert checks[f"stream {stream}: writers"]["ok"] is True


def test_read_format_table_and_json(streams_url: str, client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        writer.append({"ü": 1}, timestamp=1_700_000_000_123)
    table = ok(cli(streams_url, "read", stream, "--format", "table"))
    assert "2023-11-14 22:13:20.123Z" in table and '{"ü": 1}' in table
    (record,) = [
        json.loads(x) for x in ok(cli(streams_url, "read", stream, "--format", "json")).splitlines()
    ]
    assert record["timestamp"] == 1_700_000_000_123
    result = cli(streams_url, "read", stream, "--format", "table", "--json")
    assert result.exit_code == 2


def test_append_from_a_terminal_stdin_says_what_to_do(
    streams_url: str, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streams.ops.io_commands, "_stdin_terminal", lambda: True)
    result = cli(streams_url, "append", stream)
    assert result.exit_code == 2
    assert "pipe JSON lines" in result.stderr


def test_keys_list_and_rotate_never_show_a_secret(streams_url: str) -> None:
    before = json.loads(ok(cli(streams_url, "keys", "--json")))
    assert [k["live"] for k in before][:1] == [True]  # the migration's first key
    rotated = json.loads(ok(cli(streams_url, "keys", "rotate", "--json")))
    after = json.loads(ok(cli(streams_url, "keys", "--json")))
    assert after[0] == {**after[0], "id": rotated["key"], "live": True, "retired_at": None}
    assert all(not k["live"] and k["retired_at"] for k in after[1:])
    assert len(after) == len(before) + 1
    text = ok(cli(streams_url, "keys"))
    assert f"key {rotated['key']}: created" in text and "retired" in text
    with psycopg.connect(streams_url) as conn:
        secrets = [
            bytes(s)
            for row in conn.execute(
                "SELECT s.seed, k.cipher_key FROM streams_keys k "
                "JOIN streams_prover.signing_keys s ON s.key_id = k.id"
            )
            for s in row
        ]
    assert secrets
    for secret in secrets:
        assert secret.hex() not in text and secret.hex() not in json.dumps(after)
    assert all(k["incarnation"] for k in after[:1])


def test_async_client_lists_and_rotates_keys(streams_url: str) -> None:
    import asyncio

    import streams

    async def main() -> None:
        async with await streams.aconnect(streams_url) as client:
            new = await client.rotate_replication_keys()
            keys = await client.replication_keys()
            assert keys[0]["id"] == new and keys[0]["live"]
            assert all(not k["live"] for k in keys[1:])
            assert all("secret" not in k for k in keys)

    asyncio.run(main())
