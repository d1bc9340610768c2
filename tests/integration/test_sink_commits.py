"""Sink commits (`streams.store.sinks`) and `Writer.append_facts` against real PostgreSQL.

The exactly-once argument's cases one by one, without Spark: two attempts of one task at once
(one writes; the other waits and writes nothing, or writes if the first rolls back), attempts of
a batch Spark already committed, retention of idle queries, and a write failing half-way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from streams import Client, Writer
from streams.store import driver, sinks
from streams.types import FactChunk, StreamInfo

pytestmark = pytest.mark.timeout(60)


def chunk(*numbers: int, rows: int = 1) -> FactChunk:
    return FactChunk.of([[f'{{"n": {n}, "row": {r}}}' for r in range(rows)] for n in numbers],
                        [None] * len(numbers))  # fmt: skip


def attempt(writer: Writer, key: sinks.TaskKey, chunks: Any) -> int:
    """One attempt of a task: the facts it wrote (0: it found the task written)."""
    ack = writer.append_facts(chunks, first=sinks.claim_task(writer.stream, key))
    return 0 if ack is None else ack.count


def payloads(client: Client, stream: str) -> list[list[Any]]:
    with client.reader(stream) as reader:
        return [list(f.payloads) for f in reader.facts()]


def settled(client: Client, stream: str) -> bool:
    positions = client.positions(stream)
    return positions.linear == positions.max_allocated and positions.oldest_pending_ms is None


def test_multi_row_facts_in_chunks_one_transaction(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_facts([chunk(1, 2, rows=3), chunk(3, rows=2)])
    assert ack is not None and ack.count == 3
    assert payloads(client, stream) == [
        [{"n": 1, "row": 0}, {"n": 1, "row": 1}, {"n": 1, "row": 2}],
        [{"n": 2, "row": 0}, {"n": 2, "row": 1}, {"n": 2, "row": 2}],
        [{"n": 3, "row": 0}, {"n": 3, "row": 1}],
    ]


def test_write_failing_half_way_leaves_no_fact_and_no_pending_id(
    client: Client, stream: str
) -> None:
    def chunks() -> Iterator[FactChunk]:
        yield chunk(1, 2, 3)  # reserved and copied
        raise RuntimeError("the task died")

    with client.writer(stream, instance="w") as writer:
        with pytest.raises(RuntimeError, match="the task died"):
            writer.append_facts(chunks())
        assert writer.core.tracker.pending_count == 0
        assert writer.core.tracker.in_flight_count == 0
        # Bad JSON in a later chunk: PostgreSQL refuses it, and the transaction with it.
        with pytest.raises(Exception, match="json"):
            writer.append_facts([chunk(4), FactChunk(["{not json"], [None])])
        assert writer.core.tracker.pending_count == 0
    assert payloads(client, stream) == []
    assert client.positions(stream).max_allocated == 5  # 1-3, 4 and 5: gaps now
    assert settled(client, stream)


@pytest.mark.parametrize("first_commits", [True, False])
def test_two_attempts_of_one_task_write_once(
    client: Client, stream: str, first_commits: bool
) -> None:
    key = sinks.TaskKey("q-concurrent", 0, 7)
    claimed = threading.Event()
    release = threading.Event()

    def held() -> Iterator[FactChunk]:
        claimed.set()  # the claim ran: this attempt holds the task commit, uncommitted
        release.wait(10)
        if not first_commits:
            raise RuntimeError("attempt 1 fails")
        yield chunk(1)

    results: dict[str, Any] = {}

    def first() -> None:
        with client.writer(stream, instance="a-1") as writer:
            try:
                results["first"] = attempt(writer, key, held())
            except RuntimeError as exc:
                results["first"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    assert claimed.wait(10)
    with client.writer(stream, instance="a-2") as writer:
        second = threading.Thread(
            target=lambda: results.__setitem__("second", attempt(writer, key, [chunk(2)]))
        )
        second.start()
        second.join(1.0)
        assert second.is_alive()  # waits for the first attempt's transaction
        release.set()
        thread.join(10)
        second.join(10)
    if first_commits:
        assert (results["first"], results["second"]) == (1, 0)
        assert payloads(client, stream) == [[{"n": 1, "row": 0}]]
    else:
        assert isinstance(results["first"], RuntimeError) and results["second"] == 1
        assert payloads(client, stream) == [[{"n": 2, "row": 0}]]
    assert settled(client, stream)


def test_committed_batch_refuses_late_attempts_and_drops_task_commits(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="t") as writer:
        info = writer.stream
        for batch in (2, 3):
            assert attempt(writer, sinks.TaskKey("q", batch, 0), [chunk(batch)]) == 1
        assert attempt(writer, sinks.TaskKey("q", 3, 0), [chunk(99)]) == 0  # a retry
        assert state(streams_url, info, "q") == (-1, [(2, 0), (3, 0)])

        done = run(streams_url, sinks.commit_batch(info, "q", 3))
        assert (done.committed_batch, done.task_commits_deleted) == (3, 2)
        assert state(streams_url, info, "q") == (3, [])
        # A zombie or replayed attempt of a committed batch writes nothing, task commit or not.
        assert attempt(writer, sinks.TaskKey("q", 3, 1), [chunk(98)]) == 0
        assert attempt(writer, sinks.TaskKey("q", 1, 0), [chunk(97)]) == 0
        assert attempt(writer, sinks.TaskKey("q", 4, 0), [chunk(4)]) == 1
        # Spark repeating a commit, or committing an older batch, never moves it back.
        assert run(streams_url, sinks.commit_batch(info, "q", 2)).committed_batch == 3
    assert [p[0]["n"] for p in payloads(client, stream)] == [2, 3, 4]


def test_retention_drops_idle_queries_but_not_held_ones(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="t") as writer:
        info = writer.stream
        for query in ("old", "held", "new"):
            attempt(writer, sinks.TaskKey(query, 0, 0), [chunk(1)])
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE streams_sink_queries SET committed_at = now() - interval '8 days' "
            "WHERE stream = %s AND query_id IN ('old', 'held')",
            (info.id,),
        )
        with psycopg.connect(streams_url) as holder:  # a task of 'held' is claiming
            holder.execute(
                "SELECT 1 FROM streams_sink_queries WHERE stream = %s AND query_id = 'held' "
                "FOR SHARE",
                (info.id,),
            )
            done = run(streams_url, sinks.commit_batch(info, "new", 0))
            holder.rollback()
    assert done.stale_queries_deleted >= 1
    assert state(streams_url, info, "old") == (None, [])  # its task commit went with it
    assert state(streams_url, info, "held") == (-1, [(0, 0)])
    assert state(streams_url, info, "new") == (0, [])


def run(url: str, gen: Any) -> Any:
    with psycopg.connect(url) as conn:
        return driver.run(conn, gen)


def state(url: str, info: StreamInfo, query_id: str) -> tuple[Any, list[Any]]:
    result: tuple[Any, list[Any]] = run(url, sinks.sink_state(info, query_id))
    return result
