"""The PostgreSQL side of streams: registry, positions and writer retirement, as generators.

Tables (created by the Alembic migrations in ``migrations/``):

* ``streams_registry``: one row per stream, naming its own sequence and the user tables that
  hold its facts besides ``streams_facts`` (`FactTable`).
* ``streams_facts``: the built-in facts table, one or more rows per fact.
* ``streams_writers``: one row per (stream, writer instance): its generation, its persisted
  per-writer position (forward-only) and its lease.
* ``streams_reader_groups``: committed positions of named reader groups.
* ``streams_proofs``: the complete position the elected prober of each stream last proved.

Why PostgreSQL judges dead writers (the fencing argument)
---------------------------------------------------------
Every writing transaction starts with one statement that takes ``FOR KEY SHARE`` on its
writer's row *where the generation is still the writer's own and the row is not retired*, and
reserves its IDs in the same statement. Retiring a writer takes ``FOR UPDATE`` on that row,
which conflicts with ``FOR KEY SHARE``: the retirement therefore waits until every open
transaction of that writer has ended (committed or rolled back), and every later transaction
of the retired writer finds no row, reserves nothing and stops with `WriterFenced`. So once a
retirement commits, no ID reserved by that writer can still complete: it is safe to treat the
writer as caught up and let the linear position pass its pending IDs. A writer killed with
``kill -9`` loses its connection, the server aborts its transaction, and the retirement goes
through as soon as the lease has expired. Position heartbeats are plain ``UPDATE``s of
non-key columns, which do not conflict with ``FOR KEY SHARE``, so they never wait for appends.
A wedged-but-connected writer cannot hold a transaction open forever either: each writing
transaction sets ``idle_in_transaction_session_timeout`` to the lease.

How readers know what is complete (the probe argument)
-----------------------------------------------------
A reader may deliver the facts up to ``C`` only when every ID ``<= C`` has completed: an ID
still pending could commit later and would then be skipped. `probe` learns ``C`` for every
stream it is given from PostgreSQL alone, without trusting any writer's announcement (Redis is
unauthenticated). It sends three kinds of statement in one pipeline (one round trip), and the
argument rests only on the order of *statements*, which the server runs one after the other,
never on the order in which PostgreSQL evaluates the parts of one statement (a planner may
evaluate a function scan such as ``pg_lock_status()`` once and reuse it, or read rows in any
order):

1. statement 1 reads ``A[s]``, every stream's sequence last value (max allocated), and leaves
   them in session settings;
2. statement 2 reads ``pg_locks`` for the streams' reservation locks (`streams.constants`) and
   computes ``C[s] = min(A[s], min(L[s]) - 1)`` from the settings of statement 1; a reservation
   lock is held by every writing transaction from just *before* its ``nextval`` until it ends,
   keyed by ``L`` (the sequence value plus one when it started), so every ID it reserves is
   ``>= L``;
3. later statements read rows ``<= C[s]``.

For one stream ``s``: any transaction holding an ID ``<= A[s]`` called ``nextval`` before
statement 1 read ``A[s]``, so it took its lock before statement 1 ended, hence before statement
2 began. If it is still open when statement 2 reads ``pg_locks``, its lock is seen, with ``L <=``
its IDs, and ``C[s]`` stays below them. Otherwise it has ended (committed or rolled back for
good). This holds for each stream separately, whatever the number of streams and whichever
order statement 1 reads their sequences in: every sequence is read before any lock is. The rows
are read by a *later* statement, with a newer snapshot, so they include every committed fact
``<= C[s]``; that needs READ COMMITTED (a pipeline is one implicit transaction, and under
REPEATABLE READ its first statement's snapshot would serve them all), so reader sessions pin it
(`READER_SESSION_SETUP`). A writer whose process dies releases its locks when the server
notices the dropped connection; a wedged one, when its transaction has been idle for the lease
(``idle_in_transaction_session_timeout``).

The writer's side (`streams.core`): one statement computes ``L`` from the sequence, takes the
lock on it and calls ``nextval``. That is the one place where order inside a statement matters,
and it is a data dependency, not an evaluation-order assumption: ``nextval`` runs in a CTE that
scans the CTE taking the lock, and the writer checks ``ID >= L`` for every ID before the
transaction can commit (inside the statement itself for a single fact, which then commits by
itself in autocommit; from the returned ``L`` for a batch): `SequenceRewound` otherwise.

Earlier versions read ``pg_locks`` in a correlated subquery of the statement that read the
sequences. PostgreSQL evaluated ``pg_lock_status()`` once, at the first stream's row, and reused
it for the others, whose sequences were therefore read *after* the lock snapshot: a reader of
several streams could pass an ID reserved in between (issue 7; `tests/test_probe.py` forces that
window).

Shared proofs (one prober per stream instead of one per reader)
---------------------------------------------------------------
A probe reads ``pg_locks``, which the server copies whole (every lock of every application)
under all lock-manager partition locks: K readers each probing on every hint cost K such copies
per fact, and the copy grows with everything else the server does. So the processes that read
a stream elect one *prober* among themselves (session advisory lock ``(PROOF_LOCK, id)``,
`try_become_prover`); it runs the probe above and, as one more statement of the same pipeline,
records ``C[s]`` in ``streams_proofs`` (`prove`: forward-only, with the server's time). Every
other reader reads that row *and* the rows behind it in **one statement**
(`fetch_rows_after_proof`), so both come from one snapshot: if the snapshot shows ``C``, the
prober's transaction had committed before it was taken; that transaction read ``pg_locks``
before committing, when every transaction holding an ID ``<= C`` had already ended, so all of
them are visible (committed) or gone (rolled back) in the same snapshot. Nothing depends on the
order in which the statement's parts are evaluated; only on one statement seeing one snapshot
(READ COMMITTED). The proof row is a cache of a fact PostgreSQL itself established: a lost,
stale or missing row only makes a reader probe for itself (`streams.reader`), never skip a fact.
The choice against the alternatives (coalescing probes per process, sharing one probe inside a
process) is that this one costs O(streams) ``pg_locks`` reads, not O(reader processes), and a
reader's read becomes a primary-key lookup plus the range scan it needed anyway.

The alternative (transaction-ID snapshots with ``pg_current_snapshot``) needs every fact to
record its ``xid`` and readers to reason about snapshots; row locks put the whole proof in one
place the database already enforces.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from ._ops import Autocommit, Commit, Gen, Pipeline, Query, Row
from .config import validate_stream_name
from .constants import (
    PROOF_LOCK,
    REGISTRATION_LOCK,
    RESERVATION_LOCK_SPAN,
    facts_partition,
    reservation_lock_class,
)
from .errors import (
    FactsPruned,
    InvalidFactTables,
    SchemaNotReady,
    StreamExists,
    UnknownStream,
)
from .positions import sequence_repair_target
from .timestamps import TimestampMode

__all__ = [
    "PROVER_SESSION_SETUP",
    "PRUNE_BATCH",
    "SPLIT_SCAN_LIMIT",
    "TIME_START_STEPS",
    "FactTable",
    "GroupRow",
    "LockHolder",
    "Probe",
    "PruneResult",
    "PruneTarget",
    "SequenceState",
    "StreamInfo",
    "StreamPositions",
    "UnseenIds",
    "WriterRow",
    "check_fact_tables",
    "check_retained",
    "commit_group",
    "count_facts",
    "create_stream",
    "database_time_ms",
    "delete_group",
    "drop_stream",
    "expired_writer_count",
    "fetch_rows",
    "fetch_rows_after_probe",
    "fetch_rows_after_proof",
    "first_fact_since",
    "group_position",
    "list_groups",
    "list_streams",
    "load_stream",
    "load_streams",
    "parse_fact_tables",
    "persisted_writer_position",
    "position_before_time",
    "probe",
    "probe_queries",
    "probes_from_rows",
    "prove",
    "prune",
    "prune_step",
    "prune_target",
    "prune_writers",
    "pruned_positions",
    "pruned_through_sql",
    "range_rows_sql",
    "registration_lock",
    "repair_sequence",
    "repair_sequence_now",
    "reservation_lock_holders",
    "reservation_lock_key_sql",
    "resign_prover",
    "retention_query",
    "retire_expired_writers",
    "sequence_state",
    "set_fact_tables",
    "set_retention",
    "split_range",
    "stream_positions",
    "try_become_prover",
    "ts_floor_at",
    "unseen_ids",
]

ALEMBIC_HEAD = "0006_partitions"

_NOW_MS_SQL = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

#: Session setting (plus the stream's registry id) where `probe` leaves the complete position.
COMPLETE_SETTING = "streams.complete_"


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """A stream's registry row."""

    id: int
    name: str
    sequence_name: str
    timestamping: TimestampMode
    uncapped: bool
    retention_ms: int | None
    #: User tables that hold facts of this stream, besides ``streams_facts``.
    fact_tables: tuple[FactTable, ...] = ()

    @property
    def sequence(self) -> sql.Identifier:
        return sql.Identifier(self.sequence_name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "timestamping": str(self.timestamping),
            "uncapped": self.uncapped,
            "retention_ms": self.retention_ms,
            "fact_tables": [str(t) for t in self.fact_tables],
        }


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")


