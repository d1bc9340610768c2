"""Reading ahead: a reader catching up sends the read of its next page before it plans the
one it has (`streams.store.reader_core`, `streams.store.reads.send_proven`). What must hold
whatever happens between the send and the next step: every fact delivered once, in order,
whole; a group commit, a lost session, a prune or a close in between loses nothing and
delivers nothing twice."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

import streams
from streams import Client, FactsPruned

HOUR_MS = 3_600_000


def _fill(client: Client, stream: str, count: int, *, multi_every: int = 0) -> list[int]:
    """``count`` facts, every ``multi_every``-th with three rows (0: single rows only)."""
    ids: list[int] = []
    with (
        client.writer(stream, instance="w") as writer,
        psycopg.connect(client.settings.database_url) as conn,
    ):
        for n in range(count):
            if multi_every and n % multi_every == 0:
                with writer.fact(conn) as fact:
                    fact.add({"n": n, "row": 0}, {"n": n, "row": 1}, {"n": n, "row": 2})
                ids.append(fact.stream_id)
            else:
                ids.append(writer.append({"n": n}).first_id)
    return ids


def test_catching_up_reads_ahead_and_delivers_each_fact_once(
    client: Client, unique_name: str
) -> None:
    first, second = unique_name, unique_name + "_b"
    client.create_stream(first)
    client.create_stream(second)
    ids = {first: _fill(client, first, 120, multi_every=7), second: _fill(client, second, 45)}
    with client.reader([first, second], page_size=8) as reader:
        seen: dict[str, list[int]] = {first: [], second: []}
        for epoch in reader.epochs():
            for fact in epoch:
                seen[fact.stream].append(fact.stream_id)
                if fact.stream == first and fact.payload["n"] % 7 == 0:
                    assert [p["row"] for p in fact.payloads] == [0, 1, 2]  # whole
        assert seen == ids
        assert reader.core.counters.pages_ahead > 10  # most pages were read ahead
        assert reader.core.counters.pages_ahead < reader.core.counters.pages


def test_a_group_commit_between_pages_read_ahead(client: Client, stream: str) -> None:
    ids = _fill(client, stream, 60)
    delivered: list[int] = []
    with client.reader(stream, group="g", page_size=10) as reader:
        for _ in range(3):
            epoch = reader.poll()
            assert epoch is not None
            delivered.extend(f.stream_id for f in epoch)
        assert reader.core.reading_ahead  # the next page is in flight
        committed = len(delivered)
        assert reader.commit() == {stream: delivered[-1]}  # same session: page taken in first
        epoch = reader.poll()
        assert epoch is not None
        delivered.extend(f.stream_id for f in epoch)
        assert reader.core.counters.pages_ahead >= 3
    with client.reader(stream, group="g", page_size=10) as again:
        rest = [f.stream_id for e in again.epochs() for f in e]
    assert delivered[:committed] + rest == ids  # the page after the commit comes again


def test_a_session_lost_with_a_page_in_flight(
    client: Client, stream: str, streams_url: str
) -> None:
    ids = _fill(client, stream, 50)
    with client.reader(stream, page_size=10) as reader:
        epoch = reader.poll()
        assert epoch is not None and reader.core.reading_ahead
        delivered = [f.stream_id for f in epoch]
        pid = reader._conn.info.backend_pid
        with psycopg.connect(streams_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        for epoch in reader.epochs(idle_timeout=5):
            delivered.extend(f.stream_id for f in epoch)
            if delivered[-1] == ids[-1]:
                break
    assert delivered == ids


def test_a_prune_with_a_page_in_flight_is_never_a_silent_gap(
    client: Client, unique_name: str
) -> None:
    client.create_stream(unique_name, retention_ms=HOUR_MS)
    old = int((time.time() - 2 * 3600) * 1000)
    with client.writer(unique_name, instance="w") as writer:
        olds = [writer.append({"n": n}, timestamp=old + n).first_id for n in range(40)]
    with client.reader(unique_name, page_size=5) as reader:
        epoch = reader.poll()
        assert epoch is not None and reader.core.reading_ahead
        delivered = [f.stream_id for f in epoch]
        assert client.prune(unique_name).after == olds[-1]
        with pytest.raises(FactsPruned) as caught:
            while (epoch := reader.poll(timeout=1)) is not None:
                delivered.extend(f.stream_id for f in epoch)
    assert delivered == [i for i in olds if i <= caught.value.position]


def test_closing_a_reader_with_a_page_in_flight(client: Client, stream: str) -> None:
    _fill(client, stream, 30)
    reader = client.reader(stream, page_size=5)
    assert reader.poll() is not None and reader.core.reading_ahead
    reader.close()  # nothing to wait for, no error


def test_the_async_reader_reads_ahead(streams_url: str, unique_name: str) -> None:
    async def scenario() -> tuple[list[int], list[int], Any]:
        async with await streams.aconnect(streams_url) as client:
            await client.create_stream(unique_name)
            async with (
                await client.writer(unique_name, instance="w") as writer,
                await psycopg.AsyncConnection.connect(streams_url) as conn,
            ):
                ids = [(await writer.append({"n": n})).first_id for n in range(40)]
                async with writer.fact(conn) as fact:
                    await fact.add({"last": 0}, {"last": 1})
                ids.append(fact.stream_id)
            delivered: list[int] = []
            async with await client.reader(unique_name, group="ag", page_size=6) as reader:
                async for epoch in reader.epochs():
                    delivered.extend(f.stream_id for f in epoch)
                    if len(delivered) == 12:
                        await reader.commit()  # with the next page in flight
                return ids, delivered, reader.core.counters.pages_ahead

    ids, delivered, ahead = asyncio.run(scenario())
    assert delivered == ids
    assert ahead >= 4
