"""`connect()` / `aconnect()`: the entry points of the Python API.

A `Client` holds the settings, one connection for administrative work (creating streams,
reading positions and groups) and, when a Redis URL is configured, the process's Redis link,
started on first use and shared by all its writers and readers (`streams.transport.link`). Every
writer and reader opens its own PostgreSQL connections.

Plans
-----
Every call of a client that uses its connection is written **once**, as a plan of the kernel
(`streams.plans`): ``plan_<call>`` (`streams.client_plans`) builds it, and `Client` drives it
with `streams.plans.drive`, `AsyncClient` with `streams.plans.adrive`. A plan runs its store
generator on the client's connection through one step, `_ClientBase.on_connection`: under the
client's lock (one call at a time uses the connection), the *session* plan
(`_ClientBase._session`) opens the connection on first use and reuses it; one the server ended
meanwhile (`streams.store.driver.gone`) is closed and a new one opened, waiting for a starting
server up to ``connect_timeout`` but not past the step's deadline (`_open_within`), and checked
against the database history the client belongs to (`Client.guard`, `streams.store.identity`)
before its first use. ``tests/integration/test_client_twins.py`` runs one scenario through both
clients and compares every result and exception. What stays twice is what really differs: a
`Client` checks the schema on a connection it then closes (it holds no idle connection until a
call needs one), while an `AsyncClient` keeps the one `AsyncClient.open` checked; only
`Client.reader` can follow shared proofs (`streams.proofs`); and the classes of the writers,
readers and Redis link.

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
`rotate_replication_keys`...): they are never sent twice here (`client_plans._once`), since a broken
connection may leave their outcome unknown. Every call (reads and writes) first checks that the
client's idle connection was not ended by the server meanwhile (the session plan), and opening
one waits for a starting server (`streams.store.sessions`, ``connect_timeout``). The retry is
one plan, `client_plans._read_plan`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg

from .client_plans import (
    READ_RETRY_SECONDS,
    announce_keys,
    checked,
    plan_create_stream,
    plan_create_streams,
    plan_delete_group,
    plan_drop_streams,
    plan_group_streams,
    plan_groups,
    plan_overview,
    plan_positions,
    plan_prune,
    plan_prune_writers,
    plan_replication_keys,
    plan_rotate_replication_keys,
    plan_set_fact_tables,
    plan_set_key_window,
    plan_set_retention,
    plan_stream,
    plan_streams,
)
from .config import Settings
from .core.incarnation import Guard
from .core.staleness import STALE_AFTER_MS
from .core.standby_fence import StandbyRoute
from .core.timestamps import TimestampMode
from .errors import InvalidPattern
from .plans import Call, Locked, Plan, adrive, drive
from .proofs import ProofService
from .reader import AsyncReader, Reader
from .store import sessions
from .store.driver import Gen, gone, run
from .store.identity import verify
from .store.overview import Overview, Sort
from .store.reader_core import ReaderCore, Start
from .store.registry import (
    list_streams,
)
from .store.retention import PRUNE_BATCH
from .store.steps import Connect, Run
from .store.writer_core import WriterCore
from .transport.link import AsyncRedisLink, RedisLink
from .types import (
    Created,
    FactTableSpec,
    GroupRow,
    PruneResult,
    StreamInfo,
    StreamPositions,
    StreamSpec,
)
from .writer import AsyncWriter, Writer

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "READ_RETRY_SECONDS",
    "AsyncClient",
    "Client",
    "aconnect",
    "connect",
    "default_instance_name",
]

log = logging.getLogger("streams.client")


T = TypeVar("T")
#: The client's connection: psycopg's synchronous one (`Client`) or its asyncio one.
C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])
L = TypeVar("L", RedisLink, AsyncRedisLink)


# --------------------------------------------------------------------------------------------
# What both clients share


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


class _ClientBase(Generic[C]):
    """What `Client` and `AsyncClient` share: the settings, the database history (`guard`),
    the client's connection (``C``) and the session plan that uses it."""

    def __init__(self, settings: Settings, conn: C | None, guard: Guard) -> None:
        self.settings = settings
        self.guard = guard  # `Client.guard`
        # The connection of the client's own calls (create_stream, positions, prune...),
        # re-opened when broken (see `_session`).
        self._conn: C | None = conn

    #: One call at a time uses the connection: threading's lock or asyncio's.
    _conn_lock: Any

    def on_connection(self, gen: Gen[T], deadline: float | None) -> Locked:
        """The step that runs ``gen`` on the client's connection, (re)opened if needed, by
        ``deadline`` if given (`time.monotonic`): `_session`, holding the client's lock."""
        return Locked(self._conn_lock, self._session(gen, deadline))

    def _session(self, gen: Gen[T], deadline: float | None) -> Plan[T]:
        """See "Plans" above."""
        conn = self._conn
        if conn is None or gone(conn):
            if conn is not None:
                yield Call(conn.close)
            self._conn = None
            timeout = _open_within(self.settings.connect_timeout, deadline)
            opening = functools.partial(verify, self.guard, "client")
            self._conn = conn = yield Connect(
                self.settings.database_url, timeout, "client", opening
            )
        result: T = yield Run(conn, gen)
        return result

    def _new_link(self, kind: type[L], url: str) -> L:
        """The client's Redis link (`streams.transport.link`), of ``kind``."""
        return kind(
            url,
            self.settings.prefix,
            _link_name(),
            known_streams=functools.partial(_known_streams, self.settings),
        )

    def _writer_core(self, stream: str, instance: str | None) -> WriterCore:
        core = WriterCore(
            stream,
            instance or default_instance_name(),
            lease_seconds=self.settings.lease_seconds,
            max_payload_bytes=self.settings.max_payload_bytes,
        )
        core.guard = self.guard
        return core

    def _reader_core(
        self,
        streams: str | Sequence[str] | None,
        start: Start,
        group: str | None,
        page_size: int | None,
        pattern: str | None = None,
    ) -> ReaderCore:
        if streams is not None and pattern is not None:
            raise InvalidPattern("a reader follows named streams or a pattern, not both")
        if streams is None and pattern is None:
            raise InvalidPattern("a reader follows named streams or a pattern: pass one of them")
        names = [] if streams is None else [streams] if isinstance(streams, str) else list(streams)
        lease = self.settings.lease_seconds
        if page_size is None:
            core = ReaderCore(names, pattern=pattern, start=start, group=group, lease_seconds=lease)
        else:
            core = ReaderCore(
                names,
                pattern=pattern,
                start=start,
                group=group,
                page_size=page_size,
                lease_seconds=lease,
            )
        core.guard = self.guard
        return core

    def _standby_route(self) -> StandbyRoute | None:
        """How a reader waits for the read URL's standby (None: there is none)."""
        if self.settings.read_database_url is None:
            return None
        return StandbyRoute(max_wait=self.settings.standby_max_wait)


