"""`connect()` / `aconnect()`: the entry points of the Python API.

A `Client` holds the settings, one connection for administrative work (creating streams,
reading positions and groups) and, when a Redis URL is configured, the process's Redis link,
started on first use and shared by all its writers and readers (`streams.transport.link`). Every
writer and reader opens its own PostgreSQL connections.

Riding out a restart
--------------------
A *read-only call* is one of the client's calls that changes nothing a caller could see twice
(`stream`, `streams`, `positions`, `groups`, `group_streams`, `replication_keys`; `positions`
also retires writers whose lease expired, housekeeping every reader repeats anyway). When
PostgreSQL restarts under a long-lived client, its connection breaks; a read-only call then runs
again from the start on a new connection, with backoff, for up to `READ_RETRY_SECONDS`, as long
as the failure is transient (`ConnectionLost`, or a SQLSTATE that
`streams.store.driver.transient_sqlstate` accepts). Its ``COMMIT`` only ends a snapshot, so
even a `CommitUnknown` there is harmless. The other calls write (`create_stream`, `prune`,
`rotate_replication_keys`...): they are never sent twice here, since a broken connection may
leave their outcome unknown. Every call (reads and writes) first checks that the client's idle
connection was not ended by the server meanwhile (`streams.store.driver.gone`), and opening one
waits for a starting server (`streams.store.sessions`, ``connect_timeout``). The retry is one
plan (`_read_plan`) that `Client` and `AsyncClient` both drive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from typing import Any, NamedTuple, TypeAlias, TypeVar

import psycopg

from .config import Settings
from .core.incarnation import Guard
from .core.replication import backoff_delay
from .core.staleness import STALE_AFTER_MS
from .core.timestamps import TimestampMode
from .errors import ConnectionLost, StoreError
from .proofs import ProofService
from .reader import AsyncReader, Reader
from .store import sessions
from .store.driver import Gen, arun, gone, run, transient_sqlstate
from .store.identity import verify
from .store.keys import describe_keys, rotate_keys
from .store.leases import prune_writers
from .store.reader_core import ReaderCore, Start
from .store.reader_groups import (
    GroupRow,
    StreamPositions,
    delete_group,
    list_groups,
    stream_positions,
    streams_of_group,
)
from .store.registry import (
    FactTableSpec,
    StreamInfo,
    check_schema,
    create_stream,
    list_streams,
    load_stream,
    set_fact_tables,
    set_key_window,
    set_retention,
)
from .store.retention import PRUNE_BATCH, PruneResult, prune
from .store.writer_core import WriterCore
from .transport.link import AsyncRedisLink, RedisLink
from .writer import AsyncWriter, Writer

__all__ = [
    "READ_RETRY_SECONDS",
    "AsyncClient",
    "Client",
    "aconnect",
    "connect",
    "default_instance_name",
]

log = logging.getLogger("streams.client")

#: Seconds a read-only call of a client keeps trying while PostgreSQL is restarting or the
#: connection broke (see "Riding out a restart"): as long as a reader's group commit is tried
#: again (`streams.reader.COMMIT_RETRY_SECONDS`), enough for a restart with a short recovery.
READ_RETRY_SECONDS = 30.0

T = TypeVar("T")


class _Pause(NamedTuple):
    seconds: float


class _Run(NamedTuple):
    """Run ``gen`` on the client's connection, opening one if needed by ``deadline``."""

    gen: Gen[Any]
    deadline: float


_ReadPlan: TypeAlias = Generator[_Run | _Pause, Any, T]


def _retryable(error: StoreError) -> bool:
    """Worth running a read-only call again: the connection broke (a read's ``COMMIT``
    included: it only ends a snapshot), or the server's error is transient."""
    return isinstance(error, ConnectionLost) or transient_sqlstate(error.sqlstate)


