"""Reading facts: the statements that read rows, starts by time, timestamp floors, batch ranges.

Every read names its stream's own partition of ``streams_facts`` (`partition_sql`): through
the parent, a generic plan with a parameter would plan and lock every partition, and even with
the stream as a literal, a session's first statement on the parent loads the descriptor of
every partition (8 ms at 1,000 streams, 10x that at 10,000: a cost each new reader session
would pay for every other stream), and reads only up to a
position PostgreSQL proved complete (`streams.store.probe.probe`). The statements that read
rows and check retention are here; the order in which a reader runs them (incarnation, probe,
rows, retention) and why that order is the proof are in `streams.store.reads`, whose plans every
reader runs: after a probe in the same pipeline (`fetch_rows_after_probe`), with a shared
proof in the same statement (`fetch_rows_after_proof`), or up to a proven position given by
the caller (`range_query`, and `range_rows_sql` for the batch ranges of the Spark source).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg import sql

from ..core.constants import facts_partition
from ..core.fact_columns import KEY, PAYLOAD, ROW_COLUMNS, TIMESTAMP
from ..errors import FactsPruned
from ..types import StreamInfo
from ._common import COMPLETE_SETTING, int_array
from .driver import Commit, Gen, Query, Row


def _select_list(prefix: str = "", **exprs: str) -> str:
    """The row columns (`ROW_COLUMNS`) as a select list: each column's read expression (or
    ``exprs[stored name]``), named by its stored name, ``prefix`` before each."""
    parts = []
    for column in ROW_COLUMNS:
        expr = prefix + exprs.get(column.stored, column.read)
        parts.append(expr if expr == column.stored else f"{expr} AS {column.stored}")
    return ", ".join(parts)


#: The rows' select list (derived once: these are hot paths).
_ROWS = _select_list()
#: The rows of the inner select, read by name from the outer one (`_proof_rows_sql`).
_JOINED_ROWS = ", ".join(f"f.{column.stored}" for column in ROW_COLUMNS)
#: `range_rows_sql`'s, by the payload's form (as text, or as stored) with a slot for ``ts``.
_TS_SLOT = "{ts}"
_RANGE_ROWS = {
    jsonb: _select_list(**{TIMESTAMP.stored: _TS_SLOT, PAYLOAD.stored: payload})
    for jsonb, payload in ((False, PAYLOAD.read), (True, PAYLOAD.stored))
}
#: A fact row's order.
_ORDER = ", ".join(column.stored for column in KEY)


@functools.lru_cache(maxsize=4096)
def partition_sql(stream_key: int) -> str:
    """The stream's partition of ``streams_facts``, quoted, for a statement that reads one
    stream's facts (see the module doc: never through the parent)."""
    return sql.Identifier(facts_partition(int(stream_key))).as_string(None)


def fetch_rows_after_proof(
    info: StreamInfo, after: int, limit: int, incarnation: str | None = None
) -> Query:
    """One statement: the shared proof of ``info`` and up to ``limit`` rows (`ROW_COLUMNS`)
    after ``after`` and ``<=`` it, in (stream ID, row) order.

    Its rows are ``(complete, age_ms, possible, *row)`` (``row`` all NULL when there is none);
    no rows at all when nobody has proven the stream yet in the database ``incarnation`` (the
    follower's token: a record of another history, or of none, is not read). One snapshot
    serves both reads: see "shared proofs". ``age_ms``: how long ago (server clock) the prober
    last proved it. ``possible``: ``complete`` is at or below the stream's max allocated ID (its
    sequence's last value, read here as the probe reads it); a proof above it was not written
    by a prober (a prober proves only IDs its probe saw allocated, and the sequence only
    grows), so it is refused: no rows are read behind it and the reader probes for itself. The
    stream and its sequence are literals, so the planner reads (and locks) only its partition;
    a value from the join would be pruned at run time, after every partition had been locked.
    """
    return Query(_proof_rows_sql(info.id, info.sequence_name), (after, limit, incarnation))


