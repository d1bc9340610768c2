"""The ``streams`` Spark data source: micro-batches that are epochs, read as Arrow batches.

Theory of operation
===================

Driver (one `StreamsStreamReader` per query, in Spark's long-lived Python planner process):

* ``initialOffset`` resolves where a new query starts with the Python reader's own logic
  (`streams.store.reading.ReaderCore.open`: a group's committed position, earliest, latest, an ID, a
  time), or takes a given frontier JSON as is.
* ``latestOffset(start, limit)`` returns, per stream, at most the position PostgreSQL proved
  complete (`streams.store.probe.probe`): every ID ``<=`` it has completed, so a fact that commits
  later always has a higher ID and can never be skipped. ``maxFactsPerTrigger`` cuts the range
  after the N-th *fact* (`streams.store.rows.count_facts`; gaps and extra rows do not count);
  ``minFactsPerTrigger`` returns ``start`` (no batch) until N facts are there or
  ``maxTriggerDelay`` passed. Spark calls this in a tight loop: the source probes only when a
  Redis hint arrived since the last probe, or once per poll interval (1 s while the Redis link
  is up, 0.1 s without; option ``pollInterval``); otherwise it answers from the last probe.
* ``partitions(start, end)`` cuts every stream's epoch ``(start, end]`` at stream IDs into
  ranges of about equal row counts (`streams.store.rows.split_range`), each carrying the running
  maximum timestamp at its start (`streams.store.rows.ts_floor_at`). Same offsets, same
  partitions: a batch replayed after a crash reads exactly the same facts.
* ``commit(end)`` records ``end`` as the reader group (`streams.store.groups.commit_group`,
  forward-only, so Spark repeating the last commit after a restart is harmless).

Executors run `read_partition`: everything comes from the pickled `RangePartition`; the query
text comes from `streams.store.rows.range_rows_sql`; ADBC returns Arrow record batches, the running
maximum timestamp is computed with pyarrow (or in SQL, ``timestampIn=sql``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from streams.client import default_instance_name
from streams.config import redact_url
from streams.core.replication import backoff_delay
from streams.core.stalls import HeldStreams
from streams.errors import ConfigurationError, ConnectionLost, FactsPruned, StoreError
from streams.store import connect, driver, groups, reading, registry, rows, writers
from streams.store import probe as store_probe
from streams.transport.link import RedisLink

from .offsets import frontier_offset, positions_of, since_of
from .options import Position, SourceOptions, parse_options

if TYPE_CHECKING:
    import pyarrow as pa

    from streams.core.replication import Hint
    from streams.store.registry import StreamInfo


#: Seconds the driver keeps trying a statement while PostgreSQL cannot be reached.
RETRY_SECONDS = 60.0

__all__ = [
    "SCHEMA",
    "RangePartition",
    "StreamsBatchReader",
    "StreamsDataSource",
    "StreamsStreamReader",
    "read_partition",
]

log = logging.getLogger("streams.spark")

SCHEMA = StructType(
    [
        StructField("stream", StringType()),
        StructField("stream_id", LongType()),
        StructField("row_no", IntegerType()),
        StructField("instance", StringType()),
        StructField("timestamp", TimestampType()),
        StructField("payload", StringType()),
        StructField("epoch_upper", LongType()),
    ]
)

#: Seconds between probes while the Redis link is up / without it (the Python reader's).
LIVE_POLL_INTERVAL = 1.0
FALLBACK_POLL_INTERVAL = 0.1


class StreamsDataSource(DataSource):
    """``spark.readStream.format("streams")`` / ``spark.read.format("streams")``."""

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        # Checked here, when the query is defined: one clear error, never one from an executor.
        self.config: SourceOptions = parse_options(dict(options))

    @classmethod
    def name(cls) -> str:
        return "streams"

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        bad = [
            name
            for name, value in (
                ("maxFactsPerTrigger", self.config.max_facts),
                ("minFactsPerTrigger", self.config.min_facts),
            )
            if value is not None
        ]
        if bad:
            raise ConfigurationError(
                f"option {bad[0]} applies to streaming reads (spark.readStream) only"
            )
        return StreamsBatchReader(self.config)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if self.config.end is not None:
            raise ConfigurationError(
                "option endingPosition applies to batch reads (spark.read) only; a streaming "
                "query with an end is trigger(availableNow=True)"
            )
        return StreamsStreamReader(self.config)


# ------------------------------------------------------------------------------ partitions


@dataclass(frozen=True)
class RangePartition(InputPartition):
    """Every row of the facts of ``stream`` in ``(after, through]``, for one Spark task."""

    stream: str
    stream_key: int
    after: int
    through: int
    #: The running maximum timestamp at ``after`` (ms).
    ts_floor: int
    #: The batch's end position on this stream (the ``epoch_upper`` column).
    epoch_upper: int
    database_url: str
    timestamp_in: str = "arrow"
    #: A query started by time: drop facts whose running-maximum timestamp is earlier (ms).
    since_ms: int | None = None
    #: Retention removed facts this partition needed: fail the task (else log a warning).
    fail_on_data_loss: bool = True

    def __repr__(self) -> str:
        return (
            f"RangePartition({self.stream!r}, ({self.after}, {self.through}], "
            f"floor={self.ts_floor}, db={redact_url(self.database_url)!r})"
        )


# ADBC connections cannot be pickled; one per Python worker process, reused across tasks
# (measured faster than one per task). Workers run one task at a time.
_ADBC: dict[str, Any] = {}
_ADBC_LOCK = threading.Lock()


def _close_adbc_connections() -> None:
    """At exit, while the driver manager still exists (its ``__del__`` fails at interpreter
    shutdown, noisily, when a cached connection is collected that late)."""
    with _ADBC_LOCK:
        for conn in _ADBC.values():
            with contextlib.suppress(Exception):
                conn.close()
        _ADBC.clear()


atexit.register(_close_adbc_connections)


def _adbc_connection(url: str, fresh: bool = False) -> Any:
    import adbc_driver_postgresql.dbapi as adbc

    with _ADBC_LOCK:
        conn = _ADBC.pop(url, None)
        if conn is not None and fresh:
            try:
                conn.close()
            except Exception:
                log.debug("closing a stale ADBC connection failed", exc_info=True)
            conn = None
        if conn is None:
            try:
                conn = adbc.connect(connect.with_client_tcp_settings(url), autocommit=True)
                with conn.cursor() as cur:
                    for statement in store_probe.READER_SESSION_SETUP:
                        cur.execute(statement)
            except Exception as exc:
                raise StoreError(
                    f"cannot connect to {redact_url(url)} with ADBC: {type(exc).__name__}"
                ) from None
        _ADBC[url] = conn
        return conn


def _convert(
    batch: pa.RecordBatch, part: RangePartition, floor: int, stream_col: pa.Array | None
) -> tuple[pa.RecordBatch, int]:
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    ts = batch.column(3)
    if ts.type != pa.int64():
        ts = ts.cast(pa.int64())
    if part.timestamp_in == "arrow":
        ts = pc.max_element_wise(pc.cumulative_max(ts), pa.scalar(floor, pa.int64()))
    if n:
        floor = max(floor, int(ts[n - 1].as_py()))
    if part.since_ms is not None and n:
        keep = pc.greater_equal(ts, pa.scalar(part.since_ms, pa.int64()))
        if not pc.all(keep).as_py():
            batch, ts = batch.filter(keep), ts.filter(keep)
            n = batch.num_rows
    stamps = pc.multiply(ts, pa.scalar(1000, pa.int64())).cast(pa.timestamp("us", tz="UTC"))
    if stream_col is None or len(stream_col) != n:
        stream_col = pc.fill_null(pa.nulls(n, pa.string()), part.stream)
    row_no = batch.column(1)
    if row_no.type != pa.int32():
        row_no = row_no.cast(pa.int32())
    payload = batch.column(4)
    if payload.type != pa.string():
        payload = payload.cast(pa.string())
    out = pa.RecordBatch.from_arrays(
        [
            stream_col,
            batch.column(0).cast(pa.int64()),
            row_no,
            batch.column(2).cast(pa.string()),
            stamps,
            payload,
            pc.fill_null(pa.nulls(n, pa.int64()), part.epoch_upper),
        ],
        schema=_ARROW_SCHEMA(),
    )
    return out, floor


_SCHEMA_CACHE: list[Any] = []


def _ARROW_SCHEMA() -> pa.Schema:
    if not _SCHEMA_CACHE:
        import pyarrow as pa

        _SCHEMA_CACHE.append(
            pa.schema(
                [
                    ("stream", pa.string()),
                    ("stream_id", pa.int64()),
                    ("row_no", pa.int32()),
                    ("instance", pa.string()),
                    ("timestamp", pa.timestamp("us", tz="UTC")),
                    ("payload", pa.string()),
                    ("epoch_upper", pa.int64()),
                ]
            )
        )
    schema: pa.Schema = _SCHEMA_CACHE[0]
    return schema


_PREFETCH = os.environ.get("STREAMS_SPARK_PREFETCH", "1") != "0"


def _prefetched(reader: Iterator[pa.RecordBatch], depth: int = 2) -> Iterator[pa.RecordBatch]:
    """Read the next record batches from PostgreSQL in a thread while Spark ships this one
    (ADBC releases the GIL while it reads)."""
    import queue

    slots: queue.Queue[Any] = queue.Queue(depth)
    done = object()
    stop = threading.Event()

    def pump() -> None:
        try:
            for batch in reader:
                while not stop.is_set():
                    try:
                        slots.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put(done)
        except BaseException as exc:  # handed to the consumer
            slots.put(exc)

    thread = threading.Thread(target=pump, name="streams-adbc-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _check_retained(cur: Any, part: RangePartition) -> None:
    """After the rows (a later statement: see "retention" in `streams.store`): did retention
    remove facts of this partition before they were read?"""

    cur.execute(rows.pruned_through_sql(part.stream_key))
    row = cur.fetchone()
    pruned = int(row[0]) if row else 0
    if pruned > part.after:
        lost = FactsPruned(part.stream, part.after, pruned)
        if part.fail_on_data_loss:
            raise _with_hint(lost)
        log.warning("%s; failOnDataLoss=false: continuing without them", lost)


def _with_hint(lost: FactsPruned) -> FactsPruned:
    lost.args = (f"{lost}; or set failOnDataLoss=false to continue without them",)
    return lost


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading over ADBC raises when the connection or the server fails (a statement
    error, such as a missing table, is a ``ProgrammingError``: no retry mends it)."""
    import adbc_driver_manager

    return (adbc_driver_manager.OperationalError, OSError)


