"""Tests of the `streams` command line (contract surface 3) against a real PostgreSQL.

Commands run in-process through `click.testing.CliRunner` with ``--database-url`` given
explicitly; the outer environment's ``STREAMS_*`` settings are cleared, so nothing here can
touch a developer's or CI's real database. JSON output (``--json``) is what scripts rely on,
so its shape is checked exactly; errors must be one line on stderr and never show a password.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner, Result
from helpers import default_sigint
from servers import create_database, drop_database

from streams import Client, redact_url
from streams.command import main
from streams.migrate import upgrade
from streams.types import FactChunk

ENV_VARS = ("STREAMS_DATABASE_URL", "STREAMS_REDIS_URL", "STREAMS_PREFIX")
DEAD_URL = "postgresql://u:topsecret@127.0.0.1:1/x"
HOUR_MS = 3_600_000


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No command here may pick up the developer's or CI's real settings."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    # DEAD_URL on purpose: one attempt, not the wait for a starting server.
    monkeypatch.setenv("STREAMS_CONNECT_TIMEOUT", "0")


@pytest.fixture
def fresh_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty (unmigrated) database for one test, dropped afterwards."""
    url = create_database(postgres_admin_url, prefix="streams_cli")
    yield url
    drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))


def cli(url: str, *args: str, stdin: str | None = None) -> Result:
    """Run ``streams ARGS --database-url URL`` in-process."""
    return CliRunner().invoke(main, [*args, "--database-url", url], input=stdin)


def ok(result: Result) -> str:
    """Assert a command succeeded; return its stdout."""
    assert result.exit_code == 0, (
        f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}\n"
        f"exception: {result.exception!r}"
    )
    return result.stdout


def one_json(result: Result) -> Any:
    """The single JSON document a successful ``--json`` command printed."""
    out = ok(result)
    assert len(out.strip().splitlines()) == 1, out
    return json.loads(out)


def json_lines(result: Result) -> list[dict[str, Any]]:
    return [json.loads(line) for line in ok(result).splitlines() if line.strip()]


def error_line(result: Result, exit_code: int = 1) -> str:
    """Assert a command failed with `exit_code` and a one-line ``Error: ...``; return it."""
    assert result.exit_code == exit_code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # no traceback
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    return lines[0]