@dataclass(frozen=True, slots=True, order=True)
class FactTable:
    """A user table holding facts of a stream: ``table`` (``schema.table``) and the column with
    the stream ID. Sequence repair takes ``max(column)`` over the whole table, so index it."""

    table: str
    column: str

    def __str__(self) -> str:
        return f"{self.table}.{self.column}"

    @classmethod
    def parse(cls, spec: object) -> FactTable:
        """``"table.column"``, ``"schema.table.column"`` or a ``(table, column)`` pair; the
        schema defaults to ``public``. Plain identifiers only: they become SQL identifiers."""
        if isinstance(spec, FactTable):
            return spec
        if isinstance(spec, str):
            parts = spec.split(".")
        elif isinstance(spec, tuple | list) and len(spec) == 2 and isinstance(spec[0], str):
            parts = [*spec[0].split("."), spec[1]]
        else:
            raise InvalidFactTables(
                f"invalid fact table {spec!r}: use 'table.column', 'schema.table.column' "
                "or a (table, column) pair"
            )
        if len(parts) == 2:
            parts.insert(0, "public")
        if len(parts) != 3 or not all(
            isinstance(p, str) and _IDENTIFIER.fullmatch(p) for p in parts
        ):
            raise InvalidFactTables(
                f"invalid fact table {spec!r}: use 'table.column' or 'schema.table.column' "
                "with plain identifiers (letters, digits, '_', '$')"
            )
        return cls(f"{parts[0]}.{parts[1]}", parts[2])

    def as_json(self) -> dict[str, str]:
        return {"table": self.table, "column": self.column}

    def _relation(self) -> sql.Identifier:
        return sql.Identifier(*self.table.split("."))

    def max_sql(self) -> sql.Composed:
        return sql.SQL("(SELECT max({column}) FROM {relation})").format(
            column=sql.Identifier(self.column), relation=self._relation()
        )

    def ids_sql(self) -> sql.Composed:
        return sql.SQL("SELECT {column}::bigint FROM {relation}").format(
            column=sql.Identifier(self.column), relation=self._relation()
        )


@dataclass(frozen=True, slots=True)
class WriterRow:
    """A writer's row: its persisted position, lease and what it last reported."""

    instance: str
    generation: int
    position: int
    retired: bool
    lease_expires_in_ms: int
    pending: int = 0
    #: Milliseconds since its last heartbeat (or registration).
    heartbeat_age_ms: int = 0

    @property
    def state(self) -> str:
        """``retired`` (closed, fenced or pruned from the linear position), ``lease expired``
        (stopped heartbeating; retired at the next chance), ``active`` (it had IDs pending
        between its last two heartbeats, i.e. it wrote) or ``idle`` (nothing pending in that
        time: it holds nobody back)."""
        if self.retired:
            return "retired"
        if self.lease_expires_in_ms < 0:
            return "lease expired"
        return "active" if self.pending else "idle"

    def as_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "generation": self.generation,
            "retired": self.retired,
            "state": self.state,
            "lease_expires_in_ms": self.lease_expires_in_ms,
            "heartbeat_age_ms": self.heartbeat_age_ms,
            "pending": self.pending,
        }


@dataclass(frozen=True, slots=True)
class StreamPositions:
    """What `positions(stream)` reports; every figure read in one database snapshot."""

    stream: str
    linear: int
    max_allocated: int
    writers: Mapping[str, WriterRow]
    #: The minimum of the writers' persisted positions: trails ``linear`` by a heartbeat.
    persisted_linear: int = 0
    groups: tuple[GroupRow, ...] = ()
    #: Age in ms of the oldest open writing transaction (the oldest pending ID), if any.
    oldest_pending_ms: int | None = None
    #: Every fact ``<=`` it may have been removed by retention (`prune`); 0: none was.
    pruned_through: int = 0

    @property
    def scratchpad(self) -> int:
        """IDs in (linear, max allocated]: pending, or completed behind a pending one."""
        return self.max_allocated - self.linear

    def as_dict(self, *, retired: bool = True) -> dict[str, Any]:
        """JSON-ready; ``retired=False`` folds retired writers into ``retired_writers``."""
        shown = {n: w for n, w in sorted(self.writers.items()) if retired or not w.retired}
        return {
            "stream": self.stream,
            "linear": self.linear,
            "persisted_linear": self.persisted_linear,
            "max_allocated": self.max_allocated,
            "scratchpad": self.scratchpad,
            "oldest_pending_ms": self.oldest_pending_ms,
            "pruned_through": self.pruned_through,
            "groups": {g.group: g.as_dict() for g in self.groups},
            "writers": {name: row.as_dict() for name, row in shown.items()},
            "retired_writers": sum(w.retired for w in self.writers.values()),
        }


_STREAM_COLUMNS = "id, name, sequence_name, timestamping, uncapped, retention_ms, fact_tables"


