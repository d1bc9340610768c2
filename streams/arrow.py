"""Arrow record batches for Python consumers: `Reader.batches`, `Client.read_arrow`.

A reader's facts as ``pyarrow.RecordBatch``es, with the columns and types of the Spark source's
rows (`streams_spark.executor.SCHEMA` without its ``epoch_upper``), `schema()`:

* ``stream`` (string): the stream's name;
* ``stream_id`` (int64): the fact's stream ID;
* ``row_no`` (int32): the row within its fact (0 for most facts);
* ``instance`` (string): the writer;
* ``timestamp`` (timestamp[us, tz=UTC]): raised to the stream's running maximum, as
  `streams.core.epochs.Fact.timestamp`;
* ``payload`` (string): the row's payload as JSON text.

With a payload schema (``schema=``, `typing_of`), the schema's fields, typed, take the place of
``payload`` (after ``timestamp``): parsed from it as Spark's JSON reader does, bad rows as the
``mode`` says (`streams.core.typed_payloads`, the logic the Spark source's ``schema`` option
uses too); FAILFAST raises `streams.MalformedPayload` for the first bad row, the batch
undelivered (the reader's position is then past it: reopen a group's reader to read it again).

Terms: a **batch** is one stream's part of an epoch: whole facts only (a fact's rows are never
split across two batches), in (stream ID, row) order, at most ``max_rows`` rows unless a single
fact has more (it is read alone, whole). When `Reader.batches` yields a batch, the reader's
position on its stream is already the batch's end: a group's ``commit()`` after it commits
through it, as after an epoch, and nothing before it is delivered again.

How it reads: the reader proves on its own psycopg session (`ReaderCore.step` without rows,
with its waiting for hints: `Reader.poll`), and reads the rows of what that proved on other
sessions, over ADBC, as Arrow columns (`streams.store.arrow_reads`: steps 3-4 of the read
sequence, `streams.store.reads`); where a page is cut into whole facts is decided on the
stream-ID column (`streams.core.page_cut`). A step reads consecutive spans of stream IDs at once
on the reader's ADBC sessions (`_read_stream`), and the next step's spans while the caller takes
this one's batches (a prefetch: `_Start`); a page is delivered only if the reader is where it
starts.
So the guarantees are the ones of `epochs`: each fact once, none beyond a proof, retention
checked after every page (`FactsPruned`), each session checked on the reader's database history
(`DatabaseChanged`), and a start by ``live`` or by time filtered as there
(`ReaderCore.advance_columns`). Signed ranges from Redis (facts already
built as objects) become batches too (`_epoch_batches`). The rows are read on the primary, also
for a client with a read URL (a standby is not used here yet).

The plan is written once over the kernel's steps (`streams.plans`): `_next_batch` returns the
next batch to deliver (None: done), its state between two (pages read, the prefetch) in a
`_Batches`; `reader_batches` and `areader_batches` run it once per batch with `drive` and
`adrive` (the asyncio one runs the ADBC reads in worker threads: ADBC blocks, and releases the
GIL while it reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .core.delivery import behind, deliverable
from .core.epochs import Epoch
from .core.fact_columns import (
    FACT_COLUMNS,
    INSTANCE,
    OWN_NAMES,
    PAYLOAD,
    ROW_NO,
    STREAM,
    STREAM_ID,
    TIMESTAMP,
    Kind,
)
from .core.page_cut import cut_page
from .errors import MalformedPayload, UsageError
from .plans import Blocking, Call, Io, Plan, adrive, drive
from .store.arrow_reads import ArrowSessions, require_arrow
from .store.reader_core import ReaderCore

if TYPE_CHECKING:
    import pyarrow as pa

    from .core.typed_payloads import PayloadSchema

__all__ = [
    "DEFAULT_MAX_ROWS",
    "areader_batches",
    "reader_batches",
    "schema",
    "typed_schema",
    "typing_of",
]

#: Rows per batch (and per page read) by default: large enough that a page's two statements
#: and its conversion cost little per row (at 65,536 rows of a 200-byte payload, a page is
#: about 16 MB of Arrow data).
DEFAULT_MAX_ROWS = 65_536


@functools.cache
def schema() -> pa.Schema:
    """The batches' Arrow schema (see the module doc; a function: pyarrow is imported only
    when Arrow is used)."""
    return pa_schema([(c.exposed, c.kind) for c in FACT_COLUMNS])


def pa_schema(columns: list[tuple[str, Kind]]) -> pa.Schema:
    """An Arrow schema of named columns of `streams.core.fact_columns` kinds (timestamps as UTC
    microseconds)."""
    import pyarrow as pa

    types = {
        "string": pa.string(),
        "int64": pa.int64(),
        "int32": pa.int32(),
        "timestamp": pa.timestamp("us", tz="UTC"),
    }
    return pa.schema([(name, types[kind]) for name, kind in columns])


#: The batches' columns besides ``payload``: a payload schema's field may not take their names.
OWN_COLUMNS = OWN_NAMES


def typing_of(
    payload: pa.Schema | str | None, mode: str = "PERMISSIVE", corrupt_column: str = ""
) -> PayloadSchema | None:
    """``schema``, ``mode`` and ``corrupt_column`` of `Reader.batches`, checked (`UsageError`);
    None without a schema. A string is a Spark DDL string or a ``StructType`` JSON."""
    if payload is None:
        if str(mode).upper() != "PERMISSIVE":
            raise UsageError("mode applies only with a schema")
        return None
    require_arrow("typed columns (schema=)")
    from .core.typed_payloads import (
        DEFAULT_CORRUPT_COLUMN,
        SchemaError,
        parse_schema_text,
        payload_schema,
    )

    try:
        fields = parse_schema_text(payload) if isinstance(payload, str) else payload
        return payload_schema(
            fields, mode, corrupt_column or DEFAULT_CORRUPT_COLUMN, reserved=OWN_COLUMNS
        )
    except SchemaError as exc:
        raise UsageError(str(exc)) from None


def typed_schema(typed: PayloadSchema | None) -> pa.Schema:
    """The batches' schema: `schema`, or with a payload schema its fields instead of
    ``payload``."""
    if typed is None:
        return schema()
    import pyarrow as pa

    own = [f for f in schema() if f.name != PAYLOAD.exposed]
    return pa.schema(own + list(typed.schema))


def _typed(batch: pa.RecordBatch, typed: PayloadSchema | None) -> pa.RecordBatch:
    """A batch with the payload's typed columns (`typing_of`), bad rows as the mode says."""
    if typed is None:
        return batch
    import pyarrow as pa

    from .core.typed_payloads import failfast_message, typed_columns

    found = typed_columns(batch.column(PAYLOAD.exposed), typed)
    if found.bad and typed.mode == "FAILFAST":
        row = min(found.bad)
        stream = batch.column(STREAM.exposed)[row].as_py()
        stream_id = batch.column(STREAM_ID.exposed)[row].as_py()
        row_no = batch.column(ROW_NO.exposed)[row].as_py()
        raise MalformedPayload(
            failfast_message(stream, stream_id, row_no, found.bad[row]), stream, stream_id, row_no
        )
    out = pa.RecordBatch.from_arrays(
        [batch.column(name) for name in OWN_NAMES] + found.arrays, schema=typed_schema(typed)
    )
    if found.bad and typed.mode == "DROPMALFORMED":
        out = out.filter(found.keep(out.num_rows))
    return out


