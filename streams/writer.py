"""`Writer` and `AsyncWriter`: thin shells that drive `WriterCore` on psycopg connections.

Each writer holds one connection, for its appends (one transaction at a time, so appends
from several threads or tasks queue on a lock) and for its heartbeat, which renews the lease,
persists the position and re-samples the database clock. A heartbeat that comes due borrows
the connection between two appends, waiting at most `BORROW_WAIT` for the lock (measured:
four threads appending back to back still let it in within that time, every time; asyncio's
lock is first come, first served). If the append in flight is slower (a long ``COPY``, a
sink's lazy chunks, a lock wait), the heartbeat runs on a *spare* connection, opened then and
closed once unused for `SPARE_IDLE`: the lease is never held hostage by an append, and a
writer costs the server one session while its appends are short.

The heartbeat runs every ``lease / 4`` seconds; an append that moved the position also wakes
it, coalesced to at most one such early heartbeat per `FLUSH_INTERVAL` (each is one
autocommit statement, without the retirement of expired peers that every
`streams.store.writer_core.RETIRE_EVERY`-th scheduled one does), so the persisted position trails
the real one by at most about `FLUSH_INTERVAL` while a writer is busy. It is informational
(``persisted_linear``): readers ask PostgreSQL what is complete.

With a Redis link, each writer also has an `Announcer`: after every completion the appending
thread (or task) publishes ``RDATA``/``POSITION`` through the link, best effort and without
waiting for Redis (`streams.transport.link`), and every heartbeat re-announces the position
(``POSITION p p``, the courtesy answer to readers that joined in between).

The logic lives in `streams.store.writer_core` and `streams.core.replication`; everything here is
connection handling and scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ._aio import wait_event
from .core.replication import Announcer
from .errors import CommitUnknown, ConnectionLost, StoreError, UsageError, WriterFenced
from .orm import async_target, sync_target
from .store import sessions
from .store.driver import (
    Gen,
    afail_joined,
    arun,
    asettle,
    commit_unknown,
    fail_joined,
    gone,
    run,
    settle,
)
from .store.registry import StreamInfo
from .store.writer_core import Ack, FactChunk, FactHandle, WriterCore

__all__ = ["AsyncOpenFact", "AsyncWriter", "OpenFact", "Writer"]

log = logging.getLogger("streams.writer")

#: Minimum seconds between two heartbeats woken by appends. At 20 ms (and four round trips a
#: heartbeat) four single-fact writers lost ~25% of their throughput to them; at 100 ms and one
#: round trip the heartbeat thread costs 1-5 us of CPU per append (`streams bench write`).
FLUSH_INTERVAL = 0.1
#: Seconds between heartbeat attempts while they fail (a restart, a partition), at most an
#: eighth of the lease. Waiting the usual quarter of the lease after a failure, plus a second
#: after a failed reconnection, let a writer's lease run out behind a 2 s restart on a loaded
#: machine (its last beat up to a quarter lease before, 2 s down, up to 2.25 s to the next try
#: with a 5 s lease); now the gap is the outage plus about this much.
BEAT_RETRY_INTERVAL = 0.25
#: Seconds a due heartbeat waits for the writer's connection (the append in flight, and
#: appends queued before it) before it runs on the spare connection instead.
BORROW_WAIT = 0.25
#: Seconds the spare connection stays open after the last heartbeat that needed it: a writer
#: whose appends are often slow keeps it rather than connecting again every lease/4.
SPARE_IDLE = 30.0


def _retry_interval(core: WriterCore) -> float:
    return min(BEAT_RETRY_INTERVAL, core.lease_seconds / 8)


def _beat_wait(core: WriterCore, interval: float, failing: bool) -> float:
    """Seconds until the next heartbeat: sooner after a failure, and every `FLUSH_INTERVAL`
    while facts written in transactions of callers' are pending (the heartbeat is how the
    writer learns that those transactions ended: `WriterCore.resolve_joined`)."""
    if failing:
        return _retry_interval(core)
    return min(interval, FLUSH_INTERVAL) if core.joined_pending else interval


def _written(ack: Ack) -> tuple[tuple[int, ...], int]:
    """The IDs an append wrote (not its duplicates') and the timestamp to announce them with."""
    if not ack.duplicates:
        return ack.ids, ack.last_timestamp
    return tuple(i for n, i in enumerate(ack.ids) if n not in ack.duplicates), ack.last_timestamp


_FAILED_IN_BLOCK = (
    "a statement of the fact failed inside the block (an error was caught there): "
    "its transaction can only roll back, and nothing of it was written"
)


def _log_beat(writer: _Announcing, failing: bool, exc: Exception | None) -> None:
    """Log a change of a heartbeat run: the first failure at WARNING (the next come every
    `BEAT_RETRY_INTERVAL` while the server is away: DEBUG), the first success after at INFO."""
    if exc is not None:
        level = logging.DEBUG if failing else logging.WARNING
        log.log(level, "heartbeat of %r failed: %s", writer, exc)
    elif failing:
        log.info("heartbeat of %r succeeded again", writer)


def _connect(
    url: str, core: WriterCore, connect_timeout: float | None = 0
) -> psycopg.Connection[Any]:
    """One of the writer's own connections, with its session settings (TCP keepalives and
    checks: `WriterCore.configure_session`). ``connect_timeout``: see `streams.store.sessions`;
    0 (one attempt) when reopening, so an append fails at once while the server is down and
    the heartbeat keeps its own pace of retries."""
    conn = sessions.connect(
        url, autocommit=False, connect_timeout=connect_timeout, purpose="writer"
    )
    try:
        run(conn, core.configure_session())
    except BaseException:
        conn.close()
        raise
    return conn


async def _aconnect(
    url: str, core: WriterCore, connect_timeout: float | None = 0
) -> psycopg.AsyncConnection[Any]:
    conn = await sessions.aconnect(
        url, autocommit=False, connect_timeout=connect_timeout, purpose="writer"
    )
    try:
        await arun(conn, core.configure_session())
    except BaseException:
        await conn.close()
        raise
    return conn


def _check_committable(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], failed: bool
) -> None:
    """Before a fact's ``COMMIT``: is its transaction still the open, healthy one?

    PostgreSQL answers ``COMMIT`` of a failed transaction with a rollback, not an error, so a
    statement that failed inside the block (and whose exception the block swallowed) would
    otherwise pass for a written fact; and rows written after a failed `add` (whose failure
    rolled the transaction back) or after the block ended the transaction itself would
    commit without their ID's reservation, after readers may have passed that ID.
    """
    status = conn.info.transaction_status
    if failed or status == TransactionStatus.INERROR:
        raise StoreError(
            "the fact's transaction failed inside the block (an error was caught there): "
            "it was rolled back and nothing was written"
        )
    if status != TransactionStatus.INTRANS:
        raise UsageError(
            "the fact's transaction ended inside the block (commit or rollback on its "
            "connection): writer.fact() commits it when the block exits"
        )


