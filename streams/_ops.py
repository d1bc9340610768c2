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

Failure contract (both drivers): if an operation raises, the driver first rolls the open
transaction back (shielded from cancellation), then throws the exception into the generator
so its ``try``/``finally`` can complete reserved IDs as gaps. If the generator itself raises
while a transaction is open, the driver rolls back before propagating. Driver errors from
psycopg are wrapped into `StoreError` on the way out (never with a password in the message).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from .errors import StoreError

__all__ = [
    "Autocommit",
    "Commit",
    "CopyIn",
    "Gen",
    "Op",
    "Pipeline",
    "Query",
    "Row",
    "arun",
    "run",
]

T = TypeVar("T")
Row: TypeAlias = tuple[Any, ...]
Params: TypeAlias = dict[str, Any] | Sequence[Any] | None
SqlText: TypeAlias = sql.SQL | sql.Composed | str | bytes


@dataclass(frozen=True, slots=True)
class Query:
    """Execute one statement; the generator receives ``list[Row]`` (empty if no result)."""

    statement: SqlText
    params: Params = None


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
    rows per query.
    """

    queries: Sequence[Query]


Op: TypeAlias = Query | Autocommit | CopyIn | Commit | Pipeline
Gen: TypeAlias = Generator[Op, list[Row], T]


def _wrap(error: psycopg.Error) -> StoreError:
    # psycopg's messages come from the server and never contain the connection password;
    # the class name tells operators what kind of failure it was.
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    wrapped = StoreError(f"{type(error).__name__}: {text}")
    wrapped.sqlstate = error.sqlstate
    return wrapped


def _in_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)


def _execute(conn: psycopg.Connection[Any], op: Op) -> list[Row]:
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
        with conn.pipeline():
            cursors = [conn.execute(q.statement, q.params) for q in op.queries]
        return [tuple(cur.fetchall()) for cur in cursors]
    with conn.cursor() as cur:
        if isinstance(op, CopyIn):
            with cur.copy(op.statement) as copy:
                for row in op.rows:
                    copy.write_row(row)
            return []
        cur.execute(op.statement, op.params)
        return cur.fetchall() if cur.description is not None else []


async def _aexecute(conn: psycopg.AsyncConnection[Any], op: Op) -> list[Row]:
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
        async with conn.pipeline():
            acursors = [await conn.execute(q.statement, q.params) for q in op.queries]
        return [tuple(await cur.fetchall()) for cur in acursors]
    async with conn.cursor() as cur:
        if isinstance(op, CopyIn):
            async with cur.copy(op.statement) as copy:
                for row in op.rows:
                    await copy.write_row(row)
            return []
        await cur.execute(op.statement, op.params)
        return await cur.fetchall() if cur.description is not None else []


def _rollback(conn: psycopg.Connection[Any]) -> None:
    """End the transaction so that it can never commit.

    A connection interrupted in the middle of a command (status ACTIVE, e.g. a cancelled
    task) or broken cannot roll back; closing it has the same effect, because a transaction
    only commits when the client sends COMMIT. The writer reconnects on its next use.
    """
    if conn.closed or conn.info.transaction_status == TransactionStatus.IDLE:
        return
    if _in_transaction(conn):
        try:
            conn.rollback()
            return
        except psycopg.Error:
            pass
    conn.close()


async def _arollback(conn: psycopg.AsyncConnection[Any]) -> None:
    """The asyncio twin of `_rollback`."""
    if conn.closed or conn.info.transaction_status == TransactionStatus.IDLE:
        return
    if _in_transaction(conn):
        try:
            await conn.rollback()
            return
        except psycopg.Error:
            pass
    await conn.close()


def _advance(gen: Gen[T], result: list[Row] | None, error: BaseException | None) -> Op:
    if error is not None:
        return gen.throw(error)
    if result is None:
        return next(gen)
    return gen.send(result)


def run(conn: psycopg.Connection[Any], gen: Gen[T]) -> T:
    """Drive `gen` on a synchronous connection."""
    result: list[Row] | None = None
    error: BaseException | None = None
    while True:
        try:
            op = _advance(gen, result, error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except psycopg.Error as exc:
            _rollback(conn)
            raise _wrap(exc) from None
        except BaseException:
            _rollback(conn)
            raise
        error = None
        try:
            result = _execute(conn, op)
        except BaseException as exc:  # includes KeyboardInterrupt: IDs must not leak
            _rollback(conn)
            error = _wrap(exc) if isinstance(exc, psycopg.Error) else exc


async def arun(conn: psycopg.AsyncConnection[Any], gen: Gen[T]) -> T:
    """Drive `gen` on an asyncio connection; a cancellation completes reserved IDs as gaps."""
    result: list[Row] | None = None
    error: BaseException | None = None
    while True:
        try:
            op = _advance(gen, result, error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except psycopg.Error as exc:
            await asyncio.shield(_arollback(conn))
            raise _wrap(exc) from None
        except BaseException:
            await asyncio.shield(_arollback(conn))
            raise
        error = None
        try:
            result = await _aexecute(conn, op)
        except BaseException as exc:
            # Shielded: a second cancellation must not leave the transaction open.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(_arollback(conn))
            error = _wrap(exc) if isinstance(exc, psycopg.Error) else exc