def _stream_from_row(row: tuple[Any, ...]) -> StreamInfo:
    return StreamInfo(
        id=row[0],
        name=row[1],
        sequence_name=row[2],
        timestamping=TimestampMode(row[3]),
        uncapped=row[4],
        retention_ms=row[5],
        fact_tables=tuple(FactTable(t["table"], t["column"]) for t in row[6] or ()),
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


def create_stream(
    name: str,
    *,
    timestamping: TimestampMode | str = TimestampMode.CLIENT_PREFER,
    uncapped: bool = False,
    retention_ms: int | None = None,
    fact_tables: Sequence[object] | None = None,
    exist_ok: bool = True,
) -> Gen[StreamInfo]:
    """Create a stream and its sequence (idempotent when the settings match; ``fact_tables``
    None means "whatever is declared")."""
    validate_stream_name(name)
    mode = TimestampMode(timestamping)
    if retention_ms is not None and (isinstance(retention_ms, bool) or retention_ms <= 0):
        raise ValueError("retention_ms must be a positive number of milliseconds or None")
    tables = None if fact_tables is None else parse_fact_tables(fact_tables)
    if tables:
        yield from check_fact_tables(tables)
    yield Query("SELECT pg_advisory_xact_lock(hashtext('streams_registry'))")
    rows = yield Query(
        f"SELECT {_STREAM_COLUMNS} FROM streams_registry WHERE name = %s",
        (name,),
    )
    if rows:
        existing = _stream_from_row(rows[0])
        wanted = (mode, uncapped, retention_ms)
        if (
            not exist_ok
            or (existing.timestamping, existing.uncapped, existing.retention_ms) != wanted
            or (tables is not None and existing.fact_tables != tables)
        ):
            raise StreamExists(f"stream {name!r} exists already with settings {existing.as_dict()}")
        yield Commit()
        return existing
    rows = yield Query("SELECT nextval(pg_get_serial_sequence('streams_registry', 'id'))")
    stream_key = int(rows[0][0])
    rows = yield Query(
        f"""
        INSERT INTO streams_registry
            (id, name, sequence_name, timestamping, uncapped, retention_ms, fact_tables)
        OVERRIDING SYSTEM VALUE
        VALUES (%s, %s, %s, %s, %s, %s, %s)
        RETURNING {_STREAM_COLUMNS}
        """,
        (
            stream_key,
            name,
            f"streams_seq_{stream_key}",
            str(mode),
            uncapped,
            retention_ms,
            Jsonb([t.as_json() for t in tables or ()]),
        ),
    )
    info = _stream_from_row(rows[0])
    # Synapse's pitfall: a fresh sequence's START value is not "allocated" until nextval is
    # called (pg_sequence_last_value() is NULL until then), so nothing may assume ID 1 exists.
    yield Query(
        sql.SQL("CREATE SEQUENCE {} AS bigint MINVALUE 1 START WITH 1 NO CYCLE").format(
            info.sequence
        )
    )
    # The stream's own partition of streams_facts (revision 0006: appends at the right edge of
    # its own indexes). Created apart and attached: ATTACH takes SHARE UPDATE EXCLUSIVE on
    # streams_facts, so other streams' appends and reads go on; CREATE ... PARTITION OF would
    # take ACCESS EXCLUSIVE and queue every one of them behind any open transaction.
    partition = sql.Identifier(facts_partition(stream_key))
    yield Query(
        sql.SQL(
            "CREATE TABLE {} (LIKE streams_facts INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
        ).format(partition)
    )
    yield Query(
        sql.SQL("ALTER TABLE streams_facts ATTACH PARTITION {} FOR VALUES IN ({})").format(
            partition, sql.Literal(stream_key)
        )
    )
    yield Commit()
    return info


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
    attached = yield Autocommit(
        "SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(%s)", (name_of_partition,)
    )
    if attached:
        yield Autocommit(
            sql.SQL("ALTER TABLE streams_facts DETACH PARTITION {} CONCURRENTLY").format(partition)
        )
    yield Autocommit(sql.SQL("DROP TABLE IF EXISTS {}").format(partition))
    yield Autocommit(sql.SQL("DROP SEQUENCE IF EXISTS {}").format(sql.Identifier(sequence)))
    return True


def max_allocated_sql(info: StreamInfo) -> sql.Composed:
    """``pg_sequence_last_value`` is NULL before the first nextval: that means 0 allocated."""
    return sql.SQL("COALESCE(pg_sequence_last_value({}::regclass), 0)").format(
        sql.Literal(info.sequence_name)
    )


def parse_fact_tables(specs: Sequence[object]) -> tuple[FactTable, ...]:
    """Validate declared fact tables (`FactTable.parse`), sorted and without duplicates."""
    if isinstance(specs, str | bytes):
        raise InvalidFactTables("fact_tables is a list of 'table.column' (not a single string)")
    tables = sorted({FactTable.parse(spec) for spec in specs})
    if any(t.table == "public.streams_facts" for t in tables):
        raise InvalidFactTables("streams_facts is always included; do not declare it")
    return tuple(tables)


def check_fact_tables(tables: Sequence[FactTable]) -> Gen[None]:
    """Every declared table exists and its column is an integer type (IDs are bigints)."""
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


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A stream's sequence beside every ID known to be used: what repair compares."""

    last_value: int | None
    #: The largest stream ID found in ``streams_facts`` and every declared table.
    max_stored: int | None
    #: The largest position any writer persisted or any reader group committed.
    max_position: int | None
    #: Declared tables that do not exist (any more): their IDs cannot be seen.
    missing_tables: tuple[FactTable, ...] = ()

    @property
    def max_used(self) -> int | None:
        known = [v for v in (self.max_stored, self.max_position) if v is not None]
        return max(known) if known else None

    @property
    def repair_target(self) -> int | None:
        return sequence_repair_target(self.last_value, self.max_used)


def _existing_fact_tables(
    info: StreamInfo,
) -> Gen[tuple[list[FactTable], list[FactTable]]]:
    """The stream's declared tables split into (existing, missing): a dropped table must not
    fail repair, only be reported."""
    present: list[FactTable] = []
    missing: list[FactTable] = []
    for table in info.fact_tables:
        rows = yield Query("SELECT to_regclass(%s) IS NOT NULL", (table.table,))
        (present if rows[0][0] else missing).append(table)
    return present, missing


def sequence_state(info: StreamInfo, *, commit: bool = True) -> Gen[SequenceState]:
    """Read everything sequence repair needs, in one statement: the sequence, the largest ID in
    ``streams_facts`` and in each declared table, and the largest writer and group position (a
    writer persists positions up to max allocated; a group commits up to the linear position;
    both mean those IDs were handed out) or ``pruned_through`` (retention removed facts up to
    it: they existed even when no row is left).

    What stays invisible: facts in a table the stream does not declare. `streams doctor`
    reports how many IDs have no row anywhere it can see (rollbacks, or such a table).
    """
    present, missing = yield from _existing_fact_tables(info)
    maxima = [
        sql.SQL("(SELECT max(stream_id) FROM streams_facts WHERE stream = %(stream)s)"),
        *(t.max_sql() for t in present),
    ]
    rows = yield Query(
        sql.SQL(
            "SELECT pg_sequence_last_value({seq}::regclass), GREATEST({maxima})::bigint, "
            "GREATEST((SELECT max(position) FROM streams_writers WHERE stream = %(stream)s), "
            "(SELECT max(position) FROM streams_reader_groups WHERE stream = %(stream)s), "
            "(SELECT NULLIF(pruned_through, 0) FROM streams_registry WHERE id = %(stream)s))"
        ).format(seq=sql.Literal(info.sequence_name), maxima=sql.SQL(", ").join(maxima)),
        {"stream": info.id},
    )
    if commit:
        yield Commit()
    last, stored, position = rows[0]
    return SequenceState(
        None if last is None else int(last),
        None if stored is None else int(stored),
        None if position is None else int(position),
        tuple(missing),
    )


@dataclass(frozen=True, slots=True)
class UnseenIds:
    """Of the last ``ids`` allocated IDs, ``unseen`` have no row in ``streams_facts`` nor in any
    declared table: rolled back, or facts in a table the stream does not declare."""

    ids: int
    unseen: int


def unseen_ids(info: StreamInfo, window: int) -> Gen[UnseenIds]:
    """Count the most recent ``window`` allocated IDs that no known table holds (`doctor`)."""
    present, _ = yield from _existing_fact_tables(info)
    tables: list[sql.Composable] = [
        sql.SQL("SELECT stream_id FROM streams_facts WHERE stream = %(stream)s"),
        *(table.ids_sql() for table in present),
    ]
    rows = yield Query(
        sql.SQL(
            """
            WITH a AS (SELECT {allocated} AS top),
            seen AS ({union})
            SELECT LEAST(a.top, %(window)s),
                   LEAST(a.top, %(window)s) - (
                       SELECT count(DISTINCT s.stream_id) FROM seen s
                       WHERE s.stream_id > a.top - %(window)s AND s.stream_id <= a.top)
            FROM a
            """
        ).format(
            allocated=max_allocated_sql(info),
            union=sql.SQL(" UNION ALL ").join(
                sql.SQL("SELECT * FROM ({}) AS t(stream_id)").format(t) for t in tables
            ),
        ),
        {"stream": info.id, "window": window},
    )
    yield Commit()
    return UnseenIds(int(rows[0][0]), int(rows[0][1]))


def expired_writer_count(info: StreamInfo) -> Gen[int]:
    """Writers whose lease expired but that are not retired yet."""
    rows = yield Query(
        "SELECT count(*) FROM streams_writers WHERE stream = %s AND NOT retired "
        "AND lease_expires_at < clock_timestamp()",
        (info.id,),
    )
    yield Commit()
    return int(rows[0][0])


def registration_lock(info: StreamInfo) -> Gen[None]:
    """Take the stream's registration lock for the rest of the transaction: writer registration
    and sequence repair of one stream run one at a time (`streams.constants`)."""
    yield Query("SELECT pg_advisory_xact_lock(%s, %s)", (REGISTRATION_LOCK, info.id))


def repair_sequence_now(info: StreamInfo) -> Gen[int | None]:
    """`repair_sequence` in a transaction of its own, under the registration lock (for
    ``streams doctor --repair``); returns the new value, or None."""
    yield from registration_lock(info)
    target = yield from repair_sequence(info)
    yield Commit()
    return target


def repair_sequence(info: StreamInfo) -> Gen[int | None]:
    """Move the sequence past every ID known to be used (`sequence_state`) if it is behind;
    returns the new value.

    Runs in the caller's transaction under the stream's registration lock, so two starting
    writers do not both repair. ``setval`` is not transactional: the repair stands even if the
    caller's transaction rolls back, which is what it should do.
    """
    state = yield from sequence_state(info, commit=False)
    target = state.repair_target
    if target is None:
        return None
    yield Query(
        sql.SQL("SELECT setval({}::regclass, %s)").format(sql.Literal(info.sequence_name)),
        (target,),
    )
    return target


def retire_expired_writers(info: StreamInfo) -> Gen[list[str]]:
    """Retire writers whose lease has expired, if none of their transactions is still open.

    ``FOR UPDATE SKIP LOCKED`` skips a writer whose transaction is still open (it holds
    ``FOR KEY SHARE`` on its row): that transaction may still commit, so the writer is not
    caught up yet. The server aborts it when the connection dies, and at the latest when the
    transaction has been idle for the lease (see the module docstring); the next call retires it.
    """
    rows = yield Query(
        """
        WITH expired AS (
            SELECT stream, instance FROM streams_writers
            WHERE stream = %s AND NOT retired AND lease_expires_at < clock_timestamp()
            FOR UPDATE SKIP LOCKED
        )
        UPDATE streams_writers w
        SET retired = true, generation = w.generation + 1
        FROM expired e
        WHERE w.stream = e.stream AND w.instance = e.instance
        RETURNING w.instance
        """,
        (info.id,),
    )
    yield Commit()
    return sorted(row[0] for row in rows)


def linear_from(live_positions: list[int], max_allocated: int) -> int:
    """The minimum persisted position over writers that are not retired (or max allocated).

    Persisted positions are values that were true when written, so this is a safe but slightly
    old reading; `probe` gives the current one.
    """
    return min([*live_positions, max_allocated])


def reservation_lock_key_sql(floor: sql.Composable) -> sql.Composed:
    """The int4 second key of a reservation lock on ``L`` (an SQL bigint expression): ``L mod
    2**32`` as an int4. For statements executed with parameters (``%%`` is psycopg's ``%``)."""
    return sql.SQL("((({floor} + 2147483648) %% 4294967296) - 2147483648)::int4").format(
        floor=floor
    )


@dataclass(frozen=True, slots=True)
class Probe:
    """What PostgreSQL proves about a stream at one moment (see "the probe argument").

    ``max_allocated``: the highest ID reserved so far. ``complete``: every ID ``<=`` it has
    completed, so a reader may deliver everything up to it; this is the stream's linear
    position as PostgreSQL alone can vouch for it.
    """

    stream: str
    max_allocated: int
    complete: int


#: The rows of ``pg_locks l`` that are reservation locks (of some stream) in this database.
_RESERVATION_LOCKS = (
    "l.locktype = 'advisory' AND l.objsubid = 2"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)

#: Session settings (plus the stream's registry id) where a probe leaves max allocated
#: (statement 1) and the complete position (statement 2, for `fetch_rows_after_probe`).
ALLOCATED_SETTING = "streams.allocated_"

_HALF_SPAN = RESERVATION_LOCK_SPAN // 2

#: Statement 1 of a probe: every sequence's last value, before any lock is read.
_PROBE_ALLOCATED_SQL = f"""
SELECT r.id,
       set_config('{ALLOCATED_SETTING}' || r.id,
                  COALESCE(pg_sequence_last_value(r.sequence_name::regclass), 0)::text, false)
FROM streams_registry r
WHERE r.id = ANY(%(ids)s::int[])
"""

#: Statement 2 of a probe: pg_locks, then ``C`` from statement 1's values. Nothing here depends
#: on the order of evaluation: statement 1 has ended before this statement starts.
_PROBE_COMPLETE_SQL = f"""
SELECT r.name, a.allocated, c.complete,
       set_config('{COMPLETE_SETTING}' || r.id, c.complete::text, false)
FROM unnest(%(ids)s::int[], %(classes)s::bigint[]) AS k(id, lock_class)
JOIN streams_registry r ON r.id = k.id
CROSS JOIN LATERAL (
    SELECT current_setting('{ALLOCATED_SETTING}' || r.id)::bigint AS allocated
) AS a
CROSS JOIN LATERAL (
    -- objid holds L mod 2**32; L is the one value in [allocated + 1 - 2**31, allocated + 1 +
    -- 2**31). Not only <= allocated + 1: a writer that took its lock after statement 1 read
    -- the sequence has an L above it (its IDs are too, so it cannot lower C), and must not
    -- wrap around to a value 2**32 below (that read C as 0 while writers were busy).
    SELECT min(a.allocated + 1
               + ((l.objid::bigint - a.allocated - 1 + {_HALF_SPAN}) %% {RESERVATION_LOCK_SPAN}
                  + {RESERVATION_LOCK_SPAN}) %% {RESERVATION_LOCK_SPAN}
               - {_HALF_SPAN}) AS min_locked
    FROM pg_locks l
    WHERE {_RESERVATION_LOCKS} AND l.classid = k.lock_class::oid
) AS m
CROSS JOIN LATERAL (
    SELECT GREATEST(0, LEAST(a.allocated, COALESCE(m.min_locked - 1, a.allocated))) AS complete
) AS c
"""

#: Settings of every session that reads facts behind a probe (readers): READ COMMITTED, which the
#: probe argument needs; the statements that repeat (the probe, the page behind it) are prepared by
#: psycopg, and generic plans halved a caught-up reader's round trip (688 -> 349 us per probe,
#: measured); with statistics older than a stream's growth the planner read a page
#: ``stream_id > a AND stream_id <= b ... LIMIT n`` as a bitmap scan of the whole remaining range
#: plus a sort (100 ms per 5000-row page instead of 2 ms): the ordered primary-key scan is always
#: right for these statements.
READER_SESSION_SETUP = (
    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET plan_cache_mode = force_generic_plan",
    "SET enable_bitmapscan = off",
)


def probe_queries(infos: Sequence[StreamInfo]) -> list[Query]:
    """The statements of `probe`, for pipelining (see "the probe argument"): the rows of the
    *last* one go to `probes_from_rows`; more statements may follow them in the pipeline
    (`fetch_rows_after_probe`)."""
    return list(_probe_queries(tuple(info.id for info in infos)))


def _int_array(values: Iterable[int]) -> str:
    """An int array as a SQL literal. Readers look at PostgreSQL on every hint with the same
    arrays of stream ids, and psycopg spent ~20% of a caught-up reader's look adapting them as
    parameters; ints only, so nothing can be injected."""
    return "'{" + ",".join(str(int(value)) for value in values) + "}'"


@functools.lru_cache(maxsize=1024)
def _probe_queries(ids: tuple[int, ...]) -> tuple[Query, ...]:
    # pg_locks shows the int4 key as an unsigned oid.
    classes = [reservation_lock_class(i) % RESERVATION_LOCK_SPAN for i in ids]
    allocated = _PROBE_ALLOCATED_SQL.replace("%(ids)s", _int_array(ids))
    complete = _PROBE_COMPLETE_SQL.replace("%(ids)s", _int_array(ids)).replace(
        "%(classes)s", _int_array(classes)
    )
    # Rendered to bytes once: psycopg caches the conversion of a bytes query (empty parameters
    # still turn ``%%`` into ``%``).
    return (Query(allocated.encode(), ()), Query(complete.encode(), ()))


#: How many statements `probe_queries` returns (results before the rows behind a probe).
PROBE_STATEMENTS = 2


def probes_from_rows(rows: Sequence[Row]) -> dict[str, Probe]:
    return {
        name: Probe(name, int(allocated), int(complete)) for name, allocated, complete, _ in rows
    }


def probe(infos: Sequence[StreamInfo]) -> Gen[dict[str, Probe]]:
    """`Probe` every stream in ``infos`` in one round trip (no transaction is left open)."""
    results = yield Pipeline(probe_queries(infos))
    yield Commit()
    return probes_from_rows(results[-1])


#: Statement 3 of `prove`: record what statement 2 proved (forward-only) for every reader.
_RECORD_PROOF_SQL = f"""
INSERT INTO streams_proofs (stream, complete, proven_at)
SELECT k.id, current_setting('{COMPLETE_SETTING}' || k.id)::bigint, clock_timestamp()
FROM unnest(%(ids)s::int[]) AS k(id)
ON CONFLICT (stream) DO UPDATE
SET complete = GREATEST(streams_proofs.complete, EXCLUDED.complete),
    proven_at = EXCLUDED.proven_at
RETURNING stream
"""

#: Settings of the prober's session, on top of `READER_SESSION_SETUP`: a proof row that a crash
#: loses is recomputed by the next probe, and the facts it vouches for were durable before their
#: locks went away, so its commit need not wait for the WAL flush.
PROVER_SESSION_SETUP = ("SET synchronous_commit = off",)


def prove(infos: Sequence[StreamInfo]) -> Gen[dict[str, Probe]]:
    """`probe` every stream in ``infos`` and record the result in ``streams_proofs`` for the
    readers of other processes, in one round trip (see "shared proofs")."""
    queries = probe_queries(infos)
    queries.append(Query(_RECORD_PROOF_SQL, {"ids": [info.id for info in infos]}))
    results = yield Pipeline(queries)
    yield Commit()
    return probes_from_rows(results[PROBE_STATEMENTS - 1])


def try_become_prover(infos: Sequence[StreamInfo]) -> Gen[list[str]]:
    """Take the prober election lock of each stream that nobody holds (session-scoped: it is
    kept until `resign_prover` or the session ends); returns the names taken."""
    by_id = {info.id: info.name for info in infos}
    rows = yield Query(
        "SELECT k.id FROM unnest(%s::int[]) AS k(id) WHERE pg_try_advisory_lock(%s, k.id)",
        (list(by_id), PROOF_LOCK),
    )
    yield Commit()
    return sorted(by_id[int(row[0])] for row in rows)


def resign_prover(infos: Sequence[StreamInfo]) -> Gen[None]:
    """Release the prober election locks of ``infos`` that this session holds."""
    yield Query(
        "SELECT pg_advisory_unlock(%s, k.id) FROM unnest(%s::int[]) AS k(id)",
        (PROOF_LOCK, [info.id for info in infos]),
    )
    yield Commit()


def fetch_rows_after_proof(info: StreamInfo, after: int, limit: int) -> Query:
    """One statement: the shared proof of ``info`` and up to ``limit`` rows ``(stream_id,
    row_no, instance, ts, payload)`` after ``after`` and ``<=`` it, in (stream ID, row) order.

    Its rows are ``(complete, age_ms, *row)`` (``row`` all NULL when there is none); no rows at
    all when nobody has proven the stream yet. One snapshot serves both reads: see "shared
    proofs". ``age_ms``: how long ago (server clock) the prober last proved it. The stream is
    a literal, so the planner reads (and locks) only its partition; a value from the join
    would be pruned at run time, after every partition had been locked.
    """
    return Query(_proof_rows_sql(info.id), (after, limit))


@functools.lru_cache(maxsize=1024)
def _proof_rows_sql(stream_key: int) -> bytes:
    key = int(stream_key)
    return (
        "SELECT p.complete, "
        "(extract(epoch FROM clock_timestamp() - p.proven_at) * 1000)::bigint, "
        "f.stream_id, f.row_no, f.instance, f.ts, f.payload "
        "FROM streams_proofs p LEFT JOIN LATERAL ("
        "SELECT stream_id, row_no, instance, ts, payload::text AS payload FROM streams_facts "
        f"WHERE stream = {key} AND stream_id > %s AND stream_id <= p.complete "
        "ORDER BY stream_id, row_no LIMIT %s) AS f ON true "
        f"WHERE p.stream = {key}"
    ).encode()


def _range_literals(info: StreamInfo, after: int, through: int, limit: int) -> dict[str, Any]:
    """The integer bounds of a range scan as SQL literals (faster than parameters for range
    scans, measured; ints, so nothing can be injected)."""
    return {
        "stream": sql.Literal(int(info.id)),
        "after": sql.Literal(int(after)),
        "through": sql.Literal(int(through)),
        "limit": sql.Literal(int(limit)),
    }


def fetch_rows(info: StreamInfo, after: int, through: int, limit: int) -> Gen[list[Row]]:
    """Rows ``(stream_id, row_no, instance, ts, payload)`` of facts with
    ``after < stream_id <= through``, in (stream ID, row) order; ``payload`` as JSON text (the
    reader decodes a page's payloads in one call, cheaper than psycopg's loader per value).

    At most ``limit`` rows: a page may end in the middle of a fact's rows (see
    `streams.epochs`). `FactsPruned` if retention removed facts after ``after``. Bounds are
    inlined as literals: measurably faster than parameters for range scans, and they are ints,
    so nothing can be injected.
    """
    query = sql.SQL(
        "SELECT stream_id, row_no, instance, ts, payload::text FROM streams_facts "
        "WHERE stream = {stream} AND stream_id > {after} AND stream_id <= {through} "
        "ORDER BY stream_id, row_no LIMIT {limit}"
    ).format(**_range_literals(info, after, through, limit))
    # The stream's retention is read after the rows, in the same round trip (see "retention").
    rows, pruned = yield Pipeline([Query(query), retention_query([info])])
    yield Commit()
    check_retained(pruned, {info.name: after})
    return list(rows)


def fetch_rows_after_probe(info: StreamInfo, after: int, limit: int) -> Query:
    """Like `fetch_rows` up to the complete position the preceding `probe_query` of the same
    session remembered: pipelined behind it, a caught-up reader needs one round trip, and this
    statement's snapshot is still taken after the probe's pg_locks read, as the argument needs.

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
        "SELECT stream_id, row_no, instance, ts, payload::text FROM streams_facts "
        f"WHERE stream = {key} AND stream_id > %s "
        f"AND stream_id <= current_setting('{COMPLETE_SETTING}{key}')::bigint "
        "ORDER BY stream_id, row_no LIMIT %s"
    ).encode()


@dataclass(frozen=True, slots=True)
class LockHolder:
    """A session in a writing transaction on a stream (it holds a reservation lock)."""

    pid: int
    application_name: str
    state: str
    transaction_seconds: float


def reservation_lock_holders(info: StreamInfo) -> Gen[list[LockHolder]]:
    """The sessions holding the stream's reservation locks, oldest transaction first: what
    holds the stream's linear position back (for operators; readers only need `probe`).

    ``pg_locks`` and ``pg_stat_activity`` are read at different instants, and a session may not
    report its activity (``track_activities = off``): its transaction start may be unknown
    (reported as 0 seconds, state as the server gives it, e.g. ``disabled``), and a holder that
    ended in between is left out by the join.
    """
    rows = yield Query(
        f"""
        SELECT a.pid, COALESCE(a.application_name, ''), COALESCE(a.state, ''),
               COALESCE(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE {_RESERVATION_LOCKS} AND l.classid = %s::bigint::oid
        ORDER BY a.xact_start NULLS LAST, a.pid
        """,
        (reservation_lock_class(info.id) % RESERVATION_LOCK_SPAN,),
    )
    yield Commit()
    return [LockHolder(int(pid), app, state, float(age)) for pid, app, state, age in rows]


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
    rows = yield Query(
        "SELECT stream_id FROM streams_facts WHERE stream = %s AND ts >= %s "
        "ORDER BY ts, stream_id LIMIT 1",
        (info.id, ts_ms),
    )
    first = None if not rows else int(rows[0][0])
    for _ in range(TIME_START_STEPS):
        if first is None:
            break
        rows = yield Query(
            "SELECT min(w.stream_id) FROM (SELECT stream_id, ts FROM streams_facts "
            "WHERE stream = %s AND stream_id < %s ORDER BY stream_id DESC, row_no DESC "
            "LIMIT %s) AS w WHERE w.ts >= %s",
            (info.id, first, TS_FLOOR_WINDOW, ts_ms),
        )
        if rows[0][0] is None:
            break
        first = int(rows[0][0])
    else:
        rows = yield Query(
            "SELECT min(stream_id) FROM streams_facts "
            "WHERE stream = %s AND stream_id < %s AND ts >= %s",
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
        "SELECT min(stream_id) FROM streams_facts "
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
        "SELECT max(ts) FROM (SELECT ts FROM streams_facts WHERE stream = %s AND stream_id <= %s "
        "ORDER BY stream_id DESC LIMIT %s) AS recent",
        (info.id, position, TS_FLOOR_WINDOW),
    )
    yield Commit()
    return int(rows[0][0] or 0)


def persisted_writer_position(info: StreamInfo, instance: str) -> Gen[int | None]:
    """The position writer ``instance`` persisted (None if it never registered)."""
    rows = yield Query(
        "SELECT position FROM streams_writers WHERE stream = %s AND instance = %s",
        (info.id, instance),
    )
    yield Commit()
    return int(rows[0][0]) if rows else None


def database_time_ms() -> Gen[int]:
    rows = yield Query("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
    yield Commit()
    return int(rows[0][0])


# --- reader groups ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupRow:
    """A reader group's committed frontier on one stream and its lag behind the stream."""

    stream: str
    group: str
    position: int
    ts_floor: int
    lag: int
    updated_at: str
    #: Age in ms of the oldest fact the group has not consumed (None when it is caught up).
    lag_ms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "position": self.position,
            "lag": self.lag,
            "lag_ms": self.lag_ms,
            "updated_at": self.updated_at,
        }


def group_position(info: StreamInfo, group: str) -> Gen[tuple[int, int] | None]:
    """(position, ts_floor) committed by ``group`` on this stream, or None if it never did."""
    rows = yield Query(
        "SELECT position, ts_floor FROM streams_reader_groups "
        "WHERE stream = %s AND group_name = %s",
        (info.id, group),
    )
    yield Commit()
    return (int(rows[0][0]), int(rows[0][1])) if rows else None


def commit_group(info: StreamInfo, group: str, position: int, ts_floor: int) -> Gen[int]:
    """Record that ``group`` consumed everything ``<= position`` (forward-only); returns the
    committed position, which is higher than ``position`` if another reader committed more."""
    rows = yield Query(
        """
        INSERT INTO streams_reader_groups (stream, group_name, position, ts_floor)
        VALUES (%(stream)s, %(group)s, %(position)s, %(ts_floor)s)
        ON CONFLICT (stream, group_name) DO UPDATE
        SET position = GREATEST(streams_reader_groups.position, EXCLUDED.position),
            ts_floor = GREATEST(streams_reader_groups.ts_floor, EXCLUDED.ts_floor),
            updated_at = now()
        RETURNING position
        """,
        {"stream": info.id, "group": group, "position": position, "ts_floor": ts_floor},
    )
    yield Commit()
    return int(rows[0][0])


def delete_group(info: StreamInfo, group: str) -> Gen[bool]:
    rows = yield Query(
        "DELETE FROM streams_reader_groups WHERE stream = %s AND group_name = %s RETURNING 1",
        (info.id, group),
    )
    yield Commit()
    return bool(rows)


def list_groups(info: StreamInfo, linear: int | None = None) -> Gen[list[GroupRow]]:
    """Every group of the stream with its lag: the linear position (by `probe` unless given)
    minus the committed one."""
    if linear is None:
        probes = yield from probe([info])
        linear = probes[info.name].complete
    # The oldest unconsumed fact: the first one above the group's position (a primary-key
    # lookup), if it is complete.
    rows = yield Query(
        f"""
        SELECT g.group_name, g.position, g.ts_floor, g.updated_at,
               {_NOW_MS_SQL} - (SELECT f.ts FROM streams_facts f
                                 WHERE f.stream = g.stream AND f.stream_id > g.position
                                   AND f.stream_id <= %(linear)s
                                 ORDER BY f.stream_id LIMIT 1)
        FROM streams_reader_groups g
        WHERE g.stream = %(stream)s ORDER BY g.group_name
        """,
        {"stream": info.id, "linear": linear},
    )
    yield Commit()
    return [
        GroupRow(
            stream=info.name,
            group=name,
            position=int(position),
            ts_floor=int(ts_floor),
            lag=max(0, linear - int(position)),
            updated_at=updated_at.isoformat(),
            lag_ms=None if lag_ms is None else max(0, int(lag_ms)),
        )
        for name, position, ts_floor, updated_at, lag_ms in rows
    ]


def stream_positions(info: StreamInfo, *, retire: bool = True) -> Gen[StreamPositions]:
    """Positions of a stream: linear, max allocated and every writer's row."""
    if retire:
        yield from retire_expired_writers(info)
    # One statement: max allocated always comes back, with one row per writer (or one row
    # of NULL writer columns when the stream has none).
    rows = yield Query(
        sql.SQL(
            """
            SELECT {max_allocated}, w.instance, w.generation, w.position, w.retired,
                   (extract(epoch FROM w.lease_expires_at - clock_timestamp()) * 1000)::bigint,
                   w.pending,
                   (extract(epoch FROM clock_timestamp() - w.heartbeat_at) * 1000)::bigint,
                   (SELECT r.pruned_through FROM streams_registry r WHERE r.id = %s)
            FROM (SELECT 1) AS one
            LEFT JOIN streams_writers w ON w.stream = %s
            ORDER BY w.instance
            """
        ).format(max_allocated=max_allocated_sql(info)),
        (info.id, info.id),
    )
    yield Commit()
    max_allocated = int(rows[0][0])
    writers = {
        row[1]: WriterRow(
            instance=row[1],
            generation=row[2],
            position=row[3],
            retired=row[4],
            lease_expires_in_ms=row[5],
            pending=row[6],
            heartbeat_age_ms=row[7],
        )
        for row in rows
        if row[1] is not None
    }
    probes = yield from probe([info])
    groups = yield from list_groups(info, probes[info.name].complete)
    holders = yield from reservation_lock_holders(info)
    return StreamPositions(
        stream=info.name,
        linear=probes[info.name].complete,
        max_allocated=max(max_allocated, probes[info.name].max_allocated),
        writers=writers,
        persisted_linear=linear_from(
            [w.position for w in writers.values() if not w.retired], max_allocated
        ),
        groups=tuple(groups),
        oldest_pending_ms=(
            round(max(h.transaction_seconds for h in holders) * 1000) if holders else None
        ),
        pruned_through=int(rows[0][8] or 0),
    )


def prune_writers(info: StreamInfo, older_than_ms: int) -> Gen[list[str]]:
    """Delete the rows of writers retired more than ``older_than_ms`` ago (by their last
    heartbeat). Safe: a retired writer is fenced whether or not its row exists (its
    transactions find no row at their generation), and a process that registers the same
    name again starts a new row at the linear position."""
    rows = yield Query(
        "DELETE FROM streams_writers WHERE stream = %s AND retired "
        "AND heartbeat_at < clock_timestamp() - make_interval(secs => %s) RETURNING instance",
        (info.id, older_than_ms / 1000),
    )
    yield Commit()
    return sorted(row[0] for row in rows)


# --- batch ranges (Spark source and other batch readers) ---------------------------------------
# Readers that plan a whole range of complete positions up front (the Spark source) rather than
# page by page. Bounds are ints inlined as literals (see `fetch_rows`).


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
        "SELECT DISTINCT stream_id FROM streams_facts "
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
        "SELECT percentile_disc({fractions}::float8[]) WITHIN GROUP (ORDER BY stream_id) "
        "FROM streams_facts "
        "WHERE stream = {stream} AND stream_id > {after} AND stream_id <= {through}"
    ).format(
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
    stream_key: int, after: int, through: int, *, running_ts_floor: int | None = None
) -> str:
    """The text of a query for every row of the facts in ``(after, through]`` of the stream
    with registry id ``stream_key``, as ``stream_id, row_no, instance, ts, payload`` in (stream
    ID, row) order, the payload as JSON text.

    For executors that run it with another driver (ADBC returns JSONB as an extension type,
    hence ``::text``). With ``running_ts_floor``, ``ts`` is the running maximum the readers
    report (`streams.epochs`), starting from that floor: rows of one fact share their writer's
    timestamp, so the maximum over rows equals the maximum over facts. Plain text, not
    `psycopg.sql`: every value is an int, so nothing can be injected.
    """
    key, low, high = int(stream_key), int(after), int(through)
    if running_ts_floor is None:
        ts = "ts"
    else:
        ts = (
            f"GREATEST({int(running_ts_floor)}::bigint, max(ts) OVER "
            "(ORDER BY stream_id, row_no ROWS UNBOUNDED PRECEDING))"
        )
    return (
        f"SELECT stream_id, row_no, instance, {ts} AS ts, payload::text AS payload "
        f"FROM streams_facts WHERE stream = {key} AND stream_id > {low} "
        f"AND stream_id <= {high} ORDER BY stream_id, row_no"
    )