class _FactView:
    """What `OpenFact` and `AsyncOpenFact` share: the fact's ID, timestamp and `Ack`."""

    _handle: FactHandle
    _joined: bool

    @property
    def stream_id(self) -> int:
        return self._handle.stream_id

    @property
    def timestamp(self) -> int:
        return self._handle.timestamp

    @property
    def duplicate(self) -> bool:
        """The fact's key had been written already: `stream_id`, `timestamp` and `ack` are the
        original fact's, and nothing may be written for it (`add` refuses)."""
        return self._handle.duplicate

    @property
    def ack(self) -> Ack:
        """The fact's `Ack` (the original's for a duplicate): known before anything is added,
        and final once the transaction commits."""
        return self._handle.ack

    def _check_addable(self) -> None:
        if self._handle.duplicate:
            raise UsageError(
                f"the fact's key was written already (fact {self.stream_id}): check "
                "fact.duplicate and write nothing for a duplicate"
            )


class OpenFact(_FactView):
    """A fact being written in the caller's transaction: its ID and timestamp, and `add`."""

    def __init__(
        self,
        core: WriterCore,
        conn: psycopg.Connection[Any],
        handle: FactHandle,
        joined: bool = False,
    ):
        self._core, self._conn, self._handle, self._joined = core, conn, handle, joined
        #: An `add` failed (its transaction was rolled back): the fact can only be abandoned.
        self.failed = False

    def add(self, *payloads: Any) -> None:
        """Add rows with this fact's stream ID to the built-in facts table."""
        self._check_addable()
        try:
            run(self._conn, self._core.add_rows(self._handle, payloads), joined=self._joined)
        except BaseException:
            self.failed = True
            raise


