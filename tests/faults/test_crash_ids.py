"""A PostgreSQL crash never hands out again an ID that a reader passed (the durability argument
of `streams.store.probe`).

PostgreSQL flushes a sequence's WAL record only when some transaction commits (or its WAL
writer gets to it), so after a crash ``nextval`` may return values it had already returned to
transactions that never committed. Here the window is made wide on purpose: the private server
runs with ``wal_writer_delay = 10s``, a ``CHECKPOINT`` makes the next ``nextval`` write a fresh
WAL record, a ``fact()`` reserves an ID and rolls back (nothing commits after it: the writer's
lease is long, so no heartbeat commits either), a reader passes the ID as a gap, and the server
stops with an immediate shutdown (crash recovery at the next start). Before the probe made what
it proves durable, the next append was acknowledged under the same ID and the reader never
delivered it (3 rounds of 3).
"""

from __future__ import annotations

import contextlib
import time

import psycopg
import pytest
from faultkit import restartable_postgres

import streams
from streams.devservers import ensure_database

ROUNDS = 3


class _RollBack(Exception):
    """Raised inside ``fact()`` to roll its transaction back (a gap)."""


def _deliver_until(reader: streams.Reader, position: int, seconds: float = 60.0) -> list[int]:
    delivered: list[int] = []
    deadline = time.monotonic() + seconds
    while reader.position() < position:
        assert time.monotonic() < deadline, f"reader stuck at {reader.position()} < {position}"
        epoch = reader.poll(0.2)
        if epoch is not None:
            delivered += [fact.stream_id for fact in epoch.facts]
    return delivered


@pytest.mark.timeout(300)
def test_an_id_a_reader_passed_as_a_gap_is_not_handed_out_again_after_a_crash(
    unique_name: str,
) -> None:
    from streams.migrate import upgrade

    with restartable_postgres({"wal_writer_delay": "10s"}) as server:
        url = server.proxy.url(ensure_database(server.server.url, "streams"))
        upgrade(url)
        with streams.connect(url) as client:
            client.create_stream(unique_name)
            with client.writer(unique_name) as writer:
                first = writer.append({"before": True}).first_id
        reader = streams.connect(url).reader(unique_name)
        delivered = _deliver_until(reader, first)
        acked: list[int] = [first]
        gaps: list[int] = []
        for round_no in range(ROUNDS):
            with streams.connect(url, lease_seconds=60) as client:
                writer = client.writer(unique_name)  # registered before the checkpoint
                with psycopg.connect(url, autocommit=True) as admin:
                    admin.execute("CHECKPOINT")
                with (
                    psycopg.connect(url) as conn,
                    contextlib.suppress(_RollBack),
                    writer.fact(conn) as fact,
                ):
                    gaps.append(fact.stream_id)
                    raise _RollBack
                delivered += _deliver_until(reader, gaps[-1])  # passes the gap
                server.restart("immediate")
                with contextlib.suppress(streams.StreamsError):
                    writer.close()  # its connection died with the server
            with streams.connect(url) as client, client.writer(unique_name) as writer:
                ack = writer.append({"round": round_no})
            acked.append(ack.first_id)
            assert ack.first_id not in gaps, (
                f"round {round_no}: ID {ack.first_id} was handed out again after the crash "
                f"(gaps the reader passed: {gaps})"
            )
            delivered += _deliver_until(reader, ack.last_id)
        reader.close()
        assert delivered == acked, f"reader delivered {delivered}, acknowledged {acked}"


@pytest.mark.parametrize("role", ["reader", "prover"])
def test_a_probe_flushes_the_wal_past_what_it_proves(unique_name: str, role: str) -> None:
    """The prover's session commits asynchronously (``synchronous_commit = off``) and a
    reader's may too (a server or role default): the probe's durability statement turns it on
    for the transactions that need a flush, so the WAL is on disk past every sequence value it
    read when the probe returns."""
    from streams.migrate import upgrade
    from streams.store.driver import run
    from streams.store.probe import PROVER_SESSION_SETUP, READER_SESSION_SETUP, probe, prove
    from streams.store.registry import load_stream

    with restartable_postgres({"wal_writer_delay": "10s"}) as server:
        url = server.proxy.url(ensure_database(server.server.url, "streams"))
        upgrade(url)
        with streams.connect(url) as client:
            info = client.create_stream(unique_name)
        with psycopg.connect(url, autocommit=True) as session:
            for statement in (*READER_SESSION_SETUP, *PROVER_SESSION_SETUP):
                session.execute(statement)  # asynchronous commits, for both roles here
            info = run(session, load_stream(unique_name))
            for _ in range(3):
                session.execute("CHECKPOINT")
                # A reservation that never commits: its WAL record waits for someone's flush.
                session.execute("SELECT nextval(%s::regclass)", (info.sequence_name,))
                row = session.execute(
                    "SELECT pg_current_wal_insert_lsn(), "
                    "pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()"
                ).fetchone()
                assert row is not None
                lsn, flushed = row
                assert not flushed, "the test needs a WAL record nobody flushed yet"
                found = run(session, (prove if role == "prover" else probe)([info]))
                assert found[unique_name].max_allocated >= 1
                after = session.execute(
                    "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (lsn,)
                ).fetchone()
                assert after is not None and after[0], (
                    f"{role}: the WAL was not flushed past {lsn} by the probe"
                )