@functools.lru_cache(maxsize=1024)
def _proof_rows_sql(stream_key: int, sequence_name: str) -> bytes:
    key = int(stream_key)
    sequence = sql.Literal(sequence_name).as_bytes(None).decode()
    return (
        "SELECT p.complete, "
        "(extract(epoch FROM clock_timestamp() - p.proven_at) * 1000)::bigint, "
        "p.complete <= a.allocated, "
        f"{_JOINED_ROWS} "
        "FROM streams_proofs p CROSS JOIN LATERAL ("
        f"SELECT COALESCE(pg_sequence_last_value({sequence}::regclass), 0) AS allocated) AS a "
        "LEFT JOIN LATERAL ("
        f"SELECT {_ROWS} FROM {partition_sql(key)} "
        f"WHERE stream = {key} AND stream_id > %s AND stream_id <= p.complete "
        "AND p.complete <= a.allocated "
        f"ORDER BY {_ORDER} LIMIT %s) AS f ON true "
        f"WHERE p.stream = {key} AND p.incarnation = %s"
    ).encode()


def range_query(info: StreamInfo, after: int, through: int, limit: int) -> Query:
    """Rows (`ROW_COLUMNS`) of facts with
    ``after < stream_id <= through``, in (stream ID, row) order; ``payload`` as JSON text (the
    reader decodes a page's payloads in one call, cheaper than psycopg's loader per value).

    At most ``limit`` rows: a page may end in the middle of a fact's rows (see
    `streams.core.epochs`). Read it as `streams.store.reads.read_proven` does (with the
    retention check after it). Bounds are inlined as literals: measurably faster than
    parameters for range scans, and they are ints, so nothing can be injected.
    """
    return Query(sql.SQL(_RANGE_QUERY).format(**_range_literals(info, after, through, limit)))


_RANGE_QUERY = (
    f"SELECT {_ROWS} FROM {{facts}} "
    "WHERE stream = {stream} AND stream_id > {after} AND stream_id <= {through} "
    f"ORDER BY {_ORDER} LIMIT {{limit}}"
)


def fetch_rows_after_probe(info: StreamInfo, after: int, limit: int) -> Query:
    """Like `range_query` up to the complete position the preceding probe statements of the
    same session remembered (`streams.store.reads.probe_and_read`): pipelined behind them, a
    caught-up reader needs one round trip, and this statement's snapshot is still taken after
    the probe's pg_locks read, as the argument needs.

    The stream is a literal (its partition is known when planning: a generic plan with a
    parameter would lock every stream's partition), the bounds are parameters: this runs
    after every hint with the same text, so psycopg prepares it and the server stops
    re-planning (a small page is all it reads).
    """
    return Query(_probe_rows_sql(info.id), (after, limit))


@functools.lru_cache(maxsize=1024)
def _probe_rows_sql(stream_key: int) -> bytes:
    key = int(stream_key)
    return (
        f"SELECT {_ROWS} FROM {partition_sql(key)} "
        f"WHERE stream = {key} AND stream_id > %s "
        f"AND stream_id <= current_setting('{COMPLETE_SETTING}{key}')::bigint "
        f"ORDER BY {_ORDER} LIMIT %s"
    ).encode()


TIME_START_STEPS = 8


def position_before_time(info: StreamInfo, ts_ms: int) -> Gen[int | None]:
    """The position just before the first fact with timestamp ``>= ts_ms`` (None if none yet).

    Timestamps as readers see them are running maxima, and the first fact whose running maximum
    reaches ``ts_ms`` is the first whose own timestamp does. Found in index lookups, whatever
    the stream's length: the time index ``(stream, ts, stream_id)`` gives the candidate with
    the earliest such timestamp. A fact with a lower ID and a timestamp ``>= ts_ms`` was written
    out of order with it; writers keep their own timestamps non-decreasing, so only facts of
    other writers in flight at the same time can be, and the `TS_FLOOR_WINDOW` rows before the
    candidate are checked (the window `ts_floor_at` trusts too), then the window before each
    earlier fact found, until one holds none. After `TIME_START_STEPS` windows (timestamps far
    out of order) the primary key is scanned. Scanning it for ``min(stream_id) WHERE ts >= t``
    from the start reads every fact before ``t``: 290-415 ms at 2M facts.
    """
    facts = partition_sql(info.id)
    rows = yield Query(
        f"SELECT stream_id FROM {facts} WHERE stream = %s AND ts >= %s "
        "ORDER BY ts, stream_id LIMIT 1",
        (info.id, ts_ms),
    )
    first = None if not rows else int(rows[0][0])
    for _ in range(TIME_START_STEPS):
        if first is None:
            break
        rows = yield Query(
            f"SELECT min(w.stream_id) FROM (SELECT stream_id, ts FROM {facts} "
            "WHERE stream = %s AND stream_id < %s ORDER BY stream_id DESC, row_no DESC "
            "LIMIT %s) AS w WHERE w.ts >= %s",
            (info.id, first, TS_FLOOR_WINDOW, ts_ms),
        )
        if rows[0][0] is None:
            break
        first = int(rows[0][0])
    else:
        rows = yield Query(
            f"SELECT min(stream_id) FROM {facts} WHERE stream = %s AND stream_id < %s AND ts >= %s",
            (info.id, first, ts_ms),
        )
        first = first if rows[0][0] is None else int(rows[0][0])
    yield Commit()
    return None if first is None else first - 1


