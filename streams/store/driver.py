"""Database work as generators, and the two drivers that run them (sync and asyncio).

Theory of operation
-------------------
Every piece of logic that talks to PostgreSQL (registering a writer, appending, heartbeats,
reading positions) is written **once**, as a generator that *yields operations* and receives
their results, like psycopg's own ``generators.py``::

    def append(...) -> Gen[Ack]:
        rows = yield Query(sql, params)   # the driver executes it and sends back the rows
        yield Commit()
        return Ack(...)

The generator never touches a connection, so it cannot know whether it runs in a thread or on
an event loop. `run` drives it on a ``psycopg.Connection``, `arun` on a
``psycopg.AsyncConnection``; they are the only two places that do I/O, and they are small enough
to check by eye that they do the same thing.

Failure contract (both drivers): if an operation raises, the driver first *settles* the
connection (below), then throws the exception into the generator so its ``try``/``finally`` can
complete reserved IDs as gaps. If the generator itself raises, the driver settles the connection
before propagating. Driver errors from psycopg are wrapped into `StoreError` on the way out
(never with a password in the message): `ConnectionLost` when the connection broke under the
operation (a restart, a terminated session, a network failure; nothing uncommitted survives
that), `CommitUnknown` when the operation was a ``COMMIT`` or an `Autocommit` statement, whose
outcome the client then cannot know. `gone` tells, before using an idle connection, whether the
server ended it meanwhile.

Interruptions: what a cancellation may leave behind, and what restores the connection
-------------------------------------------------------------------------------------
An asyncio task can be cancelled at every ``await``, and psycopg awaits in more places than
the network waits: its ``wait_async`` yields to the event loop (``sleep(0)``) *after* a step
that needed no I/O whenever the loop has been busy for 5 ms, so a cancellation can arrive
after the step took effect. Measured consequences before this contract existed:

* ``conn.pipeline()`` interrupted right after entering pipeline mode: psycopg's
  ``AsyncPipeline.__aenter__`` has switched the libpq connection to pipeline mode and counted
  one level, the ``CancelledError`` skips ``__aexit__``, and ``AsyncConnection.pipeline()``
  sees a level of 1 in its ``finally`` and leaves both the libpq pipeline mode and
  ``conn._pipeline`` in place. Every later ``COPY`` on that connection then fails with
  "COPY cannot be used in pipeline mode" (the random CI failure of the batch append) and every
  later statement is queued in a pipeline nobody syncs.
* ``set_autocommit(True)`` interrupted after it took effect: the writer's connection stays in
  autocommit, and a batch's reservation would commit on its own, before its rows.
* a statement, ``COPY`` or ``COMMIT`` interrupted in flight: psycopg asks the server to cancel
  it and waits up to 5 s for the outcome, so the transaction is then failed, open, or (for a
  ``COMMIT`` that won the race) committed; if it cannot tell, it closes the connection.
* ``cursor.copy()`` interrupted after the server entered ``COPY ... FROM STDIN`` but before
  psycopg handed over its copy object: nobody ends the COPY, and the connection stays busy in
  it (``ACTIVE``). The driver ends it with an error (`_aend_copy`), which fails the
  transaction; settling then rolls it back, and a caller's connection (``writer.fact``) stays
  open.
* a pipeline interrupted or failed part-way: psycopg records a statement it prepares when it
  queues it, and forgets it only when its result is processed; results abandoned with the
  pipeline left a name in its cache that the server never created ("prepared statement
  "_pg3_2" does not exist" on the next read, seen in a loop of the cancellation tests).

So the drivers never trust the state an interruption left. On every failure (an error, a
``CancelledError``, a ``KeyboardInterrupt``) `run` and `arun` *settle* the connection before
anything else may use it, and settling ends in exactly one of two states:

1. **clean**: no pipeline (neither libpq's pipeline mode nor psycopg's pipeline object), no
   transaction (an open or failed one is rolled back; nothing commits without our ``COMMIT``),
   no command in flight, and ``autocommit`` as it was when the driver was called; or
2. **closed**: when any of that cannot be established (pipeline state left behind, a command
   still in flight, a rollback that fails or takes longer than `SETTLE_TIMEOUT`), and always
   after a pipeline that failed (the drivers close it at once: only the library's own
   connections run pipelines, never a caller's). Closing is always safe: a transaction only
   commits when the client sends ``COMMIT``. The owners reopen a closed connection on their
   next use (writers, readers, the client).

`arun` settles in a task of its own and waits for it even when cancelled again meanwhile (the
cancellation is re-raised once the connection is settled), so no caller ever resumes beside a
half-restored connection. The generator learns of the failure only after settling, which is
why its ``finally`` may rely on the transaction being over: an ID reserved in it is a gap, or
(a ``COMMIT`` or an autocommit statement whose outcome is unknown) a fact that readers learn
from PostgreSQL like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import psycopg
from psycopg import generators, sql
from psycopg.adapt import Transformer
from psycopg.pq import ConnStatus, ExecStatus, PipelineStatus, TransactionStatus
from psycopg.pq.abc import PGresult

from .._aio import uninterrupted
from ..core.fact_columns import Row
from ..errors import CommitUnknown, ConnectionLost, StoreError

__all__ = [
    "Autocommit",
    "Commit",
    "CopyIn",
    "Gen",
    "Op",
    "Pipeline",
    "Query",
    "Receive",
    "Row",
    "Send",
    "afail_joined",
    "arun",
    "asettle",
    "commit_unknown",
    "fail_joined",
    "gone",
    "run",
    "settle",
    "transient_sqlstate",
]

T = TypeVar("T")
Params: TypeAlias = dict[str, Any] | Sequence[Any] | None
SqlText: TypeAlias = sql.SQL | sql.Composed | str | bytes


@dataclass(frozen=True, slots=True)
class Query:
    """Execute one statement; the generator receives ``list[Row]`` (empty if no result).

    ``prepare``: psycopg's choice (None: prepared after a few executions), or False for a
    statement whose generic plan would be poor (its parameters decide the plan).
    """

    statement: SqlText
    params: Params = None
    prepare: bool | None = None


@dataclass(frozen=True, slots=True)
class Autocommit:
    """Execute one statement as a transaction of its own (one round trip, no ``BEGIN``).

    The connection must be idle (no transaction open); the statement commits by itself when
    it succeeds, or leaves nothing behind when it fails, so nothing needs rolling back. The
    generator receives ``list[Row]`` (empty if no result). If the connection breaks while the
    statement runs, the outcome is unknown to the client (as it is for a ``COMMIT``).
    """

    statement: SqlText
    params: Params = None


@dataclass(frozen=True, slots=True)
class CopyIn:
    """``COPY ... FROM STDIN`` these rows; the generator receives an empty list.

    ``rows`` may be a lazy iterable: an exception it raises aborts the COPY (and the transaction
    is rolled back) before it reaches the generator.
    """

    statement: SqlText
    rows: Iterable[Row]


@dataclass(frozen=True, slots=True)
class Commit:
    """Commit the current transaction; the generator receives an empty list."""


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Execute several statements in one network round trip (psycopg's pipeline mode).

    The server still runs them one after the other, each with its own snapshot under READ
    COMMITTED, so a later statement sees what an earlier one left behind (e.g. ``set_config``).
    The generator receives ``[Row(rows_of_query_1), Row(rows_of_query_2), ...]``: one tuple of
    rows per query (empty for a statement without a result).

    ``commit``: the pipeline is a whole transaction of its own (the connection must be idle),
    in one round trip: run in autocommit, its statements are one implicit transaction that
    commits at the pipeline's sync, or rolls back whole if one of them fails. If the connection
    breaks, the outcome is unknown (`CommitUnknown`), as for `Commit`. (Without it, psycopg
    begins the transaction of a pipeline with a round trip of its own.)
    """

    queries: Sequence[Query]
    commit: bool = False


