"""The ``streams`` Spark sink: ``df.write.format("streams")`` and ``df.writeStream.format(...)``.

Theory of operation
===================

A Spark **task** writes one partition of one write (a batch job, or one micro-batch of a
streaming query). It reads its rows as Arrow record batches, makes each row a payload (JSON
text; `streams_spark.sink_options.plan_columns` says which columns) and, with a ``keyColumn``,
groups rows sharing a key into one multi-row fact (`group_rows`). It holds them in memory and
only then opens a writer and one transaction, so the transaction (which holds the stream's
linear position back while it is open) lasts as long as PostgreSQL needs to store the rows, not
as long as Spark needs to compute them.

The task writes as its own writer instance, ``<instancePrefix>-<partition id>`` (a `Writer`,
registered when the task starts and retired when it ends, so no live writer row of it holds the
linear position back afterwards; a task killed outright leaves its row to its lease, which every
other writer and reader retires). In that writer's one transaction it claims its task key
(`streams.store.sinks.claim_task`: query, batch, partition) and appends its facts
(`streams.store.writer_core.WriterCore.append_facts`), and commits both together. Why no row is
written twice, by a retried task, a speculative copy, a replayed micro-batch, and why a failed
task leaves nothing (its reserved IDs complete as gaps), is "the exactly-once argument" in
`streams.store.sinks`. The query id and batch id come from Spark's task-local properties for
streaming writes; a batch job draws a random query id on the driver (batch 0).

On the driver, Spark's ``commit`` of a micro-batch (or of a batch job) runs
`streams.store.sinks.commit_batch`: the batch's task commits go, and so do queries idle for
longer than ``commitRetention``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from streams import Writer
from streams.config import DEFAULT_MAX_PAYLOAD_BYTES
from streams.connector import (
    BatchCommit,
    FactChunk,
    TaskKey,
    WriterCore,
    claim_task,
    commit_batch,
    encode_payload,
    load_stream,
    open_session,
    run,
)
from streams.errors import CommitUnknown, ConfigurationError, ConnectionLost, PayloadTooLarge

from . import source
from .sink_options import (
    ColumnPlan,
    SinkOptions,
    chunked,
    group_rows,
    parse_sink_options,
    plan_columns,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from streams import StreamInfo
    from streams.connector import Gen

__all__ = [
    "ROWS_PER_CHUNK",
    "SinkMessage",
    "StreamsBatchWriter",
    "StreamsDataSource",
    "StreamsStreamWriter",
    "write_task",
]

log = logging.getLogger("streams.spark.sink")

#: Rows reserved and copied per statement of a task's transaction (each statement must fit in
#: the writer's lease, and so must the transaction as a whole: readers end a session that holds
#: a stream's reservation lock longer, "the holding argument" in docs/design/liveness.md).
ROWS_PER_CHUNK = 10_000

#: Spark's task-local properties that name a streaming query and its micro-batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"


class StreamsDataSource(source.StreamsDataSource):
    """``format("streams")`` for reads (`streams_spark.source`) and for writes (this module).

    Spark builds a data source from the options of a read or of a write and only then asks it
    for a reader or a writer, and the two take different options (a write's include Spark's own
    ``checkpointLocation``). So the source's checks run when Spark first asks for the schema or
    a reader (for a read that is when it is defined, ``load()``), the sink's when it asks for a
    writer (``save()``, ``start()``).
    """

    def __init__(self, options: Any) -> None:
        DataSource.__init__(self, options)
        self._read_checked = False

    def _as_source(self) -> None:
        if not self._read_checked:
            source.StreamsDataSource.__init__(self, self.options)
            self._read_checked = True

    def schema(self) -> StructType:
        self._as_source()
        return super().schema()

    def reader(self, schema: StructType) -> DataSourceReader:
        self._as_source()
        return super().reader(schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        self._as_source()
        return super().streamReader(schema)

    def writer(self, schema: StructType, overwrite: bool) -> StreamsBatchWriter:
        options, plan = _prepare(self.options, schema, overwrite)
        return StreamsBatchWriter(options, plan, f"batch-{uuid.uuid4().hex}")

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamsStreamWriter:
        options, plan = _prepare(self.options, schema, overwrite)
        return StreamsStreamWriter(options, plan)


def _prepare(raw: Any, schema: StructType, overwrite: bool) -> tuple[SinkOptions, ColumnPlan]:
    """Check a write's options and columns, and that its stream exists (on the driver)."""
    if overwrite:
        raise ConfigurationError(
            "format 'streams' only appends (facts are never rewritten): use mode('append')"
        )
    options = parse_sink_options(dict(raw))
    plan = plan_columns(options, schema)
    with open_session(options.database_url, autocommit=True, purpose="Spark sink") as conn:
        run(conn, load_stream(options.stream))  # UnknownStream if it is not
    return options, plan


