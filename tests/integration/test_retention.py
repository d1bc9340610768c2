"""Retention (`streams.store.retention.prune`): old facts go in short transactions, never past the
complete position or a reader group, and every read that needs removed facts fails loudly."""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from helpers import wait_until

import streams
from streams import Client, FactsPruned
from streams.command import main

HOUR_MS = 3_600_000


def old_ms(hours: float = 2.0) -> int:
    return int((time.time() - hours * 3600) * 1000)


def stream_ids(client: Client, stream: str) -> list[int]:
    with psycopg.connect(client.settings.database_url) as conn:
        rows = conn.execute(
            "SELECT f.stream_id FROM streams_facts f JOIN streams_registry r ON r.id = f.stream "
            "WHERE r.name = %s ORDER BY 1",
            (stream,),
        ).fetchall()
    return [int(r[0]) for r in rows]


def read_all(client: Client, stream: str, **kwargs: Any) -> list[int]:
    with client.reader(stream, **kwargs) as reader:
        return [fact.stream_id for epoch in reader.epochs(idle_timeout=0.0) for fact in epoch]


def fill(client: Client, stream: str, old: int, new: int) -> tuple[list[int], list[int]]:
    """``old`` facts two hours old, then ``new`` facts of now; their IDs."""
    base = old_ms()
    with client.writer(stream, instance="w") as writer:
        olds = [writer.append({"n": k}, timestamp=base + k).first_id for k in range(old)]
        news = [writer.append({"n": k}).first_id for k in range(new)]
    return olds, news


def test_prune_removes_what_retention_allows_in_batches(client: Client, stream: str) -> None:
    olds, news = fill(client, stream, 25, 5)
    # Without retention nothing goes.
    result = client.prune(stream)
    assert (result.after, result.rows_deleted, result.limited_by) == (0, 0, "no retention")
    client.set_retention(stream, HOUR_MS)
    result = client.prune(stream, batch=7)
    assert result.before == 0 and result.after == olds[-1] == result.target
    assert result.rows_deleted == 25 and result.transactions >= 4
    assert result.limited_by == "retention"
    assert stream_ids(client, stream) == news
    assert client.positions(stream).as_dict()["pruned_through"] == olds[-1]
    # Idempotent: nothing more is old enough.
    again = client.prune(stream)
    assert (again.before, again.after, again.rows_deleted) == (olds[-1], olds[-1], 0)
    # "earliest" is the oldest fact kept; an ID below it cannot be read any more.
    assert read_all(client, stream, start="earliest") == news
    with pytest.raises(FactsPruned) as caught:
        client.reader(stream, start=olds[3])
    assert (caught.value.stream, caught.value.position, caught.value.pruned_through) == (
        stream,
        olds[3] - 1,
        olds[-1],
    )
    assert "removed by retention" in str(caught.value)
    assert read_all(client, stream, start=news[0]) == news


def test_prune_stops_at_reader_groups_and_pending_facts(
    client: Client, stream: str, streams_url: str
) -> None:
    client.set_retention(stream, HOUR_MS)
    olds, _ = fill(client, stream, 10, 0)
    with client.reader(stream, start="earliest", group="slow", page_size=4) as reader:
        reader.poll(timeout=0)
        reader.commit()
        held_at = reader.position()
    assert 0 < held_at < olds[-1]
    result = client.prune(stream)
    assert (result.after, result.limited_by) == (held_at, "group slow")
    assert stream_ids(client, stream)[0] == held_at + 1
    # The group resumes where it was: nothing it needed is gone.
    assert read_all(client, stream, group="slow") == olds[olds.index(held_at) + 1 :]
    # A pending fact (old timestamp, still open) holds retention below it.
    with (
        client.writer(stream, instance="holder") as writer,
        psycopg.connect(streams_url) as conn,
        writer.fact(conn, timestamp=old_ms()) as pending,
    ):
        pending.add({"late": True})
        with client.writer(stream, instance="w2") as other:
            other.append({"after": True}, timestamp=old_ms())
        client.delete_group(stream, "slow")
        result = client.prune(stream)
        assert result.after == pending.stream_id - 1
        assert result.limited_by.startswith("complete position")
    assert client.prune(stream).after == pending.stream_id + 1  # both old now complete