def _read_plan(what: str, operation: Callable[[], Gen[T]]) -> _ReadPlan[T]:
    """``operation()`` (a read-only store generator), run again from the start with backoff
    while it fails transiently, for up to `READ_RETRY_SECONDS`; the drivers send back its
    result or throw in its `StoreError`. A connection that cannot be opened (the client waited
    for it until the deadline, or the failure is not transient) ends the call."""
    deadline = time.monotonic() + READ_RETRY_SECONDS
    attempt = 0
    while True:
        try:
            result: T = yield _Run(operation(), deadline)
        except StoreError as error:
            remaining = deadline - time.monotonic()
            if not _retryable(error) or remaining <= 0:
                raise
            if attempt == 0:
                log.warning("%s: PostgreSQL failed (%s); trying again", what, error)
            attempt += 1
            yield _Pause(min(remaining, backoff_delay(attempt - 1, jitter=random.random())))
            continue
        if attempt:
            log.warning("%s: PostgreSQL answered again", what)
        return result


def _positions(stream: str, stale_after_ms: int) -> Gen[StreamPositions]:
    info = yield from load_stream(stream)
    return (yield from stream_positions(info, stale_after_ms=stale_after_ms))


def _groups(stream: str, stale_after_ms: int) -> Gen[list[GroupRow]]:
    info = yield from load_stream(stream)
    return (yield from list_groups(info, stale_after_ms=stale_after_ms))


def default_instance_name() -> str:
    """``<hostname>-<pid>``, cleaned to the instance-name alphabet."""
    host = re.sub(r"[^A-Za-z0-9_.:\-]", "-", socket.gethostname())[:100] or "host"
    return f"{host}-{os.getpid()}"


def _link_name() -> str:
    # Unique per client, so two clients of one process never mistake each other's echoes.
    return f"{default_instance_name()}-{secrets.token_hex(3)}"


def _known_streams(settings: Settings) -> list[str]:
    """The registry's stream names, for the Redis link: a POSITION or RDATA for a stream this
    database does not know means another deployment shares the channel (`streams.core.replication`).
    Runs on the link's thread (rarely: only when it hears an unknown name), on a connection of
    its own."""
    with sessions.connect(
        settings.database_url, autocommit=True, connect_timeout=3, purpose="redis link"
    ) as conn:
        return [info.name for info in run(conn, list_streams())]


def _open_within(connect_timeout: float, deadline: float | None) -> float:
    """Seconds to wait for a connection: ``connect_timeout``, but not past ``deadline``."""
    if deadline is None:
        return connect_timeout
    return max(0.0, min(connect_timeout, deadline - time.monotonic()))


def _reader_core(
    streams: str | Sequence[str],
    start: Start,
    group: str | None,
    page_size: int | None,
    guard: Guard,
) -> ReaderCore:
    names = [streams] if isinstance(streams, str) else list(streams)
    if page_size is None:
        core = ReaderCore(names, start=start, group=group)
    else:
        core = ReaderCore(names, start=start, group=group, page_size=page_size)
    core.guard = guard
    return core


