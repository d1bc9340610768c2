"""A writer holds one PostgreSQL session: heartbeats borrow it between appends, and run on a
spare session only while an append holds it for longer than `BORROW_WAIT` (`streams.writer`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import wait_until

import streams
import streams.heartbeat as writer_module
from streams import Client
from streams.types import FactChunk


def sessions(url: str) -> set[int]:
    """Backend PIDs of the sessions on the database other than this query's."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
        ).fetchall()
    return {int(row[0]) for row in rows}


def last_statement(url: str, pid: int) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert row is not None
    return str(row[0])


def beat_count(client: Client, stream: str, instance: str) -> int:
    """How far the writer's persisted position has moved: a heartbeat persists it."""
    return client.positions(stream).writers[instance].position


def test_a_writer_holds_one_session_and_beats_on_it(
    client: Client, stream: str, streams_url: str
) -> None:
    client.positions(stream)  # the client's own session, opened before counting
    before = sessions(streams_url)
    with client.writer(stream, instance="one") as writer:
        ack = writer.append({"n": 1})
        writer.heartbeat()
        home = writer._conn.info.backend_pid
        assert sessions(streams_url) - before == {home}
        # The heartbeat ran on the writer's own session (its last statement is the beat's).
        assert "streams_writers" in last_statement(streams_url, home)
        assert writer._spare is None
        assert beat_count(client, stream, "one") >= ack.last_id


def test_a_busy_writer_still_beats_on_its_own_session(
    client: Client, stream: str, streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Appends from several threads back to back: heartbeats still get their turn on the
    writer's session (the spare stays closed) and the lease holds.

    The property is that the lock lets the heartbeat in between appends, not how fast: on a
    starved machine a thread may not run within the 0.25 s of `BORROW_WAIT` and the spare
    rightly takes the beat. So the wait is long here, and the lease longer than it."""
    monkeypatch.setattr(writer_module, "BORROW_WAIT", 3.0)
    with streams.connect(streams_url, lease_seconds=8.0) as short:
        writer = short.writer(stream, instance="busy")
        stop = threading.Event()
        errors: list[BaseException] = []

        def hammer() -> None:
            try:
                while not stop.is_set():
                    writer.append({"x": 1})
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            # Scheduled beats (lease/4) and flushes (every 0.1 s), several of each.
            first = beat_count(client, stream, "busy")
            time.sleep(5.0)
            assert beat_count(client, stream, "busy") > first
            assert writer._spare is None
            assert not writer.core.fenced
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            writer.close()
        assert not errors
        assert client.positions(stream).writers["busy"].retired


def slow_chunks(chunks: int, gap: float, started: threading.Event) -> Iterator[FactChunk]:
    """A lazy batch (as the Spark sink's) that keeps the connection for ``chunks * gap``
    seconds (each gap inside the lease: the transaction may not sit idle longer)."""
    for n in range(chunks):
        yield FactChunk([f'{{"slow": {n}}}'], [None])
        started.set()
        time.sleep(gap)


def test_a_slow_append_moves_heartbeats_to_the_spare_and_keeps_the_lease(
    client: Client, stream: str, streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "SPARE_IDLE", 0.0)
    with (
        streams.connect(streams_url, lease_seconds=2.0) as short,
        short.writer(stream, instance="slow") as writer,
    ):
        started = threading.Event()
        result: list[Any] = []
        thread = threading.Thread(
            target=lambda: result.append(writer.append_facts(slow_chunks(5, 1.0, started)))
        )
        thread.start()
        assert started.wait(10)
        # Over two leases inside one append: the heartbeats run on the spare meanwhile.
        wait_until(lambda: writer._spare is not None, timeout=5)
        home, spare = writer._conn.info.backend_pid, writer._spare
        assert spare is not None and spare.info.backend_pid != home
        thread.join()
        assert not writer.core.fenced
        ack = result[0]
        assert ack is not None and len(ack.ids) == 5
        # Another writer taking the name over would fence it; nobody did: the lease held.
        assert not short.positions(stream).writers["slow"].retired
        # Once the connection is free again, a heartbeat borrows it and closes the spare.
        writer.heartbeat()
        assert writer._spare is None and spare.closed
        assert writer.append({"after": True}).first_id > ack.last_id


def test_the_spare_is_reopened_after_the_server_ends_it(
    client: Client, stream: str, streams_url: str
) -> None:
    with (
        streams.connect(streams_url, lease_seconds=1.0) as short,
        short.writer(stream, instance="ended") as writer,
    ):
        writer.append({"n": 1})
        home = writer._conn.info.backend_pid
        with psycopg.connect(streams_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (home,))
        # The heartbeat finds the session gone, opens a new one, and appends use it.
        wait_until(lambda: writer._conn.info.backend_pid != home or writer._conn.closed)
        writer.heartbeat()
        assert writer.append({"n": 2}).ids
        assert writer._spare is None
        assert not writer.core.fenced


def test_async_writer_holds_one_session(
    stream: str, streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above: the lock's turn, not its speed (asyncio's lock is first come, first served).
    monkeypatch.setattr(writer_module, "BORROW_WAIT", 3.0)

    async def main() -> None:
        async with await streams.aconnect(streams_url, lease_seconds=8.0) as client:
            await client.positions(stream)
            before = sessions(streams_url)
            async with await client.writer(stream, instance="aone") as writer:
                stop = asyncio.Event()

                async def hammer() -> None:
                    while not stop.is_set():
                        await writer.append({"x": 1})

                tasks = [asyncio.create_task(hammer()) for _ in range(8)]
                first = (await client.positions(stream)).writers["aone"].position
                await asyncio.sleep(5.0)
                stop.set()
                await asyncio.gather(*tasks)
                assert (await client.positions(stream)).writers["aone"].position > first
                assert writer._conn is not None and writer._spare is None
                home = writer._conn.info.backend_pid
                assert sessions(streams_url) - before == {home}
                assert not writer.core.fenced

    asyncio.run(main())


def test_async_slow_append_uses_the_spare(
    stream: str, streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "SPARE_IDLE", 0.0)

    async def main() -> None:
        async with (
            await streams.aconnect(streams_url, lease_seconds=1.0) as client,
            await client.writer(stream, instance="aslow") as writer,
        ):
            started = threading.Event()
            # Hold the writer's connection as a slow append would (a lazy chunk would
            # block the event loop, so a lock wait on the server stands in for it).
            async with await psycopg.AsyncConnection.connect(streams_url) as blocker:
                await blocker.execute("SELECT pg_advisory_xact_lock(hashtext('streams-test-slow'))")

                async def held() -> None:
                    assert writer._conn is not None
                    async with writer._lock:
                        started.set()
                        await writer._conn.execute(
                            "SELECT pg_advisory_xact_lock(hashtext('streams-test-slow'))"
                        )
                        await writer._conn.rollback()

                task = asyncio.create_task(held())
                while not started.is_set():
                    await asyncio.sleep(0.01)
                for _ in range(500):
                    if writer._spare is not None:
                        break
                    await asyncio.sleep(0.01)
                spare = writer._spare
                assert spare is not None
                await asyncio.sleep(1.5)  # more than a lease, beating on the spare
                assert not writer.core.fenced
                await blocker.rollback()
                await task
            await writer.heartbeat()
            assert writer._spare is None and spare.closed
            assert (await writer.append({"after": True})).ids

    asyncio.run(main())