# --- retention --------------------------------------------------------------------------------
#
# A stream with ``retention_ms`` keeps its facts for that long; `prune` removes older ones in
# short transactions of about `PRUNE_BATCH` rows (row locks only, no table lock: appends and
# reads go on). Each transaction moves the stream's ``pruned_through`` (every fact <= it may be
# gone) forward together with the rows it deletes, so a statement sees both or neither. A read
# of the rows after ``p`` followed, in a *later* statement, by ``pruned_through <= p`` lost
# nothing: any prune that deleted from that range had committed a watermark above ``p`` before
# the read's snapshot, hence before the later statement's (`retention_query`, `check_retained`).
#
# Retention never passes: the stream's complete position (a pending ID below it could still
# commit, into a range readers would never read again), nor any reader group's committed
# position (Materialize's AllowCompaction: a group's frontier holds the stream's "since" back).
# A group already below ``pruned_through`` lost facts and holds nothing back. Readers without a
# group are not waited for: one that falls behind retention gets `FactsPruned`, as a Kafka
# consumer gets OffsetOutOfRange. Rows are deleted, in short transactions, rather than dropped
# as time partitions: each stream has its own partition of streams_facts (revision 0006), whose
# indexes it appends to at the right edge, so the pages a prune empties are recycled by the
# appends that follow (``streams bench history``: the indexes stop growing after the first
# prune-and-refill cycle; in one table shared by all streams they grew every cycle, because
# every stream but the last-created one appended in the middle of the shared indexes). Time
# partitions within a stream would need DDL as the stream grows.

