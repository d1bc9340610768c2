"""Cancellation of the asyncio API at every await point, deterministically.

`CancelAt` runs an operation in a task of its own and cancels that task at the operation's
n-th suspension (the n-th time it awaits something that is not ready), through the real
``Task.cancel``. Each test runs the operation with n = 1, 2, ... until it completes without
reaching n, so every await point it reaches is interrupted once, and after each
interruption checks what the issue of record asks: the cancellation propagated (it was not
swallowed), the object is usable, its connection is clean (no pipeline, no transaction,
nothing in flight; or closed, to be reopened), nothing is half-written and no ID is leaked.

psycopg yields to the event loop after a step that needed no I/O only when the loop has been
busy for a while (``psycopg.waiting.MAX_BUSY_TIME``); the fixture sets that to 0 so those
points exist on every run, as they do on a loaded machine, instead of at random (the random
CI failure of the batch append was a cancellation at one of them).

The last test is the randomized one: hundreds of cancellations at random delays.
"""

from __future__ import annotations

import asyncio
import random
import signal
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import psycopg
import psycopg.waiting
import pytest
import redis
from helpers import fact_rows
from psycopg.pq import PipelineStatus, TransactionStatus

import streams
from streams import AsyncClient, AsyncWriter
from streams.core.constants import data_channel
from streams.core.protocol import PositionCommand as Position
from streams.transport import link_plans
from streams.transport.link import AsyncRedisLink

#: Each operation here completes within this many suspensions (a safety net against a loop).
MAX_POINTS = 400


class CancelAt:
    """Drive a coroutine; cancel the task running it at its ``n``-th suspension."""

    def __init__(self, coro: Awaitable[Any], n: int) -> None:
        self._coro = coro
        self.n = n
        self.suspensions = 0
        self.reached = False

    @types.coroutine
    def _drive(self) -> Generator[Any, Any, Any]:
        inner = self._coro.__await__()
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                yielded = inner.throw(thrown) if thrown is not None else inner.send(sent)
            except StopIteration as stop:
                return stop.value
            self.suspensions += 1
            if self.suspensions == self.n:
                self.reached = True
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # the real thing: the awaited future is cancelled next
            try:
                sent, thrown = (yield yielded), None
            except BaseException as exc:
                sent, thrown = None, exc

    async def run(self) -> Any:
        return await self._drive()


async def attempt(make: Callable[[], Awaitable[Any]], n: int) -> tuple[bool, Any]:
    """Run ``make()`` cancelled at its ``n``-th suspension: (was it cancelled, its result).

    A cancellation that was delivered must come out as ``CancelledError``; an operation that
    finished before its ``n``-th suspension must not have been cancelled.
    """
    cancel = CancelAt(make(), n)
    task = asyncio.ensure_future(cancel.run())
    await asyncio.wait({task})
    if cancel.reached:
        assert task.cancelled(), f"cancelled at suspension {n}, but it " + (
            "raised " + repr(task.exception()) if task.exception() else "returned normally"
        )
        return True, None
    return False, task.result()


async def every_point(
    make: Callable[[], Awaitable[Any]],
    after_cancel: Callable[[int], Awaitable[None]],
) -> tuple[int, Any]:
    """Cancel ``make()`` at n = 1, 2, ... (calling ``after_cancel(n)`` after each) until it
    completes without reaching n; returns (points interrupted, the final result)."""
    for n in range(1, MAX_POINTS):
        cancelled, result = await attempt(make, n)
        if not cancelled:
            return n - 1, result
        await after_cancel(n)
    raise AssertionError(f"still cancelled at suspension {MAX_POINTS}")