@dataclass(frozen=True, slots=True)
class Send:
    """Send these statements now and return at once (the generator receives an empty list);
    their results stay on the connection until a `Receive` takes them.

    The statements are plain text without parameters (bounds inlined as literals), sent as one
    simple-protocol query: the server runs them one after the other, each with its own snapshot
    under READ COMMITTED, as one implicit transaction that commits after the last (the
    connection must be idle, in autocommit). Meanwhile the connection is busy: the next
    operation on it must be the `Receive`. What it buys: the server works on the statements
    while the client does something else (a reader plans the page it has while the next one
    is read: `streams.store.reader_core`).
    """

    statements: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Receive:
    """The results of the statements the last `Send` left on the connection: the generator
    receives one tuple of rows per statement, as for a `Pipeline`. An error of a statement is
    raised here (the server ran none after it)."""


Op: TypeAlias = Query | Autocommit | CopyIn | Commit | Pipeline | Send | Receive
Gen: TypeAlias = Generator[Op, list[Row], T]


def _interruption(error: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt``, ``SystemExit`` or ``CancelledError`` (anything not an
    ``Exception``) that ``error`` was raised while handling, if any (see "Interruptions")."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if not isinstance(cause, Exception):
            return cause
        seen.add(id(cause))
        cause = cause.__context__
    return None


def _raised(
    error: BaseException, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], op: Op
) -> BaseException:
    """What the driver throws into the generator for ``error`` raised by ``op``: the
    interruption behind it, else the `StoreError` for a driver error, else ``error``."""
    interruption = _interruption(error)
    if interruption is not None:
        return interruption
    return _wrap(error, conn, op) if isinstance(error, psycopg.Error) else error