def first_fact_since(info: StreamInfo, ts_ms: int, after: int, through: int) -> Gen[int | None]:
    """The first fact in ``(after, through]`` with timestamp ``>= ts_ms`` (None if none).

    For a query started by time: once its frontier covers such a fact, every later fact's
    running maximum is at least ``ts_ms`` and the start time no longer filters anything.
    """
    rows = yield Query(
        f"SELECT min(stream_id) FROM {partition_sql(info.id)} "
        "WHERE stream = %s AND stream_id > %s AND stream_id <= %s AND ts >= %s",
        (info.id, after, through, ts_ms),
    )
    yield Commit()
    return None if rows[0][0] is None else int(rows[0][0])


#: How many facts before a mid-stream start are scanned for the running maximum timestamp.
TS_FLOOR_WINDOW = 1000


def ts_floor_at(info: StreamInfo, position: int) -> Gen[int]:
    """The running maximum timestamp at ``position``, for a reader starting after it.

    Exact from the start of a stream (0) and for reader groups (they commit it). Elsewhere it is
    the maximum over the last `TS_FLOOR_WINDOW` facts, not the whole history, so that starting
    mid-stream stays cheap: writers keep their own timestamps non-decreasing from the stream's
    maximum at registration, so older facts rarely matter.
    """
    if position <= 0:
        return 0
    rows = yield Query(
        f"SELECT max(ts) FROM (SELECT ts FROM {partition_sql(info.id)} "
        "WHERE stream = %s AND stream_id <= %s ORDER BY stream_id DESC LIMIT %s) AS recent",
        (info.id, position, TS_FLOOR_WINDOW),
    )
    yield Commit()
    return int(rows[0][0] or 0)


def range_ts_maxima(info: StreamInfo, bounds: Sequence[int]) -> Gen[list[int | None]]:
    """The greatest timestamp of the facts in each of ``(b0, b1], (b1, b2], ...`` (None for
    a range without facts), in one statement: with the floor before ``b0`` it gives the exact
    timestamp floor at every bound (`streams_spark.planning.running_floors`), unlike
    `ts_floor_at`, which looks at recent facts only. Each range is read once, by the primary
    key (or backwards through the time index when that is cheaper: the planner's choice).
    Bounds are ints, inlined (see `range_query`).
    """
    if len(bounds) < 2:
        return []
    key = int(info.id)
    pairs = ", ".join(
        f"({i}, {int(low)}, {int(high)})"
        for i, (low, high) in enumerate(itertools.pairwise(bounds))
    )
    rows = yield Query(
        f"SELECT b.i, (SELECT max(ts) FROM {partition_sql(key)} "
        f"WHERE stream = {key} AND stream_id > b.low AND stream_id <= b.high) "
        f"FROM (VALUES {pairs}) AS b(i, low, high) ORDER BY b.i"
    )
    yield Commit()
    return [None if high is None else int(high) for _, high in rows]