def usage_error(result: Result) -> str:
    """Assert a click usage error (exit 2, "Usage:" and one "Error:" line); return stderr."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Usage:" in result.stderr
    assert sum(line.startswith("Error: ") for line in result.stderr.splitlines()) == 1
    return result.stderr


def with_password(url: str, password: str) -> str:
    """`url` with its password replaced by (or set to) `password`."""
    parts = urlsplit(url)
    user = parts.username or "postgres"
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}:{password}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def create(url: str, name: str, *options: str) -> dict[str, Any]:
    info = one_json(cli(url, "create", name, *options, "--json"))
    assert isinstance(info, dict)
    return info


def append(url: str, name: str, *payloads: str, timestamp: int | None = None) -> dict[str, Any]:
    extra = ("--timestamp", str(timestamp)) if timestamp is not None else ()
    ack = one_json(cli(url, "append", name, *payloads, *extra, "--json"))
    assert isinstance(ack, dict)
    return ack


def listed(url: str) -> dict[str, dict[str, Any]]:
    rows = one_json(cli(url, "list", "--json"))
    assert isinstance(rows, list)
    return {row["name"]: row for row in rows}


def read(url: str, name: str, *options: str) -> list[dict[str, Any]]:
    return json_lines(cli(url, "read", name, *options, "--json"))


# ---------------------------------------------------------------------------------------------
# migrate


def test_migrate_is_idempotent_and_redacts_the_url(fresh_url: str) -> None:
    outputs = [ok(cli(fresh_url, "migrate")) for _ in range(2)]
    for out in outputs:
        assert out.strip() == f"{redact_url(fresh_url)}: schema at 0020_domain_checks"
    password = urlsplit(fresh_url).password
    if password:
        assert password not in "".join(outputs)
        assert "***" in outputs[0]


def test_migrate_prints_a_url_with_a_password_redacted(streams_url: str) -> None:
    # With trust authentication the wrong password still connects (exit 0); otherwise the
    # error line names the URL. Either way it is shown, redacted.
    url = with_password(streams_url, "migr4te-s3cret")
    result = cli(url, "migrate")
    assert result.exit_code in (0, 1), result.output
    assert "migr4te-s3cret" not in result.output
    assert redact_url(url) in result.output
    assert ":***@" in result.output


# ---------------------------------------------------------------------------------------------
# create / list


def test_create_json_prints_the_settings(streams_url: str, unique_name: str) -> None:
    assert create(streams_url, unique_name) == {
        "name": unique_name,
        "timestamping": "client-prefer",
        "uncapped": False,
        "retention_ms": None,
        "fact_tables": [],
        "key_window_ms": 86_400_000,
        "created": True,
    }
    # Idempotent when the settings match; it says the stream existed.
    again = create(streams_url, unique_name)
    assert again["name"] == unique_name and again["created"] is False


def test_create_bad_name_is_one_line_error(streams_url: str) -> None:
    line = error_line(cli(streams_url, "create", "Not A Name"))
    assert line.startswith("Error: InvalidStreamName: ")


def test_create_with_other_settings_is_stream_exists(streams_url: str, unique_name: str) -> None:
    create(streams_url, unique_name)
    line = error_line(cli(streams_url, "create", unique_name, "--uncapped"))
    assert line.startswith("Error: StreamExists: ")


def test_create_options_are_honoured(streams_url: str, unique_name: str) -> None:
    info = create(
        streams_url,
        unique_name,
        "--timestamping",
        "client-require",
        "--uncapped",
        "--retention",
        "60000",
        "--key-window",
        "90m",
    )
    expected = {
        "name": unique_name,
        "timestamping": "client-require",
        "uncapped": True,
        "retention_ms": 60000,
        "fact_tables": [],
        "key_window_ms": 90 * 60_000,
    }
    assert info == {**expected, "created": True}
    row = listed(streams_url)[unique_name]
    assert row == {**expected, "linear": 0, "max_allocated": 0, "writers": 0, "groups": 0, "lag": 0}


def test_create_rejects_unknown_timestamping(streams_url: str, unique_name: str) -> None:
    usage_error(cli(streams_url, "create", unique_name, "--timestamping", "sometimes"))


def test_list_json_is_one_document(streams_url: str, unique_name: str) -> None:
    create(streams_url, unique_name)
    append(streams_url, unique_name, '{"x":1}', '{"x":2}')
    row = listed(streams_url)[unique_name]
    assert row["linear"] == 2
    assert row["max_allocated"] == 2
    assert set(row) == {
        "name",
        "timestamping",
        "uncapped",
        "retention_ms",
        "fact_tables",
        "key_window_ms",
    } | {
        "linear",
        "max_allocated",
    } | {"writers", "groups", "lag"}  # issue 40: new keys only
    text = ok(cli(streams_url, "list"))
    assert unique_name in text


# ---------------------------------------------------------------------------------------------
# append


def test_append_arguments_json(streams_url: str, stream: str) -> None:
    ack = append(streams_url, stream, '{"a":1}', '{"b":2}')
    assert ack["first_id"] == 1
    assert ack["last_id"] == 2
    assert ack["count"] == 2
    assert ack["first_timestamp"] <= ack["last_timestamp"]
    assert set(ack) == {"first_id", "last_id", "count", "first_timestamp", "last_timestamp"}
    assert [r["payload"] for r in read(streams_url, stream)] == [{"a": 1}, {"b": 2}]


def test_append_from_stdin_json_lines(streams_url: str, stream: str) -> None:
    ack = one_json(cli(streams_url, "append", stream, "--json", stdin='{"c":3}\n\n[4, "x"]\n'))
    assert (ack["first_id"], ack["last_id"], ack["count"]) == (1, 2, 2)
    assert [r["payload"] for r in read(streams_url, stream)] == [{"c": 3}, [4, "x"]]


def test_append_text_output(streams_url: str, stream: str) -> None:
    out = ok(cli(streams_url, "append", stream, "1", "2", "3"))
    assert out.strip() == "appended 3 fact(s): ids 1..3"


def test_append_invalid_json_is_usage_error(streams_url: str, stream: str) -> None:
    error = usage_error(cli(streams_url, "append", stream, '{"a":1}', "{bad"))
    assert "argument 2 is not JSON" in error and "nothing was appended" in error, error
    assert read(streams_url, stream) == []  # nothing was written


def test_a_bad_stdin_line_is_named_by_its_line(streams_url: str, stream: str) -> None:
    """Line 3 of the input, counted with the blank line before it: not "line 1 column 7", the
    position inside that one payload."""
    error = usage_error(cli(streams_url, "append", stream, stdin='{"a":1}\n\n{"b": x}\n{"c":3}\n'))
    assert "stdin line 3 is not JSON: Expecting value (column 7)" in error, error
    assert read(streams_url, stream) == []


def test_append_nothing_is_usage_error(streams_url: str, stream: str) -> None:
    usage_error(cli(streams_url, "append", stream, stdin="\n  \n"))


def test_append_unknown_stream(streams_url: str, unique_name: str) -> None:
    line = error_line(cli(streams_url, "append", unique_name, "{}"))
    assert line.startswith("Error: UnknownStream: ")


def test_append_timestamp_is_honoured(streams_url: str, stream: str) -> None:
    ack = append(streams_url, stream, '"x"', '"y"', timestamp=1_000)
    assert (ack["first_timestamp"], ack["last_timestamp"]) == (1_000, 1_000)
    assert [r["timestamp"] for r in read(streams_url, stream)] == [1_000, 1_000]


def test_append_timestamp_required_and_uncapped(streams_url: str, unique_name: str) -> None:
    create(streams_url, unique_name, "--timestamping", "client-require", "--uncapped")
    line = error_line(cli(streams_url, "append", unique_name, "{}"))
    assert line.startswith("Error: InvalidTimestamp: ")
    future = int(time.time() * 1000) + 365 * 24 * HOUR_MS
    ack = append(streams_url, unique_name, "{}", timestamp=future)
    assert ack["first_timestamp"] == future  # uncapped: kept although later than arrival


def test_append_future_timestamp_is_capped(streams_url: str, stream: str) -> None:
    future = int(time.time() * 1000) + 365 * 24 * HOUR_MS
    ack = append(streams_url, stream, "{}", timestamp=future)
    assert ack["first_timestamp"] < future


# ---------------------------------------------------------------------------------------------
# read


@pytest.fixture
def timed_stream(streams_url: str, stream: str) -> str:
    """A stream with facts 1..3 at timestamps 1000, 2000, 3000 and fact 4 at arrival time."""
    for n, stamp in enumerate((1_000, 2_000, 3_000), start=1):
        append(streams_url, stream, json.dumps({"n": n}), timestamp=stamp)
    append(streams_url, stream, '{"n":4}')
    return stream


def test_read_json_lines_in_id_order(streams_url: str, timed_stream: str) -> None:
    records = read(streams_url, timed_stream)
    assert [r["stream_id"] for r in records] == [1, 2, 3, 4]
    assert [r["payload"] for r in records] == [{"n": n} for n in (1, 2, 3, 4)]
    for record in records:
        assert set(record) == {"stream_id", "row", "instance", "timestamp", "payload"}
        assert record["row"] == 0
        assert isinstance(record["instance"], str)
    stamps = [r["timestamp"] for r in records]
    assert stamps[:3] == [1_000, 2_000, 3_000]
    assert stamps[3] > int(time.time() * 1000) - HOUR_MS


def test_read_text_output(streams_url: str, timed_stream: str) -> None:
    lines = ok(cli(streams_url, "read", timed_stream)).splitlines()
    assert len(lines) == 4
    assert lines[0].split()[:3] == ["1", "1970-01-01", "00:00:01.000Z"]


def test_read_from_id_and_limit(streams_url: str, timed_stream: str) -> None:
    assert [r["stream_id"] for r in read(streams_url, timed_stream, "--from-id", "2")] == [2, 3, 4]
    got = read(streams_url, timed_stream, "--from-id", "2", "--limit", "2")
    assert [r["stream_id"] for r in got] == [2, 3]
    assert [r["stream_id"] for r in read(streams_url, timed_stream, "--limit", "1")] == [1]
    assert read(streams_url, timed_stream, "--from-id", "5") == []
    result = cli(streams_url, "read", timed_stream, "--limit", "4")
    assert len(ok(result).splitlines()) == 4 and result.stderr == ""  # all of it: no note


def test_read_says_when_its_limit_stopped_it_and_how_to_read_on(
    streams_url: str, client: Client, stream: str
) -> None:
    """150 facts, and one of three rows: the default page of 100 rows, then a note on stderr
    (stdout stays data) naming where to go on; --from-id there reads the rest; --limit 0 reads
    everything; a limit inside a fact of several rows sends its rows again from --from-id."""
    with client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(150)])
        ack = writer.append_facts([FactChunk(['{"rows": 3}'] * 3, [None], sizes=[3])])
        assert ack is not None
        multi = ack.first_id
    result = cli(streams_url, "read", stream, "--json")
    rows = [json.loads(line) for line in ok(result).splitlines()]
    assert [r["stream_id"] for r in rows] == list(range(1, 101))
    assert result.stderr.strip() == (
        "(stopped after 100 rows, --limit; more follow: --from-id 101 reads on, --limit 0 reads "
        "to the end)"
    )
    rest = cli(streams_url, "read", stream, "--json", "--from-id", "101")
    assert len(ok(rest).splitlines()) == 50 + 3 and rest.stderr == ""
    assert len(ok(cli(streams_url, "read", stream, "--limit", "0")).splitlines()) == 153
    cut = cli(streams_url, "read", stream, "--json", "--from-id", str(multi), "--limit", "2")
    assert [json.loads(line)["row"] for line in ok(cut).splitlines()] == [0, 1]
    assert f"--from-id {multi} reads on" in cut.stderr


def test_read_from_time(streams_url: str, timed_stream: str) -> None:
    got = read(streams_url, timed_stream, "--from-time", "1500")
    assert [r["stream_id"] for r in got] == [2, 3, 4]
    got = read(streams_url, timed_stream, "--from-time", "3000")
    assert [r["stream_id"] for r in got] == [3, 4]
    got = read(streams_url, timed_stream, "--from-time", "0", "--limit", "1")
    assert [r["stream_id"] for r in got] == [1]


def test_read_ago(streams_url: str, timed_stream: str) -> None:
    assert [r["stream_id"] for r in read(streams_url, timed_stream, "--ago", "1h")] == [4]
    assert [r["stream_id"] for r in read(streams_url, timed_stream, "--ago", "1h30m")] == [4]
    # Further back than the epoch: every fact matches.
    assert len(read(streams_url, timed_stream, "--ago", "100000d")) == 4


@pytest.mark.parametrize(
    "options",
    [
        ("--from-id", "1", "--from-time", "0"),
        ("--from-id", "1", "--ago", "1h"),
        ("--from-time", "0", "--ago", "1h"),
    ],
)
def test_read_two_starts_is_usage_error(
    streams_url: str, stream: str, options: tuple[str, ...]
) -> None:
    assert "at most one" in usage_error(cli(streams_url, "read", stream, *options))


@pytest.mark.parametrize("ago", ["1x", "h", "5 m", "-5m", "1h-", ""])
def test_read_bad_ago_is_usage_error(streams_url: str, stream: str, ago: str) -> None:
    usage_error(cli(streams_url, "read", stream, "--ago", ago))


def test_read_unknown_stream(streams_url: str, unique_name: str) -> None:
    line = error_line(cli(streams_url, "read", unique_name))
    assert line.startswith("Error: UnknownStream: ")


def test_read_timestamps_are_non_decreasing(streams_url: str, client: Client, stream: str) -> None:
    # Writer a holds fact 1 (timestamp 9000) open while writer b completes fact 2 with an
    # earlier timestamp: stored timestamps then go down in ID order, and readers must raise
    # them to the running maximum.
    with (
        client.writer(stream, instance="cli-test-a") as a,
        client.writer(stream, instance="cli-test-b") as b,
        psycopg.connect(streams_url) as conn,
    ):
        with a.fact(conn, timestamp=9_000) as held:
            held.add({"by": "a"})
            assert b.append({"by": "b"}, timestamp=5_000).first_timestamp == 5_000
            a.heartbeat()
            b.heartbeat()
            assert read(streams_url, stream) == []  # fact 1 is not complete yet
        b.append({"by": "b", "n": 2}, timestamp=7_000)
    records = read(streams_url, stream)
    assert [r["stream_id"] for r in records] == [1, 2, 3]
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps)
    assert stamps == [9_000, 9_000, 9_000]
    # Starting in the middle keeps the floor from the facts before the start.
    assert [r["timestamp"] for r in read(streams_url, stream, "--from-id", "2")] == [9_000] * 2


def test_read_only_up_to_the_linear_position(streams_url: str, client: Client, stream: str) -> None:
    with (
        client.writer(stream, instance="cli-test-held") as a,
        client.writer(stream, instance="cli-test-free") as b,
        psycopg.connect(streams_url) as conn,
    ):
        b.append({"n": 1})
        with a.fact(conn) as held:
            held.add({"n": 2})
            b.append({"n": 3})
            a.heartbeat()  # positions reach the database with heartbeats
            b.heartbeat()
            assert [r["stream_id"] for r in read(streams_url, stream)] == [1]
        a.heartbeat()
        b.heartbeat()
        assert [r["stream_id"] for r in read(streams_url, stream)] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# positions


def test_positions_json(streams_url: str, stream: str) -> None:
    append(streams_url, stream, "1", "2", "3")
    data = one_json(cli(streams_url, "positions", stream, "--json"))
    assert isinstance(data, list)
    assert len(data) == 1
    (entry,) = data
    assert set(entry) == {
        "stream",
        "linear",
        "persisted_linear",
        "max_allocated",
        "scratchpad",
        "oldest_pending_ms",
        "pruned_through",
        "key_window_ms",
        "writers",
        "retired_writers",
        "groups",
    }
    assert entry["groups"] == {}
    assert (entry["stream"], entry["linear"], entry["max_allocated"]) == (stream, 3, 3)
    assert (entry["scratchpad"], entry["oldest_pending_ms"]) == (0, None)
    # The CLI's writer retired when `append` ended: folded away unless --all.
    assert (entry["writers"], entry["retired_writers"]) == ({}, 1)
    (entry,) = one_json(cli(streams_url, "positions", stream, "--json", "--all"))
    (writer,) = entry["writers"].values()
    assert writer["position"] == 3
    assert writer["state"] == "retired"
    assert set(writer) == {
        "position",
        "generation",
        "retired",
        "state",
        "lease_expires_in_ms",
        "heartbeat_age_ms",
        "pending",
    }

    # Without arguments: every stream, including both of ours.
    other = f"{stream}-2"
    create(streams_url, other)
    everything = one_json(cli(streams_url, "positions", "--json"))
    assert isinstance(everything, list)
    by_name = {e["stream"]: e for e in everything}
    assert {stream, other} <= set(by_name)
    assert set(by_name) == set(listed(streams_url))
    assert by_name[other]["linear"] == 0


def test_positions_text(streams_url: str, stream: str) -> None:
    append(streams_url, stream, "1")
    out = ok(cli(streams_url, "positions", stream))
    header, row = out.splitlines()[:2]
    assert header.split() == [
        "STREAM",
        "LINEAR",
        "MAX_ALLOCATED",
        "SCRATCHPAD",
        "OLDEST_PENDING_MS",
        "PRUNED_THROUGH",
        "KEY_WINDOW",
    ]
    assert row.split() == [stream, "1", "1", "0", "-", "0", "24h"]
    out = ok(cli(streams_url, "positions", stream, "--all"))
    assert "WRITER" in out and "retired" in out


def test_positions_unknown_stream(streams_url: str, unique_name: str) -> None:
    line = error_line(cli(streams_url, "positions", unique_name))
    assert line.startswith("Error: UnknownStream: ")


# ---------------------------------------------------------------------------------------------
# doctor


def test_doctor_healthy(fresh_url: str) -> None:
    upgrade(fresh_url)
    create(fresh_url, "doctor-stream")
    append(fresh_url, "doctor-stream", "{}")
    checks = one_json(cli(fresh_url, "doctor", "--json"))
    assert isinstance(checks, list)
    for check in checks:
        assert set(check) == {"name", "ok", "detail"}
        assert check["ok"] is True, check
    names = [c["name"] for c in checks]
    assert names[0] == "database"
    # The server's place in the deployment (`streams.ops.pg_topology`), then the schema.
    assert names[1].startswith("postgres ") and names[2] == "postgres replication"
    assert names[3] == "schema"
    assert "stream doctor-stream: sequence" in names
    assert "stream doctor-stream: writers" in names
    text = ok(cli(fresh_url, "doctor"))
    assert text.startswith("[ok] database: ")


def test_doctor_names_a_transaction_holding_the_stream_back(
    streams_url: str, client: Client, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import streams.ops.stream_checks

    monkeypatch.setattr(streams.ops.stream_checks, "HELD_WARNING_SECONDS", 0.0)
    name = f"stream {stream}: linear position"
    with client.writer(stream, instance="holder") as writer:
        writer.append({"before": 1})
        with (
            psycopg.connect(streams_url, application_name="holder-app") as conn,
            writer.fact(conn) as held,
        ):
            result = cli(streams_url, "doctor", "--json")
            assert result.exit_code == 1, result.output
            (check,) = [c for c in json.loads(result.stdout) if c["name"] == name]
            assert check["ok"] is False
            assert "1 session(s) holding its reservation locks" in check["detail"]
            assert "'holder-app'" in check["detail"]
            assert check["detail"].startswith(f"{held.stream_id - 1} ")
    (check,) = [c for c in one_json(cli(streams_url, "doctor", "--json")) if c["name"] == name]
    assert check == {"name": name, "ok": True, "detail": f"{held.stream_id} (max allocated "
                     f"{held.stream_id})"}  # fmt: skip


def test_doctor_unmigrated_database_fails(fresh_url: str) -> None:
    result = cli(fresh_url, "doctor", "--json")
    assert result.exit_code == 1, result.output
    checks = json.loads(result.stdout)
    found = [(c["name"], c["ok"]) for c in checks]
    assert found[0] == ("database", True) and found[-1] == ("schema", False)
    # Between them, the server's place in the deployment (`streams.ops.pg_topology`).
    assert [name.split(" ")[0] for name, _ in found[1:-1]] == ["postgres", "postgres"]


def test_doctor_dead_database(fresh_url: str) -> None:
    for extra in (("--json",), ()):
        result = cli(DEAD_URL, "doctor", *extra)
        assert result.exit_code == 1, result.output
        assert "topsecret" not in result.output
        assert "u:***@127.0.0.1:1/x" in result.output
    checks = json.loads(cli(DEAD_URL, "doctor", "--json").stdout)
    assert [(c["name"], c["ok"]) for c in checks] == [("database", False)]


# ---------------------------------------------------------------------------------------------
# Secrets


@pytest.mark.parametrize(
    "args",
    [
        ("doctor",),
        ("doctor", "--json"),
        ("positions",),
        ("positions", "--json"),
        ("positions", "no-such-stream"),
        ("list",),
        ("create", "Bad Name"),
        ("append", "no-such-stream", "{}"),
        ("migrate",),
        ("read", "no-such-stream"),
    ],
)
def test_no_command_prints_a_wrong_password(streams_url: str, args: tuple[str, ...]) -> None:
    # The server may accept the wrong password (trust authentication) or refuse it; either
    # way the password must not be shown.
    url = with_password(streams_url, "wr0ng-pa55word")
    result = cli(url, *args)
    assert "wr0ng-pa55word" not in result.output
    assert "wr0ng-pa55word" not in repr(result.exception)
    assert result.exit_code in (0, 1), result.output


@pytest.mark.parametrize(
    "args",
    [
        ("migrate",),
        ("create", "s1"),
        ("list",),
        ("append", "s1", "{}"),
        ("positions",),
        ("positions", "s1", "--json"),
        ("doctor",),
        ("demo", "--duration", "1", "--no-spark"),
    ],
)
def test_dead_database_is_one_line_error(args: tuple[str, ...]) -> None:
    result = cli(DEAD_URL, *args)
    assert result.exit_code == 1, result.output
    assert "topsecret" not in result.output
    assert "u:***@127.0.0.1:1/x" in result.output
    if args[0] != "doctor":
        assert error_line(result).startswith("Error: StoreError: ")


def test_read_dead_database_is_one_line_error() -> None:
    result = cli(DEAD_URL, "read", "s1")
    assert "topsecret" not in result.output
    assert error_line(result).startswith("Error: StoreError: ")


def test_missing_database_url_is_configuration_error() -> None:
    result = CliRunner().invoke(main, ["list"])
    assert error_line(result).startswith("Error: ConfigurationError: ")


def test_environment_variable_is_used(streams_url: str, stream: str) -> None:
    result = CliRunner().invoke(
        main, ["positions", stream, "--json"], env={"STREAMS_DATABASE_URL": streams_url}
    )
    assert one_json(result)[0]["stream"] == stream


# ---------------------------------------------------------------------------------------------
# demo and bench


def test_demo_checks_itself_without_spark(fresh_url: str) -> None:
    result = cli(
        fresh_url, "demo", "--duration", "4", "--writers", "2", "--rate", "40", "--no-spark",
        "--json",
    )  # fmt: skip
    summary = one_json(result)
    assert summary["ok"] is True, summary
    assert summary["problems"] == []
    assert summary["committed_facts"] > 100
    assert summary["python_facts"] == summary["committed_facts"]
    assert summary["committed_rows"] > summary["committed_facts"]  # multi-row facts
    assert redact_url(fresh_url) in result.stderr


def test_bench_write_small_run(fresh_url: str) -> None:
    upgrade(fresh_url)
    args = ("bench", "write", "--seconds", "0.3", "--rounds", "1", "--writers", "1")
    out = ok(cli(fresh_url, *args, "--memory-facts", "1000"))
    ratios = [line for line in out.splitlines() if "ratio" in line]
    assert len(ratios) == 2, out
    assert any(line.lstrip().startswith("single x1") for line in ratios), out
    assert any(line.lstrip().startswith("batch x1") for line in ratios), out
    assert all("keyed" in line for line in ratios), out  # keyed appends beside unkeyed ones
    keyed = [line for line in out.splitlines() if line.lstrip().startswith("keyed ")]
    assert len(keyed) == 2, out  # single and batch: beside unkeyed, with the ratio and target
    assert all("vs unkeyed" in line and "(target >= " in line for line in keyed), out
    assert "tracker memory over 1,000 completed facts" in out
    assert out.startswith(f"database {redact_url(fresh_url)}")


# ---------------------------------------------------------------------------------------------
# Entry points


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}


def test_python_dash_m_streams_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "streams", "--help"],
        capture_output=True,
        text=True,
        env=_clean_environ(),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("migrate", "create", "list", "append", "read", "positions", "doctor"):
        assert command in proc.stdout
    assert "bench" in proc.stdout
    assert "demo" in proc.stdout


def test_console_script() -> None:
    path = shutil.which("streams")
    if path is None:
        pytest.skip("the `streams` console script is not on PATH")
    proc = subprocess.run(
        [path, "--version"],
        capture_output=True,
        text=True,
        env=_clean_environ(),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "streams" in proc.stdout


def test_tables_declares_shows_and_clears_fact_tables(streams_url: str, unique_name: str) -> None:
    table = f"cli_lines_{unique_name.replace('-', '_')}"
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (stream_id bigint)")
    try:
        info = create(streams_url, unique_name, "--table", f"{table}.stream_id")
        assert info["fact_tables"] == [f"public.{table}.stream_id"]
        shown = json.loads(cli(streams_url, "tables", unique_name, "--json").output)
        assert shown["fact_tables"] == [f"public.{table}.stream_id"]
        result = cli(streams_url, "tables", unique_name)
        assert result.exit_code == 0
        assert f"public.{table}.stream_id" in result.output
        cleared = json.loads(cli(streams_url, "tables", unique_name, "--clear", "--json").output)
        assert cleared["fact_tables"] == []
        line = error_line(cli(streams_url, "tables", unique_name, "nope.stream_id"))
        assert line.startswith("Error: InvalidFactTables: no table")
    finally:
        with psycopg.connect(streams_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE {table}")


def test_tables_with_the_column_that_says_whose_a_row_is(
    streams_url: str, unique_name: str
) -> None:
    table = f"cli_shared_{unique_name.replace('-', '_')}"
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (stream_id bigint, stream text)")
    try:
        info = create(streams_url, unique_name, "--table", f"{table}.stream_id WHERE stream = 'x'")
        assert info["fact_tables"] == [f"public.{table}.stream_id WHERE stream = 'x'"]
        shown = one_json(cli(streams_url, "tables", unique_name, "--json"))
        assert shown["fact_tables"] == [f"public.{table}.stream_id WHERE stream = 'x'"]
        # Lowercase WHERE, a quote in the value: shown in the one full form.
        declared = f"{table}.stream_id where stream='it''s'"
        shown = one_json(cli(streams_url, "tables", unique_name, declared, "--json"))
        assert shown["fact_tables"] == [f"public.{table}.stream_id WHERE stream = 'it''s'"]
        out = ok(cli(streams_url, "tables", unique_name))
        assert f"fact tables besides streams_facts: public.{table}.stream_id WHERE " in out
        line = error_line(cli(streams_url, "tables", unique_name, f"{table}.stream_id WHERE x"))
        assert line.startswith("Error: InvalidFactTables: invalid fact table"), line
        assert "WHERE column = 'value'" in line
        line = error_line(
            cli(streams_url, "tables", unique_name, f"{table}.stream_id WHERE nope = 'x'")
        )
        assert line.startswith("Error: InvalidFactTables:") and "no column 'nope'" in line
        shown = one_json(cli(streams_url, "tables", unique_name, "--json"))
        assert shown["fact_tables"] == [f"public.{table}.stream_id WHERE stream = 'it''s'"]
    finally:  # no declaration of a dropped table left for other tests' doctors
        with psycopg.connect(streams_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE streams_registry SET fact_tables = '[]' WHERE name = %s", (unique_name,)
            )
            conn.execute(f"DROP TABLE {table}")


def test_ctrl_c_stops_read_follow_quietly_with_exit_130(
    streams_url: str, client: Client, stream: str
) -> None:
    """As a user runs it: `streams read --follow` prints what there is, waits, and Ctrl-C
    (SIGINT) ends it with 130, as shells expect of an interrupted command, and no traceback."""
    with client.writer(stream) as writer:
        writer.append({"n": 1})
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streams", "read", stream, "--follow", "--json",
         "--database-url", streams_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=default_sigint,  # noqa: PLW1509 (one signal call: no lock taken)
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["payload"] == {"n": 1}
        time.sleep(0.3)  # following: waiting for more
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_read_commit_commits_exactly_what_was_printed(
    streams_url: str, client: Client, stream: str
) -> None:
    """--limit ending inside an epoch (even inside a multi-row fact) used to commit nothing,
    silently. Now the group commits through the last fact printed whole."""
    with client.writer(stream, instance="w") as writer, psycopg.connect(streams_url) as conn:
        first = writer.append({"n": 1}).first_id
        with writer.fact(conn) as fact:
            fact.add({"n": 2, "row": 0}, {"n": 2, "row": 1}, {"n": 2, "row": 2})
        third = writer.append({"n": 3}).first_id

    def read(*options: str) -> list[dict[str, Any]]:
        result = cli(streams_url, "read", stream, "--group", "g", "--json", *options)
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in result.stdout.splitlines()]

    # 3 rows: the first fact and two of the second's three rows; commit through the first.
    assert [r["stream_id"] for r in read("--commit", "--limit", "3")] == [first] + [
        fact.stream_id
    ] * 2
    assert [g.position for g in client.groups(stream)] == [first]
    # Without --commit nothing moves; the second fact comes again, whole.
    assert [r["row"] for r in read("--limit", "3")] == [0, 1, 2]
    assert [g.position for g in client.groups(stream)] == [first]
    # Exactly the second fact: committed through it, the third still to come.
    assert len(read("--commit", "--limit", "3")) == 3
    assert [g.position for g in client.groups(stream)] == [fact.stream_id]
    # The rest: the whole epoch is committed.
    assert [r["stream_id"] for r in read("--commit")] == [third]
    assert [g.position for g in client.groups(stream)] == [third]
    assert read("--commit") == []


def test_a_command_that_uses_no_redis_ignores_a_bad_redis_url(
    streams_url: str, stream: str
) -> None:
    """A bad ``STREAMS_REDIS_URL`` (or ``--redis-url``, ``--prefix``) breaks only the commands
    that use Redis: `list` runs, `append` says what is wrong with the URL."""
    env = {"STREAMS_REDIS_URL": "bogus", "STREAMS_PREFIX": "a b"}
    listed = CliRunner().invoke(
        main, ["list", "--like", stream, "--database-url", streams_url], env=env
    )
    assert ok(listed).splitlines()[1].split()[0] == stream
    flagged = cli(streams_url, "list", "--like", stream, "--redis-url", "x y", "--prefix", "a b")
    assert stream in ok(flagged)
    appended = CliRunner().invoke(
        main, ["append", stream, '{"n": 1}', "--database-url", streams_url], env=env
    )
    assert appended.exit_code == 1 and "Redis URL must be" in appended.output, appended.output


def test_ctrl_c_in_any_command_exits_130_without_a_traceback(
    streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commands without a Ctrl-C path of their own end as the others do (click's default was
    "Aborted!" and exit 1)."""
    from streams.ops import stream_commands

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(stream_commands, "open_client", interrupted)
    result = cli(streams_url, "list")
    assert result.exit_code == 130, result.output
    assert "Aborted" not in result.output and "Traceback" not in result.output