@dataclass(frozen=True, slots=True)
class _Page:
    """One stream's page, read and cut to whole facts: its rows and where the stream goes."""

    name: str
    table: pa.Table
    #: The page holds the facts of ``(after, position]``.
    after: int
    position: int


@dataclass(frozen=True, slots=True)
class _Read:
    """A read of a page of every stream behind its target, after ``positions``
    (`_read_pages`). Two reads are the same read when their fields are equal: a prefetch is
    used only by the read it was started for."""

    positions: Mapping[str, int]
    until: Mapping[str, int] | None
    max_rows: int


@dataclass(slots=True)
class _Batches:
    """A reader's batches between two deliveries: the plan's state (`_next_batch`)."""

    reader: BatchSource | AsyncBatchSource
    idle_timeout: float
    until: Mapping[str, int] | None
    max_rows: int
    typed: PayloadSchema | None
    #: Pages read, each delivered (a batch) only while the reader is where it starts.
    pages: deque[_Page] = field(default_factory=deque)
    #: Batches of an epoch of signed ranges from Redis (facts already built as objects).
    ready: deque[pa.RecordBatch] = field(default_factory=deque)
    #: The read started ahead (`_Start`) and its future, until taken or settled.
    pending: tuple[_Read, Any] | None = None
    #: The prefetches' thread, synchronous world only (made by the first one).
    pool: ThreadPoolExecutor | None = None


def _start(state: _Batches, sessions: ArrowSessions, read: _Read) -> Future[list[_Page]]:
    if state.pool is None:
        state.pool = ThreadPoolExecutor(1, thread_name_prefix="streams-arrow-prefetch")
    return state.pool.submit(_read_pages, state.reader.core, sessions, read)


