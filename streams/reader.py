"""`Reader` and `AsyncReader`: thin shells that drive `ReaderCore` on psycopg connections.

The model, the stages of a reader session and the reads themselves are in
`streams.store.reader_core` (`ReaderCore`, written once as generators). What is here: a connection
per reader (reopened if the server or an interruption closed it), waiting for hints from the
process's Redis link (`streams.transport.link`) or for the poll interval, and the waiting logic
of `poll` and `wait_for_position`, also written once as generators that both shells drive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import psycopg

from ._gc import collection_paused
from .arrow import areader_batches, reader_batches, typing_of
from .core.epochs import Epoch, Fact
from .core.frontier import Antichain, FrontierProbe
from .core.replication import Hint, backoff_delay
from .core.standby_fence import StandbyRoute
from .errors import ConnectionLost, StandbyBehind, StoreError, UsageError, WaitTimeout
from .orm import async_target, sync_target
from .plans import Call, Flag, Plan, Sleep, Wait, adrive, drive
from .store import sessions
from .store.arrow_reads import ArrowSessions
from .store.driver import Gen, arun, run, transient_sqlstate
from .store.probe import (
    READER_SESSION_SETUP,
)
from .store.reader_core import ReaderCore, Start
from .store.standby import check_standby
from .store.steps import Run
from .transport.faces import Link

if TYPE_CHECKING:
    import pyarrow as pa

    from .proofs import ProofService

__all__ = ["AsyncReader", "Reader", "ReaderCore", "Start"]

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


def _connect(
    url: str, core: ReaderCore, connect_timeout: float | None = 0, *, first: bool = False
) -> psycopg.Connection[Any]:
    """A reader session on the database history the reader started on (else
    `streams.errors.DatabaseChanged`: `streams.store.identity`); ``first``: the reader's
    first, which opens it (`ReaderCore.opening`). ``connect_timeout``: see
    `streams.store.sessions`; 0 (one attempt) when reopening: the plans try again with
    backoff, within the caller's timeout."""
    return sessions.connect(
        url,
        autocommit=True,
        connect_timeout=connect_timeout,
        purpose="reader",
        opening=functools.partial(core.opening, first=first),
        decode_payloads=True,
    )


def _standby_where(core: ReaderCore) -> str:
    return f"reader of {', '.join(core.names)}"


def _standby_unusable(exc: psycopg.Error | StoreError) -> StoreError:
    """What opening a standby session raises: `StandbyBehind` as it is (the reader waits or
    falls back), anything else as `ConnectionLost` (the driver's name only, for psycopg's)."""
    if isinstance(exc, StandbyBehind):
        return exc
    reason = type(exc).__name__ if isinstance(exc, psycopg.Error) else str(exc)
    return ConnectionLost(f"cannot connect to the standby: {reason}")


def _connect_standby(url: str, core: ReaderCore) -> psycopg.Connection[Any]:
    """A session on the read URL's standby, checked against the reader's incarnation
    (`streams.store.standby.check_standby`); one attempt (the plans wait and fall back)."""
    try:
        conn = sessions.connect(url, autocommit=True, connect_timeout=0, purpose="standby reader")
        try:
            for statement in READER_SESSION_SETUP:
                conn.execute(statement)
            assert core.guard.expected is not None  # the primary's session checked first
            run(conn, check_standby(core.guard.expected, _standby_where(core)))
        except BaseException:
            conn.close()
            raise
        sessions.use_payload_decoder(conn)
        return conn
    except (psycopg.Error, StoreError) as exc:
        raise _standby_unusable(exc) from None


async def _aconnect_standby(url: str, core: ReaderCore) -> psycopg.AsyncConnection[Any]:
    try:
        conn = await sessions.aconnect(
            url, autocommit=True, connect_timeout=0, purpose="standby reader"
        )
        try:
            for statement in READER_SESSION_SETUP:
                await conn.execute(statement)
            assert core.guard.expected is not None
            await arun(conn, check_standby(core.guard.expected, _standby_where(core)))
        except BaseException:
            await conn.close()
            raise
        sessions.use_payload_decoder(conn)
        return conn
    except (psycopg.Error, StoreError) as exc:
        raise _standby_unusable(exc) from None


async def _aconnect(
    url: str, core: ReaderCore, connect_timeout: float | None = 0, *, first: bool = False
) -> psycopg.AsyncConnection[Any]:
    return await sessions.aconnect(
        url,
        autocommit=True,
        connect_timeout=connect_timeout,
        purpose="reader",
        opening=functools.partial(core.opening, first=first),
        decode_payloads=True,
    )