def _wrap(
    error: psycopg.Error,
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | None = None,
    op: Op | None = None,
) -> StoreError:
    """The `StoreError` for a driver error: `ConnectionLost` when the connection broke under
    ``op``, `CommitUnknown` when ``op`` was committing (a ``COMMIT``, or an `Autocommit`
    statement, which commits by itself)."""
    # psycopg's messages come from the server and never contain the connection password;
    # the class name tells operators what kind of failure it was.
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    kind: type[StoreError] = StoreError
    if conn is not None and _lost(error, conn):
        if isinstance(op, Commit | Autocommit) or (isinstance(op, Pipeline) and op.commit):
            kind = CommitUnknown
            text += "; it may or may not have committed"
        else:
            kind = ConnectionLost
            text += "; nothing of the transaction in flight was committed"
    wrapped = kind(f"{type(error).__name__}: {text}")
    wrapped.sqlstate = error.sqlstate
    return wrapped


def _lost(
    error: psycopg.Error, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
) -> bool:
    """Did ``error`` come from the connection breaking (rather than a statement failing)?

    libpq marks the connection bad; the server says so when it ends the session (SQLSTATE class
    ``08``, connection exception; ``57P``, shutdown or termination); psycopg raises without a
    SQLSTATE when the socket fails. (The driver closes a connection whose pipeline failed for
    any reason, so a closed connection alone says nothing.)
    """
    if conn.broken:
        return True
    if not isinstance(error, psycopg.OperationalError | psycopg.InterfaceError):
        return False
    return error.sqlstate is None or error.sqlstate.startswith(("08", "57P"))


#: SQLSTATEs (whole classes, or single codes) of errors that running the same statement again
#: later can mend: the connection broke (08), the transaction was rolled back for another's
#: sake (40: serialization failure, deadlock), the server lacks resources for now (53: too
#: many connections, out of memory, disk full), a lock was not available (55P03), the statement
#: was cancelled (57014: a statement timeout or ``pg_cancel_backend``), the server is shutting
#: down, restarting or starting (57P01-57P03), an I/O error (58000, 58030), or it is a standby
#: for now (25006: a failover promotes it). A statement's own error (a missing table, bad
#: data) is none of these: running it again fails again.
TRANSIENT_SQLSTATES = ("08", "40", "53", "55P03", "57014", "57P01", "57P02", "57P03", "58000",
                       "58030", "25006")  # fmt: skip


def transient_sqlstate(sqlstate: str | None) -> bool:
    """Is an error with this SQLSTATE worth the same statement again later (see
    `TRANSIENT_SQLSTATES`)? None (no code: the client's own failure) is not."""
    return sqlstate is not None and sqlstate.startswith(TRANSIENT_SQLSTATES)


def commit_unknown(
    error: psycopg.Error, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
) -> CommitUnknown | None:
    """The `CommitUnknown` for ``error`` raised by a ``COMMIT`` the caller sent itself
    (``conn.commit()``), if the connection broke under it; None if the server answered (the
    error is then the transaction's own, e.g. a deferred constraint)."""
    if not _lost(error, conn):
        return None
    wrapped = _wrap(error, conn, Commit())
    assert isinstance(wrapped, CommitUnknown)
    return wrapped