async def _astart(
    state: _Batches, sessions: ArrowSessions, read: _Read
) -> asyncio.Future[list[_Page]]:
    return asyncio.ensure_future(asyncio.to_thread(_read_pages, state.reader.core, sessions, read))


class _Start(Io):
    """Start ``read`` in the background (the state's thread, or a worker thread under
    asyncio); the result: its future, for `_Take` or `_Settle`."""

    def __init__(self, state: _Batches, sessions: ArrowSessions, read: _Read) -> None:
        super().__init__(_start, _astart, state, sessions, read)


def _result(future: Future[list[_Page]]) -> list[_Page]:
    return future.result()


async def _aresult(future: asyncio.Future[list[_Page]]) -> list[_Page]:
    return await asyncio.shield(future)  # a cancelled caller settles it (`_settle`)


class _Take(Io):
    """The pages a started read returns (or its error)."""

    def __init__(self, future: Any) -> None:
        super().__init__(_result, _aresult, future)


def _settled(future: Future[list[_Page]]) -> None:
    with contextlib.suppress(Exception):  # discarded with the pages
        future.result()


async def _asettled(future: asyncio.Future[list[_Page]]) -> None:
    # A cancelled caller still waits for the thread's read: it cannot be stopped, and the
    # session must not be closed under it.
    with contextlib.suppress(BaseException):
        await asyncio.shield(future)


class _Settle(Io):
    """Wait for a started read nobody will use, its error swallowed (the read that replaces
    it, if any, reports its own): a read is never left running on the sessions."""

    def __init__(self, future: Any) -> None:
        super().__init__(_settled, _asettled, future)


def _ends(
    core: ReaderCore, until: Mapping[str, int] | None, positions: Mapping[str, int] | None = None
) -> dict[str, int]:
    """What may be delivered after ``positions`` (the reader's), as every reader decides it."""
    return deliverable(
        core.positions if positions is None else positions, core.proven.targets, until
    )


def _behind(
    core: ReaderCore, until: Mapping[str, int] | None, positions: Mapping[str, int] | None = None
) -> bool:
    at = core.positions if positions is None else positions
    return behind(at, _ends(core, until, at))


def _next_batch(state: _Batches) -> Plan[pa.RecordBatch | None]:
    """The reader's next batch, or None when there is none: no batch arrived within
    ``idle_timeout`` seconds, or (with ``until``) its positions reached ``until`` (or what is
    complete, if less). The reader's position is the batch's end when it is returned."""
    core, until = state.reader.core, state.until
    while True:
        while state.ready:
            batch = _typed(state.ready.popleft(), state.typed)
            if batch.num_rows:  # DROPMALFORMED may have dropped every row
                return batch
        while state.pages:
            page = state.pages.popleft()
            if core.positions[page.name] != page.after:
                state.pages.clear()  # the reader moved meanwhile (an epoch by `poll`): read again
                break
            batch = _deliver(core, page)
            if batch.num_rows and (batch := _typed(batch, state.typed)).num_rows:
                return batch
        if _behind(core, until):
            pages = yield from _read(state, _Read(dict(core.positions), until, state.max_rows))
            # Read the next pages while the caller takes these: a read moves nothing, and the
            # next read uses them only if it starts where these end (`_Read` equality).
            ahead = {**core.positions, **{page.name: page.position for page in pages}}
            if _behind(core, until, ahead):
                yield from _settle(state)
                read = _Read(ahead, until, state.max_rows)
                future = yield _Start(state, state.reader.arrow_sessions(), read)
                state.pending = (read, future)
            # Every read of this step is done: from here on positions move, batch by batch.
            state.pages.extend(pages)
            continue
        if until is not None and all(core.positions[n] >= until[n] for n in core.names):
            return None
        epoch: Epoch | None = yield Call(state.reader.prove, state.idle_timeout)
        if epoch is not None:
            state.ready.extend(_epoch_batches(epoch))
        elif not _behind(core, until):
            return None


def _read(state: _Batches, read: _Read) -> Plan[list[_Page]]:
    """The pages of ``read``: the prefetch's if it is the same read, else read now."""
    if state.reader.closed:
        raise UsageError("reader is closed")
    taken = state.pending
    if taken is not None and taken[0] == read:
        # Pending until taken: a caller who leaves meanwhile still waits for it (`_settle`).
        pages: list[_Page] = yield _Take(taken[1])
        state.pending = None
        return pages
    yield from _settle(state)
    core, sessions = state.reader.core, state.reader.arrow_sessions()
    pages = yield Blocking(_read_pages, core, sessions, read)
    return pages