class _ReaderBase:
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
                f"{what} of {', '.join(core.names)} (Arrow)",
                lambda: (core.incarnation, core.proven.proof_lsn),
            )
        return sessions

    _url: str

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

    # The waiting logic of `poll` and `wait_for_position`, written once as generators (like
    # `ReaderCore`'s): they yield `_WaitWake` (wait for a hint, up to some seconds; the driver
    # sends back whether one came), `_Pause` (sleep), or a `ReaderCore` generator to run on the
    # connection (the driver sends back its result). `Reader` and `AsyncReader` only drive them.
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
            # The server restarted or the network failed: a step moves nothing until it has
            # read everything, so trying again (on a new connection) delivers each fact once.
            # Within the caller's timeout; for ever when there is none.
            epoch: Epoch | None = yield from step(deadline)
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

    def _connection(self) -> Any:
        """The reader's session (a `Call` step: a coroutine in `AsyncReader`)."""
        raise NotImplementedError

    def _standby_connection(self) -> Any:
        """The read URL's session (a `Call` step: a coroutine in `AsyncReader`)."""
        raise NotImplementedError

    def _on_session(self, gen: Gen[T]) -> _Plan[T]:
        """``gen`` on the reader's session, reopened if the server or an interruption closed
        it (`ConnectionLost` while it cannot be reached); first the pages read ahead, which
        the session is busy with. The garbage collector is paused meanwhile while behind."""
        conn = yield Call(self._connection)
        with _paused_while_behind(self._core):
            if self._core.reading_ahead:
                yield Run(conn, self._core.receive_ahead())
            result: T = yield Run(conn, gen)
        return result

    def _on_standby(self, gen: Gen[T]) -> _Plan[T]:
        """``gen`` on the read URL's session (`streams.core.standby_fence`), reopened when
        needed; what made the standby fail (`StandbyBehind`, `ConnectionLost`, a `StoreError`
        the standby may mend by itself) is the caller's to handle (`_standby_failure`)."""
        conn = yield Call(self._standby_connection)
        result: T = yield Run(conn, gen)
        return result

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