@pytest.mark.parametrize("shared_proofs", [False, True], ids=["own-probe", "shared-proofs"])
def test_a_reader_that_falls_behind_retention_gets_facts_pruned(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str, shared_proofs: bool
) -> None:
    with streams.connect(
        streams_url, redis_url=redis_url, prefix=redis_prefix, shared_proofs=shared_proofs
    ) as client:
        client.create_stream(unique_name, retention_ms=HOUR_MS)
        olds, _ = fill(client, unique_name, 12, 0)
        reader = client.reader(unique_name, start="earliest", page_size=5)
        try:
            first = reader.poll(timeout=5)
            assert first is not None and reader.position() < olds[-1]
            assert client.prune(unique_name).after == olds[-1]
            delivered = [f.stream_id for f in first]
            with pytest.raises(FactsPruned) as caught:
                while (epoch := reader.poll(timeout=1)) is not None:
                    delivered.extend(f.stream_id for f in epoch)
            # A page read ahead before the prune (rows, then its retention check, both before
            # it) may still be delivered; nothing after a gap ever is.
            position = caught.value.position
            assert delivered == [i for i in olds if i <= position]
            assert first.upper[unique_name] <= position < olds[-1]
            # A live reader (shared proofs or not) caught up past the pruned range is unharmed.
            with client.reader(unique_name, start="latest") as live:
                proofs = client._proofs
                if shared_proofs:
                    assert proofs is not None
                    wait_until(lambda: unique_name in proofs.proving, timeout=5)
                with client.writer(unique_name, instance="w3") as writer:
                    ack = writer.append({"fresh": True})
                epoch = live.poll(timeout=5)
                assert epoch is not None and [f.stream_id for f in epoch] == [ack.first_id]
        finally:
            reader.close()


def test_cli_retention_and_prune(client: Client, stream: str, streams_url: str) -> None:
    olds, news = fill(client, stream, 6, 2)

    def cli(*args: str) -> Any:
        return CliRunner().invoke(main, [*args, "--database-url", streams_url])

    shown = cli("retention", stream, "1h", "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["retention_ms"] == HOUR_MS
    text = cli("retention", stream)
    assert "retention 3600000 ms" in text.stdout
    assert cli("retention", stream, "soon").exit_code == 2  # a usage error, nothing changed
    pruned = cli("prune", stream, "--json")
    assert pruned.exit_code == 0, pruned.output
    assert json.loads(pruned.stdout) == {
        "stream": stream,
        "pruned_through_before": 0,
        "pruned_through": olds[-1],
        "target": olds[-1],
        "limited_by": "retention",
        "rows_deleted": 6,
        "transactions": 1,
        "keys_deleted": 0,
    }
    assert "nothing to remove" in cli("prune", stream).stdout
    failed = cli("read", stream, "--from-id", "1")
    assert failed.exit_code == 1
    assert "removed by retention" in failed.output
    assert cli("retention", stream, "forever", "--json").exit_code == 0
    assert client.stream(stream).retention_ms is None
    assert stream_ids(client, stream) == news


def test_sequence_repair_counts_pruned_ids(client: Client, stream: str, streams_url: str) -> None:
    """Once retention removed every row, only ``pruned_through`` remembers that those IDs were
    handed out: a sequence set back (a restore) is repaired past it, never below."""
    client.set_retention(stream, HOUR_MS)
    olds, _ = fill(client, stream, 5, 0)
    assert client.prune(stream).after == olds[-1]
    assert stream_ids(client, stream) == []
    assert client.prune_writers(stream, 0) == ["w"]  # nor a writer's row
    info = client.stream(stream)
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute("SELECT setval(%s::regclass, 1)", (info.sequence_name,))
    with client.writer(stream, instance="after-restore") as writer:
        assert writer.append({"again": True}).first_id > olds[-1]


def test_doctor_reports_retention_and_groups_that_lost_facts(
    client: Client, stream: str, streams_url: str
) -> None:
    from streams.ops.doctor import diagnose

    olds, _ = fill(client, stream, 6, 1)
    client.set_retention(stream, HOUR_MS)

    def check() -> Any:
        (found,) = [c for c in diagnose(client.settings) if c.name == f"stream {stream}: retention"]
        return found

    waiting = check()
    assert waiting.ok and f"IDs up to {olds[-1]} may go now" in waiting.detail
    client.prune(stream)
    done = check()
    assert done.ok and f"pruned through {olds[-1]}" in done.detail
    assert "held by: retention" in done.detail
    # A group that fell below what was pruned (it committed while its facts were removed).
    with psycopg.connect(streams_url) as conn:
        conn.execute(
            "INSERT INTO streams_reader_groups (stream, group_name, position) "
            "VALUES (%s, 'late', 2)",
            (client.stream(stream).id,),
        )
    try:
        lost = check()
        assert not lost.ok and "late (at 2)" in lost.detail
    finally:
        client.delete_group(stream, "late")
    assert check().ok