def read_partition(part: RangePartition) -> Iterator[pa.RecordBatch]:
    """The rows of one partition as Arrow record batches in (stream ID, row) order (executors).

    A read that fails (a stale cached connection, a restarted server, a network failure) goes on
    from the row after the last one handed to Spark, on a fresh connection, for as long as the
    failures last no more than `RETRY_SECONDS` in a row: the range is complete, so its rows are
    the same on every read (`streams.store.rows.range_rows_sql`), and no row is handed twice.
    """

    if part.through <= part.after:
        return
    retryable: tuple[type[BaseException], ...] = (*_read_errors(), StoreError)
    floor = part.ts_floor  # the running timestamp maximum through the last row handed out
    resume: tuple[int, int] | None = None  # (stream ID, row) of the last row handed out
    failures = 0
    failing_since = 0.0
    while True:
        cur = None
        try:
            conn = _adbc_connection(part.database_url, fresh=failures > 0)
            query = rows.range_rows_sql(
                part.stream_key,
                part.after,
                part.through,
                running_ts_floor=floor if part.timestamp_in == "sql" else None,
                resume_after=resume,
            )
            cur = conn.cursor()
            cur.execute(query)
            stream_col = None
            reader = cur.fetch_record_batch()
            batches = _prefetched(reader) if _PREFETCH else iter(reader)
            try:
                for batch in batches:
                    out, next_floor = _convert(batch, part, floor, stream_col)
                    if batch.num_rows:
                        last = batch.num_rows - 1
                        resume = (
                            int(batch.column(0)[last].as_py()),
                            int(batch.column(1)[last].as_py()),
                        )
                    floor, stream_col = next_floor, out.column(0)
                    failures = 0
                    yield out
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()  # stops and joins the prefetch thread before the cursor closes
            _check_retained(cur, part)
            return
        except retryable as exc:  # not FactsPruned: retention is no outage
            now = time.monotonic()
            if failures == 0:
                failing_since = now
            elif now - failing_since >= RETRY_SECONDS:
                raise StoreError(
                    f"reading stream {part.stream!r} ({part.after}, {part.through}] failed for "
                    f"{RETRY_SECONDS:g}s: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None
            if failures:  # the first retry is at once: a stale cached connection is common
                time.sleep(backoff_delay(failures - 1, jitter=random.random()))
            failures += 1
            log.info("reading stream %s failed (%s); going on", part.stream, type(exc).__name__)
        finally:
            if cur is not None:
                with contextlib.suppress(Exception):
                    cur.close()


# ------------------------------------------------------------------------------ the driver


class _Driver:
    """Driver-side state shared by the stream and batch readers: a lazy psycopg connection."""

    def __init__(self, config: SourceOptions) -> None:
        self.config = config
        self._conn: psycopg.Connection[Any] | None = None
        self._infos: dict[str, StreamInfo] = {}
        self._held = HeldStreams()

    def __getstate__(self) -> dict[str, Any]:
        # Spark pickles a fresh reader to ship read() to executors: never a connection.
        state = dict(self.__dict__)
        for key in list(state):
            if key in ("_conn", "_link", "_lock", "_hinted"):
                state[key] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            # The readers' own session (streams.store.probe.READER_SESSION_SETUP): the probe's
            # argument needs READ COMMITTED whatever the server's default.
            try:
                conn = connect.connect(
                    self.config.database_url, autocommit=True, purpose="Spark source"
                )
            except StoreError as exc:
                if self._infos:  # it was reachable: an outage, which `run` waits out
                    raise ConnectionLost(str(exc)) from None
                raise
            try:
                for statement in store_probe.READER_SESSION_SETUP:
                    conn.execute(statement)
            except psycopg.Error as exc:
                conn.close()
                raise StoreError(f"Spark source session setup failed: {exc}") from None
            self._conn = conn
        return self._conn

    def run(self, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)`` (a store generator) on the driver's connection. If the connection
        breaks (a restart, a network failure), it is run again from the start on a new one, for
        up to `RETRY_SECONDS`: each is a read, or forward-only (a group commit), so running it
        twice is harmless, and Spark does not fail the query for a passing outage."""
        deadline = time.monotonic() + RETRY_SECONDS
        attempt = 0
        while True:
            try:
                return driver.run(self._connection(), make(*args))
            except ConnectionLost as lost:
                delay = backoff_delay(attempt, jitter=random.random())
                if time.monotonic() + delay >= deadline:
                    raise
                if attempt == 0:
                    log.warning("streams source lost PostgreSQL (%s); trying again", lost)
                attempt += 1
                self._conn = None
                time.sleep(delay)
            except StoreError:
                if self._conn is not None and (self._conn.broken or self._conn.closed):
                    self._conn = None
                raise

    def infos(self) -> dict[str, StreamInfo]:
        if not self._infos:
            loaded = self.run(registry.load_streams, list(self.config.streams))
            self._infos = {info.name: info for info in loaded}
        return self._infos

    def probe(self) -> dict[str, int]:
        """What PostgreSQL proves complete, per stream; a stream held back for a while by an
        expired writer gets that writer's sessions ended (`streams.store.writers`)."""
        infos = self.infos()
        found = self.run(store_probe.probe, [infos[n] for n in self.config.streams])
        observed = [(n, found[n].complete, found[n].max_allocated) for n in self.config.streams]
        self.run(writers.retire_where_held, infos, self._held, time.monotonic(), observed)
        return {n: found[n].complete for n in self.config.streams}

    def resolve(
        self, where: Position, complete: dict[str, int], *, start: bool = True
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Positions for a start or an end, and the start times in force (see
        `streams_spark.offsets`). For a start, an explicit ``group``'s committed position wins
        over the option, stream by stream, as for Python readers."""

        names = self.config.streams
        committed: dict[str, int] = {}
        if start and self.config.group_explicit:
            infos = self.infos()
            for n in names:
                found = self.run(groups.group_position, infos[n], self.config.group)
                if found is not None:
                    committed[n] = int(found[0])
        if committed:
            committed = self.retained(committed)
        rest = [n for n in names if n not in committed]
        if not rest:
            return committed, {}
        if where.kind == "frontier":
            return self.retained({**{n: int(where.frontier[n]) for n in rest}, **committed}), {}
        if where.kind == "latest":
            return {**{n: complete[n] for n in rest}, **committed}, {}

        begin: Any
        if where.kind == "earliest":
            begin = "earliest"
        elif where.kind == "id":
            begin = where.id
        elif where.kind == "timestamp":
            begin = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
                milliseconds=where.timestamp_ms
            )
        else:
            begin = dt.timedelta(seconds=where.ago_seconds)
        core = reading.ReaderCore(rest, start=begin)
        try:
            self.run(core.open)
        except FactsPruned as lost:  # startingPosition below what retention kept
            self.lost_facts(lost)
            core = reading.ReaderCore(rest, start="earliest")
            self.run(core.open)
        positions = {**{n: int(core.positions[n]) for n in rest}, **committed}
        # The reader core resolved the time on the database's clock: keep exactly its filter.
        return positions, core.start_times()

    def lost_facts(self, lost: FactsPruned) -> None:
        """Retention removed facts this query needed: fail (``failOnDataLoss``, the default),
        or say so and go on."""
        if self.config.fail_on_data_loss:
            raise _with_hint(lost) from None
        log.warning("%s; failOnDataLoss=false: continuing after them", lost)

    def retained(self, positions: dict[str, int]) -> dict[str, int]:
        """``positions``, each raised to what retention kept (`lost_facts` for any below)."""

        infos = self.infos()
        pruned = self.run(rows.pruned_positions, [infos[n] for n in positions])
        for name, position in positions.items():
            if pruned[name] > position:
                self.lost_facts(FactsPruned(name, position, pruned[name]))
        return {n: max(p, pruned[n]) for n, p in positions.items()}

    def plan(
        self, lower: dict[str, int], upper: dict[str, int], since: dict[str, int] | None = None
    ) -> list[RangePartition]:
        """Partitions of every stream's ``(lower, upper]`` (deterministic for complete ranges);
        ``since``: start times still in force, by stream."""

        infos = self.infos()
        parts: list[RangePartition] = []
        for name in self.config.streams:
            after, through = lower[name], upper[name]
            if through <= after:
                continue
            info = infos[name]
            cuts = self.run(rows.split_range, info, after, through, self.config.partitions)
            bounds = [after, *cuts, through]
            for low, high in itertools.pairwise(bounds):
                parts.append(
                    RangePartition(
                        stream=name,
                        stream_key=info.id,
                        after=low,
                        through=high,
                        ts_floor=int(self.run(rows.ts_floor_at, info, low)),
                        epoch_upper=through,
                        database_url=self.config.database_url,
                        timestamp_in=self.config.timestamp_in,
                        since_ms=(since or {}).get(name),
                        fail_on_data_loss=self.config.fail_on_data_loss,
                    )
                )
        return parts

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class StreamsBatchReader(_Driver, DataSourceReader):
    """``spark.read.format("streams")``: facts in (startingPosition, endingPosition]."""

    def partitions(self) -> Sequence[InputPartition]:
        try:
            complete = self.probe()
            lower, since = self.resolve(self.config.start, complete)
            end = self.config.end or Position("latest")
            if end.kind == "id":
                upper = {n: end.id for n in self.config.streams}
            else:
                upper, _ = self.resolve(end, complete, start=False)
            for name in self.config.streams:
                if upper[name] > complete[name]:
                    log.warning(
                        "stream %r: endingPosition %d is beyond the complete position %d; "
                        "reading up to %d",
                        name, upper[name], complete[name], complete[name],
                    )  # fmt: skip
                    upper[name] = complete[name]
                upper[name] = max(upper[name], lower[name])
            parts = self.plan(lower, upper, since)
        finally:
            self.close()
        return parts or [_EMPTY]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, RangePartition):
            yield from read_partition(partition)


class _Empty(InputPartition):
    def __init__(self) -> None:
        super().__init__(None)


_EMPTY = _Empty()


class StreamsStreamReader(_Driver, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("streams")``: one micro-batch = one epoch of every stream."""

    def __init__(self, config: SourceOptions) -> None:
        super().__init__(config)
        self._complete: dict[str, int] = {}
        self._last_probe = 0.0
        self._probed = False
        self._hinted: threading.Event | None = None
        self._link: Any = None
        self._link_up = False
        self._target: dict[str, int] | None = None
        self._last_batch = time.monotonic()
        self._found: dict[str, int] = {}
        self.probes = 0

    # ------------------------------------------------------------------ Redis (lazy)

    def _follow_redis(self) -> None:
        if self._hinted is None:
            self._hinted = threading.Event()
        if self._link is not None or self.config.redis_url is None:
            return

        try:
            self._link = RedisLink(
                self.config.redis_url, self.config.prefix, f"spark-{default_instance_name()}"
            )
            self._link.add_listener(self, self.config.streams)
            # It may have connected before we listened: take its state now (as readers do).
            self._link_up = bool(self._link.connected)
        except Exception:
            log.warning("cannot follow Redis; polling PostgreSQL instead", exc_info=True)
            self._link = None

    def on_hint(self, hint: Hint) -> None:
        wanted = hint.stream in self._complete and hint.token > self._complete[hint.stream]
        if wanted and self._hinted is not None:
            self._hinted.set()

    def on_link_state(self, connected: bool) -> None:
        self._link_up = connected
        if self._hinted is not None:
            self._hinted.set()  # reconcile with PostgreSQL at the next call

    def _interval(self) -> float:
        if self.config.poll_interval is not None:
            return self.config.poll_interval
        return LIVE_POLL_INTERVAL if self._link_up else FALLBACK_POLL_INTERVAL

    def _refresh(self, force: bool = False) -> dict[str, int]:
        """The complete positions, probing only when a hint came or the interval passed."""
        self._follow_redis()
        assert self._hinted is not None
        now = time.monotonic()
        due = now - self._last_probe >= self._interval()
        if force or not self._probed or due or self._hinted.is_set():
            self._hinted.clear()
            self._last_probe = now
            found = self.probe()
            self.probes += 1
            self._probed = True
            for name, complete in found.items():
                self._complete[name] = max(self._complete.get(name, 0), complete)
            self._found = found
        return dict(self._complete)

    # ------------------------------------------------------------------ offsets

    def initialOffset(self) -> dict[str, Any]:
        complete = self._refresh(force=True)
        start, since = self.resolve(self.config.start, complete)
        log.info("streams source starts at %s (group %s)", start, self.config.group)
        return frontier_offset(start, since)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.config.max_facts is not None:
            return ReadMaxRows(self.config.max_facts)
        if self.config.min_facts is not None:
            return ReadMinRows(self.config.min_facts)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._refresh(force=True)

    def _check_loss(self, start: dict[str, int], found: dict[str, int]) -> dict[str, int]:
        """A query position above what PostgreSQL proves complete means the stream went
        backwards (sequence rewound, database restored): fail, or warn and wait there."""
        for name, position in start.items():
            if position > found[name]:
                message = (
                    f"stream {name!r} went backwards: this query has read through {position}, "
                    f"but PostgreSQL proves only {found[name]} complete (sequence rewound or "
                    "database restored from an older backup)"
                )
                if self.config.fail_on_data_loss:
                    raise StoreError(
                        message + "; set failOnDataLoss=false to continue from the query's "
                        "position (facts re-issued at or below it are then skipped)"
                    )
                log.warning("%s; failOnDataLoss=false: continuing from %d", message, position)
        return found

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        names = self.config.streams
        lower, since = positions_of(start, names), since_of(start, names)
        had_probes = self.probes
        complete = self._refresh()
        if self.probes != had_probes:
            self._check_loss(lower, self._found)
            self.retained(lower)  # retention passed this query (its group was deleted)
        upper = {n: max(lower[n], complete[n]) for n in names}
        if self._target is not None:
            upper = {n: max(lower[n], min(upper[n], self._target[n])) for n in names}
        use_options = not (
            isinstance(limit, ReadAllAvailable)
            and not isinstance(self.getDefaultReadLimit(), ReadAllAvailable)
        )
        max_facts = None
        if isinstance(limit, ReadMaxRows):
            max_facts = limit.max_rows
        elif use_options:
            max_facts = self.config.max_facts
        min_facts = self.config.min_facts if use_options and self._target is None else None
        waiting = time.monotonic() - self._last_batch < self.config.max_trigger_delay
        if min_facts is not None and waiting and any(upper[n] > lower[n] for n in names):
            have = self._count(lower, upper, min_facts)
            if sum(c for c, _ in have.values()) < min_facts:
                return frontier_offset(lower, since)
        if max_facts is not None and any(upper[n] > lower[n] for n in names):
            upper = self._admit(lower, upper, max_facts)
        if upper != lower:
            self._last_batch = time.monotonic()
        return frontier_offset(upper, self._since_after(since, lower, upper))

    def _since_after(
        self, since: dict[str, int], lower: dict[str, int], upper: dict[str, int]
    ) -> dict[str, int]:
        """The start times still in force after ``(lower, upper]``: a stream's is dropped
        once the batch holds a fact at or after it (every later fact's timestamp is then
        at least as late)."""

        infos = self.infos()
        return {
            n: ms
            for n, ms in since.items()
            if upper[n] <= lower[n]
            or self.run(rows.first_fact_since, infos[n], ms, lower[n], upper[n]) is None
        }

    def _count(
        self, lower: dict[str, int], upper: dict[str, int], limit: int
    ) -> dict[str, tuple[int, int]]:

        infos = self.infos()
        return {
            n: self.run(rows.count_facts, infos[n], lower[n], upper[n], limit)
            if upper[n] > lower[n]
            else (0, lower[n])
            for n in self.config.streams
        }

    def _admit(self, lower: dict[str, int], upper: dict[str, int], budget: int) -> dict[str, int]:
        """At most ``budget`` facts over all streams, shared in proportion to what each has
        (the rounding remainder first to streams that would get none, so none starves)."""

        have = self._count(lower, upper, budget)
        total = sum(c for c, _ in have.values())
        result = dict(upper)
        if total <= budget:
            for n, (count, _last) in have.items():
                if count == budget:  # exactly budget facts seen: there may be more beyond
                    result[n] = _last
            return result
        shares = {n: budget * c // total for n, (c, _) in have.items()}
        spare = budget - sum(shares.values())
        # The rounding remainder goes first to streams that got nothing, so none starves.
        for n in sorted(have, key=lambda n: (shares[n] > 0, n)):
            if spare <= 0:
                break
            if shares[n] < have[n][0]:
                shares[n] += 1
                spare -= 1
        infos = self.infos()
        for n, (count, last) in have.items():
            share = shares[n]
            if count == 0:
                result[n] = upper[n]
            elif share == 0:
                result[n] = lower[n]
            elif share == count:
                result[n] = upper[n] if count < budget else last
            else:
                _, result[n] = self.run(rows.count_facts, infos[n], lower[n], upper[n], share)
        return result

    def reportLatestOffset(self) -> dict[str, Any] | None:
        if not self._complete:
            return None
        return frontier_offset(self._complete)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        names = self.config.streams
        lower, upper = positions_of(start, names), positions_of(end, names)
        if lower == upper:
            return []
        parts = self.plan(lower, upper, since_of(start, names))
        return parts or [
            RangePartition(
                stream=names[0],
                stream_key=0,
                after=0,
                through=0,
                ts_floor=0,
                epoch_upper=0,
                database_url=self.config.database_url,
            )
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(partition)

    def commit(self, end: dict[str, Any]) -> None:

        positions = positions_of(end, self.config.streams)
        infos = self.infos()
        commits = [
            (infos[name], position, self.run(rows.ts_floor_at, infos[name], position))
            for name, position in positions.items()
        ]
        self.run(groups.commit_group, self.config.group, commits)

    def stop(self) -> None:
        if self._link is not None:
            try:
                self._link.remove_listener(self, self.config.streams)
                self._link.close()
            except Exception:
                log.debug("closing the Redis link failed", exc_info=True)
            self._link = None
        self.close()