class Reader(_ReaderBase):
    """A synchronous reader. Iterate it for epochs; see `ReaderCore` for the model."""

    _wake: threading.Event

    def __init__(
        self,
        database_url: str,
        core: ReaderCore,
        link: Link | None = None,
        *,
        poll_interval: float | None = None,
        proofs: ProofService | None = None,
        connect_timeout: float | None = None,
        read_database_url: str | None = None,
        standby: StandbyRoute | None = None,
    ) -> None:
        self._core = core
        self._url = database_url
        # ``read_database_url``: a hot standby where the rows are read
        # (`streams.core.standby_fence`), opened at the first read there; ``standby``: how long
        # to wait for it.
        self._read_url = read_database_url
        self._standby: psycopg.Connection[Any] | None = None
        if read_database_url is not None:
            core.route = standby or StandbyRoute()
        # None: the default wait; a session lost while opening is waited out within it.
        self._conn = _connect(database_url, core, connect_timeout, first=True)
        self._wake = threading.Event()
        self._closed = False
        self._poll = poll_interval
        self._last_probe = 0.0
        self._link = link
        if link is not None:
            core.set_link_state(link.connected)
            link.add_listener(self, core.names)
        # ``proofs``: the process's `streams.proofs.ProofService` (None: probe every time).
        self._proofs = proofs
        if proofs is not None:
            core.following.shared_proofs = True
            proofs.follow(core.names)

    def __repr__(self) -> str:
        return f"<Reader streams={list(self.streams)!r} group={self.group!r}>"

    def _wakeup(self) -> None:
        self._wake.set()

    def poll(self, timeout: float | None = 0.0) -> Epoch | None:
        """The next epoch, waiting up to ``timeout`` seconds (None: forever) for one.

        ``timeout=0`` asks PostgreSQL once, now. Otherwise a caught-up reader asks again only
        when a hint arrives (a command naming a token beyond its position) or the poll interval
        has passed since its last probe, so a quiet stream costs one probe per interval, not
        one per call.
        """
        return drive(self._poll_plan(timeout))

    def prove(self, timeout: float | None = 0.0) -> Epoch | None:
        """Wait up to ``timeout`` seconds (None: for ever) for something new and prove it, without
        reading rows: None once the reader is behind what a proof proved (its rows are read
        elsewhere: `batches`) or the time is up, or an epoch of signed ranges from Redis
        (delivered: the positions moved)."""
        return drive(self._prove_plan(timeout))

    def _standby_connection(self) -> psycopg.Connection[Any]:
        """The session on the read URL's standby, opened (again) when needed."""
        assert self._read_url is not None
        conn = self._standby
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._standby = None
            if self._closed:
                raise UsageError("reader is closed")
            self._standby = conn = _connect_standby(self._read_url, self._core)
        return conn

    def _connection(self) -> psycopg.Connection[Any]:
        """The reader's connection, reopened if the server or an interruption closed it (the
        reader's state lives in its core, so nothing else needs restoring); `ConnectionLost`
        while the server cannot be reached."""
        if self._conn.closed or self._conn.broken:
            if self._closed:
                raise UsageError("reader is closed")
            self._conn.close()
            self._core.forget_ahead()
            try:
                self._conn = _connect(self._url, self._core)
            except StoreError as exc:
                raise ConnectionLost(str(exc)) from None
        return self._conn

    def __iter__(self) -> Iterator[Epoch]:
        """Epochs forever (blocking); stop by breaking out or closing the reader."""
        while not self._closed:
            epoch = self.poll(timeout=None)
            if epoch is not None:
                yield epoch

    def epochs(self, *, idle_timeout: float = 0.0) -> Iterator[Epoch]:
        """Epochs until none arrives within ``idle_timeout`` seconds (0: until caught up; with
        a read URL, facts proven but not yet replayed on the standby are waited for)."""
        while True:
            epoch = self.poll(timeout=idle_timeout)
            while epoch is None and self._standby_behind():
                epoch = self.poll(timeout=None)
            if epoch is None:
                return
            yield epoch

    def facts(self, *, idle_timeout: float = 0.0) -> Iterator[Fact]:
        """The facts of `epochs`, one by one."""
        for epoch in self.epochs(idle_timeout=idle_timeout):
            yield from epoch.facts

    def batches(
        self,
        *,
        idle_timeout: float = 0.0,
        max_rows: int | None = None,
        schema: pa.Schema | str | None = None,
        mode: str = "PERMISSIVE",
        corrupt_column: str = "_corrupt_record",
    ) -> Iterator[pa.RecordBatch]:
        """`epochs` as Arrow record batches (`streams.arrow`: the columns, what a batch is, the
        guarantees): until none arrives within ``idle_timeout`` seconds (0: until caught up).
        A batch holds whole facts of one stream, at most ``max_rows`` rows (default
        `streams.arrow.DEFAULT_MAX_ROWS`) unless one fact has more. Needs the ``arrow`` extra.

        ``schema`` (an Arrow schema, or a Spark DDL string): typed columns parsed from the
        payload instead of ``payload``; bad rows as ``mode`` says (PERMISSIVE, DROPMALFORMED,
        FAILFAST: `streams.core.typed_payloads`), the raw payload of a bad row in the
        ``corrupt_column`` field when the schema has one."""
        typed = typing_of(schema, mode, corrupt_column)
        return reader_batches(self, idle_timeout=idle_timeout, max_rows=max_rows, typed=typed)

    def wait_for_position(
        self, stream: str, token: int, instance: str | None = None, *, timeout: float = 10.0
    ) -> None:
        """Wait until PostgreSQL has every fact of ``stream`` up to ``token`` complete (only
        ``instance``'s facts, if given), so a query now sees them; raises `WaitTimeout`.

        This is about what is *visible*, not what this reader has delivered yet: compare
        `position` for that.
        """
        drive(self._wait_plan(stream, token, instance, timeout))

    def commit(self, through: Fact | None = None, *, conn: Any = None) -> dict[str, int]:
        """Commit this reader's positions for its group; a restart of the group resumes here.
        ``through``: only up to that delivered fact (see `ReaderCore.commit`). Tried again for
        `COMMIT_RETRY_SECONDS` if the connection breaks.

        ``conn``: write the positions in *your* transaction instead (a psycopg connection, a
        SQLAlchemy ``Connection`` or ``Session``, a Django connection inside
        ``transaction.atomic()``: `streams.orm`), so that your effects and the group's
        position commit or roll back together. Never committed, rolled back or retried here.
        The group must still be where this reader left it (when it opened the group or last
        committed it): otherwise `GroupMoved`, and your transaction can only roll back
        (`streams.store.reader_groups.commit_group_in`).

        `InvalidPosition` (nothing committed, on any stream) for a position beyond its
        stream's max allocated ID, which no reader reaches by itself.
        """
        if conn is None:
            return drive(self._commit_plan(through))
        target = sync_target(conn)
        return run(target.conn, self._core.commit_in(through), joined=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.remove_listener(self, self._core.names, writers=self._writer_hints)
        if self._proofs is not None:
            self._proofs.unfollow(self._core.names)
        self._wake.set()
        self._conn.close()
        if self._standby is not None:
            self._standby.close()
        if self._arrow is not None:
            self._arrow.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncReader(_ReaderBase):
    """The asyncio twin of `Reader`: ``async for epoch in reader``."""

    _wake: asyncio.Event

    def __init__(
        self,
        url: str,
        core: ReaderCore,
        conn: psycopg.AsyncConnection[Any],
        link: Link | None,
        poll: float | None,
        read_url: str | None = None,
    ) -> None:
        self._url = url
        self._read_url = read_url
        self._standby: psycopg.AsyncConnection[Any] | None = None
        self._core = core
        self._conn = conn
        self._link = link
        self._poll = poll
        self._wake = asyncio.Event()
        self._closed = False
        self._last_probe = 0.0

    @classmethod
    async def open(
        cls,
        database_url: str,
        core: ReaderCore,
        link: Link | None = None,
        *,
        poll_interval: float | None = None,
        connect_timeout: float | None = None,
        read_database_url: str | None = None,
        standby: StandbyRoute | None = None,
    ) -> AsyncReader:
        if read_database_url is not None:
            core.route = standby or StandbyRoute()
        conn = await _aconnect(database_url, core, connect_timeout, first=True)
        self = cls(database_url, core, conn, link, poll_interval, read_database_url)
        if link is not None:
            core.set_link_state(link.connected)
            link.add_listener(self, core.names)
        return self

    def __repr__(self) -> str:
        return f"<AsyncReader streams={list(self.streams)!r} group={self.group!r}>"

    def _wakeup(self) -> None:
        self._wake.set()

    async def poll(self, timeout: float | None = 0.0) -> Epoch | None:
        """The asyncio twin of `Reader.poll`."""
        return await adrive(self._poll_plan(timeout))

    async def prove(self, timeout: float | None = 0.0) -> Epoch | None:
        """The asyncio twin of `Reader.prove`."""
        return await adrive(self._prove_plan(timeout))

    async def _standby_connection(self) -> psycopg.AsyncConnection[Any]:
        """The asyncio twin of `Reader._standby_connection`."""
        assert self._read_url is not None
        conn = self._standby
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                await conn.close()
            self._standby = None
            if self._closed:
                raise UsageError("reader is closed")
            self._standby = conn = await _aconnect_standby(self._read_url, self._core)
        return conn

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        """The asyncio twin of `Reader._connection`."""
        if self._conn.closed or self._conn.broken:
            if self._closed:
                raise UsageError("reader is closed")
            await self._conn.close()
            self._core.forget_ahead()
            try:
                self._conn = await _aconnect(self._url, self._core)
            except StoreError as exc:
                raise ConnectionLost(str(exc)) from None
        return self._conn

    def __aiter__(self) -> AsyncIterator[Epoch]:
        return self._forever()

    async def _forever(self) -> AsyncIterator[Epoch]:
        while not self._closed:
            epoch = await self.poll(timeout=None)
            if epoch is not None:
                yield epoch

    async def epochs(self, *, idle_timeout: float = 0.0) -> AsyncIterator[Epoch]:
        while True:
            epoch = await self.poll(timeout=idle_timeout)
            while epoch is None and self._standby_behind():
                epoch = await self.poll(timeout=None)
            if epoch is None:
                return
            yield epoch

    async def facts(self, *, idle_timeout: float = 0.0) -> AsyncIterator[Fact]:
        async for epoch in self.epochs(idle_timeout=idle_timeout):
            for fact in epoch.facts:
                yield fact

    def batches(
        self,
        *,
        idle_timeout: float = 0.0,
        max_rows: int | None = None,
        schema: pa.Schema | str | None = None,
        mode: str = "PERMISSIVE",
        corrupt_column: str = "_corrupt_record",
    ) -> AsyncIterator[pa.RecordBatch]:
        """The asyncio twin of `Reader.batches` (``async for batch in reader.batches()``; the
        ADBC reads run in a worker thread)."""
        typed = typing_of(schema, mode, corrupt_column)
        return areader_batches(self, idle_timeout=idle_timeout, max_rows=max_rows, typed=typed)

    async def wait_for_position(
        self, stream: str, token: int, instance: str | None = None, *, timeout: float = 10.0
    ) -> None:
        await adrive(self._wait_plan(stream, token, instance, timeout))

    async def commit(self, through: Fact | None = None, *, conn: Any = None) -> dict[str, int]:
        """The asyncio twin of `Reader.commit` (``conn``: a psycopg ``AsyncConnection``, or a
        SQLAlchemy ``AsyncConnection`` or ``AsyncSession``)."""
        if conn is None:
            return await adrive(self._commit_plan(through))
        target = await async_target(conn)
        return await arun(target.conn, self._core.commit_in(through), joined=True)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.remove_listener(self, self._core.names, writers=self._writer_hints)
        self._wake.set()
        await self._conn.close()
        if self._standby is not None:
            await self._standby.close()
        if self._arrow is not None:
            self._arrow.close()

    async def __aenter__(self) -> AsyncReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