# ------------------------------------------------------------------------------ rows to facts


def _json_type(kind: pa.DataType) -> pa.DataType:
    """The Arrow type whose Python values are JSON's: times, dates and decimals as text."""
    import pyarrow as pa

    types = pa.types
    if types.is_timestamp(kind) or types.is_date(kind) or types.is_time(kind):
        return pa.string()
    if types.is_decimal(kind):
        return pa.string()  # exact, where a float would round
    if types.is_struct(kind):
        return pa.struct([pa.field(f.name, _json_type(f.type)) for f in kind])
    if types.is_list(kind):
        return pa.list_(_json_type(kind.value_type))
    if types.is_large_list(kind):
        return pa.large_list(_json_type(kind.value_type))
    if types.is_map(kind):
        return pa.map_(_json_type(kind.key_type), _json_type(kind.item_type))
    return kind


def _json_values(column: pa.Array) -> list[Any]:
    wanted = _json_type(column.type)
    if wanted != column.type:
        column = column.cast(wanted)
    values: list[Any] = column.to_pylist(maps_as_pydicts="strict")
    return values


def _text_payload(text: str | None, limit: int) -> str:
    """A string payload column's value: JSON text, stored as it is (PostgreSQL checks it)."""
    if text is None:
        return "null"
    if len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise PayloadTooLarge(len(text.encode("utf-8", "surrogatepass")), limit)
    return text


def payload_texts(batch: pa.RecordBatch, plan: ColumnPlan, limit: int) -> list[str]:
    """Each row's payload as JSON text: built by Arrow when every payload column is of a flat
    type (`_arrow_json`; ~6x faster), else value by value in Python (`encode_payload`). Both
    give the same JSON (`tests/unit/test_spark_sink_options.py`)."""
    import pyarrow as pa

    fast = _arrow_texts(batch, plan, limit)
    if fast is not None:
        return fast
    if plan.payload_index is not None:
        column = batch.column(plan.payload_index)
        if plan.payload_is_text:
            return [_text_payload(v, limit) for v in column.to_pylist()]
        return [encode_payload(v, limit) for v in _json_values(column)]
    assert plan.payload_object is not None
    struct = pa.StructArray.from_arrays(
        [batch.column(i) for _, i in plan.payload_object],
        names=[name for name, _ in plan.payload_object],
    )
    return [encode_payload(v, limit) for v in _json_values(struct)]


def _arrow_texts(batch: pa.RecordBatch, plan: ColumnPlan, limit: int) -> list[str] | None:
    """The payloads as JSON text built column-wise by Arrow, or None (then Python does it)."""
    import pyarrow.compute as pc

    if plan.payload_index is not None:
        column = batch.column(plan.payload_index)
        if plan.payload_is_text:
            texts = pc.fill_null(column, "null")
        else:
            texts = _arrow_json(column)
            if texts is None:
                return None
    else:
        assert plan.payload_object is not None
        parts: list[Any] = []
        for n, (name, index) in enumerate(plan.payload_object):
            value = _arrow_json(batch.column(index))
            if value is None:
                return None
            # The separators and keys as encode_payload writes them: {"a":1,"b":"x"}.
            parts += [("{" if n == 0 else ",") + encode_payload(name, limit) + ":", value]
        texts = pc.binary_join_element_wise(*parts, "}", "")
    if len(texts) and pc.max(pc.binary_length(texts)).as_py() > limit:
        return None  # Python's path names the size
    result: list[str] = texts.to_pylist()
    return result


