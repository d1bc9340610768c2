"""The probe of several streams: the proof holds whatever order PostgreSQL evaluates things in.

Issue 7: a reader of several streams delivered epochs past an ID still pending and never
delivered that fact after it committed. The old probe read ``pg_locks`` in a correlated
subquery of the statement that read the sequences; PostgreSQL evaluated ``pg_lock_status()``
once, at the first stream's row, so the later streams' sequences were read *after* the lock
snapshot. These tests force that window deterministically (a session holds a lock on a
sequence, stalling the probe between two streams while a writer reserves in a third) and hunt
for it at random (stalls plus out-of-order commits and rollbacks on three streams).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import wait_until

import streams
from streams import Client
from streams.core.epochs import Fact
from streams.store.driver import run
from streams.store.probe import READER_SESSION_SETUP, Probe, probe
from streams.store.registry import load_streams


@pytest.fixture
def three_streams(client: Client, unique_name: str) -> list[str]:
    names = [f"{unique_name}-a", f"{unique_name}-b", f"{unique_name}-c"]
    for name in names:  # registry (and so evaluation) order: a, b, c
        client.create_stream(name)
    return names


def lock_sequence(conn: psycopg.Connection[Any], sequence: str) -> None:
    """Take a lock on a sequence, until ``conn``'s transaction ends, that blocks every read of
    it: ``ALTER SEQUENCE`` takes SHARE ROW EXCLUSIVE, which conflicts with the ROW EXCLUSIVE of
    ``pg_sequence_last_value`` and ``nextval`` (``LOCK TABLE`` refuses sequences)."""
    conn.execute(f'ALTER SEQUENCE "{sequence}" CACHE 1')


@contextlib.contextmanager
def sequence_locked(url: str, sequence: str) -> Iterator[None]:
    with psycopg.connect(url) as conn:
        lock_sequence(conn, sequence)
        try:
            yield
        finally:
            conn.rollback()


def waiting_on_lock(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return row is not None and row[0] == "Lock"


def test_probe_stalled_between_streams_never_passes_a_pending_id(
    client: Client, three_streams: list[str], streams_url: str
) -> None:
    """Stall the probe on stream b's sequence; meanwhile reserve an ID on stream c and keep it
    open; then let the probe finish. It must not report c complete through that ID (the old
    probe did: it had read pg_locks at stream a's row, before the reservation)."""
    a, b, c = three_streams
    with client.writer(a, instance="wa") as wa, client.writer(c, instance="wc") as wc:
        wa.append({"warm": "a"})
        wc.append({"warm": "c"})
        with psycopg.connect(streams_url, autocommit=True) as conn:
            infos = run(conn, load_streams([a, b, c]))
        result: dict[str, dict[str, Probe]] = {}
        with (
            psycopg.connect(streams_url, autocommit=True) as probe_conn,
            psycopg.connect(streams_url) as lock_conn,
            psycopg.connect(streams_url) as fact_conn,
        ):
            pid = probe_conn.info.backend_pid
            lock_sequence(lock_conn, infos[1].sequence_name)
            thread = threading.Thread(target=lambda: result.update(p=run(probe_conn, probe(infos))))
            thread.start()
            wait_until(lambda: waiting_on_lock(streams_url, pid), what="the probe to stall")
            with wc.fact(fact_conn) as held:
                held.add({"held": True})
                lock_conn.rollback()  # the probe goes on while the fact is open
                thread.join(timeout=10)
                assert not thread.is_alive()
                found = result["p"][c]
                assert found.max_allocated >= held.stream_id  # the read saw the reservation
                assert found.complete < held.stream_id, found
        # Committed now: a reader of all three streams delivers it.
        with client.reader([a, b, c]) as reader:
            ids = {(f.stream, f.stream_id) for f in reader.facts()}
        assert (c, held.stream_id) in ids


def test_reader_session_is_read_committed_whatever_the_default(
    client: Client, stream: str, streams_url: str
) -> None:
    """The rows behind a probe are read in the same implicit transaction (one pipeline): under
    REPEATABLE READ they would come from the probe's snapshot, so readers pin READ COMMITTED."""
    sep = "&" if "?" in streams_url else "?"
    rr_url = f"{streams_url}{sep}options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"
    with psycopg.connect(rr_url, autocommit=True) as conn:
        assert conn.execute("SHOW transaction_isolation").fetchone() == ("repeatable read",)
        for statement in READER_SESSION_SETUP:
            conn.execute(statement)
        assert conn.execute("SHOW transaction_isolation").fetchone() == ("read committed",)
    with client.writer(stream, instance="w") as writer:
        ack = writer.append({"x": 1})
    with streams.connect(rr_url) as rr_client, rr_client.reader(stream) as reader:
        assert [f.stream_id for f in reader.facts()] == [ack.first_id]


@pytest.mark.slow
def test_random_multi_stream_commits_are_delivered_exactly_once(
    client: Client, three_streams: list[str], streams_url: str
) -> None:
    """Three streams, four writer threads each with its own writer per stream, facts held open
    for random times, committed or rolled back, single appends, batches and multi-row facts;
    a thread stalling random sequences; one reader of all three streams polling throughout.
    Every committed fact is delivered exactly once, whole, in ID order per stream."""
    rng = random.Random(7)
    stop = threading.Event()
    errors: list[BaseException] = []
    infos = {i.name: i for i in client.streams() if i.name in three_streams}

    def writer_loop(k: int) -> None:
        seed = rng.random()
        local = random.Random(seed)
        try:
            writers = {s: client.writer(s, instance=f"w{k}-{s[-1]}") for s in three_streams}
            with psycopg.connect(streams_url) as conn:
                while not stop.is_set():
                    s = local.choice(three_streams)
                    w = writers[s]
                    kind = local.random()
                    if kind < 0.4:
                        rows = local.randint(1, 3)
                        rollback = local.random() < 0.25
                        try:
                            with w.fact(conn) as fact:
                                fact.add(*[{"k": k, "row": r} for r in range(rows)])
                                time.sleep(local.uniform(0, 0.02))
                                if rollback:
                                    raise _Rollback
                        except _Rollback:
                            pass
                    elif kind < 0.8:
                        w.append({"k": k})
                    else:
                        w.append_batch([{"k": k, "n": n} for n in range(local.randint(2, 20))])
            for w in writers.values():
                w.close()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def staller() -> None:
        local = random.Random(11)
        try:
            while not stop.is_set():
                info = infos[local.choice(three_streams)]
                with sequence_locked(streams_url, info.sequence_name):
                    time.sleep(local.uniform(0.001, 0.03))
                time.sleep(local.uniform(0, 0.02))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    delivered: list[Fact] = []
    reader = client.reader(three_streams, page_size=50)

    def read_loop() -> None:
        try:
            while not stop.is_set():
                epoch = reader.poll(timeout=0.02)
                if epoch is not None:
                    delivered.extend(epoch.facts)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer_loop, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=staller), threading.Thread(target=read_loop)]
    for t in threads:
        t.start()
    time.sleep(6.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    # Drain what completed at the very end.
    for epoch in reader.epochs():
        delivered.extend(epoch.facts)
    reader.close()

    with psycopg.connect(streams_url) as conn:
        stored = conn.execute(
            "SELECT r.name, f.stream_id, count(*) FROM streams_facts f "
            "JOIN streams_registry r ON r.id = f.stream "
            "WHERE r.name = ANY(%s) GROUP BY 1, 2 ORDER BY 1, 2",
            (three_streams,),
        ).fetchall()
    expected = {(name, int(i)): int(n) for name, i, n in stored}
    got = [(f.stream, f.stream_id) for f in delivered]
    assert len(got) == len(set(got)), "a fact was delivered twice"
    missing, invented = set(expected) - set(got), set(got) - set(expected)
    assert not missing and not invented, f"missing {sorted(missing)[:10]}, invented {invented}"
    for f in delivered:
        assert len(f.payloads) == expected[(f.stream, f.stream_id)], f"fact {f} torn"
    for name in three_streams:
        ids = [i for s, i in got if s == name]
        assert ids == sorted(ids), f"{name} out of order"
    assert len(expected) > 300, "the run wrote too little to mean anything"


class _Rollback(Exception):
    pass


def test_a_lock_taken_after_the_sequence_was_read_does_not_collapse_the_probe(
    client: Client, stream: str, streams_url: str
) -> None:
    """A writer that locks after statement 1 read the sequence holds an ``L`` above max
    allocated (other writers advanced the sequence in between). Recovered as ``L - 2**32``, it
    made the probe report 0 complete while writers were busy (seen as ``complete=0`` beside
    ``max_allocated=4157`` in ``streams bench history``; the Spark source took it for a
    sequence going backwards). Locks below max allocated still hold the position back."""
    from psycopg import sql

    from streams.core.constants import reservation_lock_class
    from streams.store.leases import reservation_lock_key_sql

    with client.writer(stream, instance="w") as writer:
        last = writer.append_batch([{"n": n} for n in range(20)]).last_id
    info = client.stream(stream)

    def probe_holding(floor: int) -> Probe:
        with psycopg.connect(streams_url) as holder:
            holder.execute(
                sql.SQL("SELECT pg_advisory_xact_lock_shared({cls}, {key})")
                .format(
                    cls=sql.Literal(reservation_lock_class(info.id)),
                    key=reservation_lock_key_sql(sql.Literal(floor)),
                )
                .as_string(holder)
                .replace("%%", "%")
            )
            with psycopg.connect(streams_url, autocommit=True) as conn:
                for statement in READER_SESSION_SETUP:
                    conn.execute(statement)
                found = run(conn, probe([info]))[stream]
                return dataclasses.replace(found, wal_lsn=0, flushed_lsn=0)

    assert probe_holding(last + 3) == Probe(stream, last, last)  # IDs above max allocated
    assert probe_holding(last + 1) == Probe(stream, last, last)
    assert probe_holding(last) == Probe(stream, last, last - 1)
    assert probe_holding(last - 10) == Probe(stream, last, last - 11)
    assert probe_holding(1) == Probe(stream, last, 0)
