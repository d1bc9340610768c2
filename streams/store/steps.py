"""The kernel's steps that touch PostgreSQL (`streams.plans`): run a statement plan on a
session, open a session, settle one, fail a caller's transaction.

A statement plan is a store generator (`streams.store.driver.Gen`); `Run` hands it to the
driver of its world (`streams.store.driver.run` / ``arun``), which is the level below the
kernel, as libpq's generators are below psycopg's waits.
"""

from __future__ import annotations

from typing import Any

from ..plans import Io
from . import sessions
from .driver import Gen, afail_joined, arun, asettle, fail_joined, run, settle

__all__ = ["Connect", "FailJoined", "Run", "Settle"]


class Run(Io):
    """Run a store generator on ``conn``; ``joined``: in a transaction of the caller's
    (`streams.store.driver.run`)."""

    def __init__(self, conn: Any, gen: Gen[Any], *, joined: bool = False) -> None:
        super().__init__(run, arun, conn, gen, joined=joined)


class Connect(Io):
    """A new connection to ``url``, checked by ``opening`` (`streams.store.sessions.connect`),
    waiting up to ``connect_timeout`` seconds for a starting server."""

    def __init__(
        self,
        url: str,
        connect_timeout: float | None,
        purpose: str,
        opening: sessions.Opening | None = None,
        *,
        autocommit: bool = False,
        decode_payloads: bool = False,
    ) -> None:
        super().__init__(
            sessions.connect,
            sessions.aconnect,
            url,
            autocommit=autocommit,
            connect_timeout=connect_timeout,
            purpose=purpose,
            opening=opening,
            decode_payloads=decode_payloads,
        )


class Settle(Io):
    """Leave a connection clean or closed (`streams.store.driver.settle`)."""

    def __init__(self, conn: Any, autocommit: bool) -> None:
        super().__init__(settle, asettle, conn, autocommit)


class FailJoined(Io):
    """Leave a caller's transaction able only to roll back (`streams.store.driver.fail_joined`)."""

    def __init__(self, conn: Any) -> None:
        super().__init__(fail_joined, afail_joined, conn)