def _arrow_json(column: pa.Array) -> pa.Array | None:
    """JSON text of each value of a flat column (null: ``null``), exactly as
    `encode_payload` writes it (floats: the same number), or None for other types, for a
    string with a control character (Python escapes those) and for a float that is not finite
    (Python refuses those)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    types = pa.types
    if types.is_large_string(kind):  # Spark's large variable types: join needs one kind
        try:
            column, kind = column.cast(pa.string()), pa.string()
        except pa.ArrowInvalid:  # over 2 GiB of text: Python's path
            return None
    if types.is_string(kind):
        if pc.any(pc.match_substring_regex(column, r"[\x00-\x1f]")).as_py():
            return None
        escaped = pc.replace_substring(pc.replace_substring(column, "\\", "\\\\"), '"', '\\"')
        text = pc.binary_join_element_wise('"', escaped, '"', "")
    elif types.is_integer(kind) or types.is_boolean(kind):
        text = column.cast(pa.string())
    elif types.is_floating(kind):
        wide = column.cast(pa.float64())
        if pc.any(pc.invert(pc.is_finite(wide))).as_py():
            return None
        text = wide.cast(pa.string())
        # Arrow writes 3.0 as "3": keep it a float for JSON readers, as Python writes it.
        plain = pc.invert(pc.match_substring_regex(text, "[.e]"))
        text = pc.if_else(plain, pc.binary_join_element_wise(text, ".0", ""), text)
    else:
        return None
    return pc.fill_null(text, "null")


_PER_MS = {"s": 0.001, "ms": 1, "us": 1000, "ns": 1_000_000}


def timestamps_ms(batch: pa.RecordBatch, plan: ColumnPlan) -> list[int | None]:
    """Each row's client timestamp in ms since the epoch (None: the arrival time)."""
    import pyarrow as pa

    if plan.timestamp_index is None:
        return [None] * batch.num_rows
    column = batch.column(plan.timestamp_index)
    if not plan.timestamp_is_time:
        return column.cast(pa.int64()).to_pylist()  # type: ignore[no-any-return]
    per_ms = _PER_MS[column.type.unit]
    raw: list[int | None] = column.cast(pa.int64()).to_pylist()
    if per_ms == 0.001:
        return [None if v is None else v * 1000 for v in raw]
    divisor = int(per_ms)
    return [None if v is None else v // divisor for v in raw]


def task_chunks(
    batches: Iterable[pa.RecordBatch], plan: ColumnPlan, limit: int
) -> tuple[list[FactChunk], int]:
    """A task's rows as chunks of facts (held in memory; see the module doc), and the rows."""
    texts: list[str] = []
    stamps: list[int | None] = []
    keys: list[Any] = []
    for batch in batches:
        if not batch.num_rows:
            continue
        texts.extend(payload_texts(batch, plan, limit))
        stamps.extend(timestamps_ms(batch, plan))
        if plan.key_index is not None:
            keys.extend(batch.column(plan.key_index).to_pylist())
    if plan.key_index is None:
        return chunked(texts, stamps, ROWS_PER_CHUNK), len(texts)
    facts, fact_stamps = group_rows(keys, texts, stamps)
    rows = [text for fact in facts for text in fact]
    return chunked(rows, fact_stamps, ROWS_PER_CHUNK, [len(f) for f in facts]), len(texts)


# ------------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class SinkMessage(WriterCommitMessage):
    """What one task did, sent back to the driver's ``commit``."""

    query_id: str
    batch_id: int
    partition_id: int
    rows: int
    facts: int
    #: False: nothing to write, or an earlier attempt (or Spark's commit of this batch) had.
    wrote: bool


def write_task(
    options: SinkOptions,
    plan: ColumnPlan,
    key: TaskKey,
    prefix: str,
    batches: Iterable[pa.RecordBatch],
) -> SinkMessage:
    """Write one task's rows (see the module doc); on an executor."""
    chunks, rows = task_chunks(batches, plan, DEFAULT_MAX_PAYLOAD_BYTES)
    if not chunks:  # most partitions of a small micro-batch: no writer, no transaction
        return SinkMessage(key.query_id, key.batch_id, key.partition_id, 0, 0, False)
    core = WriterCore(
        options.stream,
        f"{prefix}-{key.partition_id}",
        lease_seconds=options.lease_seconds,
        max_payload_bytes=DEFAULT_MAX_PAYLOAD_BYTES,
    )
    writer = Writer(options.database_url, core)
    try:
        for attempt in range(2):
            try:
                ack = writer.append_facts(chunks, first=_claim(writer.stream, key))
                break
            except (ConnectionLost, CommitUnknown) as exc:
                # Safe to try again even when the commit's outcome is unknown: if it did
                # commit, the claim finds its task commit and nothing is written twice.
                if attempt:
                    raise
                log.warning("sink task %s lost its connection (%s); once more", key, exc)
    finally:
        writer.close()  # retire: the task's writer holds nothing back once it ends
    facts = ack.count if ack is not None else 0
    return SinkMessage(key.query_id, key.batch_id, key.partition_id, rows, facts, ack is not None)


def _claim(info: StreamInfo, key: TaskKey) -> Gen[bool]:
    claimed = yield from claim_task(info, key)
    if not claimed:
        log.info("sink task %s was written before: nothing to write", key)
    return claimed


def _task_context() -> Any:
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        raise RuntimeError("the streams sink writes only inside a Spark task")
    return context


def _commit(options: SinkOptions, query_id: str, batch_id: int) -> BatchCommit:
    with open_session(options.database_url, autocommit=False, purpose="Spark sink") as conn:
        info = run(conn, load_stream(options.stream))
        conn.commit()
        return run(conn, commit_batch(info, query_id, batch_id, options.commit_retention))


def _summary(messages: Sequence[WriterCommitMessage | None]) -> tuple[int, int]:
    done = [m for m in messages if isinstance(m, SinkMessage)]
    return sum(m.facts for m in done), sum(m.rows for m in done if m.wrote)


class StreamsBatchWriter(DataSourceArrowWriter):
    """``df.write.format("streams")``: one task = one transaction; a job = sink query
    ``batch-<random>``, micro-batch 0."""

    def __init__(self, options: SinkOptions, plan: ColumnPlan, query_id: str) -> None:
        self.options, self.plan, self.query_id = options, plan, query_id

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkMessage:
        key = TaskKey(self.query_id, 0, int(_task_context().partitionId()))
        return write_task(self.options, self.plan, key, self.options.instance_prefix or "spark",
                          iterator)  # fmt: skip

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _commit(self.options, self.query_id, 0)
        facts, rows = _summary(messages)
        log.info("wrote %d facts (%d rows) to stream %r", facts, rows, self.options.stream)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        facts, _ = _summary(messages)
        log.warning(
            "write to stream %r failed: the tasks that committed wrote %d facts (each task's "
            "facts whole); the others wrote nothing",
            self.options.stream, facts,
        )  # fmt: skip


class StreamsStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("streams")``: exactly once per (query, micro-batch, partition)."""

    def __init__(self, options: SinkOptions, plan: ColumnPlan) -> None:
        self.options, self.plan = options, plan

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkMessage:
        context = _task_context()
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY)
        batch_id = context.getLocalProperty(BATCH_ID_PROPERTY)
        if not query_id or batch_id is None:
            raise RuntimeError("a streaming write's task has no query id or batch id")
        key = TaskKey(str(query_id), int(batch_id), int(context.partitionId()))
        prefix = self.options.instance_prefix or f"spark-{key.query_id.replace('-', '')[:12]}"
        return write_task(self.options, self.plan, key, prefix, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        ids = {m.query_id for m in messages if isinstance(m, SinkMessage)}
        if len(ids) > 1:
            raise RuntimeError(f"tasks of one micro-batch named different queries: {ids}")
        if ids:
            _commit(self.options, ids.pop(), batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        facts, _ = _summary(messages)
        log.warning(
            "micro-batch %d to stream %r failed: the tasks that committed wrote %d facts; a "
            "replay of the batch writes only the others",
            batchId, self.options.stream, facts,
        )  # fmt: skip
