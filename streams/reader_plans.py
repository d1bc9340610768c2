"""What `Reader` and `AsyncReader` share, written once: the reader's plans (waiting for hints
or the poll interval, a step on the primary or a standby behind the fence, trying again on a
lost connection, a group commit, `wait_for_position`), which both drive with the kernel
(`streams.plans`), and how a reader opens its sessions. The reader's logic itself is
`streams.store.reader_core.ReaderCore`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import psycopg

from ._gc import collection_paused
from .core.epochs import Epoch, Fact
from .core.frontier import Antichain, FrontierProbe
from .core.replication import Hint, backoff_delay
from .errors import ConnectionLost, StandbyBehind, StoreError, UsageError, WaitTimeout
from .plans import Call, Flag, Plan, Sleep, Wait
from .store import sessions
from .store.arrow_reads import ArrowSessions
from .store.driver import Gen, transient_sqlstate
from .store.probe import (
    READER_SESSION_SETUP,
)
from .store.reader_core import ReaderCore
from .store.standby import check_standby
from .store.steps import Connect, Run
from .transport.faces import Link

if TYPE_CHECKING:
    from .proofs import ProofService

log = logging.getLogger("streams.reader")

#: Seconds a group commit is tried again while the connection to PostgreSQL is broken.
COMMIT_RETRY_SECONDS = 30.0
#: Seconds between probes while the Redis fast path is up (a safety net for lost messages).
LIVE_POLL_INTERVAL = 1.0
#: Seconds between probes without Redis, or while it is reconnecting.
FALLBACK_POLL_INTERVAL = 0.1
#: Least time between two probes of a caught-up reader (bounds the load a flood of forged or
#: stale messages can cause: a probe costs about as much anyway).
MIN_HINT_GAP = 0.0005
#: Most seconds between two looks at the shared proof record by a reader that follows fresh
#: proofs and so hears no writer's hint: how soon it notices a prober that stopped proving
#: (after `streams.core.constants.STALE_AFTER`), whatever the configured poll interval.
FOLLOWER_CHECK_INTERVAL = 1.0


def _paused_while_behind(core: ReaderCore) -> contextlib.AbstractContextManager[None]:
    """The garbage collector paused (`streams._gc`) while a reader catching up runs a plan:
    the rows it receives and the facts it builds from them all live until the caller has
    consumed the epoch, and each collection they would trigger finds nothing to free. Not
    while caught up: a caught-up reader's plan may wait on the network for a while, and
    allocates little. (Reading ahead keeps the waits of a reader behind short.)"""
    return collection_paused() if core.behind() else contextlib.nullcontext()


T = TypeVar("T")
_Plan: TypeAlias = Plan[T]


def _standby_failure(exc: BaseException) -> bool:
    """Is this failure on the standby's session one to wait out or fall back from (behind,
    another timeline, unreachable, a statement cancelled by a conflict with recovery or a
    timeout), rather than a reader's error (`FactsPruned`, `DatabaseChanged`, ...)?"""
    if isinstance(exc, StandbyBehind | ConnectionLost):
        return True
    return isinstance(exc, StoreError) and transient_sqlstate(exc.sqlstate)


def reader_session(
    url: str, core: ReaderCore, connect_timeout: float | None = 0, *, first: bool = False
) -> Connect:
    """The step that opens a reader session on the database history the reader started on
    (else `streams.errors.DatabaseChanged`: `streams.store.identity`); ``first``: the reader's
    first, which opens it (`ReaderCore.opening`). ``connect_timeout``: see
    `streams.store.sessions`; 0 (one attempt) when reopening: the plans try again with
    backoff, within the caller's timeout."""
    opening = functools.partial(core.opening, first=first)
    return Connect(url, connect_timeout, "reader", opening, autocommit=True, decode_payloads=True)


def _open_standby(url: str, core: ReaderCore) -> _Plan[Any]:
    """A session on the read URL's standby, checked against the reader's incarnation
    (`streams.store.standby.check_standby`); one attempt (the plans wait and fall back)."""
    try:
        conn = yield Connect(url, 0, "standby reader", autocommit=True)
        try:
            for statement in READER_SESSION_SETUP:
                yield Call(conn.execute, statement)
            assert core.guard.expected is not None  # the primary's session checked first
            yield Run(conn, check_standby(core.guard.expected, _standby_where(core)))
        except BaseException:
            yield Call(conn.close)
            raise
        sessions.use_payload_decoder(conn)
        return conn
    except (psycopg.Error, StoreError) as exc:
        raise _standby_unusable(exc) from None


def _standby_where(core: ReaderCore) -> str:
    return f"reader of {core.described}"


