"""`Writer` and `AsyncWriter` behave alike: one scripted scenario, run through each.

The scenario is written once (in asyncio's terms: what the synchronous writer returns is used as
it is, what the asyncio one returns is awaited) and run twice, each time on a fresh stream, so
the IDs come out the same. Each step records what a caller observes: the `Ack` (timestamps
aside: they are the arrival times), the exception raised, the writer's position once it has
settled, the rows PostgreSQL holds, and at the end what a reader delivers. The two records must
be equal step by step: a sync method and its asyncio twin that drift apart fail here.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import psycopg
import pytest
from faultkit import backend_waits_for_a_lock, partition_locked, terminate
from helpers import fact_rows

import streams
from streams import Ack, Client

Record = list[tuple[str, Any]]


async def may(value: Any) -> Any:
    """The synchronous writer's (or connection's) result as it is; the asyncio one's awaited."""
    return await value if inspect.isawaitable(value) else value


@contextlib.asynccontextmanager
async def entered(manager: Any) -> AsyncIterator[Any]:
    """``with`` or ``async with``, whichever ``manager`` is."""
    if hasattr(manager, "__aenter__"):
        async with manager as value:
            yield value
    else:
        with manager as value:
            yield value


def background(method: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
    """``method(...)`` running meanwhile: a task, or (synchronous) a worker thread."""
    work = method(*args, **kwargs) if inspect.iscoroutinefunction(method) else None
    return asyncio.ensure_future(work or asyncio.to_thread(method, *args, **kwargs))


def shape(ack: Ack | None) -> Any:
    if ack is None:
        return None
    assert ack.first_timestamp <= ack.last_timestamp
    return (ack.first_id, ack.last_id, ack.count, ack.ids, ack.duplicates, ack.duplicate)


class Scenario:
    """The script, and the record of one run of it."""

    def __init__(self, writer: Any, url: str, client: Client, stream: str, connect: Any) -> None:
        self.writer, self.url, self.client, self.stream = writer, url, client, stream
        self.connect = connect  # a connection of the writer's world: psycopg's, or its asyncio one
        self.record: Record = []

    def note(self, step: str, value: Any) -> None:
        self.record.append((step, value))

    async def attempt(self, step: str, action: Callable[[], Any]) -> Any:
        """Run one step; note its outcome (an `Ack`'s shape, or the exception raised)."""
        try:
            result = await action()
        except Exception as exc:  # what the caller sees is the point
            self.note(step, ("raised", type(exc).__name__, str(exc)))
            return None
        self.note(step, shape(result) if isinstance(result, Ack) or result is None else result)
        return result

    def rows(self) -> list[tuple[int, Any]]:
        return [(row[0], row[4]) for row in fact_rows(self.url, self.stream)]

    async def settled(self, stream_id: int) -> int:
        """The writer's position once it passed ``stream_id`` (facts of a joined transaction
        complete when the heartbeat finds the transaction ended)."""
        deadline = time.monotonic() + 10
        while self.writer.position < stream_id:
            assert time.monotonic() < deadline, f"the position did not pass {stream_id}"
            await asyncio.sleep(0.02)
        return int(self.writer.position)

    async def run(self, caplog: pytest.LogCaptureFixture) -> Record:
        w = self.writer
        await self.attempt("append", lambda: may(w.append({"n": 1})))
        await self.attempt("keyed", lambda: may(w.append({"n": 2}, key="k1")))
        await self.attempt(
            "batch with a duplicate",
            lambda: may(w.append_batch([{"n": 3}, {"n": 4}, {"n": 5}], keys=["k1", "k2", "k3"])),
        )
        await self.attempt(
            "batch, a key twice", lambda: may(w.append_batch([{"a": 1}, {"a": 2}], keys=["d", "d"]))
        )
        await self.attempt(
            "batch, timestamps", lambda: may(w.append_batch([{"a": 1}], timestamps=[None, None]))
        )
        self.note("position", w.position)
        conn = await may(self.connect(self.url))
        try:
            await self.facts(conn)
        finally:
            await may(conn.close())
        await self.broken_connection(caplog)
        await self.attempt("append after", lambda: may(w.append({"n": "after"})))
        await may(w.heartbeat())
        self.note("rows", self.rows())
        with self.client.reader(self.stream) as reader:
            self.note("read", [(f.stream_id, f.payloads) for f in reader.facts()])
        await may(w.aclose() if hasattr(w, "aclose") else w.close())
        await self.attempt("append after close", lambda: may(w.append({"n": "closed"})))
        row = self.client.positions(self.stream).writers["twin"]
        self.note("retired", (row.retired, row.position))
        return self.record

    async def own(self, conn: Any, key: str | None, action: str) -> Any:
        """A fact in its own transaction; ``action``: what the block does besides."""
        async with entered(self.writer.fact(conn, key=key)) as fact:
            self.note("fact", (fact.stream_id, fact.duplicate, shape(fact.ack)))
            if not fact.duplicate:
                await may(fact.add({"fact": action}))
            if action == "raise":
                raise RuntimeError("the block gave up")
            if action == "swallow":
                with contextlib.suppress(psycopg.Error):
                    await may(conn.execute("SELECT 1/0"))
        return fact.stream_id

    async def joined(self, conn: Any, end: str) -> None:
        """A fact in a transaction of the caller's, which ``end``s (commit or rollback)."""
        await may(conn.execute("SELECT 1"))  # the caller's transaction is open
        async with entered(self.writer.fact(conn)) as fact:
            await may(fact.add({"joined": end}))
        stream_id = fact.stream_id
        await may(getattr(conn, end)())
        self.note(f"joined, {end}", (stream_id, await self.settled(stream_id)))

    async def facts(self, conn: Any) -> None:
        for action in ("commit", "raise", "swallow"):
            await self.attempt(f"fact, {action}", partial(self.own, conn, None, action))
        await self.attempt("fact, duplicate key", partial(self.own, conn, "k2", "commit"))
        self.note("rows after facts", self.rows())
        await self.joined(conn, "rollback")
        await self.joined(conn, "commit")
        self.note("pending", (self.writer.core.tracker.pending_count, self.writer.position))

    async def broken_connection(self, caplog: pytest.LogCaptureFixture) -> None:
        """The connection breaks under a batch, before its ``COMMIT``: the batch is written
        once, on a new connection."""
        caplog.clear()
        pid = self.writer._conn.info.backend_pid
        with partition_locked(self.url, self.client, self.stream):  # the COPY waits
            batch = background(self.writer.append_batch, [{"b": 1}, {"b": 2}])
            deadline = time.monotonic() + 10
            while not backend_waits_for_a_lock(self.url, pid)():
                assert time.monotonic() < deadline, "the COPY did not wait"
                await asyncio.sleep(0.02)
            terminate(self.url, pid)
        await self.attempt("batch, connection lost", lambda: batch)
        retried = [r for r in caplog.records if "lost its connection before committing" in r.msg]
        self.note("retried", (len(retried), self.writer._conn.info.backend_pid != pid))


def test_writer_and_async_writer_are_twins(
    client: Client, streams_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "streams.writer")
    records: dict[str, Record] = {}
    for kind in ("sync", "asyncio"):
        stream = f"{unique_name}_{kind}"
        client.create_stream(stream)

        async def main(kind: str = kind, stream: str = stream) -> Record:
            if kind == "sync":
                writer: Any = client.writer(stream, instance="twin")
                scenario = Scenario(writer, streams_url, client, stream, psycopg.connect)
                return await scenario.run(caplog)
            async with await streams.aconnect(streams_url) as aclient:
                awriter = await aclient.writer(stream, instance="twin")
                connect = psycopg.AsyncConnection.connect
                return await Scenario(awriter, streams_url, client, stream, connect).run(caplog)

        records[kind] = asyncio.run(main())
    sync, aio = records["sync"], records["asyncio"]
    assert [step for step, _ in sync] == [step for step, _ in aio]
    for (step, seen), (_, twin) in zip(sync, aio, strict=True):
        assert seen == twin, f"{step}: Writer saw {seen!r}, AsyncWriter {twin!r}"
    outcomes = dict(sync)
    # The scenario did what it says (so that equal records mean something).
    assert outcomes["batch with a duplicate"][4] == (0,)  # the original's ID, first:
    assert outcomes["batch with a duplicate"][3][0] == outcomes["keyed"][0]
    assert outcomes["batch, a key twice"][0] == "raised"
    assert outcomes["fact, raise"] == ("raised", "RuntimeError", "the block gave up")
    assert outcomes["fact, swallow"][:2] == ("raised", "StoreError")
    assert outcomes["retried"] == (1, True)
    assert outcomes["append after close"] == ("raised", "UsageError", "writer is closed")
    assert outcomes["retired"][0] is True
    payloads = [p for _, rows in outcomes["read"] for p in rows]
    assert {"joined": "commit"} in payloads and {"joined": "rollback"} not in payloads
    assert {"fact": "raise"} not in payloads and {"fact": "swallow"} not in payloads
    assert payloads.count({"b": 1}) == 1
