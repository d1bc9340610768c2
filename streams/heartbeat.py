"""A writer's heartbeat and the connections it runs on, written once as plans (`streams.plans`).

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
`streams.store.writer_beats.RETIRE_EVERY`-th scheduled one does), so the persisted position trails
the real one by at most about `FLUSH_INTERVAL` while a writer is busy. It is informational
(``persisted_linear``): readers ask PostgreSQL what is complete. While heartbeats fail (a
restart, a partition) they are tried every `BEAT_RETRY_INTERVAL`; a fenced writer stops beating.

Each heartbeat also completes the facts written in callers' transactions that have ended
(`WriterCore.resolve_joined`: every `FLUSH_INTERVAL` while some are pending) and, with a Redis
link, announces through it (`streams.transport.faces.AttachedWriter`): what moved, and on a
scheduled heartbeat ``POSITION p p`` anyway (the courtesy answer to readers that joined in
between).

`HeartbeatPlans` holds the plans; the writers drive them on a thread or a task
(`streams.writer`). Nothing here waits or does I/O itself, so a test drives the plans by hand,
with scripted results and a fake clock (``tests/unit/test_writer_plans.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

import psycopg

from .plans import Acquire, Call, Flag, Lock, Plan, Wait
from .store.driver import gone
from .store.steps import Connect, Run
from .store.writer_core import WriterCore
from .transport.faces import AttachedWriter

__all__ = [
    "BEAT_RETRY_INTERVAL",
    "BORROW_WAIT",
    "FLUSH_INTERVAL",
    "SPARE_IDLE",
    "HeartbeatPlans",
]

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

#: A writer's connection: psycopg's, of one world or the other.
C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])
T = TypeVar("T")


def _beat_wait(core: WriterCore, interval: float, failing: bool) -> float:
    """Seconds until the next heartbeat: sooner after a failure, and every `FLUSH_INTERVAL`
    while facts written in transactions of callers' are pending (the heartbeat is how the
    writer learns that those transactions ended: `WriterCore.resolve_joined`)."""
    if failing:
        return min(BEAT_RETRY_INTERVAL, core.lease_seconds / 8)
    return min(interval, FLUSH_INTERVAL) if core.joined_pending else interval


def _log_beat(writer: object, failing: bool, exc: Exception | None) -> None:
    """Log a change of a heartbeat run: the first failure at WARNING (the next come every
    `BEAT_RETRY_INTERVAL` while the server is away: DEBUG), the first success after at INFO."""
    if exc is not None:
        level = logging.DEBUG if failing else logging.WARNING
        log.log(level, "heartbeat of %r failed: %s", writer, exc)
    elif failing:
        log.info("heartbeat of %r succeeded again", writer)


class HeartbeatPlans(Generic[C]):
    """The heartbeat and the connections of one writer (see the module docstring).

    The writer holds the state: ``_conn``, its own connection, guarded by ``_lock`` (appends
    hold it); ``_spare``, guarded by ``_beat_lock`` (one heartbeat at a time); ``_wake``, set
    by an append that moved the position; ``_stopped``, set by ``close``.
    """

    _url: str
    _core: WriterCore
    _conn: C
    _spare: C | None
    _spare_used: float
    _lock: Lock
    _beat_lock: Lock
    _wake: Flag
    _stopped: Flag
    _attached: AttachedWriter | None
    #: The clock of `SPARE_IDLE` (a fake one in the unit tests).
    _clock: Callable[[], float] = staticmethod(time.monotonic)

    # ------------------------------------------------------------------ connections

    def _connect_plan(self, connect_timeout: float | None = 0, *, first: bool = False) -> Plan[C]:
        """A new connection of the writer's, with its session settings (TCP keepalives and
        checks: `WriterCore.opening`; ``first``: the writer's first, which registers it).
        ``connect_timeout``: see `streams.store.sessions`; 0 (one attempt) when reopening, so
        an append fails at once while the server is down and the heartbeat keeps its own pace
        of retries."""
        opening = partial(self._core.opening, first=first)
        conn = yield Connect(self._url, connect_timeout, "writer", opening)
        return conn  # type: ignore[no-any-return]

    def _reopen_plan(self) -> Plan[None]:
        """Replace the writer's connection, which the server ended (a restart,
        ``pg_terminate_backend``) or an interruption broke: the lease and the generation are
        the writer's, not the connection's (the caller holds ``_lock``)."""
        yield Call(self._conn.close)
        self._conn = yield from self._connect_plan()

    # ------------------------------------------------------------------ heartbeats

    def _beat_loop_plan(self) -> Plan[None]:
        """The background heartbeat, until the writer is closed or fenced."""
        core = self._core
        interval, failing = core.lease_seconds / 4, False
        while not self._stopped.is_set():
            woken = yield Wait(self._wake, _beat_wait(core, interval, failing))
            self._wake.clear()
            if self._stopped.is_set():
                break
            try:
                yield from self._on_beat_connection(partial(self._beat_work, woken))
                if self._attached is not None:
                    if woken:
                        self._attached.completed()
                    else:
                        self._attached.beat()
                _log_beat(self, failing, None)
                failing = False
            except Exception as exc:  # keep beating through transient failures
                # (a connection it broke is reopened by whoever uses it next)
                _log_beat(self, failing, exc)
                failing = True
            if core.fenced:
                log.error("%r was fenced: its lease expired or its name was taken over", self)
                break
            if woken:
                yield Wait(self._stopped, FLUSH_INTERVAL)

    def _beat_work(self, woken: bool, conn: C) -> Plan[None]:
        """One heartbeat of the loop: complete the joined facts whose transactions ended,
        then persist the position (woken by an append: nothing else) or beat."""
        core = self._core
        if core.joined_pending:
            for stream_id, ts in (yield Run(conn, core.resolve_joined())):
                if self._attached is not None:
                    self._attached.completed((stream_id,), ts)
        yield Run(conn, core.heartbeat() if woken else core.beat())

    def _persist_work(self, conn: C) -> Plan[None]:
        """The heartbeat a caller asks for (``writer.heartbeat()``)."""
        yield Run(conn, self._core.heartbeat())

    def _on_beat_connection(self, work: Callable[[C], Plan[T]]) -> Plan[T]:
        """``work`` on the connection for one heartbeat, one heartbeat at a time: the writer's
        own, borrowed between two appends, or the spare while an append holds
        it for longer than `BORROW_WAIT`. Either is reopened if the server or an interruption
        closed it."""
        yield Acquire(self._beat_lock, None)
        try:
            if (yield Acquire(self._lock, BORROW_WAIT)):
                try:
                    if gone(self._conn):
                        yield from self._reopen_plan()
                    result = yield from work(self._conn)
                finally:
                    self._lock.release()
                if self._spare is not None and self._clock() - self._spare_used > SPARE_IDLE:
                    yield Call(self._spare.close)
                    self._spare = None
                return result
            spare = self._spare
            if spare is None or gone(spare):
                if spare is not None:
                    yield Call(spare.close)
                spare = self._spare = yield from self._connect_plan()
            self._spare_used = self._clock()
            return (yield from work(spare))
        finally:
            self._beat_lock.release()
