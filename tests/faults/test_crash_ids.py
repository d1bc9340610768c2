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
from streams.ops.embedded import ensure_database

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
