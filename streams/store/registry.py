"""Streams and their declared tables: the registry (``streams_registry``).

A stream is a row of ``streams_registry``: its name, the sequence its IDs come from (named after
the registry id, never after the user's name), its timestamping and retention settings, and the
user tables that hold its facts besides ``streams_facts`` (`FactTable`, "declared tables").
``create_stream`` makes the row, the sequence and the stream's partition of ``streams_facts``;
``drop_stream`` takes them away again. Every other module of the store starts from the
`StreamInfo` these functions return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from ..config import validate_stream_name
from ..core.constants import BUCKET_WIDTH, facts_bucket, facts_partition
from ..core.timestamps import TimestampMode
from ..errors import (
    InvalidFactTables,
    SchemaNotReady,
    StoreError,
    StreamExists,
    UnknownStream,
)
from ..types import (
    DEFAULT_KEY_WINDOW_MS,
    Created,
    FactTable,
    FactTableSpec,
    StreamInfo,
    StreamSpec,
)
from ._common import TIMELINE_SQL
from .driver import Autocommit, Commit, Gen, Query
from .roles import grant_streams, owner_to_create_as
from .stream_objects import StreamObjects

ALEMBIC_HEAD = "0020_domain_checks"

_STREAM_COLUMNS = (
    "id, name, sequence_name, timestamping, uncapped, retention_ms, fact_tables, key_window_ms"
)


def _stream_from_row(row: tuple[Any, ...]) -> StreamInfo:
    return StreamInfo(
        id=row[0],
        name=row[1],
        sequence_name=row[2],
        timestamping=TimestampMode(row[3]),
        uncapped=row[4],
        retention_ms=row[5],
        fact_tables=tuple(FactTable.from_json(t) for t in row[6] or ()),
        key_window_ms=int(row[7]),
    )


def check_schema() -> Gen[None]:
    rows = yield Query("SELECT to_regclass('streams_alembic_version') IS NOT NULL")
    if not rows[0][0]:
        raise SchemaNotReady("the streams schema is not installed: run `streams migrate`")
    rows = yield Query("SELECT version_num FROM streams_alembic_version")
    if not rows or rows[0][0] != ALEMBIC_HEAD:
        found = rows[0][0] if rows else "none"
        raise SchemaNotReady(
            f"the streams schema is at {found}, this library needs {ALEMBIC_HEAD}: "
            "run `streams migrate`"
        )
    # Never leave a connection idle in a transaction: it would hold AccessShareLock on the
    # version table (blocking `streams migrate`) for as long as the client lives.
    yield Commit()


def load_stream(name: str) -> Gen[StreamInfo]:
    validate_stream_name(name)
    rows = yield Query(
        f"SELECT {_STREAM_COLUMNS} FROM streams_registry WHERE name = %s",
        (name,),
    )
    yield Commit()
    if not rows:
        raise UnknownStream(name)
    return _stream_from_row(rows[0])


def list_streams() -> Gen[list[StreamInfo]]:
    rows = yield Query(f"SELECT {_STREAM_COLUMNS} FROM streams_registry ORDER BY name")
    yield Commit()
    return [_stream_from_row(row) for row in rows]


#: Streams one transaction of `create_streams` creates. Every new relation (partition, its
#: indexes, the sequence) holds a lock until commit, and PostgreSQL's lock table holds
#: ``max_locks_per_transaction * max_connections`` (6,400 at the defaults) for the whole server:
#: about 400 streams take 3,200 of them, leaving room for everybody else.
CREATE_CHUNK = 400


def create_stream(
    name: str,
    *,
    timestamping: TimestampMode | str = TimestampMode.CLIENT_PREFER,
    uncapped: bool = False,
    retention_ms: int | None = None,
    fact_tables: Sequence[FactTableSpec] | None = None,
    exist_ok: bool = True,
    key_window_ms: int | None = None,
) -> Gen[StreamInfo]:
    """Create a stream and its sequence (idempotent when the settings match; ``fact_tables``
    None means "whatever is declared", ``key_window_ms`` None "whatever is set", or the
    default of 24 hours for a new stream)."""
    spec = StreamSpec(name, timestamping, uncapped, retention_ms, fact_tables, key_window_ms)
    created = yield from create_streams([spec], exist_ok=exist_ok)
    return created[0].info


def create_streams(specs: Sequence[StreamSpec], *, exist_ok: bool = True) -> Gen[list[Created]]:
    """Create these streams in one transaction (all or none), each as `create_stream` would;
    each with whether it is new (False: it existed with these settings). At most
    `CREATE_CHUNK` streams: the client splits longer lists."""
    if len(specs) > CREATE_CHUNK:
        raise ValueError(f"at most {CREATE_CHUNK} streams per transaction, not {len(specs)}")
    checked = [_checked(spec) for spec in specs]
    seen: set[str] = set()
    for spec, _, _ in checked:
        if spec.name in seen:
            raise ValueError(f"stream {spec.name!r} is named twice")
        seen.add(spec.name)
    for _, _, tables in checked:
        if tables:
            yield from check_fact_tables(tables)
    yield Query("SELECT pg_advisory_xact_lock(hashtext('streams_registry'))")
    rows = yield Query(
        f"SELECT {_STREAM_COLUMNS} FROM streams_registry WHERE name = ANY(%s)",
        ([spec.name for spec in specs],),
    )
    existing = {str(row[1]): _stream_from_row(row) for row in rows}
    for spec, mode, tables in checked:
        found = existing.get(spec.name)
        if found is not None and (
            not exist_ok
            or (found.timestamping, found.uncapped, found.retention_ms)
            != (mode, spec.uncapped, spec.retention_ms)
            or (tables is not None and found.fact_tables != tables)
            or (spec.key_window_ms is not None and found.key_window_ms != spec.key_window_ms)
        ):
            raise StreamExists(
                f"stream {spec.name!r} exists already with settings {found.as_dict()}"
            )
    fresh = [c for c in checked if c[0].name not in existing]
    made: dict[str, StreamInfo] = {}
    if fresh:
        # The stream's objects belong to the owner of streams_facts (under the role model,
        # streams_admin: any admin may drop what another created), and its partition and
        # sequence are granted to the model's roles (`streams.store.roles`, "new streams").
        owner = yield from owner_to_create_as()
        if owner is not None:
            yield Query(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(owner)))
        rows = yield Query(
            "SELECT nextval(pg_get_serial_sequence('streams_registry', 'id')) "
            "FROM generate_series(1, %s)",
            (len(fresh),),
        )
        keys = sorted(int(row[0]) for row in rows)
        rows = yield Query(
            f"""
            INSERT INTO streams_registry
                (id, name, sequence_name, timestamping, uncapped, retention_ms, fact_tables,
                 key_window_ms, fenced_timeline)
            OVERRIDING SYSTEM VALUE
            SELECT *, ({TIMELINE_SQL}) FROM unnest(%s::bigint[], %s::text[], %s::text[],
                %s::text[], %s::bool[], %s::bigint[], %s::jsonb[], %s::bigint[])
            RETURNING {_STREAM_COLUMNS}
            """,
            (
                keys,
                [spec.name for spec, _, _ in fresh],
                [f"streams_seq_{key}" for key in keys],
                [str(mode) for _, mode, _ in fresh],
                [spec.uncapped for spec, _, _ in fresh],
                [spec.retention_ms for spec, _, _ in fresh],
                [Jsonb([t.as_json() for t in tables or ()]) for _, _, tables in fresh],
                [
                    DEFAULT_KEY_WINDOW_MS if spec.key_window_ms is None else spec.key_window_ms
                    for spec, _, _ in fresh
                ],
            ),
        )
        # fenced_timeline: a new stream's sequence handed out nothing on an older timeline
        # (revision 0019, docs/design/fencing.md).
        infos = sorted((_stream_from_row(row) for row in rows), key=lambda i: i.id)
        # Synapse's pitfall: a fresh sequence's START value is not "allocated" until nextval is
        # called (pg_sequence_last_value() is NULL until then), so nothing may assume ID 1
        # exists. The stream's own partition of streams_facts (revision 0006: appends at the
        # right edge of its own indexes) hangs under its bucket (see "Layout" below).
        # One round trip for all of a chunk's DDL.
        statements = yield from _buckets_for(infos)
        for info in infos:
            partition = sql.Identifier(facts_partition(info.id))
            statements += [
                sql.SQL("CREATE SEQUENCE {} AS bigint MINVALUE 1 START WITH 1 NO CYCLE").format(
                    info.sequence
                ),
                sql.SQL(
                    "CREATE TABLE {} (LIKE streams_facts INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
                ).format(partition),
                sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES IN ({})").format(
                    sql.Identifier(facts_bucket(info.id)), partition, sql.Literal(info.id)
                ),
            ]
        yield Query(sql.SQL("; ").join(statements))
        yield from grant_streams(
            [StreamObjects.of(info.id, info.name, info.sequence_name) for info in infos]
        )
        made = {info.name: info for info in infos}
    yield Commit()
    return [
        Created(made[spec.name], True) if spec.name in made else Created(existing[spec.name], False)
        for spec in specs
    ]


# Layout. ``streams_facts`` is partitioned by stream, and each stream has a partition of its
# own (revision 0006). Attaching a partition rebuilds its parent's partition descriptor, which
# costs in proportion to the parent's partitions: about 22 ms at 10^4 partitions on this
# machine, against 2-3 ms at a few hundred. So since revision 0018 a stream's partition hangs
# under a bucket, a partition of streams_facts for `BUCKET_WIDTH` consecutive stream IDs that
# is itself partitioned by stream; the root gains a bucket once every `BUCKET_WIDTH` streams,
# and no parent ever holds more than `BUCKET_WIDTH` partitions plus the streams created before
# 0018, which stay attached to the root where they were.
#
# Nothing else changes: every read and write of one stream names its own partition
# (`streams.store.rows.partition_sql`), and a statement through the root prunes at both levels
# on a literal stream. A bucket lists the IDs it will hold (LIST, not RANGE: the root was LIST
# partitioned before, and a partitioned table keeps its strategy) from the first ID created
# in it to the end of its range; IDs below that in its range belong to streams created before,
# attached to the root, or were never handed out. The registry's IDs are handed out in order
# under the registry lock this transaction holds, so no later stream can fall below a bucket's
# start. Buckets are created apart and attached, like partitions: ATTACH takes SHARE UPDATE
# EXCLUSIVE on the root and other streams go on. Nobody is granted anything on a bucket (it
# reaches every stream in it); `streams roles check` says so if somebody is.
def _buckets_for(infos: Sequence[StreamInfo]) -> Gen[list[sql.Composable]]:
    """The statements that create the buckets these new streams need and that do not exist
    yet (``infos`` in ID order)."""
    firsts: dict[int, int] = {}
    for info in infos:
        firsts.setdefault(info.id // BUCKET_WIDTH, info.id)
    # Each bucket: attached to the root (to use), absent, detached (an empty bucket whose drop
    # was interrupted after its detach: dropped and made anew) or half-detached.
    rows = yield Query(
        "SELECT b, c.oid IS NOT NULL, i.inhrelid IS NOT NULL, COALESCE(i.inhdetachpending, false), "
        "EXISTS (SELECT 1 FROM pg_inherits k WHERE k.inhparent = c.oid) "
        "FROM unnest(%s::bigint[]) AS b "
        "LEFT JOIN pg_class c ON c.oid = to_regclass(quote_ident('streams_facts_b' || b)) "
        "LEFT JOIN pg_inherits i ON i.inhrelid = c.oid",
        (list(firsts),),
    )
    statements: list[sql.Composable] = []
    for bucket, exists, attached, pending, holds in rows:
        first = firsts[int(bucket)]
        name = sql.Identifier(facts_bucket(first))
        if pending:
            raise StoreError(
                f"{facts_bucket(first)} is half-detached (a drop of its last stream was "
                f"interrupted): run ALTER TABLE streams_facts DETACH PARTITION "
                f"{facts_bucket(first)} FINALIZE, then create the streams again"
            )
        if attached:
            continue
        if exists and holds:  # detached by hand: dropping it would drop its streams' facts
            raise StoreError(
                f"{facts_bucket(first)} is not attached to streams_facts but holds streams' "
                "partitions: attach it again (ALTER TABLE streams_facts ATTACH PARTITION ...) "
                "before creating streams in its range"
            )
        if exists:
            statements.append(sql.SQL("DROP TABLE {}").format(name))
        ids = range(first, (int(bucket) + 1) * BUCKET_WIDTH)
        statements += [
            sql.SQL(
                "CREATE TABLE {} (LIKE streams_facts INCLUDING DEFAULTS INCLUDING CONSTRAINTS) "
                "PARTITION BY LIST (stream)"
            ).format(name),
            sql.SQL("ALTER TABLE streams_facts ATTACH PARTITION {} FOR VALUES IN ({})").format(
                name, sql.SQL(", ").join(sql.Literal(i) for i in ids)
            ),
        ]
    return statements


def _checked(
    spec: StreamSpec,
) -> tuple[StreamSpec, TimestampMode, tuple[FactTable, ...] | None]:
    validate_stream_name(spec.name)
    mode = TimestampMode(spec.timestamping)
    if spec.retention_ms is not None and (
        isinstance(spec.retention_ms, bool) or spec.retention_ms <= 0
    ):
        raise ValueError("retention_ms must be a positive number of milliseconds or None")
    if spec.key_window_ms is not None:
        check_key_window(spec.key_window_ms)
    tables = None if spec.fact_tables is None else parse_fact_tables(spec.fact_tables)
    return spec, mode, tables


def drop_stream(name: str) -> Gen[bool]:
    """Forget a stream: its registry row, then its facts and sequence.

    Each step is a transaction of its own that holds nothing while it waits, so no cycle of
    waits can form with readers and writers still finishing with the stream: once the registry
    row is gone nobody new can open it; the partition is detached concurrently (it waits for
    transactions that use ``streams_facts``, but stops none of them: other streams go on), then
    dropped, then the sequence. A crash in between leaves an unused table or sequence of a
    stream ID that is never handed out again.
    """
    rows = yield Query(
        "DELETE FROM streams_registry WHERE name = %s RETURNING id, sequence_name", (name,)
    )
    yield Commit()
    if not rows:
        return False
    name_of_partition, sequence = facts_partition(int(rows[0][0])), str(rows[0][1])
    partition = sql.Identifier(name_of_partition)
    # Its idempotency keys and claims (no foreign key: see revision 0009); no new row can
    # appear, since no writer can open the stream any more.
    for table in ("streams_idempotency_keys", "streams_idempotency_claims"):
        yield Autocommit(f"DELETE FROM {table} WHERE stream = %s", (int(rows[0][0]),))
    # Its parent: its bucket, or the root for a stream created before revision 0018.
    parents = yield Autocommit(
        "SELECT p.relname FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent "
        "WHERE i.inhrelid = to_regclass(quote_ident(%s))",
        (name_of_partition,),
    )
    if parents:
        yield Autocommit(
            sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(
                sql.Identifier(str(parents[0][0])), partition
            )
        )
    yield Autocommit(sql.SQL("DROP TABLE IF EXISTS {}").format(partition))
    yield Autocommit(sql.SQL("DROP SEQUENCE IF EXISTS {}").format(sql.Identifier(sequence)))
    if parents and str(parents[0][0]) != "streams_facts":
        yield from _drop_bucket_if_empty(str(parents[0][0]))
    return True


def _drop_bucket_if_empty(bucket: str) -> Gen[None]:
    """Drop ``bucket`` if no stream's partition hangs under it any more (the next stream of its
    range makes it anew), so that dropping every stream leaves the schema as it was.

    Streams are attached to a bucket under the registry lock (`create_streams`); this holds it
    as a session lock across its steps (each its own transaction: a concurrent detach cannot
    run in one), so no creation attaches a stream to the bucket while it goes. A crash between
    the detach and the drop leaves a detached, empty bucket, which the next creation in its
    range drops and makes anew (`_buckets_for`)."""
    yield Autocommit("SELECT pg_advisory_lock(hashtext('streams_registry'))")
    try:
        rows = yield Autocommit(
            "SELECT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(quote_ident(%s)))",
            (bucket,),
        )
        if not rows[0][0]:
            name = sql.Identifier(bucket)
            yield Autocommit(
                sql.SQL("ALTER TABLE streams_facts DETACH PARTITION {} CONCURRENTLY").format(name)
            )
            yield Autocommit(sql.SQL("DROP TABLE IF EXISTS {}").format(name))
    finally:
        yield Autocommit("SELECT pg_advisory_unlock(hashtext('streams_registry'))")


def parse_fact_tables(specs: Sequence[object]) -> tuple[FactTable, ...]:
    """Validate declared fact tables (`FactTable.parse`), sorted and without duplicates."""
    if isinstance(specs, str | bytes):
        raise InvalidFactTables(
            "fact_tables is a list of declarations such as 'table.column' (not a single string)"
        )
    tables = sorted({FactTable.parse(spec) for spec in specs})
    if any(t.table == "public.streams_facts" for t in tables):
        raise InvalidFactTables("streams_facts is always included; do not declare it")
    return tuple(tables)


def check_fact_tables(tables: Sequence[FactTable]) -> Gen[None]:
    """Every declared table exists and its column is an integer type (IDs are bigints); a
    filter's column exists and its value can be compared with it (``where_column = %s``, the
    value a parameter: the statement a repair runs, which must not fail a starting writer)."""
    for table in tables:
        rows = yield Query(
            "SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s "
            "AND a.attnum > 0 AND NOT a.attisdropped",
            (table.table, table.column),
        )
        if not rows:
            raise InvalidFactTables(f"no table {table.table} with a column {table.column!r}")
        if rows[0][0] not in ("bigint", "integer", "smallint", "numeric"):
            raise InvalidFactTables(
                f"{table}: a stream ID column must be an integer type, not {rows[0][0]}"
            )
        if table.where_column is None:
            continue
        rows = yield Query(
            "SELECT 1 FROM pg_attribute a WHERE a.attrelid = to_regclass(%s) "
            "AND a.attname = %s AND a.attnum > 0 AND NOT a.attisdropped",
            (table.table, table.where_column),
        )
        if not rows:
            raise InvalidFactTables(
                f"{table}: no column {table.where_column!r} in {table.table} to say which "
                "stream a row belongs to"
            )
        # LIMIT 0 reads nothing, but the server still plans the comparison and converts the
        # value to the column's type: an operator that does not exist or a value that does
        # not fit (e.g. 'x' for an integer column) fails here. The driver has rolled the
        # failed transaction back when it throws the error in.
        try:
            yield Query(
                sql.SQL("SELECT 1 FROM {relation}{where} LIMIT 0").format(
                    relation=table._relation(), where=table._where("value")
                ),
                table.params("value"),
            )
        except StoreError as exc:
            # Data exceptions (22: a value that does not fit) and rule violations (42: no such
            # operator, no privilege); anything else (a lost connection) is not the declaration.
            if exc.sqlstate is None or exc.sqlstate[:2] not in ("22", "42"):
                raise
            raise InvalidFactTables(
                f"{table}: {table.where_column} cannot be compared with "
                f"{table.where_value!r} ({exc})"
            ) from None
    yield Commit()


def set_fact_tables(name: str, specs: Sequence[object]) -> Gen[StreamInfo]:
    """Declare (replace) the user tables that hold facts of stream ``name``."""
    tables = parse_fact_tables(specs)
    yield from check_fact_tables(tables)
    rows = yield Query(
        f"UPDATE streams_registry SET fact_tables = %s WHERE name = %s RETURNING {_STREAM_COLUMNS}",
        (Jsonb([t.as_json() for t in tables]), validate_stream_name(name)),
    )
    yield Commit()
    if not rows:
        raise UnknownStream(name)
    return _stream_from_row(rows[0])


def set_retention(name: str, retention_ms: int | None) -> Gen[StreamInfo]:
    """Keep the facts of stream ``name`` for ``retention_ms`` (None: forever); `prune` applies
    it."""
    if retention_ms is not None and (
        isinstance(retention_ms, bool) or not isinstance(retention_ms, int) or retention_ms <= 0
    ):
        raise ValueError("retention_ms must be a positive number of milliseconds or None")
    rows = yield Query(
        "UPDATE streams_registry SET retention_ms = %s WHERE name = %s "
        f"RETURNING {_STREAM_COLUMNS}",
        (retention_ms, validate_stream_name(name)),
    )
    yield Commit()
    if not rows:
        raise UnknownStream(name)
    return _stream_from_row(rows[0])


def check_key_window(key_window_ms: object) -> int:
    """A key window is a positive whole number of milliseconds."""
    if isinstance(key_window_ms, bool) or not isinstance(key_window_ms, int) or key_window_ms <= 0:
        raise ValueError("key_window_ms must be a positive number of milliseconds")
    return key_window_ms


def set_key_window(name: str, key_window_ms: int) -> Gen[StreamInfo]:
    """Name appends of stream ``name`` by their idempotency keys for ``key_window_ms``. Applies
    at once to every key, old and new: a key is a duplicate while its row is younger than the
    window in force (`streams.store.idempotency`)."""
    check_key_window(key_window_ms)
    rows = yield Query(
        "UPDATE streams_registry SET key_window_ms = %s WHERE name = %s "
        f"RETURNING {_STREAM_COLUMNS}",
        (key_window_ms, validate_stream_name(name)),
    )
    yield Commit()
    if not rows:
        raise UnknownStream(name)
    return _stream_from_row(rows[0])


def load_streams(names: list[str]) -> Gen[list[StreamInfo]]:
    """Load several streams by name, in the given order; `UnknownStream` names the first missing."""
    for name in names:
        validate_stream_name(name)
    rows = yield Query(
        f"SELECT {_STREAM_COLUMNS} FROM streams_registry WHERE name = ANY(%s)", (names,)
    )
    yield Commit()
    found = {row[1]: _stream_from_row(row) for row in rows}
    for name in names:
        if name not in found:
            raise UnknownStream(name)
    return [found[name] for name in names]


#: Windows `position_before_time` walks back before scanning the primary key instead.
