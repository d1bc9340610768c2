"""`Reader` and `AsyncReader`: thin shells that drive `ReaderCore` on psycopg connections.

The model, the stages of a reader session and the reads themselves are in
`streams.store.reader_core` (`ReaderCore`, written once as store generators); the waiting, the
retries and the standby routing are plans in `streams.reader_plans`, which both shells drive
with the kernel (`streams.plans`). What is here: each world's sessions (reopened if the server
or an interruption closed them), and the iteration and commit faces.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import psycopg

from .arrow import areader_batches, reader_batches, typing_of
from .core.epochs import Epoch, Fact
from .core.standby_fence import StandbyRoute
from .orm import async_target, sync_target
from .plans import adrive, drive
from .reader_plans import (
    ReaderBase,
    reader_session,
)
from .store.driver import arun, run
from .store.reader_core import ReaderCore, Start
from .transport.faces import Link

if TYPE_CHECKING:
    import pyarrow as pa

    from .proofs import ProofService

__all__ = ["AsyncReader", "Reader", "ReaderCore", "Start"]


class Reader(ReaderBase):
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
        self._conn = reader_session(database_url, core, connect_timeout, first=True).call()
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
        return f"<Reader {self._described()} group={self.group!r}>"

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
        self._sync_streams()  # a pattern reader's last changes: the names below are all it hears
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


class AsyncReader(ReaderBase):
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
        conn = await reader_session(database_url, core, connect_timeout, first=True).acall()
        self = cls(database_url, core, conn, link, poll_interval, read_database_url)
        if link is not None:
            core.set_link_state(link.connected)
            link.add_listener(self, core.names)
        return self

    def __repr__(self) -> str:
        return f"<AsyncReader {self._described()} group={self.group!r}>"

    def _wakeup(self) -> None:
        self._wake.set()

    async def poll(self, timeout: float | None = 0.0) -> Epoch | None:
        """The asyncio twin of `Reader.poll`."""
        return await adrive(self._poll_plan(timeout))

    async def prove(self, timeout: float | None = 0.0) -> Epoch | None:
        """The asyncio twin of `Reader.prove`."""
        return await adrive(self._prove_plan(timeout))

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
        self._sync_streams()
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