class Client:
    """A synchronous handle on one `streams` database (and, later, its Redis)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # The connection of the client's own calls (create_stream, positions, prune...), opened
        # on first use and re-opened when broken: a process that only reads or only writes then
        # holds no idle connection for it (32 reader processes with shared proofs would need
        # 96 connections otherwise, against PostgreSQL's default max_connections of 100).
        self._conn: psycopg.Connection[Any] | None = None
        self._conn_lock = threading.Lock()
        #: The database history everything this client opens belongs to (its readers',
        #: writers' and prover's sessions check it on every connect: `streams.store.identity`).
        self.guard = Guard()
        with sessions.connect(
            settings.database_url,
            autocommit=False,
            connect_timeout=settings.connect_timeout,
            purpose="client",
        ) as conn:
            run(conn, check_schema())
            run(conn, verify(self.guard, "client"))
        self._link: RedisLink | None = None
        self._link_lock = threading.Lock()
        self._proofs: ProofService | None = None
        #: What this client opened, for `streams.metrics` (weak: closing is the caller's job).
        self.writers: weakref.WeakSet[Writer] = weakref.WeakSet()
        self.readers: weakref.WeakSet[Reader] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"<Client {self.settings!r}>"

    @property
    def link(self) -> RedisLink | None:
        """The Redis link (started on first use), or None without a Redis URL."""
        if self.settings.redis_url is None:
            return None
        with self._link_lock:
            if self._link is None:
                self._link = RedisLink(
                    self.settings.redis_url,
                    self.settings.prefix,
                    _link_name(),
                    known_streams=functools.partial(_known_streams, self.settings),
                )
            return self._link

    def create_stream(
        self,
        name: str,
        *,
        timestamping: TimestampMode | str = TimestampMode.CLIENT_PREFER,
        uncapped: bool = False,
        retention_ms: int | None = None,
        fact_tables: Sequence[FactTableSpec] | None = None,
        key_window_ms: int | None = None,
    ) -> StreamInfo:
        """Create a stream (idempotent when the settings match).

        ``fact_tables``: the user tables that hold facts of this stream besides the built-in
        one, as ``"table.column"`` / ``"schema.table.column"`` / ``(table, column)``, or, for a
        table shared with other streams, with the column that says which rows are this
        stream's: ``"order_lines.stream_id WHERE stream = 'orders'"`` / ``(table, column,
        {"stream": "orders"})`` / a `streams.store.FactTable`: sequence repair looks at them
        (see `set_fact_tables`). None: whatever is declared already.

        ``key_window_ms``: how long an append's idempotency key names it (default 24 hours;
        None: whatever is set already).
        """
        with self._db() as conn:
            return run(
                conn,
                create_stream(
                    name,
                    timestamping=timestamping,
                    uncapped=uncapped,
                    retention_ms=retention_ms,
                    fact_tables=fact_tables,
                    key_window_ms=key_window_ms,
                ),
            )

    def set_fact_tables(self, name: str, fact_tables: Sequence[FactTableSpec]) -> StreamInfo:
        """Declare (replace) the user tables that hold facts of stream ``name``.

        A fact written with ``writer.fact(conn)`` may live only in your own tables; when a
        sequence is set back (restore from a backup), a starting writer repairs it past the
        largest ID of ``streams_facts``, of every declared table, of every writer and of every
        reader group. IDs in a table that is not declared cannot be seen and could be handed out
        again. Each table and column must exist; index the column (repair reads its maximum).

        A table that holds the facts of several streams is declared with the column that says
        whose a row is, ``"order_lines.stream_id WHERE stream = 'orders'"`` (``WHERE`` in any
        case, the value a single-quoted SQL string, ``''`` for a quote in it; or
        ``("order_lines", "stream_id", {"stream": "orders"})``, or a
        `streams.store.FactTable`): repair then reads ``max(stream_id) FROM order_lines WHERE
        stream = 'orders'``, only this stream's rows, so another stream's IDs do not move this
        one's sequence. That column must exist and compare with the value; index ``(stream,
        stream_id)``. A bad form is `InvalidFactTables`, naming the accepted ones.
        """
        with self._db() as conn:
            return run(conn, set_fact_tables(name, fact_tables))

    def stream(self, name: str) -> StreamInfo:
        return self._read("stream", lambda: load_stream(name))

    def streams(self) -> list[StreamInfo]:
        return self._read("streams", list_streams)

    def positions(self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS) -> StreamPositions:
        """Everything ``streams positions`` shows of ``stream``; a group idle ``stale_after_ms``
        or longer while holding retention back is marked stale."""
        return self._read("positions", lambda: _positions(stream, stale_after_ms))

    def writer(self, stream: str, *, instance: str | None = None) -> Writer:
        core = WriterCore(
            stream,
            instance or default_instance_name(),
            lease_seconds=self.settings.lease_seconds,
            max_payload_bytes=self.settings.max_payload_bytes,
        )
        core.guard = self.guard
        writer = Writer(
            self.settings.database_url,
            core,
            self.link,
            connect_timeout=self.settings.connect_timeout,
        )
        self.writers.add(writer)
        return writer

    def reader(
        self,
        streams: str | Sequence[str],
        *,
        start: Start = "earliest",
        group: str | None = None,
        page_size: int | None = None,
        poll_interval: float | None = None,
        shared_proofs: bool | None = None,
    ) -> Reader:
        """A reader of one or several streams (see `streams.reader`).

        ``start``: ``"earliest"`` (default), ``"latest"``, ``"live"`` (only facts that begin
        after joining), a stream ID, a ``datetime`` or a ``timedelta`` ago. With ``group``, a
        committed position of that group wins over ``start``. ``shared_proofs`` (with Redis
        only; default: the client's setting, ``STREAMS_SHARED_PROOFS``, off): follow the complete
        positions one elected process proves for all readers of a stream instead of probing
        PostgreSQL on every hint (`streams.proofs`): for many reader processes per stream.
        """
        core = _reader_core(streams, start, group, page_size, self.guard)
        link = self.link
        if shared_proofs is None:
            shared_proofs = self.settings.shared_proofs
        proofs = self._proof_service() if shared_proofs and link is not None else None
        reader = Reader(
            self.settings.database_url,
            core,
            link,
            poll_interval=poll_interval,
            proofs=proofs,
            connect_timeout=self.settings.connect_timeout,
        )
        self.readers.add(reader)
        return reader

    def _proof_service(self) -> ProofService:
        with self._link_lock:
            if self._proofs is None:
                assert self._link is not None
                self._proofs = ProofService(
                    self.settings.database_url, self._link, _link_name(), self.guard
                )
            return self._proofs

    def groups(self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS) -> list[GroupRow]:
        """Every reader group of ``stream`` with its committed position, lag, idle time and
        whether it is stale (idle ``stale_after_ms`` or longer while holding retention back)."""
        return self._read("groups", lambda: _groups(stream, stale_after_ms))

    def group_streams(self, group: str) -> list[str]:
        """The streams ``group`` has committed on (sorted; empty for an unknown group)."""
        return self._read("group_streams", lambda: streams_of_group(group))

    def delete_group(self, stream: str, group: str) -> bool:
        """Forget ``group`` on ``stream`` (its readers start over from their own start
        position); True if it existed. A group holds retention back until deleted."""
        with self._db() as conn:
            info = run(conn, load_stream(stream))
            return run(conn, delete_group(info, group))

    def prune_writers(self, stream: str, older_than_ms: int) -> list[str]:
        """Delete rows of writers of ``stream`` retired longer ago than ``older_than_ms``."""
        with self._db() as conn:
            info = run(conn, load_stream(stream))
            return run(conn, prune_writers(info, older_than_ms))

    def replication_keys(self) -> list[dict[str, object]]:
        """The keys that sign the ranges readers take from Redis, newest first (never their
        secrets): ``id``, ``created_at``, ``retired_at``, ``live``."""
        return self._read("replication_keys", describe_keys)

    def rotate_replication_keys(self) -> int:
        """Add a replication key and retire every other one (after a leak, or a database
        restore: see `streams.core.signing`); returns the new key's id. Readers and provers
        pick it up within `streams.core.signing.KEY_REFRESH` seconds."""
        with self._db() as conn:
            return run(conn, rotate_keys())

    def set_retention(self, stream: str, retention_ms: int | None) -> StreamInfo:
        """Keep the facts of ``stream`` for ``retention_ms`` (None: forever); see `prune`."""
        with self._db() as conn:
            return run(conn, set_retention(stream, retention_ms))

    def set_key_window(self, stream: str, key_window_ms: int) -> StreamInfo:
        """Name appends of ``stream`` by their idempotency keys for ``key_window_ms`` (for
        every key, at once: `streams.store.idempotency`)."""
        with self._db() as conn:
            return run(conn, set_key_window(stream, key_window_ms))

    def prune(self, stream: str, *, batch: int = PRUNE_BATCH) -> PruneResult:
        """Apply the retention of ``stream``: remove facts older than its ``retention_ms``, in
        short transactions of about ``batch`` rows, never past its complete position or a
        reader group's committed position (``streams prune``; run it on a schedule, or
        ``streams prune --every``). A reader that needs removed facts gets `FactsPruned`.
        Idempotency keys older than the stream's key window are removed too."""
        with self._db() as conn:
            info = run(conn, load_stream(stream))
            return run(conn, prune(info, batch=batch))

    def close(self) -> None:
        if self._proofs is not None:
            self._proofs.close()
            self._proofs = None
        if self._link is not None:
            self._link.close()
            self._link = None
        with self._conn_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _read(self, what: str, operation: Callable[[], Gen[T]]) -> T:
        """Drive `_read_plan` (see "Riding out a restart")."""
        plan = _read_plan(what, operation)
        result: Any = None
        error: StoreError | None = None
        while True:
            try:
                step = plan.throw(error) if error is not None else plan.send(result)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            result, error = None, None
            if isinstance(step, _Pause):
                time.sleep(step.seconds)
                continue
            try:
                with self._db(step.deadline) as conn:
                    result = run(conn, step.gen)
            except StoreError as exc:
                error = exc

    @contextlib.contextmanager
    def _db(self, deadline: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        """The client's own connection, (re)opened if needed (waiting for a starting server up
        to ``connect_timeout``, and not past ``deadline``); one call at a time uses it."""
        with self._conn_lock:
            conn = self._conn
            if conn is None or gone(conn):
                if conn is not None:
                    conn.close()
                self._conn = None
                conn = sessions.connect(
                    self.settings.database_url,
                    autocommit=False,
                    connect_timeout=_open_within(self.settings.connect_timeout, deadline),
                    purpose="client",
                )
                try:
                    run(conn, verify(self.guard, "client"))
                except BaseException:
                    conn.close()
                    raise
                self._conn = conn
            yield conn

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of `Client`."""

    def __init__(
        self, settings: Settings, conn: psycopg.AsyncConnection[Any], guard: Guard | None = None
    ) -> None:
        self.settings = settings
        #: As `Client.guard`.
        self.guard = guard or Guard()
        # As in `Client`: re-opened when broken. It stays open (`open` checked the schema on
        # it), as asyncio services rarely run one process per reader.
        self._conn: psycopg.AsyncConnection[Any] | None = conn
        self._conn_lock = asyncio.Lock()
        self._link: AsyncRedisLink | None = None
        self.writers: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()
        self.readers: weakref.WeakSet[AsyncReader] = weakref.WeakSet()

    @property
    def link(self) -> AsyncRedisLink | None:
        """The Redis link (started on first use, on the running loop), or None."""
        if self.settings.redis_url is None:
            return None
        if self._link is None:
            self._link = AsyncRedisLink(
                self.settings.redis_url,
                self.settings.prefix,
                _link_name(),
                known_streams=functools.partial(_known_streams, self.settings),
            )
        return self._link

    @classmethod
    async def open(cls, settings: Settings) -> AsyncClient:
        conn = await sessions.aconnect(
            settings.database_url,
            autocommit=False,
            connect_timeout=settings.connect_timeout,
            purpose="client",
        )
        guard = Guard()
        try:
            await arun(conn, check_schema())
            await arun(conn, verify(guard, "client"))
        except BaseException:
            await conn.close()
            raise
        return cls(settings, conn, guard)

    def __repr__(self) -> str:
        return f"<AsyncClient {self.settings!r}>"

    async def create_stream(
        self,
        name: str,
        *,
        timestamping: TimestampMode | str = TimestampMode.CLIENT_PREFER,
        uncapped: bool = False,
        retention_ms: int | None = None,
        fact_tables: Sequence[FactTableSpec] | None = None,
        key_window_ms: int | None = None,
    ) -> StreamInfo:
        """Create a stream (idempotent when the settings match).

        ``fact_tables``: the user tables that hold facts of this stream besides the built-in
        one, as ``"table.column"`` / ``"schema.table.column"`` / ``(table, column)``, or, for a
        table shared with other streams, with the column that says which rows are this
        stream's: ``"order_lines.stream_id WHERE stream = 'orders'"`` / ``(table, column,
        {"stream": "orders"})`` / a `streams.store.FactTable`: sequence repair looks at them
        (see `set_fact_tables`). None: whatever is declared already.

        ``key_window_ms``: how long an append's idempotency key names it (default 24 hours;
        None: whatever is set already).
        """
        async with self._db() as conn:
            return await arun(
                conn,
                create_stream(
                    name,
                    timestamping=timestamping,
                    uncapped=uncapped,
                    retention_ms=retention_ms,
                    fact_tables=fact_tables,
                    key_window_ms=key_window_ms,
                ),
            )

    async def set_fact_tables(self, name: str, fact_tables: Sequence[FactTableSpec]) -> StreamInfo:
        """Declare (replace) the user tables that hold facts of stream ``name``.

        A fact written with ``writer.fact(conn)`` may live only in your own tables; when a
        sequence is set back (restore from a backup), a starting writer repairs it past the
        largest ID of ``streams_facts``, of every declared table, of every writer and of every
        reader group. IDs in a table that is not declared cannot be seen and could be handed out
        again. Each table and column must exist; index the column (repair reads its maximum).

        A table that holds the facts of several streams is declared with the column that says
        whose a row is, ``"order_lines.stream_id WHERE stream = 'orders'"`` (``WHERE`` in any
        case, the value a single-quoted SQL string, ``''`` for a quote in it; or
        ``("order_lines", "stream_id", {"stream": "orders"})``, or a
        `streams.store.FactTable`): repair then reads ``max(stream_id) FROM order_lines WHERE
        stream = 'orders'``, only this stream's rows, so another stream's IDs do not move this
        one's sequence. That column must exist and compare with the value; index ``(stream,
        stream_id)``. A bad form is `InvalidFactTables`, naming the accepted ones.
        """
        async with self._db() as conn:
            return await arun(conn, set_fact_tables(name, fact_tables))

    async def stream(self, name: str) -> StreamInfo:
        return await self._read("stream", lambda: load_stream(name))

    async def streams(self) -> list[StreamInfo]:
        return await self._read("streams", list_streams)

    async def positions(
        self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS
    ) -> StreamPositions:
        """See `Client.positions`."""
        return await self._read("positions", lambda: _positions(stream, stale_after_ms))

    async def writer(self, stream: str, *, instance: str | None = None) -> AsyncWriter:
        core = WriterCore(
            stream,
            instance or default_instance_name(),
            lease_seconds=self.settings.lease_seconds,
            max_payload_bytes=self.settings.max_payload_bytes,
        )
        core.guard = self.guard
        writer = await AsyncWriter.open(
            self.settings.database_url,
            core,
            self.link,
            connect_timeout=self.settings.connect_timeout,
        )
        self.writers.add(writer)
        return writer

    async def reader(
        self,
        streams: str | Sequence[str],
        *,
        start: Start = "earliest",
        group: str | None = None,
        page_size: int | None = None,
        poll_interval: float | None = None,
    ) -> AsyncReader:
        """The asyncio twin of `Client.reader`."""
        core = _reader_core(streams, start, group, page_size, self.guard)
        reader = await AsyncReader.open(
            self.settings.database_url,
            core,
            self.link,
            poll_interval=poll_interval,
            connect_timeout=self.settings.connect_timeout,
        )
        self.readers.add(reader)
        return reader

    async def groups(self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS) -> list[GroupRow]:
        """See `Client.groups`."""
        return await self._read("groups", lambda: _groups(stream, stale_after_ms))

    async def group_streams(self, group: str) -> list[str]:
        """See `Client.group_streams`."""
        return await self._read("group_streams", lambda: streams_of_group(group))

    async def delete_group(self, stream: str, group: str) -> bool:
        async with self._db() as conn:
            info = await arun(conn, load_stream(stream))
            return await arun(conn, delete_group(info, group))

    async def replication_keys(self) -> list[dict[str, object]]:
        """See `Client.replication_keys`."""
        return await self._read("replication_keys", describe_keys)

    async def rotate_replication_keys(self) -> int:
        """See `Client.rotate_replication_keys`."""
        async with self._db() as conn:
            return await arun(conn, rotate_keys())

    async def set_retention(self, stream: str, retention_ms: int | None) -> StreamInfo:
        """See `Client.set_retention`."""
        async with self._db() as conn:
            return await arun(conn, set_retention(stream, retention_ms))

    async def set_key_window(self, stream: str, key_window_ms: int) -> StreamInfo:
        """See `Client.set_key_window`."""
        async with self._db() as conn:
            return await arun(conn, set_key_window(stream, key_window_ms))

    async def prune(self, stream: str, *, batch: int = PRUNE_BATCH) -> PruneResult:
        """See `Client.prune`."""
        async with self._db() as conn:
            info = await arun(conn, load_stream(stream))
            return await arun(conn, prune(info, batch=batch))

    async def prune_writers(self, stream: str, older_than_ms: int) -> list[str]:
        async with self._db() as conn:
            info = await arun(conn, load_stream(stream))
            return await arun(conn, prune_writers(info, older_than_ms))

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()
            self._link = None
        async with self._conn_lock:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None

    async def _read(self, what: str, operation: Callable[[], Gen[T]]) -> T:
        """The asyncio twin of `Client._read`."""
        plan = _read_plan(what, operation)
        result: Any = None
        error: StoreError | None = None
        while True:
            try:
                step = plan.throw(error) if error is not None else plan.send(result)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            result, error = None, None
            if isinstance(step, _Pause):
                await asyncio.sleep(step.seconds)
                continue
            try:
                async with self._db(step.deadline) as conn:
                    result = await arun(conn, step.gen)
            except StoreError as exc:
                error = exc

    @contextlib.asynccontextmanager
    async def _db(
        self, deadline: float | None = None
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The asyncio twin of `Client._db`."""
        async with self._conn_lock:
            conn = self._conn
            if conn is None or gone(conn):
                if conn is not None:
                    await conn.close()
                self._conn = None
                conn = await sessions.aconnect(
                    self.settings.database_url,
                    autocommit=False,
                    connect_timeout=_open_within(self.settings.connect_timeout, deadline),
                    purpose="client",
                )
                try:
                    await arun(conn, verify(self.guard, "client"))
                except BaseException:
                    await conn.close()
                    raise
                self._conn = conn
            yield conn

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def connect(
    database_url: str | None = None,
    redis_url: str | None = None,
    prefix: str | None = None,
    **options: Any,
) -> Client:
    """Open a `Client`; URLs default to ``STREAMS_DATABASE_URL`` / ``STREAMS_REDIS_URL``.

    Options: ``max_payload_bytes`` (default 1 MiB), ``lease_seconds`` (default 10),
    ``shared_proofs`` (default ``STREAMS_SHARED_PROOFS`` or off; see `Client.reader`),
    ``connect_timeout``: seconds opening a PostgreSQL connection (this client's, and those of
    its readers and writers) waits for a server that is starting, restarting or refusing
    connections (default ``STREAMS_CONNECT_TIMEOUT`` or 30: `streams.store.sessions`).
    """
    return Client(Settings.resolve(database_url, redis_url, prefix, **options))


async def aconnect(
    database_url: str | None = None,
    redis_url: str | None = None,
    prefix: str | None = None,
    **options: Any,
) -> AsyncClient:
    """Open an `AsyncClient` (see `connect`)."""
    return await AsyncClient.open(Settings.resolve(database_url, redis_url, prefix, **options))