@pytest.fixture(autouse=True)
def busy_loop_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg yields to the loop after every step, as it does on a busy machine."""
    monkeypatch.setattr(psycopg.waiting, "MAX_BUSY_TIME", 0.0)


def assert_clean(conn: psycopg.AsyncConnection[Any], autocommit: bool) -> None:
    """Clean or closed: what `streams.store.driver.asettle` promises."""
    if conn.closed:
        return
    assert conn.pgconn.pipeline_status == PipelineStatus.OFF
    assert getattr(conn, "_pipeline", None) is None
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert conn.autocommit is autocommit


def assert_nothing_pending(writer: AsyncWriter) -> None:
    assert writer.core.tracker.pending_count == 0
    assert writer.core.tracker.in_flight_count == 0


async def no_leaked_ids(client: AsyncClient, stream: str) -> None:
    """Every reserved ID completed: the linear position reached max allocated."""
    positions = await client.positions(stream)
    assert positions.linear == positions.max_allocated, positions


def whole_facts(url: str, stream: str, rows_per_fact: int) -> dict[int, int]:
    """Row count by stream ID; asserts every fact has all its rows."""
    counts: dict[int, int] = {}
    for stream_id, *_ in fact_rows(url, stream):
        counts[stream_id] = counts.get(stream_id, 0) + 1
    assert all(n == rows_per_fact for n in counts.values()), counts
    return counts


# ---------------------------------------------------------------------------- writer


async def _writer(url: str, stream: str, **options: Any) -> tuple[AsyncClient, AsyncWriter]:
    client = await streams.aconnect(url, lease_seconds=5.0, **options)
    await client.create_stream(stream)
    return client, await client.writer(stream, instance="cancelled")


def test_append_batch_at_every_await_point(streams_url: str, unique_name: str) -> None:
    async def main() -> None:
        client, writer = await _writer(streams_url, unique_name)
        try:

            async def check(n: int) -> None:
                assert_nothing_pending(writer)
                async with writer._lock:  # the heartbeat borrows the connection too
                    assert_clean(writer._conn, autocommit=False)
                # Usable: the next batch goes through (on a reopened connection if need be).
                ack = await writer.append_batch([{"check": n}] * 3)
                assert ack.count == 3

            points, ack = await every_point(lambda: writer.append_batch([{"batch": 1}] * 50), check)
            assert points >= 5 and ack.count == 50
            await no_leaked_ids(client, unique_name)
        finally:
            await writer.aclose()
            await client.aclose()

    asyncio.run(main())
    rows = fact_rows(streams_url, unique_name)
    # Every batch landed whole or not at all: 50 or 3 rows with the same payload.
    batches: dict[str, int] = {}
    for *_, payload in rows:
        key = repr(payload)
        batches[key] = batches.get(key, 0) + 1
    assert batches.pop(repr({"batch": 1})) % 50 == 0
    assert all(count == 3 for count in batches.values())


def test_single_append_at_every_await_point(streams_url: str, unique_name: str) -> None:
    async def main() -> None:
        client, writer = await _writer(streams_url, unique_name)
        try:

            async def check(n: int) -> None:
                assert_nothing_pending(writer)
                async with writer._lock:  # the heartbeat borrows the connection too
                    assert_clean(writer._conn, autocommit=False)

            points, ack = await every_point(lambda: writer.append({"single": 1}), check)
            assert points >= 2 and ack.count == 1
            # Still a working writer, and its position passed what it wrote.
            after = await writer.append({"after": True})
            assert writer.position >= after.last_id
            await no_leaked_ids(client, unique_name)
        finally:
            await writer.aclose()
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("autocommit", [False, True], ids=["transaction", "autocommit"])
def test_fact_block_at_every_await_point(
    streams_url: str, unique_name: str, autocommit: bool
) -> None:
    """``fact()`` and ``add`` and the caller's own statement and the commit: all or nothing."""

    async def main() -> None:
        client, writer = await _writer(streams_url, unique_name)
        conn = await psycopg.AsyncConnection.connect(streams_url, autocommit=autocommit)
        try:

            async def block() -> int:
                async with writer.fact(conn) as fact:
                    await fact.add({"row": 0}, {"row": 1})
                    await conn.execute("SELECT pg_sleep(0)")
                    await fact.add({"row": 2})
                    return fact.stream_id

            async def check(n: int) -> None:
                assert_nothing_pending(writer)
                assert_clean(conn, autocommit=autocommit)
                assert not conn.closed  # the caller's connection is rolled back, not closed

            points, stream_id = await every_point(block, check)
            assert points >= 6 and stream_id > 0
            await no_leaked_ids(client, unique_name)
        finally:
            await conn.close()
            await writer.aclose()
            await client.aclose()

    asyncio.run(main())
    whole_facts(streams_url, unique_name, rows_per_fact=3)


def test_heartbeat_at_every_await_point(streams_url: str, unique_name: str) -> None:
    async def main() -> None:
        client, writer = await _writer(streams_url, unique_name)
        try:
            await writer.append({"before": True})

            async def check(n: int) -> None:
                async with writer._beat_lock:  # the background heartbeat uses it too
                    # it borrows the writer's connection (the spare only behind a slow append)
                    assert writer._conn is not None and not writer._lock.locked()
                    assert_clean(writer._conn, autocommit=False)
                    assert writer._spare is None

            points, _ = await every_point(writer.heartbeat, check)
            assert points >= 2
            await writer.heartbeat()
            positions = await client.positions(unique_name)
            assert positions.writers["cancelled"].position >= 1
        finally:
            await writer.aclose()
            await client.aclose()

    asyncio.run(main())