class Client(_ClientBase[psycopg.Connection[Any]]):
    """A synchronous handle on one `streams` database (and, later, its Redis)."""

    #: The database history everything this client opens belongs to (its readers',
    #: writers' and prover's sessions check it on every connect: `streams.store.identity`).
    guard: Guard

    def __init__(self, settings: Settings) -> None:
        # The client's connection is opened on first use: a process that only reads or only
        # writes then holds no idle connection for it (32 reader processes with shared proofs
        # would need 96 connections otherwise, against PostgreSQL's default max_connections of
        # 100).
        super().__init__(settings, None, Guard())
        self._conn_lock = threading.Lock()
        # The checks at open ride out a session ended or a server restarting under them, up
        # to connect_timeout (`streams.store.sessions`, "Opening checks").
        sessions.connect(
            settings.database_url,
            autocommit=False,
            connect_timeout=settings.connect_timeout,
            purpose="client",
            opening=functools.partial(checked, self.guard),
        ).close()
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
                self._link = self._new_link(RedisLink, self.settings.redis_url)
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
        plan = plan_create_stream(
            self, name, timestamping, uncapped, retention_ms, fact_tables, key_window_ms
        )
        return drive(plan)

    def create_streams(
        self, streams: Sequence[StreamSpec | str | Mapping[str, Any]], *, exist_ok: bool = True
    ) -> list[Created]:
        """Create many streams at once: each a name or a `StreamSpec` (``create_stream``'s
        arguments), in transactions of up to `streams.store.registry.CREATE_CHUNK` streams,
        each all or nothing (and idempotent, so a call that broke is finished by calling it
        again). The answer says, per stream in order, whether this call made it;
        ``exist_ok=False`` makes an existing stream `StreamExists` (nothing of its chunk made).
        """
        return drive(plan_create_streams(self, streams, exist_ok))

    def drop_streams(self, names: Sequence[str]) -> list[str]:
        """Drop these streams, their facts, writers, groups and keys (each in its own
        transactions: see `streams.store.registry.drop_stream`); the answer names the ones that
        existed."""
        return drive(plan_drop_streams(self, names))

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
        return drive(plan_set_fact_tables(self, name, fact_tables))

    def stream(self, name: str) -> StreamInfo:
        return drive(plan_stream(self, name))

    def streams(self) -> list[StreamInfo]:
        return drive(plan_streams(self))

    def positions(self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS) -> StreamPositions:
        """Everything ``streams positions`` shows of ``stream``; a group idle ``stale_after_ms``
        or longer while holding retention back is marked stale."""
        return drive(plan_positions(self, stream, stale_after_ms))

    def overview(
        self,
        like: str | None = None,
        *,
        limit: int | None = None,
        sort: Sort = "name",
        stale_after_ms: int = STALE_AFTER_MS,
        grouped: bool = False,
    ) -> Overview:
        """`positions` of every stream whose name matches the SQL ``LIKE`` pattern ``like``
        (None: all) at once, in a constant number of statements whatever their number: sorted
        by name, or by ``"lag"`` (the largest group lag first), the first ``limit`` of them
        (`streams.store.overview`); ``grouped``: only streams a reader group committed on."""
        return drive(plan_overview(self, like, limit, sort, stale_after_ms, grouped))

    def writer(self, stream: str, *, instance: str | None = None) -> Writer:
        writer = Writer(
            self.settings.database_url,
            self._writer_core(stream, instance),
            self.link,
            connect_timeout=self.settings.connect_timeout,
        )
        self.writers.add(writer)
        return writer

    def reader(
        self,
        streams: str | Sequence[str] | None = None,
        *,
        pattern: str | None = None,
        start: Start = "earliest",
        group: str | None = None,
        page_size: int | None = None,
        poll_interval: float | None = None,
        shared_proofs: bool | None = None,
    ) -> Reader:
        """A reader of one or several streams (see `streams.reader`).

        ``pattern`` instead of ``streams``: follow every stream whose whole name matches this
        regular expression (Python's `re` syntax, `re.fullmatch`), streams created later
        included: found within a poll interval and read from their first fact, whatever
        ``start`` (which applies to the streams that match when the reader opens); a dropped
        stream leaves the reader. With ``group``, the group commits a position on each.
        Matching nothing yet is fine: the reader waits. `InvalidPattern` for a bad pattern,
        or for both ``streams`` and ``pattern`` (or neither).

        ``start``: ``"earliest"`` (default), ``"latest"``, ``"live"`` (only facts that begin
        after joining), a stream ID, a ``datetime`` or a ``timedelta`` ago. With ``group``, a
        committed position of that group wins over ``start``. ``shared_proofs`` (with Redis
        only; default: the client's setting, ``STREAMS_SHARED_PROOFS``, off): follow the complete
        positions one elected process proves for all readers of a stream instead of probing
        PostgreSQL on every hint (`streams.proofs`): for many reader processes per stream.
        """
        core = self._reader_core(streams, start, group, page_size, pattern)
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
            read_database_url=self.settings.read_database_url,
            standby=self._standby_route(),
        )
        self.readers.add(reader)
        return reader

    def read_arrow(
        self,
        stream: str,
        *,
        start: Start = "earliest",
        end: int | None = None,
        max_rows: int | None = None,
        schema: pa.Schema | str | None = None,
        mode: str = "PERMISSIVE",
        corrupt_column: str = "_corrupt_record",
    ) -> pa.Table:
        """The facts of ``stream`` from ``start`` (as for `reader`: a stream ID, a time,
        ``"earliest"``) up to, not including, the stream ID ``end`` (None: everything complete
        now), as one ``pyarrow.Table`` (`streams.arrow`: the columns; its chunks are the record
        batches read, at most ``max_rows`` rows each, so nothing is copied to make it): what
        ``table.to_pandas()``, ``polars.from_arrow(table)`` and DuckDB (which queries a Python
        variable holding a table by its name) take as they are. Reads only what PostgreSQL has
        proven complete when it is called: facts of the range not complete yet are not in it.
        For a range larger than memory, iterate `Reader.batches` instead. Needs the ``arrow``
        extra. ``schema``, ``mode``, ``corrupt_column``: typed columns, as `Reader.batches`."""
        from .arrow import bounds, reader_batches, to_table, typing_of
        from .store.arrow_reads import require_arrow

        require_arrow("Client.read_arrow()")
        typed = typing_of(schema, mode, corrupt_column)
        until = bounds(stream, end)
        core = self._reader_core(stream, start, None, None)
        # No Redis link: a bounded read proves for itself (nothing to wait for).
        with Reader(
            self.settings.database_url, core, None, connect_timeout=self.settings.connect_timeout
        ) as reader:
            batches = reader_batches(reader, max_rows=max_rows, until=until, typed=typed)
            return to_table(list(batches), typed)

    def _proof_service(self) -> ProofService:
        with self._link_lock:
            if self._proofs is None:
                assert self._link is not None
                self._proofs = ProofService(
                    self.settings.database_url,
                    self._link,
                    _link_name(),
                    self.guard,
                    lease_seconds=self.settings.lease_seconds,
                )
            return self._proofs

    def groups(self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS) -> list[GroupRow]:
        """Every reader group of ``stream`` with its committed position, lag, idle time and
        whether it is stale (idle ``stale_after_ms`` or longer while holding retention back)."""
        return drive(plan_groups(self, stream, stale_after_ms))

    def group_streams(self, group: str) -> list[str]:
        """The streams ``group`` has committed on (sorted; empty for an unknown group)."""
        return drive(plan_group_streams(self, group))

    def delete_group(self, stream: str, group: str) -> bool:
        """Forget ``group`` on ``stream`` (its readers start over from their own start
        position); True if it existed. A group holds retention back until deleted."""
        return drive(plan_delete_group(self, stream, group))

    def prune_writers(self, stream: str, older_than_ms: int) -> list[str]:
        """Delete rows of writers of ``stream`` retired longer ago than ``older_than_ms``."""
        return drive(plan_prune_writers(self, stream, older_than_ms))

    def replication_keys(self) -> list[dict[str, object]]:
        """The keys that sign the ranges readers take from Redis, newest first (never their
        secrets): ``id``, ``created_at``, ``retired_at``, ``live``."""
        return drive(plan_replication_keys(self))

    def rotate_replication_keys(self) -> int:
        """Add a replication key and retire every other one (after a seed may have leaked:
        see `streams.core.signing`); returns the new key's id. With Redis, a ``KEYS`` line
        then tells every reader and prover to read the keys again at once (the others pick it
        up within `streams.core.signing.KEY_REFRESH` seconds). Needs the right to write the
        key tables (the owner's, or the prover role's)."""
        new = drive(plan_rotate_replication_keys(self))
        if self.settings.redis_url is not None:
            announce_keys(self.settings.redis_url, self.settings.prefix, new)
        return new

    def set_retention(self, stream: str, retention_ms: int | None) -> StreamInfo:
        """Keep the facts of ``stream`` for ``retention_ms`` (None: forever); see `prune`."""
        return drive(plan_set_retention(self, stream, retention_ms))

    def set_key_window(self, stream: str, key_window_ms: int) -> StreamInfo:
        """Name appends of ``stream`` by their idempotency keys for ``key_window_ms`` (for
        every key, at once: `streams.store.idempotency`)."""
        return drive(plan_set_key_window(self, stream, key_window_ms))

    def prune(self, stream: str, *, batch: int = PRUNE_BATCH) -> PruneResult:
        """Apply the retention of ``stream``: remove facts older than its ``retention_ms``, in
        short transactions of about ``batch`` rows, never past its complete position or a
        reader group's committed position (``streams prune``; run it on a schedule, or
        ``streams prune --every``). A reader that needs removed facts gets `FactsPruned`.
        Idempotency keys older than the stream's key window are removed too."""
        return drive(plan_prune(self, stream, batch))

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

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientBase[psycopg.AsyncConnection[Any]]):
    """The asyncio twin of `Client`."""

    #: As `Client.guard`.
    guard: Guard

    def __init__(
        self, settings: Settings, conn: psycopg.AsyncConnection[Any], guard: Guard | None = None
    ) -> None:
        # As in `Client`, re-opened when broken; it starts with the connection `open` checked
        # the schema on, as asyncio services rarely run one process per reader.
        super().__init__(settings, conn, guard or Guard())
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
            self._link = self._new_link(AsyncRedisLink, self.settings.redis_url)
        return self._link

    @classmethod
    async def open(cls, settings: Settings) -> AsyncClient:
        guard = Guard()
        conn = await sessions.aconnect(
            settings.database_url,
            autocommit=False,
            connect_timeout=settings.connect_timeout,
            purpose="client",
            opening=functools.partial(checked, guard),
        )
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
        """The asyncio twin of `Client.create_stream`."""
        plan = plan_create_stream(
            self, name, timestamping, uncapped, retention_ms, fact_tables, key_window_ms
        )
        return await adrive(plan)

    async def create_streams(
        self, streams: Sequence[StreamSpec | str | Mapping[str, Any]], *, exist_ok: bool = True
    ) -> list[Created]:
        """The asyncio twin of `Client.create_streams`."""
        return await adrive(plan_create_streams(self, streams, exist_ok))

    async def drop_streams(self, names: Sequence[str]) -> list[str]:
        """The asyncio twin of `Client.drop_streams`."""
        return await adrive(plan_drop_streams(self, names))

    async def set_fact_tables(self, name: str, fact_tables: Sequence[FactTableSpec]) -> StreamInfo:
        """The asyncio twin of `Client.set_fact_tables`."""
        return await adrive(plan_set_fact_tables(self, name, fact_tables))

    async def stream(self, name: str) -> StreamInfo:
        return await adrive(plan_stream(self, name))

    async def streams(self) -> list[StreamInfo]:
        return await adrive(plan_streams(self))

    async def positions(
        self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS
    ) -> StreamPositions:
        """See `Client.positions`."""
        return await adrive(plan_positions(self, stream, stale_after_ms))

    async def overview(
        self,
        like: str | None = None,
        *,
        limit: int | None = None,
        sort: Sort = "name",
        stale_after_ms: int = STALE_AFTER_MS,
        grouped: bool = False,
    ) -> Overview:
        """The asyncio twin of `Client.overview`."""
        return await adrive(plan_overview(self, like, limit, sort, stale_after_ms, grouped))

    async def writer(self, stream: str, *, instance: str | None = None) -> AsyncWriter:
        writer = await AsyncWriter.open(
            self.settings.database_url,
            self._writer_core(stream, instance),
            self.link,
            connect_timeout=self.settings.connect_timeout,
        )
        self.writers.add(writer)
        return writer

    async def reader(
        self,
        streams: str | Sequence[str] | None = None,
        *,
        pattern: str | None = None,
        start: Start = "earliest",
        group: str | None = None,
        page_size: int | None = None,
        poll_interval: float | None = None,
    ) -> AsyncReader:
        """The asyncio twin of `Client.reader` (``pattern`` included)."""
        reader = await AsyncReader.open(
            self.settings.database_url,
            self._reader_core(streams, start, group, page_size, pattern),
            self.link,
            poll_interval=poll_interval,
            connect_timeout=self.settings.connect_timeout,
            read_database_url=self.settings.read_database_url,
            standby=self._standby_route(),
        )
        self.readers.add(reader)
        return reader

    async def read_arrow(
        self,
        stream: str,
        *,
        start: Start = "earliest",
        end: int | None = None,
        max_rows: int | None = None,
        schema: pa.Schema | str | None = None,
        mode: str = "PERMISSIVE",
        corrupt_column: str = "_corrupt_record",
    ) -> pa.Table:
        """The asyncio twin of `Client.read_arrow`."""
        from .arrow import areader_batches, bounds, to_table, typing_of
        from .store.arrow_reads import require_arrow

        require_arrow("AsyncClient.read_arrow()")
        typed = typing_of(schema, mode, corrupt_column)
        until = bounds(stream, end)
        reader = await AsyncReader.open(
            self.settings.database_url,
            self._reader_core(stream, start, None, None),
            None,
            connect_timeout=self.settings.connect_timeout,
        )
        try:
            batches = [
                b
                async for b in areader_batches(reader, max_rows=max_rows, until=until, typed=typed)
            ]
        finally:
            await reader.aclose()
        return to_table(batches, typed)

    async def groups(self, stream: str, *, stale_after_ms: int = STALE_AFTER_MS) -> list[GroupRow]:
        """See `Client.groups`."""
        return await adrive(plan_groups(self, stream, stale_after_ms))

    async def group_streams(self, group: str) -> list[str]:
        """See `Client.group_streams`."""
        return await adrive(plan_group_streams(self, group))

    async def delete_group(self, stream: str, group: str) -> bool:
        return await adrive(plan_delete_group(self, stream, group))

    async def replication_keys(self) -> list[dict[str, object]]:
        """See `Client.replication_keys`."""
        return await adrive(plan_replication_keys(self))

    async def rotate_replication_keys(self) -> int:
        """See `Client.rotate_replication_keys`."""
        new = await adrive(plan_rotate_replication_keys(self))
        if self.settings.redis_url is not None:
            await asyncio.to_thread(
                announce_keys, self.settings.redis_url, self.settings.prefix, new
            )
        return new

    async def set_retention(self, stream: str, retention_ms: int | None) -> StreamInfo:
        """See `Client.set_retention`."""
        return await adrive(plan_set_retention(self, stream, retention_ms))

    async def set_key_window(self, stream: str, key_window_ms: int) -> StreamInfo:
        """See `Client.set_key_window`."""
        return await adrive(plan_set_key_window(self, stream, key_window_ms))

    async def prune(self, stream: str, *, batch: int = PRUNE_BATCH) -> PruneResult:
        """See `Client.prune`."""
        return await adrive(plan_prune(self, stream, batch))

    async def prune_writers(self, stream: str, older_than_ms: int) -> list[str]:
        return await adrive(plan_prune_writers(self, stream, older_than_ms))

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()
            self._link = None
        async with self._conn_lock:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _configured(database_url: str | None, redis_url: str | None) -> tuple[str | None, str | None]:
    """The URLs given, else the environment's, else those of `streams up`'s servers."""
    if database_url:
        return database_url, redis_url
    from .devservers.background import with_running_servers

    return with_running_servers(database_url, redis_url)