def database_time_ms() -> Gen[int]:
    rows = yield Query("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
    yield Commit()
    return int(rows[0][0])


# --- batch ranges (Spark source and other batch readers) ---------------------------------------
# Readers that plan a whole range of complete positions up front (the Spark source) rather than
# page by page. Bounds are ints inlined as literals (see `range_query`).


def count_facts(info: StreamInfo, after: int, through: int, limit: int) -> Gen[tuple[int, int]]:
    """``(n, last)`` for the first ``min(limit, all)`` facts in ``(after, through]``: how many
    there are and the stream ID of the last of them (``after`` if none).

    Counts facts, not rows (a multi-row fact counts once) and skips gaps, so a reader that
    admits at most ``limit`` facts may advance to ``last`` when ``n == limit`` and to
    ``through`` when ``n < limit`` (everything up to ``through`` is then within the limit).
    """
    if limit <= 0:
        raise ValueError("limit must be positive")
    query = sql.SQL(
        "SELECT count(*), max(stream_id) FROM ("
        "SELECT DISTINCT stream_id FROM {facts} "
        "WHERE stream = {stream} AND stream_id > {after} AND stream_id <= {through} "
        "ORDER BY stream_id LIMIT {limit}) AS f"
    ).format(**_range_literals(info, after, through, limit))
    rows = yield Query(query)
    yield Commit()
    count, last = rows[0]
    return int(count), int(after if last is None else last)


#: Ranges wider than this many IDs are cut at equal ID widths instead of row percentiles.
SPLIT_SCAN_LIMIT = 200_000


def split_range(info: StreamInfo, after: int, through: int, parts: int) -> Gen[list[int]]:
    """Cut points ``b1 < b2 < ...`` (each ``after < b < through``) that split ``(after,
    through]`` into at most ``parts`` ranges ``(after, b1], (b1, b2], ..., (bk, through]`` of
    about equal row counts: row percentiles, or equal ID widths beyond `SPLIT_SCAN_LIMIT` IDs.
    Every cut point is a stream ID, so a fact's rows never straddle two ranges. Deterministic
    for a complete range (its rows never change)."""
    if parts <= 1 or through <= after + 1:
        return []
    if through - after > SPLIT_SCAN_LIMIT:
        # Scanning a range this large just to cut it costs a tenth of reading it (measured:
        # 0.4-0.7 s per 10^6 rows). IDs are dense (gaps are rolled-back reservations), so
        # equal ID widths are about equal row counts; and free, exact and deterministic.
        width = (through - after) / parts
        return sorted({after + round(width * i) for i in range(1, parts)} - {after, through})
    fractions = [i / parts for i in range(1, parts)]
    query = sql.SQL(
        # As bigint: percentile_disc returns an array of its sort key's type, and an array of
        # the column's domain (revision 0020) is a type the driver does not know (text).
        "SELECT percentile_disc({fractions}::float8[]) WITHIN GROUP "
        "(ORDER BY stream_id::pg_catalog.int8) "
        "FROM {facts} "
        "WHERE stream = {stream} AND stream_id > {after} AND stream_id <= {through}"
    ).format(
        facts=sql.SQL(partition_sql(info.id)),
        fractions=sql.Literal(fractions),
        stream=sql.Literal(int(info.id)),
        after=sql.Literal(int(after)),
        through=sql.Literal(int(through)),
    )
    rows = yield Query(query)
    yield Commit()
    found = rows[0][0] or []
    return sorted({int(b) for b in found if b is not None and after < int(b) < through})


def range_rows_sql(
    stream_key: int,
    after: int,
    through: int,
    *,
    running_ts_floor: int | None = None,
    resume_after: tuple[int, int] | None = None,
    limit: int | None = None,
    jsonb: bool = False,
) -> str:
    """The text of a query for every row of the facts in ``(after, through]`` of the stream
    with registry id ``stream_key``, as `ROW_COLUMNS` in (stream
    ID, row) order, the payload as JSON text.

    The rows statement of `streams.store.reads.read_range`, which any driver runs (ADBC, on
    Spark executors, returns JSONB as an extension type, hence ``::text``). With
    ``running_ts_floor``, ``ts`` is the running maximum the readers report
    (`streams.core.epochs`), starting from that floor: rows of one fact share their writer's
    timestamp, so the maximum over rows equals the maximum over facts. Plain text, not
    `psycopg.sql`: every value is an int, so nothing can be injected.

    ``resume_after=(stream_id, row_no)``: only the rows after that one, to go on with a read
    that broke off (with ``running_ts_floor`` the maximum over the rows already read). The
    range is complete, so its rows cannot change between the two reads; retention may remove
    them, which the plan's later retention check reports as for any read.

    ``limit``: at most that many rows (a page, which may end inside a fact: `streams.core.epochs`).
    ``jsonb``: the payload as it is stored, not cast to text: ADBC 1.x hands jsonb over as
    Arrow's JSON extension type over UTF-8 strings (the same text), and the server's jsonb
    output without the cast cost about a quarter less per 200-byte row (measured).
    """
    key, low, high = int(stream_key), int(after), int(through)
    resume = ""
    if resume_after is not None:
        resume = f"AND ({_ORDER}) > ({int(resume_after[0])}, {int(resume_after[1])}) "
    if running_ts_floor is None:
        ts = TIMESTAMP.read
    else:
        ts = (
            f"GREATEST({int(running_ts_floor)}::bigint, max({TIMESTAMP.stored}) OVER "
            f"(ORDER BY {_ORDER} ROWS UNBOUNDED PRECEDING))"
        )
    return (
        f"SELECT {_RANGE_ROWS[jsonb].replace(_TS_SLOT, ts)} "
        f"FROM {partition_sql(key)} WHERE stream = {key} AND stream_id > {low} "
        f"AND stream_id <= {high} {resume}ORDER BY {_ORDER}"
        + ("" if limit is None else f" LIMIT {int(limit)}")
    )


def _range_literals(info: StreamInfo, after: int, through: int, limit: int) -> dict[str, Any]:
    """The integer bounds of a range scan as SQL literals (faster than parameters for range
    scans, measured; ints, so nothing can be injected)."""
    return {
        "facts": sql.SQL(partition_sql(info.id)),
        "stream": sql.Literal(int(info.id)),
        "after": sql.Literal(int(after)),
        "through": sql.Literal(int(through)),
        "limit": sql.Literal(int(limit)),
    }


def retention_query(infos: Sequence[StreamInfo]) -> Query:
    """``(name, pruned_through)`` of each stream: pipelined *after* a read of rows, for
    `check_retained` (step 4 of `streams.store.reads`; "the retention argument" in
    `streams.store.retention`)."""
    return _retention_query(tuple(info.id for info in infos))


@functools.lru_cache(maxsize=1024)
def _retention_query(ids: tuple[int, ...]) -> Query:
    where = f"id = ANY({int_array(ids)}::int[])"
    return Query(f"SELECT name, pruned_through FROM streams_registry WHERE {where}".encode())


def check_retained(rows: Sequence[Row], positions: Mapping[str, int]) -> dict[str, int]:
    """Raise `FactsPruned` if retention removed facts after one of ``positions`` (rows of
    `retention_query`); returns every stream's ``pruned_through``."""
    pruned = {str(name): int(through) for name, through in rows}
    for name, position in positions.items():
        if pruned.get(name, 0) > position:
            raise FactsPruned(name, position, pruned[name])
    return pruned


def pruned_through_sql(stream_key: int) -> str:
    """The text of a query for the ``pruned_through`` of the stream with registry id
    ``stream_key``: step 4 of `streams.store.reads.read_range`, in a statement after its rows
    (`range_rows_sql`), as plain text for any driver."""
    return f"SELECT pruned_through FROM streams_registry WHERE id = {int(stream_key)}"


def pruned_positions(infos: Sequence[StreamInfo]) -> Gen[dict[str, int]]:
    """Every stream's ``pruned_through`` (0: nothing was ever pruned)."""
    rows = yield retention_query(infos)
    yield Commit()
    return check_retained(rows, {})


# --- samples (`streams schema infer`) ----------------------------------------------------------


def sample_payloads(info: StreamInfo, facts: int) -> Gen[list[str]]:
    """The payload text of every row of the stream's latest ``facts`` facts (committed rows:
    a sample to infer a schema from, not a read, so no proof is needed), newest fact first."""
    if facts <= 0:
        raise ValueError("facts must be positive")
    key = int(info.id)
    rows = yield Query(
        sql.SQL(
            "SELECT min(stream_id) FROM (SELECT DISTINCT stream_id FROM {facts} "
            "WHERE stream = {stream} ORDER BY stream_id DESC LIMIT {limit}) AS f"
        ).format(
            facts=sql.SQL(partition_sql(key)),
            stream=sql.Literal(key),
            limit=sql.Literal(int(facts)),
        )
    )
    if rows[0][0] is None:
        yield Commit()
        return []
    rows = yield Query(
        sql.SQL(
            "SELECT payload::text FROM {facts} WHERE stream = {stream} "
            "AND stream_id >= {low} ORDER BY stream_id DESC, row_no"
        ).format(
            facts=sql.SQL(partition_sql(key)),
            stream=sql.Literal(key),
            low=sql.Literal(int(rows[0][0])),
        )
    )
    yield Commit()
    return [str(row[0]) for row in rows]
