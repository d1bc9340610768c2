"""The executors' side of the Spark source: one `RangePartition` read as Arrow record batches.

Everything a task needs comes from the pickled `RangePartition` (the driver plans it:
`streams_spark.source`). What a task runs, and in which order, is the store's plan
`streams.store.reads.read_range` (through `streams.connector`): it checks that the session is on
the database history the driver planned in, probes (three statements), reads the rows in a
later statement, then checks retention in a later one still. So the range it reads is complete
*now*, not only when the driver planned it: a database restored to an older state in between
(the range's end above what PostgreSQL proves) is the ``failOnDataLoss`` case here too. Why
that order is the proof is written there, once; this module only drives the plan over ADBC,
which returns Arrow record batches (its connection, retries, the Arrow conversion and the
prefetch are this module's), and says what ``failOnDataLoss`` makes of a stream that went
backwards or of facts retention removed. The running-maximum timestamp is computed with
pyarrow (or in SQL, ``timestampIn=sql``). A partition of one fact costs about 2 ms this way
(four of the six statements are checks), beside about 150 ms for a whole micro-batch
(`streams bench spark`): not worth weakening the order the probe argument rests on.

With the ``schema`` option each record batch's payload column becomes the schema's typed
columns here, on the executor (`_typed`, by `streams.core.typed_payloads`: one logic with the
Python reader's ``batches(schema=...)``), before Spark sees the rows.

Costs of a Python worker that are not the rows' own (measured with ``streams bench spark``):
Spark's worker runs a full garbage collection after every task, which walks every object the
imports made (about 116,000: 60-170 ms of CPU per task on the development machine) unless
they are frozen (`freeze_imports`); and ADBC's default 16 MiB record batches are mapped fresh
for each batch (`BATCH_BYTES`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from streams import redact_url
from streams.connector import (
    READER_SESSION_SETUP,
    PayloadSchema,
    RangeGen,
    StandbyRoute,
    backoff_delay,
    failfast_message,
    read_range,
    registry_has,
    statement_timeout_setup,
    typed_columns,
    with_client_tcp_settings,
)
from streams.core.fact_columns import (
    FACT_COLUMNS,
    INSTANCE,
    PAYLOAD,
    ROW_NO,
    STREAM,
    STREAM_ID,
    TIMESTAMP,
)
from streams.errors import (
    ConnectionLost,
    FactsPruned,
    MalformedPayload,
    StandbyBehind,
    StoreError,
)
from streams.store.arrow_reads import run_on_adbc, transient

from .options import DEFAULT_STATEMENT_TIMEOUT, EPOCH_UPPER, RETRY_CAP

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["RETRY_SECONDS", "SCHEMA", "RangePartition", "StreamWentBackwards", "read_partition"]

log = logging.getLogger("streams.spark")

#: Seconds a driver statement or an executor read keeps being tried while it fails with
#: transient errors (`streams.store.driver.transient_sqlstate`), with back-off between tries.
RETRY_SECONDS = 60.0

#: Default of `RangePartition.statement_timeout_ms`.
DEFAULT_TIMEOUT_MS = round(DEFAULT_STATEMENT_TIMEOUT * 1000)

#: The rows of the source. The Arrow schema the executors produce is derived from it
#: (`arrow_schema`), so the two cannot disagree.
_SPARK_TYPES = {
    "string": StringType(),
    "int64": LongType(),
    "int32": IntegerType(),
    "timestamp": TimestampType(),
}
SCHEMA = StructType(
    [StructField(c.exposed, _SPARK_TYPES[c.kind]) for c in FACT_COLUMNS]
    + [StructField(EPOCH_UPPER, LongType())]
)


def source_schema(typed: PayloadSchema | None = None) -> StructType:
    """The source's rows: `SCHEMA`, or with a payload schema (option ``schema``) `SCHEMA`
    without ``payload`` followed by the schema's fields (all nullable, as Spark's JSON reader
    makes them), the corrupt-record column among them if the schema names it."""
    if typed is None:
        return SCHEMA
    from pyspark.sql.pandas.types import from_arrow_type

    own = [f for f in SCHEMA.fields if f.name != PAYLOAD.exposed]
    return StructType(own + [StructField(f.name, from_arrow_type(f.type)) for f in typed.schema])


@functools.cache
def arrow_schema(typed: PayloadSchema | None = None) -> pa.Schema:
    """`source_schema` as Arrow (timestamps as UTC microseconds), as Spark converts it."""
    from pyspark.sql.pandas.types import to_arrow_schema

    schema: pa.Schema = to_arrow_schema(source_schema(typed), timezone="UTC")
    return schema


class StreamWentBackwards(StoreError):
    """A stream's complete position is below the query's (sequence rewound, database restored
    from an older backup): the ``failOnDataLoss`` case."""


def went_backwards(stream: str, position: int, complete: int, *, strict: bool) -> str:
    """The message for `StreamWentBackwards` (and the warning with ``failOnDataLoss=false``)."""
    message = (
        f"stream {stream!r} went backwards: this query has read through {position}, but "
        f"PostgreSQL proves only {complete} complete (sequence rewound or database restored "
        "from an older backup)"
    )
    if strict:
        message += (
            "; set failOnDataLoss=false to continue from the query's position (facts re-issued "
            "at or below it are then skipped)"
        )
    return message


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
    #: Retention removed facts this partition needed, or the range is no longer complete: fail
    #: the task (else log a warning and read what is there).
    fail_on_data_loss: bool = True
    #: Every statement of the task is cancelled after this long (and tried again).
    statement_timeout_ms: int = DEFAULT_TIMEOUT_MS
    #: Read the next record batches in a thread while Spark takes this one.
    prefetch: bool = True
    #: The database history the driver planned in (`streams.core.incarnation`): a session on
    #: another one fails the task with `streams.DatabaseChanged` (None: not checked).
    incarnation: str | None = None
    #: A hot standby to read the range on (``readDatabaseUrl``), once it has replayed past
    #: ``proof_lsn`` (the LSN of the driver's probe that proved the range): the store's
    #: `read_range` with ``proof_lsn``. None: read on ``database_url``.
    read_database_url: str | None = None
    proof_lsn: int = 0
    #: Seconds to wait for the standby (behind, unreachable) before reading on the primary.
    standby_max_wait: float = 5.0
    #: Typed columns from the payload instead of ``payload`` (option ``schema``): `_typed`.
    payload_schema: PayloadSchema | None = None
    #: A stream of a ``streamPattern`` query: dropped before or while the task reads it, its
    #: facts are gone with it, and the task ends with what it read (`_dropped`).
    by_pattern: bool = False

    def __repr__(self) -> str:
        return (
            f"RangePartition({self.stream!r}, ({self.after}, {self.through}], "
            f"floor={self.ts_floor}, db={redact_url(self.database_url)!r})"
        )


#: The size of the Arrow record batches ADBC builds (a hint; its default is 16 MiB): about 9,000
#: rows of a 200-byte fact, near Spark's own Arrow batches (10,000 rows). Buffers this size are
#: reused by the allocator instead of being mapped fresh for every batch: ADBC's CPU per row was
#: 10% lower, its page faults per 500,000 rows 25,000 -> 1,000 (measured).
BATCH_BYTES = 2 << 20

_frozen = False


def freeze_imports() -> bool:
    """Once per Spark Python worker (not in a driver or a test process): move every object alive
    now out of the cyclic garbage collector's reach (`gc.freeze`). Spark's worker collects
    garbage after every task (``pyspark.daemon``), and a full collection walks every object the
    imports of PySpark, pyarrow, ADBC and ``streams`` made, on every task; frozen, it walks only
    what later tasks create. What is frozen lives as long as the worker anyway (modules, classes,
    the cached connection); Spark collected after the previous task, so little garbage is frozen
    with it. Returns True when it froze."""
    global _frozen
    if _frozen:
        return False
    from pyspark import TaskContext

    if TaskContext.get() is None:
        return False
    _frozen = True
    gc.freeze()
    return True


# ADBC connections cannot be pickled; one per Python worker process and setting, reused across
# tasks (measured faster than one per task). Workers run one task at a time.
_ADBC: dict[tuple[str, int], Any] = {}
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


def _adbc_connection(
    url: str, fresh: bool = False, statement_timeout_ms: int = DEFAULT_TIMEOUT_MS
) -> Any:
    """This worker's ADBC connection to ``url`` (a new session if ``fresh``), with the readers'
    session settings and the statement timeout; `ConnectionLost` if it cannot be had.

    A session replacing one that failed (a failover, a restart, a cut) is opened on the failed
    one's ADBC database (``adbc_clone``): one libpq connection, as for psycopg. Opening a
    database takes two, the first to read the server's catalog for ADBC's type map (``pg_type``
    and every row of ``pg_attribute``, 38 a stream): 0.1 s at a few streams, 1.4 s at 1,000,
    twice ``connect_timeout`` behind a dead first host of a multi-host URL; every executor paid
    it after a failover before its first read there. The map outlives the server it was read
    on: the source's statements return built-in types only, whose OIDs are the same anywhere.
    """
    import adbc_driver_postgresql.dbapi as adbc

    key = (url, statement_timeout_ms)
    with _ADBC_LOCK:
        old = _ADBC.get(key)
        if old is not None and not fresh:
            return old
        setup = (*READER_SESSION_SETUP, statement_timeout_setup(statement_timeout_ms))
        conn = None
        try:
            if old is None:
                conn = adbc.connect(with_client_tcp_settings(url), autocommit=True)
            else:
                conn = old.adbc_clone()
                # A clone is opened in a transaction (DB-API's default); the readers' sessions
                # commit each statement by itself.
                conn.adbc_connection.set_autocommit(True)
            with conn.cursor() as cur:
                for statement in setup:
                    cur.execute(statement)
        except Exception as exc:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            # The failed session stays: the next try opens a new one on its database.
            raise ConnectionLost(
                f"cannot connect to {redact_url(url)} with ADBC: {type(exc).__name__}"
            ) from None
        if old is not None:
            try:
                old.close()  # the database lives on in the new session
            except Exception:
                log.debug("closing a stale ADBC connection failed", exc_info=True)
        _ADBC[key] = conn
        return conn


def _convert(
    batch: pa.RecordBatch, part: RangePartition, floor: int, stream_col: pa.Array | None
) -> tuple[pa.RecordBatch, int]:
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    ts = batch.column(TIMESTAMP.stored)
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
    row_no = batch.column(ROW_NO.stored)
    if row_no.type != pa.int32():
        row_no = row_no.cast(pa.int32())
    payload = batch.column(PAYLOAD.stored)
    if payload.type != pa.string():
        payload = payload.cast(pa.string())
    columns = {
        STREAM.exposed: stream_col,
        STREAM_ID.exposed: batch.column(STREAM_ID.stored).cast(pa.int64()),
        ROW_NO.exposed: row_no,
        INSTANCE.exposed: batch.column(INSTANCE.stored).cast(pa.string()),
        TIMESTAMP.exposed: stamps,
        PAYLOAD.exposed: payload,
        EPOCH_UPPER: pc.fill_null(pa.nulls(n, pa.int64()), part.epoch_upper),
    }
    if part.payload_schema is not None:
        return _typed(columns, part, part.payload_schema), floor
    schema = arrow_schema()
    return pa.RecordBatch.from_arrays(
        [columns[name] for name in schema.names], schema=schema
    ), floor


def _typed(
    columns: dict[str, pa.Array], part: RangePartition, spec: PayloadSchema
) -> pa.RecordBatch:
    """The rows with the payload's typed columns instead of ``payload``, bad rows as the mode
    says (`streams.core.typed_payloads`): FAILFAST fails the task, naming the row."""
    import pyarrow as pa

    typed = typed_columns(columns[PAYLOAD.exposed], spec)
    if typed.bad and spec.mode == "FAILFAST":
        row = min(typed.bad)
        stream_id = columns[STREAM_ID.exposed][row].as_py()
        row_no = columns[ROW_NO.exposed][row].as_py()
        raise MalformedPayload(
            failfast_message(part.stream, stream_id, row_no, typed.bad[row]),
            part.stream, stream_id, row_no,
        )  # fmt: skip
    schema = arrow_schema(spec)
    own = [columns[f.name] for f in SCHEMA.fields if f.name != PAYLOAD.exposed]
    fields = schema.types[len(own) :]
    arrays = own + [
        a.cast(t) if a.type != t else a for a, t in zip(typed.arrays, fields, strict=True)
    ]
    out = pa.RecordBatch.from_arrays(arrays, schema=schema)
    if typed.bad and spec.mode == "DROPMALFORMED":
        out = out.filter(typed.keep(out.num_rows))
    return out


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


def _plan(
    part: RangePartition, floor: int, resume: tuple[int, int] | None, standby: bool = False
) -> RangeGen[list[Any]]:
    """The store's plan for this partition (`streams.store.reads.read_range`), with what
    ``failOnDataLoss`` makes of a range no longer complete (`StreamWentBackwards`, or a warning
    and the read stops at what is complete) and of facts retention removed before they were
    read (`FactsPruned`, or a warning)."""

    def backwards(complete: int) -> None:
        if part.fail_on_data_loss:
            raise StreamWentBackwards(
                went_backwards(part.stream, part.through, complete, strict=True)
            )
        log.warning(
            "%s; failOnDataLoss=false: reading up to %d",
            went_backwards(part.stream, part.through, complete, strict=False), complete,
        )  # fmt: skip

    def lost(pruned: FactsPruned) -> None:
        if part.fail_on_data_loss:
            raise with_hint(pruned)
        log.warning("%s; failOnDataLoss=false: continuing without them", pruned)

    return read_range(
        part.stream,
        part.stream_key,
        part.after,
        part.through,
        incarnation=part.incarnation,
        who="Spark task",
        running_ts_floor=floor if part.timestamp_in == "sql" else None,
        resume_after=resume,
        went_backwards=backwards,
        lost=lost,
        proof_lsn=part.proof_lsn if standby else None,
        planned_lsn=part.proof_lsn or None,
    )


def _dropped(part: RangePartition) -> bool:
    """Was the partition's stream dropped (its registry id gone)? False if that cannot be
    told (the task's error stands then)."""
    cur = None
    try:
        cur = _adbc_connection(part.database_url, False, part.statement_timeout_ms).cursor()
        plan = run_on_adbc(cur, registry_has(part.stream_key), _no_rows, batch_bytes=BATCH_BYTES)
        while True:
            next(plan)
    except StopIteration as stop:
        return not stop.value
    except Exception:
        log.debug("cannot tell whether stream %s was dropped", part.stream, exc_info=True)
        return False
    finally:
        if cur is not None:
            with contextlib.suppress(Exception):
                cur.close()


def _no_rows(cur: Any) -> Iterator[Any]:
    return iter(())


def with_hint(lost: FactsPruned) -> FactsPruned:
    lost.args = (f"{lost}; or set failOnDataLoss=false to continue without them",)
    return lost


@dataclass
class _Progress:
    """How far a partition's read got, across its tries."""

    #: The running timestamp maximum through the last row handed out.
    floor: int
    #: (stream ID, row) of the last row handed out.
    resume: tuple[int, int] | None = None
    #: Failures in a row (reset by every record batch handed out).
    failures: int = 0


def _drive(
    cur: Any, part: RangePartition, progress: _Progress, standby: bool = False
) -> Iterator[pa.RecordBatch]:
    """Drive the store's plan (`_plan`) on an ADBC cursor, by the store's Arrow read path
    (`streams.store.arrow_reads.run_on_adbc`): the `StreamRows` statement's record batches
    handed to Spark as the source's (`_convert`), ``progress`` kept with every batch."""

    def rows(cur: Any) -> Iterator[pa.RecordBatch]:
        reader = cur.fetch_record_batch()
        return _prefetched(reader) if part.prefetch else iter(reader)

    plan = _plan(part, progress.floor, progress.resume, standby)
    stream_col = None
    # Closed when left: stops and joins the prefetch thread before the cursor closes.
    with contextlib.closing(run_on_adbc(cur, plan, rows, batch_bytes=BATCH_BYTES)) as batches:
        for batch in batches:
            out, floor = _convert(batch, part, progress.floor, stream_col)
            if batch.num_rows:
                last = batch.num_rows - 1
                progress.resume = (
                    int(batch.column(STREAM_ID.stored)[last].as_py()),
                    int(batch.column(ROW_NO.stored)[last].as_py()),
                )
            progress.floor, stream_col = floor, out.column(STREAM.exposed)
            progress.failures = 0
            yield out


def _wait_for_standby(route: StandbyRoute, exc: Exception, part: RangePartition) -> None:
    """The standby could not serve the read (behind the proof, another timeline, down): pause
    and look again, or (after ``standby_max_wait``) read from the primary from now on."""
    pause = route.failed(time.monotonic(), exc)
    if pause is None:
        log.warning(
            "reading stream %s (%d, %d] on the primary: %s",
            part.stream, part.after, part.through, exc,
        )  # fmt: skip
    else:
        time.sleep(pause)


def read_partition(part: RangePartition) -> Iterator[pa.RecordBatch]:
    """The rows of one partition as Arrow record batches in (stream ID, row) order (executors):
    the store's plan driven over ADBC (`_drive`).

    A read that fails transiently (a stale cached connection, a restarted server, a network
    failure, a cancelled statement) goes on from the row after the last one handed to Spark, on
    a fresh connection and in a new plan (which checks and probes again), for as long as the
    failures last no more than `RETRY_SECONDS` in a row: the range is complete, so its rows
    are the same on every read (`streams.store.rows.range_rows_sql`), and no row is handed
    twice.
    """

    if part.through <= part.after:
        return
    progress = _Progress(part.ts_floor)
    failing_since = 0.0
    # With a read URL: on the standby behind the fence, waiting for it as a Python reader does
    # (`streams.connector.StandbyRoute`), then on the primary for the rest of this task.
    route = None
    if part.read_database_url is not None:
        route = StandbyRoute(max_wait=part.standby_max_wait, retry_after=math.inf)
    stale_standby = False  # a failed standby session: open a fresh one
    while True:
        cur = None
        standby = route is not None and route.use_standby(time.monotonic())
        url = part.read_database_url if standby and part.read_database_url else part.database_url
        fresh = progress.failures > 0 or (standby and stale_standby)
        try:
            conn = _adbc_connection(url, fresh, part.statement_timeout_ms)
            freeze_imports()  # after the first connection: ADBC's modules are loaded
            cur = conn.cursor()
            yield from _drive(cur, part, progress, standby)
            if route is not None and standby:
                route.read_on_standby()
            return
        except Exception as exc:  # not FactsPruned, StreamWentBackwards: no outage
            if part.by_pattern and not transient(exc) and _dropped(part):
                log.info("stream %s was dropped: its partition ends here", part.stream)
                return
            if standby and route is not None and (isinstance(exc, StandbyBehind) or transient(exc)):
                stale_standby = not isinstance(exc, StandbyBehind)
                _wait_for_standby(route, exc, part)
                continue
            if not transient(exc):
                raise
            now = time.monotonic()
            if progress.failures == 0:
                failing_since = now
            elif now - failing_since >= RETRY_SECONDS:
                raise StoreError(
                    f"reading stream {part.stream!r} ({part.after}, {part.through}] failed for "
                    f"{RETRY_SECONDS:g}s: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None
            if progress.failures:  # the first retry is at once: a stale cached one is common
                time.sleep(
                    backoff_delay(progress.failures - 1, cap=RETRY_CAP, jitter=random.random())
                )
            progress.failures += 1
            log.info("reading stream %s failed (%s); going on", part.stream, type(exc).__name__)
        finally:
            if cur is not None:
                with contextlib.suppress(Exception):
                    cur.close()