def test_close_at_every_await_point(streams_url: str, unique_name: str) -> None:
    """A cancelled ``aclose()`` stops waiting, not closing: awaiting it again finishes it."""

    async def main() -> None:
        async with await streams.aconnect(streams_url, lease_seconds=5.0) as client:
            await client.create_stream(unique_name)
            points = 0
            for n in range(1, MAX_POINTS):
                writer = await client.writer(unique_name, instance=f"closing-{n}")
                await writer.append({"n": n})
                cancelled, _ = await attempt(writer.aclose, n)
                await writer.aclose()  # waits for the same close
                assert writer._conn is not None and writer._conn.closed
                assert writer._spare is None or writer._spare.closed
                row = (await client.positions(unique_name)).writers[f"closing-{n}"]
                assert row.retired
                if not cancelled:
                    break
                points += 1
            assert points >= 1
            await no_leaked_ids(client, unique_name)

    asyncio.run(main())


# ---------------------------------------------------------------------------- reader


async def _fill(client: AsyncClient, names: list[str]) -> dict[str, list[int]]:
    """Facts on each stream: batches, and a fact with more rows than a reader's page."""
    written: dict[str, list[int]] = {}
    for name in names:
        await client.create_stream(name)
        async with await client.writer(name, instance="filler") as writer:
            ids = list((await writer.append_batch([{"n": i} for i in range(7)])).ids)
            url = client.settings.database_url
            async with await psycopg.AsyncConnection.connect(url) as c, writer.fact(c) as fact:
                await fact.add(*({"row": r} for r in range(5)))  # > page_size rows
                ids.append(fact.stream_id)
            ids += (await writer.append_batch([{"m": i} for i in range(4)])).ids
            written[name] = ids
    return written


def test_reader_poll_at_every_await_point(streams_url: str, unique_name: str) -> None:
    """Every step interrupted at every point: each fact still comes exactly once, in order,
    whole, on two streams (an interrupted step must not move one stream's position)."""
    names = [unique_name + "_a", unique_name + "_b"]

    async def main() -> None:
        async with await streams.aconnect(streams_url) as client:
            written = await _fill(client, names)
            reader = await client.reader(names, page_size=3, group="g")
            delivered: dict[str, list[int]] = {name: [] for name in names}
            steps = interrupted = 0
            try:

                async def check(n: int) -> None:
                    assert_clean(reader._conn, autocommit=True)

                while True:
                    points, epoch = await every_point(lambda: reader.poll(timeout=0), check)
                    interrupted += points
                    steps += 1
                    if epoch is None:
                        break
                    for fact in epoch.facts:
                        delivered[fact.stream].append(fact.stream_id)
                        assert len(fact.payloads) == (5 if "row" in fact.payloads[0] else 1)
                assert delivered == written
                assert steps >= 5 and interrupted >= steps
            finally:
                await reader.aclose()

    asyncio.run(main())


def test_reader_epochs_and_commit_at_every_await_point(streams_url: str, unique_name: str) -> None:
    names = [unique_name + "_a", unique_name + "_b"]

    async def main() -> None:
        async with await streams.aconnect(streams_url) as client:
            written = await _fill(client, names)
            reader = await client.reader(names, page_size=3, group="g")
            delivered: dict[str, list[int]] = {name: [] for name in names}
            try:

                async def first_epoch() -> Any:
                    async for epoch in reader.epochs():
                        return epoch
                    return None

                async def check_epochs(n: int) -> None:
                    assert_clean(reader._conn, autocommit=True)

                while True:
                    _, epoch = await every_point(first_epoch, check_epochs)
                    if epoch is None:
                        break
                    for fact in epoch.facts:
                        delivered[fact.stream].append(fact.stream_id)
                assert delivered == written

                async def committed() -> dict[str, int]:
                    groups = {n: await client.groups(n) for n in names}
                    return {n: g[0].position if g else 0 for n, g in groups.items()}

                final = {n: max(written[n]) for n in names}

                async def check_commit(n: int) -> None:
                    assert_clean(reader._conn, autocommit=True)
                    # One transaction for both streams: all or nothing.
                    assert await committed() in ({n: 0 for n in names}, final)

                _, result = await every_point(reader.commit, check_commit)
                assert result == final
                assert await committed() == final
            finally:
                await reader.aclose()

    asyncio.run(main())


# ---------------------------------------------------------------------------- Redis link