def _settle(state: _Batches) -> Plan[None]:
    """Wait for the prefetch, if any (`_Settle`)."""
    taken, state.pending = state.pending, None
    if taken is not None:
        yield _Settle(taken[1])


def _read_pages(core: ReaderCore, sessions: ArrowSessions, read: _Read) -> list[_Page]:
    """The next pages of each stream behind its target (up to ``read.until``) after
    ``read.positions``, cut to whole facts, in order; moves nothing (`_deliver` does)."""
    pages: list[_Page] = []
    ends = _ends(core, read.until, read.positions)
    for name in core.names:
        after, target = read.positions[name], ends[name]
        if after < target:
            pages += _read_stream(core, sessions, name, after, target, read.max_rows)
    return pages


def _read_stream(
    core: ReaderCore, sessions: ArrowSessions, name: str, after: int, target: int, max_rows: int
) -> list[_Page]:
    """Consecutive pages of ``name`` after ``after``, read at once on the sessions: the range
    is split at stream IDs into spans of ``max_rows - 1`` IDs (one session each), so a span of
    single-row facts fits one page whole (fewer rows than the limit: `cut_page` keeps them
    all). A span is a range of its own (steps 3-4, with its own retention check), and a page
    follows the one before it only if that one ended where its span did: after a page cut
    short (a span with more rows than a page), or a read that failed, the later spans are
    dropped, read again from where that page ended by the next step (a failed first read
    raises: `FactsPruned`, or after its retries `ConnectionLost`)."""
    key = core.infos[name].id
    span = max(1, max_rows - 1)
    ranges: list[tuple[int, int]] = []
    low = after
    while low < target and len(ranges) < len(sessions.sessions):
        ranges.append((low, min(target, low + span)))
        low = ranges[-1][1]
    pages: list[_Page] = []
    for (low, high), found in zip(
        ranges, sessions.read_many(name, key, ranges, max_rows), strict=True
    ):
        if isinstance(found, Exception):
            if not pages:
                raise found
            break
        table = found.combine_chunks()
        core.counters.pages += 1
        core.counters.rows += table.num_rows
        ids = table.column(STREAM_ID.stored).to_numpy()
        cut = cut_page(ids, after=low, through=high, limit=max_rows)
        if cut.refetch is not None:
            # One fact has at least a page of rows: read it alone, whole.
            table = sessions.read(name, key, cut.refetch - 1, cut.refetch, None).combine_chunks()
            core.counters.rows += table.num_rows
            pages.append(_Page(name, table, low, cut.refetch))
        else:
            pages.append(_Page(name, table.slice(0, cut.rows), low, cut.position))
        if pages[-1].position < high:
            break  # cut short: the next span does not follow it
    return pages


def _deliver(core: ReaderCore, page: _Page) -> pa.RecordBatch:
    """Move the page's stream to its position and make its batch (`schema`): timestamps
    raised to the running maximum, the ``live`` and time-start filters applied."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = page.table
    n = table.num_rows
    floor = core.ts_floors[page.name]
    ts = table.column(TIMESTAMP.stored)
    if ts.type != pa.int64():
        ts = ts.cast(pa.int64())
    if n:
        ts = pc.max_element_wise(pc.cumulative_max(ts), pa.scalar(floor, pa.int64()))
        floor = max(floor, ts[n - 1].as_py())
    ids = table.column(STREAM_ID.stored)
    keep = core.advance_columns(
        page.name, page.position, floor, ids.to_numpy(), ts.to_numpy()
    )  # fmt: skip
    stamps = pc.multiply(ts, pa.scalar(1000, pa.int64())).cast(pa.timestamp("us", tz="UTC"))
    columns = {
        STREAM.exposed: pa.repeat(pa.scalar(page.name, pa.string()), n),
        STREAM_ID.exposed: ids.cast(pa.int64()),
        ROW_NO.exposed: table.column(ROW_NO.stored).cast(pa.int32()),
        INSTANCE.exposed: table.column(INSTANCE.stored).cast(pa.string()),
        TIMESTAMP.exposed: stamps,
        PAYLOAD.exposed: _text(table.column(PAYLOAD.stored)),
    }
    out = schema()
    batch = pa.RecordBatch.from_arrays([_array(columns[name]) for name in out.names], schema=out)
    if keep is not None:
        batch = batch.filter(pa.array(keep, pa.bool_()))
    return batch


def _text(column: Any) -> Any:
    """The payload column as plain strings: the JSON extension type's storage (no copy)."""
    import pyarrow as pa

    if isinstance(column.type, pa.ExtensionType):
        storage = column.type.storage_type
        column = pa.chunked_array([chunk.storage for chunk in column.chunks], storage)
    return column.cast(pa.string())