#: Rows removed per transaction by `prune_step`.
PRUNE_BATCH = 10_000


@dataclass(frozen=True, slots=True)
class PruneTarget:
    """How far retention lets a stream be pruned now, and what holds it there."""

    stream: str
    pruned_through: int
    target: int
    #: ``retention`` (facts newer than the retention period), ``complete position``,
    #: ``group <name>``, or ``no retention`` (the stream keeps everything).
    limited_by: str


def retention_query(infos: Sequence[StreamInfo]) -> Query:
    """``(name, pruned_through)`` of each stream: pipelined *after* a read of rows, for
    `check_retained` (see the retention argument above)."""
    return _retention_query(tuple(info.id for info in infos))


@functools.lru_cache(maxsize=1024)
def _retention_query(ids: tuple[int, ...]) -> Query:
    where = f"id = ANY({_int_array(ids)}::int[])"
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
    ``stream_key``: for executors that read rows with another driver and check, in a later
    statement, that retention removed nothing they needed (see `range_rows_sql`)."""
    return f"SELECT pruned_through FROM streams_registry WHERE id = {int(stream_key)}"


def pruned_positions(infos: Sequence[StreamInfo]) -> Gen[dict[str, int]]:
    """Every stream's ``pruned_through`` (0: nothing was ever pruned)."""
    rows = yield retention_query(infos)
    yield Commit()
    return check_retained(rows, {})


