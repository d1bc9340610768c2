"""The block of ``writer.fact(conn)``: a fact written in the caller's transaction, written once.

`OpenFact` (`AsyncOpenFact` in asyncio) is what the block gets: the fact's ID, timestamp and
`Ack`, and `add`. `FactPlans` holds what happens before and after the block, as plans
(`streams.plans`): a writer's ``fact`` drives the one, runs the block, then drives the other.

Two flows, as `streams.orm` tells them apart:

* *own*: on an idle psycopg connection the block is the fact's own transaction: begun here,
  committed when the block exits, rolled back (`streams.store.driver.settle`) if it raises;
* *joined*: on a connection already in a transaction, or an ORM's, the fact joins that
  transaction, which is never begun, committed or rolled back here. The ID stays pending until
  the heartbeat finds the transaction ended (`WriterCore.resolve_joined`); a failure leaves it
  able only to roll back (`streams.store.driver.fail_joined`).

Either way the ID completes, as a gap if nothing committed, whatever interrupts the block or
ours: the part after the block runs to its end (a second interruption included).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from .core.positions import ReservationToken
from .errors import StoreError, UsageError
from .plans import Call, Flag, Plan
from .store.driver import arun, commit_unknown, run
from .store.joined_facts import FactHandle
from .store.steps import FailJoined, Run, Settle
from .store.writer_core import WriterCore
from .types import Ack

__all__ = ["AsyncOpenFact", "FactPlans", "OpenFact"]

_FAILED_IN_BLOCK = (
    "a statement of the fact failed inside the block (an error was caught there): "
    "its transaction can only roll back, and nothing of it was written"
)

AnyConnection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]


def _check_committable(conn: AnyConnection, failed: bool) -> None:
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
    #: For `FactPlans`, from before the block to after it: the ID's reservation, and whether
    #: the connection was in autocommit (as the fact's own transaction leaves it).
    _token: ReservationToken
    _autocommit: bool

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


F = TypeVar("F", OpenFact, AsyncOpenFact)


def _commit_plan(conn: AnyConnection) -> Plan[None]:
    try:
        yield Call(conn.commit)
    except psycopg.Error as exc:
        unknown = commit_unknown(exc, conn)
        if unknown is None:
            raise
        raise unknown from exc


class FactPlans:
    """Before and after the block of a writer's ``fact`` (see the module docstring)."""

    _core: WriterCore
    _wake: Flag
    #: Callers' sessions this writer has fenced (`WriterCore.reserve_fact`'s ``fence``), with
    #: their backend PIDs: each new one is fenced once, which a failover makes necessary for
    #: a session that reaches a new primary before any of the writer's own.
    _sessions: weakref.WeakKeyDictionary[Any, int]

    def _completed(
        self, ids: tuple[int, ...] = (), timestamp: int = 0, *, remembered: bool = True
    ) -> None:
        raise NotImplementedError

    def _new_session(self, conn: AnyConnection) -> bool:
        """Whether ``conn`` is a session this writer has not fenced yet."""
        return self._sessions.get(conn) != conn.info.backend_pid

    def _enter_fact(
        self,
        conn: Any,
        joined: bool,
        open_fact: Callable[[WriterCore, Any, FactHandle, bool], F],
        timestamp: int | None,
        key: str | None,
    ) -> Plan[F]:
        """Up to the block: reserve the fact's ID (in its own transaction, begun here, unless
        ``joined``); the fact for the block."""
        core = self._core
        autocommit = conn.autocommit
        token, stamp = core.begin_fact(timestamp, key)
        handle: FactHandle | None = None
        try:
            if autocommit and not joined:
                yield Call(conn.execute, "BEGIN")
            fence = self._new_session(conn)
            reserve = core.reserve_fact(token, stamp, key, fence=fence)
            handle = yield Run(conn, reserve, joined=joined)
            if fence:
                self._sessions[conn] = conn.info.backend_pid
        except BaseException:
            yield from self._end_fact(conn, joined, autocommit, token, handle, ok=False)
            raise
        assert handle is not None
        fact = open_fact(core, conn, handle, joined)
        fact._token, fact._autocommit = token, autocommit
        return fact

    def _exit_fact(self, fact: OpenFact | AsyncOpenFact, raised: bool) -> Plan[None]:
        """After the block (``raised``: by an exception): commit the fact's own transaction
        (unless the block failed it, or the fact is a duplicate: then roll it back), or check
        that a joined one is still intact; then end the fact (`_end_fact`)."""
        conn, handle = fact._conn, fact._handle
        ok = False
        try:
            if not raised:
                if fact._joined:
                    if fact.failed:
                        raise StoreError(_FAILED_IN_BLOCK)
                else:
                    _check_committable(conn, fact.failed)
                    if handle.duplicate:  # nothing of a duplicate's block is written
                        yield Settle(conn, fact._autocommit)
                    else:
                        yield from _commit_plan(conn)
                ok = True
        finally:
            yield from self._end_fact(conn, fact._joined, fact._autocommit, fact._token, handle, ok)

    def _end_fact(
        self,
        conn: AnyConnection,
        joined: bool,
        autocommit: bool,
        token: ReservationToken,
        handle: FactHandle | None,
        ok: bool,
    ) -> Plan[None]:
        """Unless it committed (``ok``), roll the transaction back (or close a connection left
        unusable: `streams.store.driver`), or leave a joined one able only to roll back; then
        complete the ID, or hand a joined fact's to the heartbeat (it completes when its
        transaction ends), whatever happened meanwhile."""
        core = self._core
        try:
            if not ok:
                with contextlib.suppress(psycopg.Error):
                    yield FailJoined(conn) if joined else Settle(conn, autocommit)
        finally:
            written = ok and handle is not None and not handle.duplicate
            if joined and written and handle is not None:
                core.join_fact(handle)
                self._wake.set()
            else:
                core.finish_fact(token, handle, ok)
                if written and handle is not None:
                    # A fact with no row in the facts table leaves nothing there that a
                    # failover check could find: it is not remembered (`streams.core.sightings`).
                    remembered = handle.rows > 0 or bool(core.info.fact_tables)
                    self._completed((handle.stream_id,), handle.timestamp, remembered=remembered)
                else:
                    self._completed()
