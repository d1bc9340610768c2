"""`streams.store.reads.read_range` on psycopg (`reads.fetch_all`), against real PostgreSQL: the
plan the Spark executors run over ADBC reads the same rows as the Python reader, only up to
what its own probe proves, and fails on another history or on facts retention removed."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from streams import Client, DatabaseChanged, FactsPruned
from streams.store.driver import run
from streams.store.identity import read_incarnation
from streams.store.reads import READER_SESSION_SETUP, fetch_all, read_range


def _session(url: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url, autocommit=True)
    for statement in READER_SESSION_SETUP:
        conn.execute(statement)
    return conn


def test_a_range_reads_what_the_python_reader_delivers(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(5)])
        with psycopg.connect(streams_url) as conn, writer.fact(conn) as fact:
            fact.add({"row": 0}, {"row": 1})  # one fact of two rows
    through = client.positions(stream).linear
    key = client.stream(stream).id
    with client.reader(stream) as reader:
        expected = [(f.stream_id, f.payload) for f in reader.facts()]
    with _session(streams_url) as conn:
        token = run(conn, read_incarnation()).token
        rows = run(conn, fetch_all(read_range(stream, key, 0, through, incarnation=token)))
        assert not conn.info.transaction_status  # idle: nothing left open
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6, 6]
    assert [r[1] for r in rows] == [0, 0, 0, 0, 0, 0, 1]
    assert sorted({r[0] for r in rows}) == [i for i, _ in expected]


def test_a_range_is_read_only_up_to_what_its_probe_proves(
    client: Client, stream: str, streams_url: str
) -> None:
    first = client.writer(stream, instance="w1")
    second = client.writer(stream, instance="w2")
    try:
        first.append_batch([{"i": i} for i in range(3)])  # 1..3
        key = client.stream(stream).id
        with psycopg.connect(streams_url) as held_conn, first.fact(held_conn) as held:
            held.add({"held": True})  # 4, pending
            second.append_batch([{"after": i} for i in range(2)])  # 5, 6
            told: list[int] = []
            with _session(streams_url) as conn:
                rows = run(
                    conn, fetch_all(read_range(stream, key, 0, 6, went_backwards=told.append))
                )
            assert told == [3]
            assert [r[0] for r in rows] == [1, 2, 3]  # never the facts behind the pending one
    finally:
        first.close()
        second.close()


def test_another_history_and_pruned_facts_fail_the_read(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        ids = [writer.append({"n": n}).last_id for n in range(4)]
    key = client.stream(stream).id
    with _session(streams_url) as conn:
        token = run(conn, read_incarnation()).token
        other = token.replace(token.split("/")[0], "another", 1)
        with pytest.raises(DatabaseChanged, match=rf"Spark task reading '{stream}'"):
            run(conn, fetch_all(read_range(stream, key, 0, ids[-1], incarnation=other,
                                           who="Spark task")))  # fmt: skip
        client.set_retention(stream, 1)
        time.sleep(0.05)
        pruned = client.prune(stream).after
        assert pruned >= ids[0]
        with pytest.raises(FactsPruned):
            run(conn, fetch_all(read_range(stream, key, 0, ids[-1])))
        lost: list[FactsPruned] = []
        rows = run(conn, fetch_all(read_range(stream, key, 0, ids[-1], lost=lost.append)))
        assert [r[0] for r in rows] == [i for i in ids if i > pruned]
        assert [e.pruned_through for e in lost] == [pruned]
        # From what retention kept: nothing lost.
        rows = run(conn, fetch_all(read_range(stream, key, pruned, ids[-1])))
        assert [r[0] for r in rows] == [i for i in ids if i > pruned]


def test_split_range_cuts_at_stream_ids(client: Client, stream: str, streams_url: str) -> None:
    """Row percentiles of a range, as stream IDs (revision 0020 made the column a domain: an
    array of it came back as text, and every Spark query failed to plan its partitions)."""
    from streams.store.rows import split_range

    with client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(100)])
    info = client.stream(stream)
    with psycopg.connect(streams_url) as conn:
        cuts = run(conn, split_range(info, 0, 100, 4))
    assert cuts == sorted(cuts) and len(cuts) == 3, cuts
    assert all(isinstance(c, int) and 0 < c < 100 for c in cuts), cuts