def prune_target(info: StreamInfo, now_ms: int | None = None) -> Gen[PruneTarget]:
    """How far `prune` may go now: facts older than the retention period (by the database's
    clock, or ``now_ms``), capped by the complete position and every reader group that has not
    already lost facts."""
    probes = yield from probe([info])
    complete = probes[info.name].complete
    rows = yield Query(
        f"""
        SELECT r.pruned_through, {_NOW_MS_SQL},
               (SELECT g.position FROM streams_reader_groups g
                WHERE g.stream = r.id AND g.position >= r.pruned_through
                ORDER BY g.position, g.group_name LIMIT 1),
               (SELECT g.group_name FROM streams_reader_groups g
                WHERE g.stream = r.id AND g.position >= r.pruned_through
                ORDER BY g.position, g.group_name LIMIT 1)
        FROM streams_registry r WHERE r.id = %s
        """,
        (info.id,),
    )
    yield Commit()
    if not rows:
        raise UnknownStream(info.name)
    pruned, db_now, group_position, group_name = rows[0]
    pruned = int(pruned)
    if info.retention_ms is None:
        return PruneTarget(info.name, pruned, pruned, "no retention")
    cutoff = (int(db_now) if now_ms is None else now_ms) - info.retention_ms
    before = yield from position_before_time(info, cutoff)
    limits = [(complete, "complete position")]
    if before is not None:
        limits.append((before, "retention"))
    if group_position is not None:
        limits.append((int(group_position), f"group {group_name}"))
    target, limited_by = min(limits, key=lambda limit: limit[0])
    if before is None and target == complete:
        limited_by = "complete position (every fact is older than the retention period)"
    return PruneTarget(info.name, pruned, max(pruned, target), limited_by)