def _link_connections(redis_url: str, link: AsyncRedisLink) -> dict[str, int]:
    """How many Redis connections this link holds, by role (``sub``, ``pub``)."""
    admin = redis.Redis.from_url(redis_url)
    try:
        names = [c.get("name", "") for c in admin.client_list()]
    finally:
        admin.close()
    return {role: names.count(link.client_name(role)) for role in ("sub", "pub")}


class _Hints:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.states: list[bool] = []

    def on_hint(self, hint: Any) -> None:
        self.tokens.append(hint.token)

    def on_link_state(self, connected: bool) -> None:
        self.states.append(connected)


async def _until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _link_works(link: AsyncRedisLink, redis_url: str, prefix: str, token: int) -> None:
    """The link hears the channel (a listener gets a hint) and publishes on it."""
    listener = _Hints()
    link.add_listener(listener)
    try:
        await _until(lambda: link.connected, "the link to connect")
        outside = redis.asyncio.Redis.from_url(redis_url)
        pubsub = outside.pubsub()
        await pubsub.subscribe(prefix, data_channel(prefix, "s_link"))  # where s_link's lines go
        try:
            line = f"POSITION s_other outside {token - 1} {token}"
            await outside.publish(prefix, line)
            await _until(lambda: token in listener.tokens, "the hint")
            link.publish([Position("s_link", "me", token, token)])
            heard: list[bytes] = []

            async def hear() -> None:
                while not any(b"s_link" in h for h in heard):
                    message = await pubsub.get_message(timeout=0.1)
                    if message and message["type"] == "message":
                        heard.append(message["data"])

            await asyncio.wait_for(hear(), 10)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]
            await outside.aclose()
    finally:
        link.remove_listener(listener)


