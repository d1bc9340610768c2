"""The caller's connection, whatever holds it: psycopg, SQLAlchemy or Django.

`Writer.fact` and `Reader.commit` (``conn=``) write in the caller's transaction. Services hold
that transaction in an ORM more often than on a bare psycopg connection, so both accept:

* a ``psycopg.Connection`` (``AsyncConnection`` for the asyncio shells);
* a SQLAlchemy ``Connection`` or ``Session`` (``AsyncConnection`` or ``AsyncSession``), of an
  engine with the psycopg 3 dialect (``postgresql+psycopg://``); a ``scoped_session`` too;
* a Django database connection (``django.db.connection``, ``connections[alias]``) with
  Django's psycopg 3 backend, inside ``transaction.atomic()``.

A `Target` is the psycopg connection underneath and whether the library *joins* a transaction
of the caller's: it then neither begins, commits nor rolls back (the ORM does; see
`streams.store.driver.fail_joined` for what a failure leaves). An ORM's transaction is always
joined: a SQLAlchemy connection that is not in a transaction yet is begun the way SQLAlchemy
begins one on its first statement (the caller commits it, as after any statement), and a
Django connection must be inside ``atomic()``. A bare psycopg connection is joined when it is in
a transaction already; when it is idle, ``fact()`` makes the block its transaction, as it always
has. Nothing here imports SQLAlchemy or Django unless it is given one of their objects: the
library does not need them; and only an asyncio object imports SQLAlchemy's asyncio extension
(which needs greenlet, an optional dependency since SQLAlchemy 2.1).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from .errors import UsageError

__all__ = ["Target", "async_target", "sync_target"]

C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])

_ACCEPTED = (
    "a psycopg connection, a SQLAlchemy Connection or Session (postgresql+psycopg://) or a "
    "Django connection (psycopg 3 backend)"
)


@dataclass(frozen=True, slots=True)
class Target(Generic[C]):
    """The psycopg connection to write on, and whether its transaction is the caller's."""

    conn: C
    joined: bool


def _psycopg(conn: C) -> Target[C]:
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise UsageError("the connection's transaction has failed already: roll it back first")
    if status not in (TransactionStatus.IDLE, TransactionStatus.INTRANS):
        raise UsageError("the connection is busy (a statement or COPY in progress)")
    return Target(conn, joined=status == TransactionStatus.INTRANS)


def _driver(found: object, kind: type[C], what: str) -> C:
    if not isinstance(found, kind):
        raise UsageError(
            f"{what} runs on {type(found).__module__}.{type(found).__name__}: the streams "
            "library needs psycopg 3 underneath (SQLAlchemy: postgresql+psycopg://; Django: "
            "its postgresql backend with psycopg 3 installed)"
        )
    return found


def _module(obj: object) -> str:
    return type(obj).__module__ or ""


def sync_target(obj: object) -> Target[psycopg.Connection[Any]]:
    """The `Target` of a synchronous connection, session or Django connection."""
    if isinstance(obj, psycopg.Connection):
        return _psycopg(obj)
    if isinstance(obj, psycopg.AsyncConnection):
        raise UsageError("an asyncio connection: use it with the asyncio writer or reader")
    if _module(obj).startswith("sqlalchemy."):
        return _sqlalchemy(obj)
    if _module(obj).startswith("django.") and hasattr(obj, "in_atomic_block"):
        return _django(obj)
    raise UsageError(f"expected {_ACCEPTED}, got {type(obj).__name__}")


def _sqlalchemy(obj: Any) -> Target[psycopg.Connection[Any]]:
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session, scoped_session

    # Never ``import sqlalchemy.ext.asyncio`` for a synchronous object: it needs greenlet,
    # which SQLAlchemy 2.1 no longer installs (the import then raises ImportError). An object
    # of its classes exists only once that module is imported, so looking it up is enough.
    aio = sys.modules.get("sqlalchemy.ext.asyncio")
    if aio is not None and isinstance(obj, aio.AsyncConnection | aio.AsyncSession):
        raise UsageError("an asyncio SQLAlchemy object: use it with the asyncio writer or reader")
    if isinstance(obj, scoped_session):
        obj = obj()
    if isinstance(obj, Session):
        conn = obj.connection()  # begins the session's transaction if it has none yet
    elif isinstance(obj, Connection):
        conn = obj
        if not conn.in_transaction():
            conn.begin()
    else:
        raise UsageError(f"expected {_ACCEPTED}, got {type(obj).__name__}")
    found = conn.connection.driver_connection
    return Target(_driver(found, psycopg.Connection, "this SQLAlchemy engine"), joined=True)


def _django(obj: Any) -> Target[psycopg.Connection[Any]]:
    if not obj.in_atomic_block:
        raise UsageError(
            "a Django connection joins the transaction of a transaction.atomic() block: "
            "call this inside one"
        )
    obj.ensure_connection()
    return Target(_driver(obj.connection, psycopg.Connection, "this Django connection"), True)


async def async_target(obj: object) -> Target[psycopg.AsyncConnection[Any]]:
    """The `Target` of an asyncio connection or session."""
    if isinstance(obj, psycopg.AsyncConnection):
        return _psycopg(obj)
    if isinstance(obj, psycopg.Connection):
        raise UsageError("a synchronous connection: use it with the synchronous writer or reader")
    if not _module(obj).startswith("sqlalchemy."):
        raise UsageError(
            "expected a psycopg AsyncConnection or a SQLAlchemy AsyncConnection or "
            f"AsyncSession (postgresql+psycopg://), got {type(obj).__name__}"
        )
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

    if isinstance(obj, async_scoped_session):
        obj = obj()
    if isinstance(obj, AsyncSession):
        conn = await obj.connection()  # begins the session's transaction if it has none yet
    elif isinstance(obj, AsyncConnection):
        conn = obj
        if not conn.in_transaction():
            await conn.begin()
    else:
        raise UsageError(
            "a synchronous SQLAlchemy object: use it with the synchronous writer or reader"
        )
    raw = await conn.get_raw_connection()
    found = raw.driver_connection
    return Target(_driver(found, psycopg.AsyncConnection, "this SQLAlchemy engine"), joined=True)
