"""`Writer` and `AsyncWriter`: thin shells that drive `WriterCore` on psycopg connections.

The work against PostgreSQL is in `streams.store.writer_core` (store generators). What a writer
does around it is written once, as plans (`streams.plans`) that both shells drive:

* appending, opening and closing: `_WriterShell`, below. An append whose connection broke
  before its ``COMMIT`` is tried once more, on a new connection (nothing committed); one whose
  ``COMMIT`` may have gone through raises `CommitUnknown` (never written twice by us);
* the heartbeat, and the connections it runs on: `streams.heartbeat` (why a heartbeat borrows
  the writer's connection, when it takes a spare, and how often it runs: `BORROW_WAIT`,
  `SPARE_IDLE`, `FLUSH_INTERVAL` there);
* the block of ``fact()``, a fact in the caller's transaction: `streams.fact_blocks`.

`Writer` drives them on its callers' threads and a heartbeat thread, `AsyncWriter` on its
callers' tasks and a heartbeat task; each holds the state: its connection (appends from
several threads or tasks queue on a lock for it), the spare, the events.

With a Redis link a writer is attached to it (`streams.transport.faces`: the link owns the
writer's `Announcer`): after every completion the appending thread (or task) reports what
completed, and the link publishes ``RDATA``/``POSITION``, best effort and without waiting for
Redis; every heartbeat re-announces the position.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg

from .errors import CommitUnknown, ConnectionLost, StoreError, UsageError, WriterFenced
from .fact_blocks import AsyncOpenFact, FactPlans, OpenFact
from .heartbeat import C, HeartbeatPlans
from .orm import async_target, sync_target
from .plans import Call, Flag, Lock, Plan, adrive, drive
from .store.driver import Gen, gone
from .store.steps import Run
from .store.writer_core import WriterCore
from .transport.faces import Link
from .types import Ack, FactChunk, StreamInfo

__all__ = ["AsyncOpenFact", "AsyncWriter", "OpenFact", "Writer"]

log = logging.getLogger("streams.writer")

T = TypeVar("T")
A = TypeVar("A", bound=Ack | None)


def _written(ack: Ack) -> tuple[tuple[int, ...], int]:
    """The IDs an append wrote (not its duplicates') and the timestamp to announce them with."""
    if not ack.duplicates:
        return ack.ids, ack.last_timestamp
    return tuple(i for n, i in enumerate(ack.ids) if n not in ack.duplicates), ack.last_timestamp


class _WriterShell(HeartbeatPlans[C], FactPlans):
    """What `Writer` and `AsyncWriter` share: their properties, and the plans of appending,
    opening and closing (those of the heartbeat and of ``fact`` are inherited). Each shell
    holds the locks and events of its world and drives the plans."""

    _attached = None  # the writer's place on the Redis link, if any
    _closed = False  # `close` was called: appends are refused

    def __init__(
        self,
        database_url: str,
        core: WriterCore,
        lock: threading.Lock | asyncio.Lock,
        beat_lock: Lock,
        events: Callable[[], Flag],
    ) -> None:
        self._url = database_url
        self._core = core
        self._lock = lock
        # ``lock.acquire()``, blocking or awaited: made once, as every append takes it.
        self._take_lock = Call(lock.acquire)
        # One heartbeat at a time (the background one and `heartbeat()`); it guards the spare.
        self._beat_lock = beat_lock
        self._wake, self._stopped = events(), events()
        self._spare = None
        self._spare_used = 0.0
        self._sessions = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        core = self._core
        return f"<{type(self).__name__} stream={core.stream_name!r} instance={core.instance!r}>"

    @property
    def instance(self) -> str:
        return self._core.instance

    @property
    def stream(self) -> StreamInfo:
        return self._core.info

    @property
    def position(self) -> int:
        """This writer's (announceable) per-writer position."""
        return self._core.tracker.local_position

    @property
    def core(self) -> WriterCore:
        return self._core

    # ------------------------------------------------------------------ completions

    def _completed(
        self, ids: tuple[int, ...] = (), timestamp: int = 0, *, remembered: bool = True
    ) -> None:
        """IDs completed (``ids``: those that committed; ``remembered``: facts with rows a
        failover check can find): report them to the link, and wake the heartbeat to persist
        the position that moved."""
        if self._attached is not None:
            self._attached.completed(ids, timestamp)
        if ids and remembered:  # what a failover must not have lost (`streams.core.sightings`)
            self._core.sighting.note(self._core.stream_name, self._core.info.id, ids)
        if self._core.needs_persist and not self._wake.is_set():
            self._wake.set()

    def _after(self, ack: Ack | None) -> None:
        """After an append, whatever its outcome (None: it failed)."""
        if ack is None:
            self._completed()
        else:
            self._completed(*_written(ack))

    # ------------------------------------------------------------------ plans

    def _open_plan(self, link: Link | None, connect_timeout: float | None) -> Plan[None]:
        """Connect and register (waiting up to ``connect_timeout`` for a starting server, or
        a session lost meanwhile; None: the default), and attach to the link."""
        self._conn = yield from self._connect_plan(connect_timeout, first=True)
        if link is not None:
            tracker = self._core.tracker
            self._attached = link.attach_writer(
                self._core.stream_name, self._core.instance, lambda: tracker.local_position
            )

    def _exclusive(self, work: Plan[A]) -> Plan[A]:
        """``work`` (an append) holding the writer's connection; then, with the connection
        released, report what completed, whatever happened."""
        if self._closed:
            raise UsageError("writer is closed")
        ack = None
        try:
            yield self._take_lock
            try:
                ack = yield from work
            finally:
                self._lock.release()
            return ack
        finally:
            self._after(ack)

    def _append_plan(
        self,
        payloads: Sequence[Any],
        stamps: Sequence[int | None],
        keys: Sequence[str] | None = None,
    ) -> Plan[Ack]:
        """One append: `_retried_append`, exclusive."""
        return self._exclusive(self._retried_append(payloads, stamps, keys))

    def _retried_append(
        self, payloads: Sequence[Any], stamps: Sequence[int | None], keys: Sequence[str] | None
    ) -> Plan[Ack]:
        """One append, tried once more on a new connection if the connection broke before its
        ``COMMIT``."""
        for attempt in range(2):
            if gone(self._conn):
                # The server ended the session (a restart, pg_terminate_backend) or an earlier
                # append broke it: carry on with a new connection (`_reopen_plan`).
                yield from self._reopen_plan()
            try:
                ack: Ack = yield Run(self._conn, self._core.append(payloads, stamps, keys))
                return ack
            except CommitUnknown:
                raise  # it may have committed: never written twice by us
            except ConnectionLost:
                if attempt:
                    raise
                # Lost before its COMMIT: nothing committed; once more, on a new one.
                log.warning("%r lost its connection before committing; retrying", self)
        raise AssertionError("unreachable")

    def _batch_plan(
        self,
        payloads: Sequence[Any],
        timestamps: Sequence[int | None] | None,
        keys: Sequence[str] | None,
    ) -> Plan[Ack]:
        """`_append_plan` of `append_batch`'s arguments, checked now."""
        stamps = list(timestamps) if timestamps is not None else [None] * len(payloads)
        if len(stamps) != len(payloads):
            raise UsageError("timestamps must have one entry per payload")
        return self._append_plan(list(payloads), stamps, None if keys is None else list(keys))

    def _append_facts_plan(
        self, chunks: Iterable[FactChunk], first: Gen[bool] | None
    ) -> Plan[Ack | None]:
        """`append_facts`, exclusive (`_once`: ``chunks`` may be lazy, so it is never tried
        again)."""
        return self._exclusive(self._once(lambda: self._core.append_facts(chunks, first=first)))

    def _once(self, work: Callable[[], Gen[T]]) -> Plan[T]:
        """``work()`` on the writer's connection, reopened first if the server ended it."""
        if gone(self._conn):
            yield from self._reopen_plan()
        result: T = yield Run(self._conn, work())
        return result

    def _stop(self) -> None:
        """The first step of closing: refuse appends, and stop the heartbeat."""
        self._closed = True
        self._stopped.set()
        self._wake.set()

    def _close_plan(self) -> Plan[None]:
        """The rest of closing, once the heartbeat has stopped: detach from the link, retire
        (persisting the position), and close both connections."""
        if self._attached is not None:
            self._attached.detach()
        try:
            yield self._take_lock
            try:
                yield from self._once(self._core.retire)
            finally:
                self._lock.release()
        except (StoreError, WriterFenced) as exc:
            log.warning("could not retire %r cleanly: %s", self, exc)
        finally:
            yield Call(self._conn.close)
            if self._spare is not None:
                yield Call(self._spare.close)


class Writer(_WriterShell[psycopg.Connection[Any]]):
    """A synchronous writer of one stream (thread-safe)."""

    _lock: threading.Lock
    _beat_lock: threading.Lock
    _wake: threading.Event
    _stopped: threading.Event

    def __init__(
        self,
        database_url: str,
        core: WriterCore,
        link: Link | None = None,
        *,
        connect_timeout: float | None = None,
    ) -> None:
        super().__init__(database_url, core, threading.Lock(), threading.Lock(), threading.Event)
        drive(self._open_plan(link, connect_timeout))
        self._thread = threading.Thread(
            target=drive,
            args=(self._beat_loop_plan(),),
            name=f"streams-heartbeat-{core.instance}",
            daemon=True,
        )
        self._thread.start()

    # ------------------------------------------------------------------ writing

    def append(self, payload: Any, *, timestamp: int | None = None, key: str | None = None) -> Ack:
        """Append one fact; returns its `Ack` once committed.

        ``key``: an idempotency key. If an append with this key was written to the stream
        within its key window (by any process), nothing is written and the original `Ack`
        comes back (``ack.duplicate``); two processes racing with one key write one fact. Retry
        an append that raised `CommitUnknown` with the same key: it writes the fact at most once.
        """
        plan = self._append_plan([payload], [timestamp], None if key is None else [key])
        return drive(plan)

    def append_batch(
        self,
        payloads: Sequence[Any],
        *,
        timestamps: Sequence[int | None] | None = None,
        keys: Sequence[str] | None = None,
    ) -> Ack:
        """Append several facts in one transaction (IDs ascending, maybe not contiguous).

        ``keys``: one idempotency key per payload (distinct). Payloads whose key was written
        already are not written again: their positions are in ``ack.duplicates`` and their
        IDs in ``ack.ids`` are the original facts' (see `Ack`); the others are written.
        """
        return drive(self._batch_plan(payloads, timestamps, keys))

    def append_facts(
        self, chunks: Iterable[FactChunk], *, first: Gen[bool] | None = None
    ) -> Ack | None:
        """Append facts of one or more rows each (JSON text), chunk by chunk, in one
        transaction; ``first`` runs first in it and may veto the write (see
        `WriterCore.append_facts`, which the Spark sink uses). ``chunks`` may be lazy, so
        nothing is retried here: a broken connection raises (`ConnectionLost`: nothing was
        written; `CommitUnknown`: it may have committed)."""
        return drive(self._append_facts_plan(chunks, first))

    @contextlib.contextmanager
    def fact(
        self, conn: Any, *, timestamp: int | None = None, key: str | None = None
    ) -> Iterator[OpenFact]:
        """Reserve an ID for a fact written in *your* transaction on *your* connection.

        ``conn``: a psycopg connection, a SQLAlchemy ``Connection`` or ``Session``, or a Django
        connection inside ``transaction.atomic()`` (`streams.orm`).

        * An idle psycopg connection: the block is the transaction: it begins here and commits
          when the block exits (rolls back on an exception).
        * A psycopg connection already in a transaction, or an ORM's: the fact *joins* that
          transaction, which you commit (or roll back) as usual, after the block. An error
          in the block (yours or ours) leaves the transaction able only to roll back.

        Write the fact's rows in your own tables with `fact.stream_id` (and/or `fact.add(...)`
        rows in the built-in table), inside the block. The ID completes when the transaction
        ends, as a gap if it rolled back.

        ``key``: an idempotency key (see `append`). If it was written already,
        ``fact.duplicate`` is true, ``fact.ack`` is the original's, and nothing may be written:
        return without writing (a block that is its own transaction is rolled back anyway).

        The transaction holds back the linear position while open, so it must not sit idle:
        the server aborts it if it is idle (no statement running) for longer than the lease.
        """
        target = sync_target(conn)
        fact = drive(self._enter_fact(target.conn, target.joined, OpenFact, timestamp, key))
        raised = True
        try:
            yield fact
            raised = False
        finally:  # the block's exception, if any, propagates once the fact has ended
            drive(self._exit_fact(fact, raised))

    # ------------------------------------------------------------------ heartbeat, closing

    def heartbeat(self) -> None:
        """Run one heartbeat now (the background thread also runs them)."""
        drive(self._on_beat_connection(self._persist_work))

    def close(self) -> None:
        """Persist the position and retire this writer (it no longer holds anything back)."""
        if self._stopped.is_set():
            return
        self._stop()
        self._thread.join()
        drive(self._close_plan())

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWriter(_WriterShell[psycopg.AsyncConnection[Any]]):
    """An asyncio writer of one stream (safe to share between tasks)."""

    _lock: asyncio.Lock
    _beat_lock: asyncio.Lock
    _wake: asyncio.Event
    _stopped: asyncio.Event

    def __init__(self, database_url: str, core: WriterCore) -> None:
        super().__init__(database_url, core, asyncio.Lock(), asyncio.Lock(), asyncio.Event)
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    async def open(
        cls,
        database_url: str,
        core: WriterCore,
        link: Link | None = None,
        *,
        connect_timeout: float | None = None,
    ) -> AsyncWriter:
        self = cls(database_url, core)
        await adrive(self._open_plan(link, connect_timeout))
        self._task = asyncio.create_task(
            adrive(self._beat_loop_plan()), name=f"streams-heartbeat-{core.instance}"
        )
        return self

    async def append(
        self, payload: Any, *, timestamp: int | None = None, key: str | None = None
    ) -> Ack:
        """The asyncio twin of `Writer.append`."""
        plan = self._append_plan([payload], [timestamp], None if key is None else [key])
        return await adrive(plan)

    async def append_batch(
        self,
        payloads: Sequence[Any],
        *,
        timestamps: Sequence[int | None] | None = None,
        keys: Sequence[str] | None = None,
    ) -> Ack:
        """The asyncio twin of `Writer.append_batch`."""
        return await adrive(self._batch_plan(payloads, timestamps, keys))

    async def append_facts(
        self, chunks: Iterable[FactChunk], *, first: Gen[bool] | None = None
    ) -> Ack | None:
        """The asyncio twin of `Writer.append_facts`."""
        return await adrive(self._append_facts_plan(chunks, first))

    @contextlib.asynccontextmanager
    async def fact(
        self, conn: Any, *, timestamp: int | None = None, key: str | None = None
    ) -> AsyncIterator[AsyncOpenFact]:
        """The asyncio twin of `Writer.fact` (``conn``: a psycopg ``AsyncConnection``, or a
        SQLAlchemy ``AsyncConnection`` or ``AsyncSession``).

        A cancellation anywhere (in the block or in ours) rolls the transaction back before it
        propagates (`streams.store.driver.asettle`: to the end, even if cancelled again) and
        completes the ID as a gap; in a transaction of yours it leaves that transaction able
        only to roll back. A cancelled ``COMMIT`` has an unknown outcome, as a lost
        connection has: the ID completes either way, and readers learn the fact from PostgreSQL if
        it was committed.
        """
        target = await async_target(conn)
        enter = self._enter_fact(target.conn, target.joined, AsyncOpenFact, timestamp, key)
        fact = await adrive(enter)
        raised = True
        try:
            yield fact
            raised = False
        finally:
            await adrive(self._exit_fact(fact, raised))

    async def heartbeat(self) -> None:
        """The asyncio twin of `Writer.heartbeat`."""
        await adrive(self._on_beat_connection(self._persist_work))

    async def aclose(self) -> None:
        """Persist the position and retire this writer (see `Writer.close`).

        Closing runs in a task of its own: cancelling ``aclose()`` stops the wait, not the
        close, and awaiting ``aclose()`` again waits for the same close to finish.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._stop()
        if self._task is not None:
            await self._task
        await adrive(self._close_plan())

    async def __aenter__(self) -> AsyncWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