class AsyncOpenFact(_FactView):
    """The asyncio twin of `OpenFact`."""

    def __init__(
        self,
        core: WriterCore,
        conn: psycopg.AsyncConnection[Any],
        handle: FactHandle,
        joined: bool = False,
    ) -> None:
        self._core, self._conn, self._handle, self._joined = core, conn, handle, joined
        self.failed = False

    async def add(self, *payloads: Any) -> None:
        self._check_addable()
        try:
            await arun(self._conn, self._core.add_rows(self._handle, payloads), joined=self._joined)
        except BaseException:  # a cancellation too: the transaction was rolled back
            self.failed = True
            raise


class _Announcing:
    """The Redis side shared by both writers: an `Announcer` fed from the tracker."""

    _core: WriterCore
    _link: Any = None
    _announcer: Announcer | None = None

    def _attach(self, link: Any) -> None:
        self._link = link
        # Held from computing commands to queueing them, so threads of one writer can never
        # queue them out of order (RDATA 5 after POSITION 5 6). asyncio needs no lock: nothing
        # awaits in between.
        self._announce_lock = threading.Lock()
        if link is not None:
            self._announcer = Announcer(
                self._core.stream_name, self._core.instance, self._core.tracker.local_position
            )
            link.add_writer(self._announcer)

    def _detach(self) -> None:
        if self._announcer is not None:
            self._link.remove_writer(self._announcer)

    def _announce(
        self, ids: tuple[int, ...] = (), timestamp: int = 0, *, periodic: bool = False
    ) -> None:
        announcer = self._announcer
        if announcer is None:
            return
        with self._announce_lock:
            if ids:
                announcer.committed(ids, timestamp)
            commands = announcer.update(self._core.tracker.local_position)
            if periodic and not commands:
                commands = [announcer.announce()]
            self._link.publish(commands)

    def _after_completion(self, ids: tuple[int, ...] = (), timestamp: int = 0) -> None:
        """An ID completed: announce what moved, and wake the heartbeat to persist it."""
        if self._announcer is not None:
            self._announce(ids, timestamp)
        if self._core.needs_persist and not self._wake.is_set():
            self._wake.set()

    _wake: Any  # threading.Event or asyncio.Event: only is_set() and set() are used here