def prune_step(info: StreamInfo, target: int, batch: int = PRUNE_BATCH) -> Gen[tuple[int, int]]:
    """One short transaction: delete about ``batch`` rows after the stream's ``pruned_through``
    and no further than ``target`` or the lowest group that has not lost facts (read again here:
    a group may have been created since `prune_target`), moving ``pruned_through`` with them.
    Returns ``(pruned_through, rows deleted)``."""
    rows = yield Query(
        "SELECT pruned_through FROM streams_registry WHERE id = %s FOR NO KEY UPDATE", (info.id,)
    )
    if not rows:
        yield Commit()
        raise UnknownStream(info.name)
    old = int(rows[0][0])
    rows = yield Query(
        """
        SELECT LEAST(%(target)s::bigint,
                     (SELECT min(position) FROM streams_reader_groups
                      WHERE stream = %(stream)s AND position >= %(old)s),
                     (SELECT stream_id FROM streams_facts
                      WHERE stream = %(stream)s AND stream_id > %(old)s
                      ORDER BY stream_id, row_no OFFSET %(batch)s LIMIT 1))
        """,
        {"stream": info.id, "old": old, "target": target, "batch": batch},
    )
    new = int(rows[0][0])
    deleted = 0
    if new > old:
        yield Query("UPDATE streams_registry SET pruned_through = %s WHERE id = %s", (new, info.id))
        rows = yield Query(
            "WITH d AS (DELETE FROM streams_facts "
            "WHERE stream = %s AND stream_id > %s AND stream_id <= %s RETURNING 1) "
            "SELECT count(*) FROM d",
            (info.id, old, new),
        )
        deleted = int(rows[0][0])
    yield Commit()
    return max(old, new), deleted


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What one `prune` of a stream did."""

    stream: str
    #: ``pruned_through`` before and after.
    before: int
    after: int
    #: How far retention allowed, and what held it there (`PruneTarget`).
    target: int
    limited_by: str
    rows_deleted: int
    transactions: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "pruned_through_before": self.before,
            "pruned_through": self.after,
            "target": self.target,
            "limited_by": self.limited_by,
            "rows_deleted": self.rows_deleted,
            "transactions": self.transactions,
        }


def prune(
    info: StreamInfo, *, batch: int = PRUNE_BATCH, now_ms: int | None = None
) -> Gen[PruneResult]:
    """Apply the stream's retention: `prune_step` after `prune_step` up to `prune_target`."""
    if batch < 1:
        raise ValueError("batch must be a positive number of rows")
    goal = yield from prune_target(info, now_ms)
    position, deleted, transactions = goal.pruned_through, 0, 0
    while position < goal.target:
        reached, rows = yield from prune_step(info, goal.target, batch)
        transactions += 1
        deleted += rows
        if reached <= position:
            break  # a group holds it (created since the target was computed)
        position = reached
    return PruneResult(
        info.name, goal.pruned_through, position, goal.target, goal.limited_by, deleted,
        transactions,
    )  # fmt: skip