def _array(column: Any) -> Any:
    """A column as one array (a page is combined into one chunk; an empty one has none)."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks()
    return column


def _epoch_batches(epoch: Epoch) -> list[pa.RecordBatch]:
    """An epoch of `Fact`s (signed ranges from Redis) as batches, one per stream."""
    import pyarrow as pa

    out = schema()
    by_stream: dict[str, dict[str, list[Any]]] = {}
    for fact in epoch.facts:
        rows = by_stream.setdefault(fact.stream, {name: [] for name in out.names})
        for row_no, payload in enumerate(fact.payloads):
            rows[STREAM.exposed].append(fact.stream)
            rows[STREAM_ID.exposed].append(fact.stream_id)
            rows[ROW_NO.exposed].append(row_no)
            rows[INSTANCE.exposed].append(fact.instance)
            rows[TIMESTAMP.exposed].append(fact.timestamp * 1000)
            rows[PAYLOAD.exposed].append(json.dumps(payload, ensure_ascii=False))
    batches = []
    for rows in by_stream.values():
        stamps = pa.array(rows[TIMESTAMP.exposed], pa.int64())
        arrays = {
            name: pa.array(values, out.field(name).type)
            for name, values in rows.items()
            if name != TIMESTAMP.exposed
        }
        arrays[TIMESTAMP.exposed] = stamps.cast(out.field(TIMESTAMP.exposed).type)
        batches.append(pa.RecordBatch.from_arrays([arrays[name] for name in out.names], schema=out))
    return batches


def _check_max_rows(max_rows: int | None) -> int:
    if max_rows is None:
        return DEFAULT_MAX_ROWS
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise UsageError("max_rows must be a positive int")
    return max_rows


class BatchSource(Protocol):
    """What `reader_batches` uses of a `streams.Reader` (its public face)."""

    @property
    def core(self) -> ReaderCore: ...

    @property
    def closed(self) -> bool: ...

    def arrow_sessions(self) -> ArrowSessions: ...

    def prove(self, timeout: float | None = ...) -> Epoch | None: ...


class AsyncBatchSource(Protocol):
    """What `areader_batches` uses of a `streams.AsyncReader` (its public face)."""

    @property
    def core(self) -> ReaderCore: ...

    @property
    def closed(self) -> bool: ...

    def arrow_sessions(self) -> ArrowSessions: ...

    async def prove(self, timeout: float | None = ...) -> Epoch | None: ...


def reader_batches(
    reader: BatchSource,
    *,
    idle_timeout: float = 0.0,
    max_rows: int | None = None,
    until: Mapping[str, int] | None = None,
    typed: PayloadSchema | None = None,
) -> Iterator[pa.RecordBatch]:
    """`Reader.batches` (``until``: `Client.read_arrow`'s bound; ``typed``: `typing_of`)."""
    require_arrow("Reader.batches()")
    limit = _check_max_rows(max_rows)
    return _batches(_Batches(reader, idle_timeout, until, limit, typed))


def _batches(state: _Batches) -> Iterator[pa.RecordBatch]:
    try:
        while (batch := drive(_next_batch(state))) is not None:
            yield batch
    finally:
        drive(_settle(state))  # never leave a read running on the sessions after the caller left
        if state.pool is not None:
            state.pool.shutdown()


async def areader_batches(
    reader: AsyncBatchSource,
    *,
    idle_timeout: float = 0.0,
    max_rows: int | None = None,
    until: Mapping[str, int] | None = None,
    typed: PayloadSchema | None = None,
) -> AsyncIterator[pa.RecordBatch]:
    """`AsyncReader.batches` (``until``: `AsyncClient.read_arrow`'s bound; ``typed``:
    `typing_of`)."""
    require_arrow("AsyncReader.batches()")
    state = _Batches(reader, idle_timeout, until, _check_max_rows(max_rows), typed)
    try:
        while (batch := await adrive(_next_batch(state))) is not None:
            yield batch
    finally:
        await adrive(_settle(state))


def bounds(stream: str, end: int | None) -> dict[str, int] | None:
    """`Client.read_arrow`'s ``until``: the last stream ID of ``[start, end)`` (None: no end)."""
    if end is None:
        return None
    if isinstance(end, bool) or not isinstance(end, int) or end < 1:
        raise UsageError("end must be a stream ID (an int >= 1) or None")
    return {stream: end - 1}


def to_table(batches: list[pa.RecordBatch], typed: PayloadSchema | None = None) -> pa.Table:
    """The batches as one table (no copy: its chunks are the batches)."""
    import pyarrow as pa

    return pa.Table.from_batches(batches, schema=typed_schema(typed))