class Writer(_Announcing):
    """A synchronous writer of one stream (thread-safe)."""

    def __init__(
        self,
        database_url: str,
        core: WriterCore,
        link: Any = None,
        *,
        connect_timeout: float | None = None,
    ) -> None:
        self._url = database_url
        self._core = core
        # Opening waits up to ``connect_timeout`` for a starting server (None: the default).
        self._conn = _connect(database_url, self._core, connect_timeout)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        try:
            run(self._conn, core.register())
        except BaseException:
            self._conn.close()
            raise
        self._spare: psycopg.Connection[Any] | None = None
        self._spare_used = 0.0
        # One heartbeat at a time (the thread and `heartbeat()`); it also guards the spare.
        self._beat_lock = threading.Lock()
        self._attach(link)
        self._thread = threading.Thread(
            target=self._beat_loop, name=f"streams-heartbeat-{core.instance}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"<Writer stream={self._core.stream_name!r} instance={self._core.instance!r}>"

    # ------------------------------------------------------------------ properties

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

    # ------------------------------------------------------------------ writing

    def append(self, payload: Any, *, timestamp: int | None = None, key: str | None = None) -> Ack:
        """Append one fact; returns its `Ack` once committed.

        ``key``: an idempotency key. If an append with this key was written to the stream
        within its key window (by any process), nothing is written and the original `Ack`
        comes back (``ack.duplicate``); two processes racing with one key write one fact. Retry
        an append that raised `CommitUnknown` with the same key: it writes the fact at most once.
        """
        return self._append([payload], [timestamp], None if key is None else [key])

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
        stamps = list(timestamps) if timestamps is not None else [None] * len(payloads)
        if len(stamps) != len(payloads):
            raise UsageError("timestamps must have one entry per payload")
        return self._append(list(payloads), stamps, None if keys is None else list(keys))

    def _append(
        self,
        payloads: Sequence[Any],
        stamps: Sequence[int | None],
        keys: Sequence[str] | None = None,
    ) -> Ack:
        ack: Ack | None = None
        try:
            with self._lock:
                for attempt in range(2):
                    if gone(self._conn):
                        # The server ended the session (a restart, pg_terminate_backend) or an
                        # earlier append broke it: carry on with a new connection (the lease
                        # and the generation are the writer's, not the connection's).
                        self._conn.close()
                        self._conn = _connect(self._url, self._core)
                    try:
                        ack = run(self._conn, self._core.append(payloads, stamps, keys))
                        break
                    except CommitUnknown:
                        raise  # it may have committed: never written twice by us
                    except ConnectionLost:
                        if attempt:
                            raise
                        # Lost before its COMMIT: nothing committed; once more, on a new one.
                        log.warning("%r lost its connection before committing; retrying", self)
            assert ack is not None
            return ack
        finally:
            if ack is not None:
                self._after_completion(*_written(ack))
            else:
                self._after_completion()

    def append_facts(
        self, chunks: Iterable[FactChunk], *, first: Gen[bool] | None = None
    ) -> Ack | None:
        """Append facts of one or more rows each (JSON text), chunk by chunk, in one
        transaction; ``first`` runs first in it and may veto the write (see
        `WriterCore.append_facts`, which the Spark sink uses). ``chunks`` may be lazy, so
        nothing is retried here: a broken connection raises (`ConnectionLost`: nothing was
        written; `CommitUnknown`: it may have committed)."""
        ack: Ack | None = None
        try:
            with self._lock:
                if gone(self._conn):
                    self._conn.close()
                    self._conn = _connect(self._url, self._core)
                ack = run(self._conn, self._core.append_facts(chunks, first=first))
            return ack
        finally:
            if ack is not None:
                self._after_completion(ack.ids, ack.last_timestamp)
            else:
                self._after_completion()

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
        if target.joined:
            with self._joined_fact(target.conn, timestamp, key) as joined:
                yield joined
            return
        conn = target.conn
        core = self._core
        autocommit = conn.autocommit
        token, stamp = core.begin_fact(timestamp, key)
        handle: FactHandle | None = None
        ok = False
        try:
            if autocommit:
                conn.execute("BEGIN")
            handle = run(conn, core.reserve_fact(token, stamp, key))
            fact = OpenFact(core, conn, handle)
            yield fact
            _check_committable(conn, fact.failed)
            if handle.duplicate:
                settle(conn, autocommit)  # nothing of a duplicate's block is written
            else:
                try:
                    conn.commit()
                except psycopg.Error as exc:
                    unknown = commit_unknown(exc, conn)
                    if unknown is None:
                        raise
                    raise unknown from exc
            ok = True
        finally:
            try:
                # Roll back (or close a connection left unusable): streams.store.driver.
                if not ok:
                    with contextlib.suppress(psycopg.Error):
                        settle(conn, autocommit)
            finally:
                core.finish_fact(token, handle, ok)
                if ok and handle is not None and not handle.duplicate:
                    self._after_completion((handle.stream_id,), handle.timestamp)
                else:
                    self._after_completion()

    @contextlib.contextmanager
    def _joined_fact(
        self, conn: psycopg.Connection[Any], timestamp: int | None, key: str | None
    ) -> Iterator[OpenFact]:
        """`fact` in a transaction of the caller's: never begun, committed or rolled back here.
        The ID stays pending until the heartbeat finds that transaction ended
        (`WriterCore.resolve_joined`); a failure leaves it failed (`fail_joined`)."""
        core = self._core
        token, stamp = core.begin_fact(timestamp, key)
        handle: FactHandle | None = None
        ok = False
        try:
            handle = run(conn, core.reserve_fact(token, stamp, key), joined=True)
            fact = OpenFact(core, conn, handle, joined=True)
            yield fact
            if fact.failed:
                raise StoreError(_FAILED_IN_BLOCK)
            ok = True
        finally:
            if not ok:
                with contextlib.suppress(psycopg.Error):
                    fail_joined(conn)
            if ok and handle is not None and not handle.duplicate:
                core.join_fact(handle)
                self._wake.set()
            else:
                core.finish_fact(token, handle, False)
                self._after_completion()

    # ------------------------------------------------------------------ heartbeat

    def heartbeat(self) -> None:
        """Run one heartbeat now (the background thread also runs them)."""
        with self._beat_lock, self._beat_connection() as conn:
            run(conn, self._core.heartbeat())

    @contextlib.contextmanager
    def _beat_connection(self) -> Iterator[psycopg.Connection[Any]]:
        """The connection for one heartbeat (the caller holds ``_beat_lock``): the writer's
        own, borrowed between two appends, or the spare while an append holds it for longer
        than `BORROW_WAIT`. Either is reopened if an interruption or the server closed it."""
        if self._lock.acquire(timeout=BORROW_WAIT):
            try:
                if gone(self._conn):
                    self._conn.close()
                    self._conn = _connect(self._url, self._core)
                yield self._conn
            finally:
                self._lock.release()
            if self._spare is not None and time.monotonic() - self._spare_used > SPARE_IDLE:
                self._spare.close()
                self._spare = None
            return
        spare = self._spare
        if spare is None or gone(spare):
            if spare is not None:
                spare.close()
            spare = self._spare = _connect(self._url, self._core)
        self._spare_used = time.monotonic()
        yield spare

    def _beat_loop(self) -> None:
        interval, failing = self._core.lease_seconds / 4, False
        while not self._stopped.is_set():
            woken = self._wake.wait(_beat_wait(self._core, interval, failing))
            self._wake.clear()
            if self._stopped.is_set():
                break
            try:
                with self._beat_lock, self._beat_connection() as conn:
                    if self._core.joined_pending:
                        for stream_id, ts in run(conn, self._core.resolve_joined()):
                            self._announce((stream_id,), ts)
                    if woken:  # by an append: persist the position, nothing else
                        run(conn, self._core.heartbeat())
                    else:
                        run(conn, self._core.beat())
                self._announce(periodic=not woken)
                _log_beat(self, failing, None)
                failing = False
            except Exception as exc:  # keep beating through transient failures
                # (a connection it broke is reopened by whoever uses it next)
                _log_beat(self, failing, exc)
                failing = True
            if self._core.fenced:
                log.error("%r was fenced: its lease expired or its name was taken over", self)
                break
            if woken:
                self._stopped.wait(FLUSH_INTERVAL)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Persist the position and retire this writer (it no longer holds anything back)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._wake.set()
        self._thread.join()
        self._detach()
        try:
            with self._lock:
                if self._conn.closed or self._conn.broken:
                    self._conn = _connect(self._url, self._core)
                run(self._conn, self._core.retire())
        except (StoreError, WriterFenced) as exc:
            log.warning("could not retire %r cleanly: %s", self, exc)
        finally:
            self._conn.close()
            if self._spare is not None:
                self._spare.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWriter(_Announcing):
    """An asyncio writer of one stream (safe to share between tasks)."""

    def __init__(self, database_url: str, core: WriterCore) -> None:
        self._url = database_url
        self._core = core
        self._lock = asyncio.Lock()
        self._beat_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._spare: psycopg.AsyncConnection[Any] | None = None
        self._spare_used = 0.0
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    async def open(
        cls,
        database_url: str,
        core: WriterCore,
        link: Any = None,
        *,
        connect_timeout: float | None = None,
    ) -> AsyncWriter:
        self = cls(database_url, core)
        self._conn = await _aconnect(database_url, self._core, connect_timeout)
        try:
            await arun(self._conn, core.register())
        except BaseException:
            await self._conn.close()
            raise
        self._attach(link)
        self._task = asyncio.create_task(
            self._beat_loop(), name=f"streams-heartbeat-{core.instance}"
        )
        return self

    def __repr__(self) -> str:
        return f"<AsyncWriter stream={self._core.stream_name!r} instance={self._core.instance!r}>"

    @property
    def instance(self) -> str:
        return self._core.instance

    @property
    def stream(self) -> StreamInfo:
        return self._core.info

    @property
    def position(self) -> int:
        return self._core.tracker.local_position

    @property
    def core(self) -> WriterCore:
        return self._core

    def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._stopped.is_set():
            raise UsageError("writer is closed")
        return self._conn

    async def append(
        self, payload: Any, *, timestamp: int | None = None, key: str | None = None
    ) -> Ack:
        """The asyncio twin of `Writer.append`."""
        return await self._append([payload], [timestamp], None if key is None else [key])

    async def append_batch(
        self,
        payloads: Sequence[Any],
        *,
        timestamps: Sequence[int | None] | None = None,
        keys: Sequence[str] | None = None,
    ) -> Ack:
        """The asyncio twin of `Writer.append_batch`."""
        stamps = list(timestamps) if timestamps is not None else [None] * len(payloads)
        if len(stamps) != len(payloads):
            raise UsageError("timestamps must have one entry per payload")
        return await self._append(list(payloads), stamps, None if keys is None else list(keys))

    async def _append(
        self,
        payloads: Sequence[Any],
        stamps: Sequence[int | None],
        keys: Sequence[str] | None = None,
    ) -> Ack:
        conn = self._connection()
        ack: Ack | None = None
        try:
            async with self._lock:
                conn = self._conn or conn  # a heartbeat may have reopened it meanwhile
                for attempt in range(2):
                    if gone(conn):
                        await conn.close()
                        conn = self._conn = await _aconnect(self._url, self._core)
                    try:
                        ack = await arun(conn, self._core.append(payloads, stamps, keys))
                        break
                    except CommitUnknown:
                        raise
                    except ConnectionLost:  # before its COMMIT: see `Writer._append`
                        if attempt:
                            raise
                        log.warning("%r lost its connection before committing; retrying", self)
            assert ack is not None
            return ack
        finally:
            if ack is not None:
                self._after_completion(*_written(ack))
            else:
                self._after_completion()

    async def append_facts(
        self, chunks: Iterable[FactChunk], *, first: Gen[bool] | None = None
    ) -> Ack | None:
        """The asyncio twin of `Writer.append_facts`."""
        conn = self._connection()
        ack: Ack | None = None
        try:
            async with self._lock:
                conn = self._conn or conn
                if gone(conn):
                    await conn.close()
                    conn = self._conn = await _aconnect(self._url, self._core)
                ack = await arun(conn, self._core.append_facts(chunks, first=first))
            return ack
        finally:
            if ack is not None:
                self._after_completion(ack.ids, ack.last_timestamp)
            else:
                self._after_completion()

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
        if target.joined:
            async with self._joined_fact(target.conn, timestamp, key) as joined:
                yield joined
            return
        conn = target.conn
        core = self._core
        autocommit = conn.autocommit
        token, stamp = core.begin_fact(timestamp, key)
        handle: FactHandle | None = None
        ok = False
        try:
            if autocommit:
                await conn.execute("BEGIN")
            handle = await arun(conn, core.reserve_fact(token, stamp, key))
            fact = AsyncOpenFact(core, conn, handle)
            yield fact
            _check_committable(conn, fact.failed)
            if handle.duplicate:
                await asettle(conn, autocommit)  # nothing of a duplicate's block is written
            else:
                try:
                    await conn.commit()
                except psycopg.Error as exc:
                    unknown = commit_unknown(exc, conn)
                    if unknown is None:
                        raise
                    raise unknown from exc
            ok = True
        finally:
            try:
                if not ok:
                    with contextlib.suppress(psycopg.Error):
                        await asettle(conn, autocommit)
            finally:
                core.finish_fact(token, handle, ok)
                if ok and handle is not None and not handle.duplicate:
                    self._after_completion((handle.stream_id,), handle.timestamp)
                else:
                    self._after_completion()

    @contextlib.asynccontextmanager
    async def _joined_fact(
        self, conn: psycopg.AsyncConnection[Any], timestamp: int | None, key: str | None
    ) -> AsyncIterator[AsyncOpenFact]:
        """The asyncio twin of `Writer._joined_fact`."""
        core = self._core
        token, stamp = core.begin_fact(timestamp, key)
        handle: FactHandle | None = None
        ok = False
        try:
            handle = await arun(conn, core.reserve_fact(token, stamp, key), joined=True)
            fact = AsyncOpenFact(core, conn, handle, joined=True)
            yield fact
            if fact.failed:
                raise StoreError(_FAILED_IN_BLOCK)
            ok = True
        finally:
            try:
                if not ok:
                    with contextlib.suppress(psycopg.Error):
                        await afail_joined(conn)
            finally:
                if ok and handle is not None and not handle.duplicate:
                    core.join_fact(handle)
                    self._wake.set()
                else:
                    core.finish_fact(token, handle, False)
                    self._after_completion()

    async def heartbeat(self) -> None:
        async with self._beat_lock, self._beat_connection() as conn:
            await arun(conn, self._core.heartbeat())

    @contextlib.asynccontextmanager
    async def _beat_connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """As `Writer._beat_connection` (the caller holds ``_beat_lock``)."""
        borrowed = False
        try:
            async with asyncio.timeout(BORROW_WAIT):
                await self._lock.acquire()  # a cancelled acquire leaves the lock free
                borrowed = True
        except TimeoutError:
            pass
        if borrowed:
            try:
                conn = self._conn
                if conn is None or gone(conn):
                    if conn is not None:
                        await conn.close()
                    conn = self._conn = await _aconnect(self._url, self._core)
                yield conn
            finally:
                self._lock.release()
            if self._spare is not None and time.monotonic() - self._spare_used > SPARE_IDLE:
                await self._spare.close()
                self._spare = None
            return
        spare = self._spare
        if spare is None or gone(spare):
            if spare is not None:
                await spare.close()
            spare = self._spare = await _aconnect(self._url, self._core)
        self._spare_used = time.monotonic()
        yield spare

    async def _beat_loop(self) -> None:
        interval, failing = self._core.lease_seconds / 4, False
        while not self._stopped.is_set():
            woken = await wait_event(self._wake, _beat_wait(self._core, interval, failing))
            self._wake.clear()
            if self._stopped.is_set():
                break
            try:
                async with self._beat_lock, self._beat_connection() as conn:
                    if self._core.joined_pending:
                        for stream_id, ts in await arun(conn, self._core.resolve_joined()):
                            self._announce((stream_id,), ts)
                    if woken:  # by an append: persist the position, nothing else
                        await arun(conn, self._core.heartbeat())
                    else:
                        await arun(conn, self._core.beat())
                self._announce(periodic=not woken)
                _log_beat(self, failing, None)
                failing = False
            except Exception as exc:  # as in `Writer._beat_loop`
                _log_beat(self, failing, exc)
                failing = True
            if self._core.fenced:
                log.error("%r was fenced: its lease expired or its name was taken over", self)
                break
            if woken:
                await wait_event(self._stopped, FLUSH_INTERVAL)

    async def aclose(self) -> None:
        """Persist the position and retire this writer (see `Writer.close`).

        Closing runs in a task of its own: cancelling ``aclose()`` stops the wait, not the
        close, and awaiting ``aclose()`` again waits for the same close to finish.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._task is not None:
            await self._task
        self._detach()
        try:
            async with self._lock:
                conn = self._conn
                if conn is not None and (conn.closed or conn.broken):
                    conn = self._conn = await _aconnect(self._url, self._core)
                if conn is not None:
                    await arun(conn, self._core.retire())
        except (StoreError, WriterFenced) as exc:
            log.warning("could not retire %r cleanly: %s", self, exc)
        finally:
            if self._conn is not None:
                await self._conn.close()
            if self._spare is not None:
                await self._spare.close()

    async def __aenter__(self) -> AsyncWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