def connect(
    database_url: str | None = None,
    redis_url: str | None = None,
    prefix: str | None = None,
    **options: Any,
) -> Client:
    """Open a `Client`; URLs default to ``STREAMS_DATABASE_URL`` / ``STREAMS_REDIS_URL``, else
    to the servers ``streams up`` keeps running for the working directory or a parent of it.

    Options: ``max_payload_bytes`` (default 1 MiB), ``lease_seconds`` (default 10),
    ``shared_proofs`` (default ``STREAMS_SHARED_PROOFS`` or off; see `Client.reader`),
    ``connect_timeout``: seconds opening a PostgreSQL connection (this client's, and those of
    its readers and writers) waits for a server that is starting, restarting or refusing
    connections (default ``STREAMS_CONNECT_TIMEOUT`` or 30: `streams.store.sessions`).
    ``read_database_url`` (default ``STREAMS_READ_DATABASE_URL``): a hot standby where readers
    read their rows, behind the fence (`streams.core.standby_fence`; proofs and group commits stay
    on the primary); ``standby_max_wait`` (default ``STREAMS_STANDBY_MAX_WAIT`` or 5): seconds
    a reader waits for that standby, behind or down, before it reads from the primary.
    """
    database_url, redis_url = _configured(database_url, redis_url)
    return Client(Settings.resolve(database_url, redis_url, prefix, **options))


async def aconnect(
    database_url: str | None = None,
    redis_url: str | None = None,
    prefix: str | None = None,
    **options: Any,
) -> AsyncClient:
    """Open an `AsyncClient` (see `connect`)."""
    database_url, redis_url = _configured(database_url, redis_url)
    return await AsyncClient.open(Settings.resolve(database_url, redis_url, prefix, **options))