def _standby_unusable(exc: psycopg.Error | StoreError) -> StoreError:
    """What opening a standby session raises: `StandbyBehind` as it is (the reader waits or
    falls back), anything else as `ConnectionLost` (the driver's name only, for psycopg's)."""
    if isinstance(exc, StandbyBehind):
        return exc
    reason = type(exc).__name__ if isinstance(exc, psycopg.Error) else str(exc)
    return ConnectionLost(f"cannot connect to the standby: {reason}")


class ReaderBase:
    _core: ReaderCore

    @property
    def core(self) -> ReaderCore:
        return self._core

    @property
    def streams(self) -> tuple[str, ...]:
        return self._core.names

    @property
    def group(self) -> str | None:
        return self._core.group

    def _described(self) -> str:
        """The reader in its repr: its streams, or its pattern and how many streams match."""
        sub = self._core.subscription
        if sub is None:
            return f"streams={list(self.streams)!r}"
        return f"pattern={sub.pattern.pattern!r} ({len(self.streams)} streams)"

    @property
    def live(self) -> bool:
        """Is the Redis fast path up and re-established (else the reader polls)?"""
        return self._core.live

    @property
    def frontier(self) -> Antichain[tuple[int, ...]]:
        """The merged frontier: ``{(p1 + 1, p2 + 1, ...)}`` in `streams` order."""
        return self._core.frontier

    def position(self, stream: str | None = None) -> int:
        """Everything ``<=`` this has been delivered (on ``stream``, or the only stream)."""
        return self._core.position(stream)

    def probe(self, stream: str | None = None) -> FrontierProbe[int]:
        return self._core.probe(stream)

    def vector_probe(self) -> FrontierProbe[tuple[int, ...]]:
        return self._core.vector_probe()

    @property
    def closed(self) -> bool:
        """Is the reader closed (`close`)?"""
        return self._closed

    def arrow_sessions(self) -> ArrowSessions:
        """The reader's ADBC sessions (`streams.store.arrow_reads`), made at the first call and
        closed with the reader: where `batches` reads the rows of what `prove` proved."""
        sessions = self._arrow
        if sessions is None:
            core = self._core
            what = "group " + repr(core.group) if core.group is not None else "reader"
            sessions = self._arrow = ArrowSessions(
                self._url,
                f"{what} of {core.described} (Arrow)",
                lambda: (core.incarnation, core.proven.proof_lsn),
            )
        return sessions

    _url: str
    #: The reader's session and the read URL's (psycopg's sync or asyncio connections).
    _conn: Any
    _standby: Any
    _read_url: str | None

    def _standby_behind(self) -> bool:
        """Proven on the primary, not delivered: with a read URL, the standby has not replayed
        it yet (the reader waits for it, up to its max wait, then reads from the primary)."""
        return self._core.route is not None and not self._closed and self._core.behind()

    def _poll_interval(self, configured: float | None) -> float:
        if not self._core.needs_writer_hints:
            # Following fresh proofs without writers' hints: only this look notices a prober
            # that stopped (its record goes stale), so it runs whatever the configured poll.
            return min(configured or LIVE_POLL_INTERVAL, FOLLOWER_CHECK_INTERVAL)
        if time.monotonic() - self._writer_hints_since < FOLLOWER_CHECK_INTERVAL:
            # Just subscribed again to writers' hints: one sent before the subscription took
            # effect is lost, so look often until it surely has.
            return min(configured or FALLBACK_POLL_INTERVAL, FALLBACK_POLL_INTERVAL)
        if configured is not None:
            return configured
        return LIVE_POLL_INTERVAL if self._core.live else FALLBACK_POLL_INTERVAL

    _link: Link | None
    _proofs: ProofService | None = None
    _writer_hints = True  # subscribed to the data channels of the streams (writers' hints)
    _writer_hints_since = 0.0  # when that subscription was last asked for (monotonic)

    def _sync_writer_hints(self) -> None:
        """Hear writers' hints only while they are of use: a reader that follows fresh
        proofs needs only its streams' proof channels (one line per proof, not per append);
        it subscribes again as soon as the proofs go stale or the link reconnects."""
        wanted = self._core.needs_writer_hints
        if self._link is None or wanted == self._writer_hints or self._closed:
            return
        self._writer_hints = wanted
        if wanted:
            self._writer_hints_since = time.monotonic()
            self._link.watch(self._core.names, writers=True)
        else:
            self._link.unwatch(self._core.names, writers=True)

    def _sync_streams(self) -> None:
        """A pattern reader's streams that joined or left (`ReaderCore.take_changes`): hear
        their channels as the others' (writers' hints too while it hears them), and follow
        their shared proofs, or stop. Before `_sync_writer_hints`, which acts on them all."""
        joined, left = self._core.take_changes()
        if not (joined or left) or self._closed:
            return
        link = self._link
        if link is not None:
            if left:
                link.unwatch(left, writers=False)
                if self._writer_hints:
                    link.unwatch(left, writers=True)
            if joined:
                link.watch(joined, writers=False)
                if self._writer_hints:
                    link.watch(joined, writers=True)
        if self._proofs is not None:
            self._proofs.unfollow(left)
            self._proofs.follow(joined)

    # LinkListener
    def on_link_state(self, connected: bool) -> None:
        self._core.set_link_state(connected)
        self._wakeup()

    def on_hint(self, hint: Hint) -> None:
        if self._core.wants(hint):
            self._hinted = True
            self._wakeup()
        elif self._core.following.deadline_moved:
            self._wakeup()  # not a hint: the wait only recomputes its deadline

    def _wakeup(self) -> None:
        raise NotImplementedError

    # The waiting logic of `poll` and `wait_for_position`, written once as plans of the kernel:
    # they yield `Wait` (for a hint, up to some seconds: whether one came), `Sleep`, and run
    # `ReaderCore` generators on the reader's sessions (`_on_session`, `_on_standby`).
    # `Reader` drives them with `streams.plans.drive`, `AsyncReader` with `adrive`.
    _wake: Flag
    _hinted = False  # a hint (not a moved deadline) set `_wake`
    _closed: bool
    _poll: float | None
    _last_probe: float
    #: The ADBC session of `batches` (`streams.store.arrow_reads`), opened at its first read.
    _arrow: ArrowSessions | None = None

    def _poll_plan(self, timeout: float | None) -> _Plan[Epoch | None]:
        """`poll`'s plan: steps (`_step_plan`) until one delivers an epoch or the time is up."""
        return self._waiting_plan(timeout, self._step_plan, lambda: False)

    def _prove_plan(self, timeout: float | None) -> _Plan[Epoch | None]:
        """`prove`'s plan: steps that prove without reading rows (`ReaderCore.step` without
        rows), until the reader is behind what a proof proved (None), an epoch of signed ranges
        arrives from Redis, or the time is up (None)."""
        core = self._core

        def step(deadline: float | None) -> _Plan[Epoch | None]:
            return self._retried(lambda: core.step(False), deadline)

        return self._waiting_plan(timeout, step, core.behind)

    def _waiting_plan(
        self,
        timeout: float | None,
        step: Callable[[float | None], _Plan[Epoch | None]],
        ready: Callable[[], bool],
    ) -> _Plan[Epoch | None]:
        """Wait for hints (or the poll interval) and take ``step``s, until one returns an
        epoch or ``ready()``, or ``timeout`` seconds have passed (None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise UsageError("reader is closed")
            if timeout != 0 and self._core.caught_up and not self._wake.is_set():
                due = self._last_probe + self._poll_interval(self._poll)
                proof_due = self._core.proof_deadline()
                if proof_due is not None:
                    due = min(due, proof_due)
                until = due if deadline is None else min(due, deadline)
                hinted = yield Wait(self._wake, until - time.monotonic())
                if hinted and self._core.following.deadline_moved and not self._hinted:
                    self._core.following.deadline_moved = False
                    self._wake.clear()
                    continue  # a writer's hint started the proof grace: wait up to it
                if not hinted and time.monotonic() < due:
                    return None  # the deadline came first
            if self._core.caught_up:  # this step probes: at most one probe per MIN_HINT_GAP
                gap = self._last_probe + MIN_HINT_GAP - time.monotonic()
                if gap > 0:
                    yield Sleep(gap)
            self._wake.clear()
            self._hinted = False
            self._core.following.deadline_moved = False
            self._last_probe = time.monotonic()
            # A pattern reader looks for new streams in this cycle, at most once per interval.
            self._core.poll_started(self._last_probe, self._poll_interval(self._poll))
            # The server restarted or the network failed: a step moves nothing until it has
            # read everything, so trying again (on a new connection) delivers each fact once.
            # Within the caller's timeout; for ever when there is none.
            epoch: Epoch | None = yield from step(deadline)
            self._sync_streams()
            self._sync_writer_hints()
            if epoch is not None or ready():
                return epoch
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _step_plan(self, deadline: float | None) -> _Plan[Epoch | None]:
        """One step of the reader. With a read URL (`streams.core.standby_fence`): prove on the
        primary (no rows), then read the rows on the standby behind the fence, waiting for it
        with backoff (never past the caller's ``deadline``: None is returned, nothing moved),
        or from the primary when the route says so (a fallback, logged and counted)."""
        core = self._core
        route = core.route
        if route is None:
            return (yield from self._retried(core.step, deadline))
        epoch: Epoch | None = yield from self._retried(lambda: core.step(False), deadline)
        if epoch is not None or not core.behind():
            return epoch
        if not route.use_standby(time.monotonic()):
            return (yield from self._retried(core.step, deadline))
        while True:
            try:
                epoch = yield from self._on_standby(core.standby_step())
            except StoreError as exc:
                if not _standby_failure(exc):
                    raise  # a reader's error (`FactsPruned`, `DatabaseChanged`...)
                pause = route.failed(time.monotonic(), exc)
                if pause is None:
                    log.warning(
                        "%r reads from the primary for %gs: %s", self, route.retry_after, exc
                    )
                    return (yield from self._retried(core.step, deadline))
                if deadline is not None and time.monotonic() + pause >= deadline:
                    return None
                yield Sleep(pause)
                continue
            route.read_on_standby()
            return epoch

    def _commit_plan(self, through: Fact | None) -> _Plan[dict[str, int]]:
        """A group commit, tried again for `COMMIT_RETRY_SECONDS` if the connection breaks
        (forward-only, so committing twice is harmless, even when the first one's outcome is
        unknown)."""
        deadline = time.monotonic() + COMMIT_RETRY_SECONDS
        return (yield from self._retried(lambda: self._core.commit(through), deadline))

    def _retried(self, operation: Callable[[], Gen[T]], deadline: float | None) -> _Plan[T]:
        """``operation()`` (a store generator, run by the driver), run again from the start on a
        new connection, with backoff, while the connection breaks (`ConnectionLost`), until
        ``deadline`` (None: for ever). Only for operations that are safe to repeat."""
        while True:
            try:
                result: T = yield from self._on_session(operation())
            except ConnectionLost as lost:
                delay = self._lost(lost)
                if deadline is not None and time.monotonic() + delay >= deadline:
                    raise
                yield Sleep(delay)
                continue
            self._found()
            return result

    def _on_session(self, gen: Gen[T]) -> _Plan[T]:
        """``gen`` on the reader's session, reopened if the server or an interruption closed
        it (`ConnectionLost` while it cannot be reached); first the pages read ahead, which
        the session is busy with. The garbage collector is paused meanwhile while behind."""
        conn = yield from self._session()
        with _paused_while_behind(self._core):
            if self._core.reading_ahead:
                yield Run(conn, self._core.receive_ahead())
            result: T = yield Run(conn, gen)
        return result

    def _on_standby(self, gen: Gen[T]) -> _Plan[T]:
        """``gen`` on the read URL's session (`streams.core.standby_fence`), reopened when
        needed; what made the standby fail (`StandbyBehind`, `ConnectionLost`, a `StoreError`
        the standby may mend by itself) is the caller's to handle (`_standby_failure`)."""
        conn = yield from self._standby_session()
        result: T = yield Run(conn, gen)
        return result

    def _session(self) -> _Plan[Any]:
        """The reader's session, reopened if the server or an interruption closed it (the
        reader's state lives in its core, so nothing else needs restoring); `ConnectionLost`
        while the server cannot be reached."""
        conn = self._conn
        if conn.closed or conn.broken:
            if self._closed:
                raise UsageError("reader is closed")
            yield Call(conn.close)
            self._core.forget_ahead()
            try:
                self._conn = yield reader_session(self._url, self._core)
            except StoreError as exc:
                raise ConnectionLost(str(exc)) from None
        return self._conn

    def _standby_session(self) -> _Plan[Any]:
        """The session on the read URL's standby, opened (again) when needed."""
        assert self._read_url is not None
        conn = self._standby
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                yield Call(conn.close)
            self._standby = None
            if self._closed:
                raise UsageError("reader is closed")
            self._standby = conn = yield from _open_standby(self._read_url, self._core)
        return conn

    _lost_attempts = 0

    def _lost(self, lost: ConnectionLost) -> float:
        """Note a broken connection; the seconds to wait before trying again (backoff)."""
        if self._lost_attempts == 0:
            log.warning("%r lost PostgreSQL (%s); trying again", self, lost)
        delay = backoff_delay(self._lost_attempts, jitter=random.random())
        self._lost_attempts += 1
        return delay

    def _found(self) -> None:
        if self._lost_attempts:
            log.warning("%r reached PostgreSQL again", self)
            self._lost_attempts = 0

    def _wait_plan(
        self, stream: str, token: int, instance: str | None, timeout: float
    ) -> _Plan[None]:
        deadline = time.monotonic() + timeout

        def check() -> Gen[bool]:
            return self._core.reached(stream, token, instance)

        while True:
            self._wake.clear()
            if (yield from self._retried(check, deadline)):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"stream {stream!r} did not reach {token} within {timeout}s")
            yield Wait(self._wake, min(remaining, self._poll_interval(self._poll)))