@pytest.mark.parametrize("task", ["listen", "publish"])
def test_link_tasks_cancelled_at_every_await_point(
    redis_url: str, redis_prefix: str, task: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link task cancelled from outside (a service cancelling every task on shutdown)
    leaves no connection behind, and the link restarts it on its next use."""
    original = getattr(AsyncRedisLink, f"_{task}_loop")
    role = {"listen": "sub", "publish": "pub"}[task]
    points = 30 if task == "listen" else 12

    async def cancelled_at(n: int) -> None:
        wrapped: list[CancelAt] = []

        def cancelled_once(self: AsyncRedisLink) -> Any:
            if wrapped:
                return original(self)
            wrapped.append(CancelAt(original(self), n))
            return wrapped[0].run()

        monkeypatch.setattr(AsyncRedisLink, f"_{task}_loop", cancelled_once)
        # An idle listener's await points are mostly waits for a message: short ones reach
        # the 30th in seconds rather than minutes.
        monkeypatch.setattr(link_plans, "RECEIVE_WAIT", 0.02)
        # Someone listens on the busy stream's data channel: its lines are published.
        outside = redis.asyncio.Redis.from_url(redis_url)
        busy = outside.pubsub()
        await busy.subscribe(data_channel(redis_prefix, "s_busy"))
        # Names unique to this run: CLIENT LIST is shared with whatever else uses the server.
        link = AsyncRedisLink(redis_url, redis_prefix, f"{redis_prefix}-{task}-{n}")
        try:
            first = getattr(link, f"_{task}_task")
            # Keep the link busy so that every kind of await point comes up.
            for i in range(200):
                if first.done():
                    break
                link.publish([Position("s_busy", "me", i, i + 1)])
                await asyncio.sleep(0.005)
            await asyncio.wait({first}, timeout=10)
            assert first.cancelled(), f"point {n} was not reached, or the task went on"
            await _until(
                lambda: _link_connections(redis_url, link)[role] == 0,
                f"the {task} connection to close",
            )
            await _link_works(link, redis_url, redis_prefix, 1000 + n)
        finally:
            await link.aclose()
            await busy.aclose()  # type: ignore[no-untyped-call,unused-ignore]
            await outside.aclose()
        assert _link_connections(redis_url, link) == {"sub": 0, "pub": 0}

    async def main() -> None:
        for n in range(1, points + 1):
            await cancelled_at(n)

    asyncio.run(main())


def test_link_close_at_every_await_point(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        for n in range(1, MAX_POINTS):
            link = AsyncRedisLink(redis_url, redis_prefix, f"{redis_prefix}-close-{n}")
            await _until(lambda: link.connected, "the link to connect")  # noqa: B023
            link.publish([Position("s_close", "me", n, n + 1)])
            cancelled, _ = await attempt(link.aclose, n)
            await link.aclose()  # waits for the same close
            assert _link_connections(redis_url, link) == {"sub": 0, "pub": 0}
            if not cancelled:
                assert n > 1
                return
        raise AssertionError("aclose never completed")

    asyncio.run(main())


# ---------------------------------------------------------------------------- at random


def test_hundreds_of_cancellations_at_random_delays(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """Appends of every kind cancelled at random moments while a reader follows: every
    fact is whole, the reader gets each exactly once in order, and no ID is leaked."""
    rng = random.Random(1616)
    cancelled = completed = 0

    async def main() -> list[int]:
        nonlocal cancelled, completed
        async with await streams.aconnect(
            streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=5.0
        ) as client:
            await client.create_stream(unique_name)
            writer = await client.writer(unique_name, instance="random")
            reader = await client.reader(unique_name, page_size=50)
            conn = await psycopg.AsyncConnection.connect(streams_url)
            seen: list[int] = []

            async def fact_of_two() -> None:
                async with writer.fact(conn) as fact:
                    await fact.add({"pair": 0}, {"pair": 1})

            kinds: list[Callable[[], Awaitable[Any]]] = [
                lambda: writer.append({"one": 1}),
                lambda: writer.append_batch([{"many": i} for i in range(2)] * 20),
                fact_of_two,
            ]
            try:
                for _ in range(300):
                    task = asyncio.ensure_future(rng.choice(kinds)())
                    poll = asyncio.ensure_future(reader.poll(timeout=0))
                    await asyncio.sleep(rng.random() * 0.004)
                    task.cancel()
                    poll.cancel() if rng.random() < 0.5 else None
                    for done in (task, poll):
                        try:
                            result = await done
                        except asyncio.CancelledError:
                            cancelled += 1
                        else:
                            completed += 1
                            if done is poll and result is not None:
                                seen.extend(f.stream_id for f in result.facts)
                    assert_nothing_pending(writer)
                    assert_clean(conn, autocommit=False)
                while (epoch := await reader.poll(timeout=0)) is not None:
                    seen.extend(f.stream_id for f in epoch.facts)
                await no_leaked_ids(client, unique_name)
            finally:
                await conn.close()
                await reader.aclose()
                await writer.aclose()
            return seen

    seen = asyncio.run(main())
    counts: dict[int, int] = {}
    for stream_id, *_rest in fact_rows(streams_url, unique_name):
        counts[stream_id] = counts.get(stream_id, 0) + 1
    assert seen == sorted(counts)  # each fact exactly once, in order
    assert cancelled >= 100 and completed >= 100, (cancelled, completed)


# ---------------------------------------------------------------------------- Ctrl-C


# The alarm may also land in a connection's __del__ (garbage collection), where Python prints
# the KeyboardInterrupt as ignored: that attempt simply completes.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_inside_a_pipeline_stays_an_interruption(streams_url: str) -> None:
    """Ctrl-C (a ``KeyboardInterrupt`` from a signal handler) at random moments of a pipeline
    comes out of the sync driver as ``KeyboardInterrupt``, never as a `StoreError`.

    psycopg's ``Pipeline.__exit__`` interrupted while it syncs raises "cannot exit pipeline
    mode while busy" from its ``finally``; wrapped as `ConnectionLost`, that made a reader try
    again, and ``streams read --follow`` ignored Ctrl-C (CI; 40 of 3,000 interruptions here
    before the fix)."""
    from streams.store.driver import Commit, Pipeline, Query, run

    armed = False

    def interrupt(_signum: int, _frame: Any) -> None:
        nonlocal armed
        if armed:  # once per arming: a late timer never fires outside the try below
            armed = False
            raise KeyboardInterrupt

    def probe() -> Generator[Any, Any, Any]:
        rows = yield Pipeline(tuple(Query(f"SELECT {n}", ()) for n in range(3)))
        yield Commit()
        return rows

    rng = random.Random(41)
    interrupted = completed = 0
    conn = psycopg.connect(streams_url)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for _ in range(3000):
            if conn.closed:
                conn = psycopg.connect(streams_url)
            try:
                armed = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, 0.0015))
                run(conn, probe())
                armed = False
                completed += 1
            except KeyboardInterrupt:
                interrupted += 1
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                if not conn.closed:  # settled: clean, as `run` promises
                    assert conn.pgconn.pipeline_status == PipelineStatus.OFF
                    assert conn.info.transaction_status == TransactionStatus.IDLE
            finally:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
        conn.close()
    assert interrupted >= 100 and completed >= 100, (interrupted, completed)