def gone(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Is this idle connection unusable: closed, broken, or ended by the server since its last
    use (a restart, ``pg_terminate_backend``)?

    A server that ends a session says so first (SQLSTATE 57P01) and closes the socket, so the
    socket of an idle connection is readable only then (or for a rare notice). Looking costs
    one ``poll`` and no round trip, and it saves an append on such a connection from failing
    with an unknown outcome (`CommitUnknown`) when it never reached a server.
    """
    if conn.closed or conn.broken:
        return True
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return False  # in use: its next operation will tell
    try:
        for _ in range(3):  # the server's last words, then its EOF (which raises)
            readable, _, _ = select.select([conn.fileno()], [], [], 0)
            if not readable:
                break
            conn.pgconn.consume_input()  # a notice is taken in and the connection stays good
    except (OSError, ValueError, psycopg.Error):
        return True
    return conn.pgconn.status != ConnStatus.OK


def _in_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)


def _received(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], results: list[PGresult]
) -> list[Row]:
    """The rows of each result of a `Receive` (psycopg's own loaders, the connection's
    adapters), or the first statement's error."""
    rows: list[Row] = []
    for result in results:
        if result.status == ExecStatus.FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        if result.status != ExecStatus.TUPLES_OK:
            rows.append(())
            continue
        loader = Transformer(conn)
        loader.set_pgresult(result)
        rows.append(tuple(loader.load_rows(0, result.ntuples, tuple)))
    return rows


def _execute(conn: psycopg.Connection[Any], op: Op) -> list[Row]:
    if isinstance(op, Send):
        with conn.lock:
            conn.pgconn.send_query(b";".join(op.statements))
            conn.wait(generators.send(conn.pgconn))
        return []
    if isinstance(op, Receive):
        with conn.lock:
            results = conn.wait(generators.fetch_many(conn.pgconn))
        return _received(conn, results)
    if isinstance(op, Commit):
        conn.commit()
        return []
    if isinstance(op, Autocommit):
        if conn.autocommit:
            return _execute(conn, Query(op.statement, op.params))
        # Switching is a client-side flag (no round trip); allowed because the connection is idle.
        conn.autocommit = True
        try:
            return _execute(conn, Query(op.statement, op.params))
        finally:
            if not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    conn.autocommit = False
    if isinstance(op, Pipeline):
        if op.commit and not conn.autocommit:
            # psycopg begins a transaction with a round trip of its own (it syncs after its
            # BEGIN). In autocommit (a client-side flag, as for `Autocommit`) the statements of
            # a pipeline up to its one sync are one implicit transaction instead (the extended
            # query protocol's rule; psycopg syncs only when the block ends): it commits at the
            # sync, or rolls back whole if a statement fails. One round trip.
            conn.autocommit = True
            try:
                return _execute(conn, op)
            finally:
                if not conn.closed:
                    with contextlib.suppress(psycopg.Error):
                        conn.autocommit = False
        try:
            with conn.pipeline():
                cursors = [
                    conn.execute(q.statement, q.params, prepare=q.prepare) for q in op.queries
                ]
        except BaseException:
            conn.close()  # see "Interruptions": a pipeline that failed is not reused
            raise
        return [tuple(cur.fetchall()) if cur.description else () for cur in cursors]
    with conn.cursor() as cur:
        if isinstance(op, CopyIn):
            with cur.copy(op.statement) as copy:
                for row in op.rows:
                    copy.write_row(row)
            return []
        cur.execute(op.statement, op.params)
        return cur.fetchall() if cur.description is not None else []


async def _aexecute(conn: psycopg.AsyncConnection[Any], op: Op) -> list[Row]:
    if isinstance(op, Send):
        async with conn.lock:
            conn.pgconn.send_query(b";".join(op.statements))
            await conn.wait(generators.send(conn.pgconn))
        return []
    if isinstance(op, Receive):
        async with conn.lock:
            results = await conn.wait(generators.fetch_many(conn.pgconn))
        return _received(conn, results)
    if isinstance(op, Commit):
        await conn.commit()
        return []
    if isinstance(op, Autocommit):
        if conn.autocommit:
            return await _aexecute(conn, Query(op.statement, op.params))
        await conn.set_autocommit(True)  # a client-side flag, as in `_execute`
        try:
            return await _aexecute(conn, Query(op.statement, op.params))
        finally:
            if not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    await conn.set_autocommit(False)
    if isinstance(op, Pipeline):
        if op.commit and not conn.autocommit:
            await conn.set_autocommit(True)  # as in `_execute`
            try:
                return await _aexecute(conn, op)
            finally:
                if not conn.closed:
                    with contextlib.suppress(psycopg.Error):
                        await conn.set_autocommit(False)
        try:
            async with conn.pipeline():
                acursors = [
                    await conn.execute(q.statement, q.params, prepare=q.prepare) for q in op.queries
                ]
        except BaseException:
            await conn.close()  # see "Interruptions": a pipeline that failed is not reused
            raise
        return [tuple(await cur.fetchall()) if cur.description else () for cur in acursors]
    async with conn.cursor() as cur:
        if isinstance(op, CopyIn):
            try:
                async with cur.copy(op.statement) as copy:
                    for row in op.rows:
                        await copy.write_row(row)
            except BaseException as exc:
                await _aend_copy(cur, exc)
                raise
            return []
        await cur.execute(op.statement, op.params)
        return await cur.fetchall() if cur.description is not None else []


async def _aend_copy(cur: psycopg.AsyncCursor[Any], exc: BaseException) -> None:
    """End a ``COPY ... FROM STDIN`` that an interruption left running (see "Interruptions").

    When the interruption comes after the server entered the COPY but before psycopg handed
    over its copy object, nobody ends the COPY, and the connection stays busy in it. Ending it
    with an error here fails the transaction, which settling then rolls back, and keeps the
    connection (a caller's, in ``writer.fact``) open.
    """
    conn = cur.connection
    result = cur.pgresult
    if conn.closed or result is None or result.status != ExecStatus.COPY_IN:
        return
    if conn.info.transaction_status != TransactionStatus.ACTIVE:
        return
    with contextlib.suppress(Exception):  # already ended: settling closes what is left
        await uninterrupted(psycopg.AsyncCopy(cur).finish(exc))


#: Seconds settling may take (a rollback's round trip, normally well under a millisecond) before
#: the connection is closed instead.
SETTLE_TIMEOUT = 5.0


def _unsettled(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Is something left that only closing can clear (see "Interruptions" above)?

    Pipeline state is checked on both layers: libpq's pipeline mode, and psycopg's pipeline
    object (private, read defensively: an interrupted ``pipeline()`` leaves it behind).
    """
    if conn.pgconn.pipeline_status != PipelineStatus.OFF:
        return True
    if getattr(conn, "_pipeline", None) is not None:
        return True
    return conn.info.transaction_status not in (
        TransactionStatus.IDLE,
        TransactionStatus.INTRANS,
        TransactionStatus.INERROR,
    )


def settle(conn: psycopg.Connection[Any], autocommit: bool) -> None:
    """Leave `conn` clean (no pipeline, no transaction, `autocommit` as given) or closed; see
    "Interruptions" in the module docstring. Also for a caller's connection that an
    interrupted block of ours used (`streams.writer`'s ``fact``)."""
    try:
        if conn.closed:
            return
        if not _unsettled(conn):
            if _in_transaction(conn):
                conn.rollback()
            if conn.autocommit != autocommit:
                conn.autocommit = autocommit
            return
    except BaseException:  # a failed rollback, or a second Ctrl-C: close below, then re-raise
        conn.close()
        raise
    conn.close()


async def _asettle_now(conn: psycopg.AsyncConnection[Any], autocommit: bool) -> None:
    try:
        if conn.closed or _unsettled(conn):
            await conn.close()
            return
        async with asyncio.timeout(SETTLE_TIMEOUT):
            if _in_transaction(conn):
                await conn.rollback()
            if conn.autocommit != autocommit:
                await conn.set_autocommit(autocommit)
    except BaseException as exc:  # a failed rollback, the timeout, or the loop closing
        await conn.close()
        if not isinstance(exc, Exception):
            raise


async def asettle(conn: psycopg.AsyncConnection[Any], autocommit: bool) -> None:
    """The asyncio twin of `settle`, run in a task of its own to the end even if cancelled
    meanwhile; a cancellation received while waiting is raised once `conn` is settled."""
    await uninterrupted(_asettle_now(conn, autocommit))


#: The statement by which the drivers fail a caller's transaction that an operation of ours
#: joined and that failed (`fail_joined`): it fails whenever it runs, and PostgreSQL answers the
#: ``COMMIT`` of a failed transaction with a rollback.
FAIL_JOINED = (
    "SELECT 'streams: an operation of the streams library failed in this transaction; "
    "it can only roll back'::int"
)


def _failed(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.info.transaction_status == TransactionStatus.INERROR


def fail_joined(conn: psycopg.Connection[Any]) -> None:
    """After a failure of ours in a transaction of the caller's that we joined (``fact()`` or
    ``commit(conn=...)`` on a connection already in a transaction, an ORM's): leave that
    transaction able only to roll back, or the connection closed, never half-done and still
    committable. We never roll back or commit a transaction we joined (the caller's ORM would
    carry on outside it): a statement of ours that failed has failed it already, and any
    other failure fails it with `FAIL_JOINED`. What only closing clears (see "Interruptions")
    closes the connection: the caller's transaction is then over, and nothing of it commits."""
    try:
        if conn.closed:
            return
        if _unsettled(conn):
            conn.close()
            return
        if conn.info.transaction_status == TransactionStatus.INTRANS:
            with contextlib.suppress(psycopg.Error):
                conn.execute(FAIL_JOINED)
            if not _failed(conn):
                conn.close()
    except BaseException:
        conn.close()
        raise


async def _afail_joined_now(conn: psycopg.AsyncConnection[Any]) -> None:
    try:
        if conn.closed:
            return
        if _unsettled(conn):
            await conn.close()
            return
        if conn.info.transaction_status == TransactionStatus.INTRANS:
            async with asyncio.timeout(SETTLE_TIMEOUT):
                with contextlib.suppress(psycopg.Error):
                    await conn.execute(FAIL_JOINED)
            if not _failed(conn):
                await conn.close()
    except BaseException as exc:
        await conn.close()
        if not isinstance(exc, Exception):
            raise


async def afail_joined(conn: psycopg.AsyncConnection[Any]) -> None:
    """The asyncio twin of `fail_joined`, run to the end even if cancelled meanwhile."""
    await uninterrupted(_afail_joined_now(conn))


#: The drivers shadow these names with closures that honour ``joined``.
_settle, _asettle = settle, asettle


def _advance(gen: Gen[T], result: list[Row] | None, error: BaseException | None) -> Op:
    if error is not None:
        return gen.throw(error)
    if result is None:
        return next(gen)
    return gen.send(result)


def run(conn: psycopg.Connection[Any], gen: Gen[T], *, joined: bool = False) -> T:
    """Drive `gen` on a synchronous connection. ``joined``: the connection is in a transaction
    of the caller's, which a failure leaves failed (`fail_joined`) rather than rolled back."""
    autocommit = conn.autocommit

    def settle(conn: psycopg.Connection[Any], autocommit: bool) -> None:
        if joined:
            fail_joined(conn)
        else:
            _settle(conn, autocommit)

    # A signal's exception (Ctrl-C) is raised where the interpreter checks for signals, which
    # includes the loop's back edge, between two steps and outside both handlers below: the
    # outer handler settles then too (settling twice changes nothing) and closes `gen`, whose
    # ``finally`` completes what it reserved. asyncio cancels only at an ``await``: no twin.
    try:
        result: list[Row] | None = None
        error: BaseException | None = None
        while True:
            try:
                op = _advance(gen, result, error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            except psycopg.Error as exc:
                settle(conn, autocommit)
                raise _interruption(exc) or _wrap(exc) from None
            except BaseException:
                settle(conn, autocommit)
                raise
            error = None
            try:
                result = _execute(conn, op)
            except BaseException as exc:  # includes KeyboardInterrupt: IDs must not leak
                error = _raised(exc, conn, op)
                try:
                    settle(conn, autocommit)
                except BaseException as again:  # interrupted again: the connection is closed
                    error = again
    except BaseException as exc:
        if not isinstance(exc, Exception):
            settle(conn, autocommit)
            with contextlib.suppress(Exception):
                gen.close()
        raise


async def arun(conn: psycopg.AsyncConnection[Any], gen: Gen[T], *, joined: bool = False) -> T:
    """Drive `gen` on an asyncio connection; a cancellation completes reserved IDs as gaps.
    ``joined``: as for `run`."""
    autocommit = conn.autocommit

    async def asettle(conn: psycopg.AsyncConnection[Any], autocommit: bool) -> None:
        if joined:
            await afail_joined(conn)
        else:
            await _asettle(conn, autocommit)

    result: list[Row] | None = None
    error: BaseException | None = None
    while True:
        try:
            op = _advance(gen, result, error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except psycopg.Error as exc:
            await asettle(conn, autocommit)
            raise _interruption(exc) or _wrap(exc) from None
        except BaseException:
            await asettle(conn, autocommit)
            raise
        error = None
        try:
            result = await _aexecute(conn, op)
        except BaseException as exc:
            error = _raised(exc, conn, op)
            try:
                await asettle(conn, autocommit)
            except asyncio.CancelledError as again:  # cancelled while settling: that wins
                error = again
