"""The PostgreSQL side of streams: registry, positions and writer retirement, as generators.

Tables (created by the Alembic migrations in ``migrations/``):

* ``streams_registry``: one row per stream, naming its own sequence.
* ``streams_facts``: the built-in facts table, one or more rows per fact.
* ``streams_writers``: one row per (stream, writer instance): its generation, its persisted
  per-writer position (forward-only) and its lease.
* ``streams_reader_groups``: committed positions of named reader groups.

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

The alternative (transaction-ID snapshots with ``pg_current_snapshot``) needs every fact to
record its ``xid`` and readers to reason about snapshots; row locks put the whole proof in one
place the database already enforces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from ._ops import Commit, Gen, Query
from .config import validate_stream_name
from .errors import SchemaNotReady, StreamExists, UnknownStream
from .positions import sequence_repair_target
from .timestamps import TimestampMode

__all__ = [
    "StreamInfo",
    "StreamPositions",
    "WriterRow",
    "create_stream",
    "drop_stream",
    "linear_position",
    "list_streams",
    "load_stream",
    "repair_sequence",
    "retire_expired_writers",
    "stream_positions",
]

ALEMBIC_HEAD = "0001_initial"


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """A stream's registry row."""

    id: int
    name: str
    sequence_name: str
    timestamping: TimestampMode
    uncapped: bool
    retention_ms: int | None

    @property
    def sequence(self) -> sql.Identifier:
        return sql.Identifier(self.sequence_name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "timestamping": str(self.timestamping),
            "uncapped": self.uncapped,
            "retention_ms": self.retention_ms,
        }


@dataclass(frozen=True, slots=True)
class WriterRow:
    instance: str
    generation: int
    position: int
    retired: bool
    lease_expires_in_ms: int
    pending: int = 0


@dataclass(frozen=True, slots=True)
class StreamPositions:
    """What `positions(stream)` reports; every figure read in one database snapshot."""

    stream: str
    linear: int
    max_allocated: int
    writers: Mapping[str, WriterRow]

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "linear": self.linear,
            "max_allocated": self.max_allocated,
            "writers": {
                name: {
                    "position": row.position,
                    "generation": row.generation,
                    "retired": row.retired,
                    "lease_expires_in_ms": row.lease_expires_in_ms,
                    "pending": row.pending,
                }
                for name, row in sorted(self.writers.items())
            },
        }


_STREAM_COLUMNS = "id, name, sequence_name, timestamping, uncapped, retention_ms"


def _stream_from_row(row: tuple[Any, ...]) -> StreamInfo:
    return StreamInfo(
        id=row[0],
        name=row[1],
        sequence_name=row[2],
        timestamping=TimestampMode(row[3]),
        uncapped=row[4],
        retention_ms=row[5],
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


def load_stream(name: str) -> Gen[StreamInfo]:
    validate_stream_name(name)
    rows = yield Query(
        f"SELECT {_STREAM_COLUMNS} FROM streams_registry WHERE name = %s",
        (name,),
    )
    if not rows:
        raise UnknownStream(name)
    return _stream_from_row(rows[0])


def list_streams() -> Gen[list[StreamInfo]]:
    rows = yield Query(f"SELECT {_STREAM_COLUMNS} FROM streams_registry ORDER BY name")
    return [_stream_from_row(row) for row in rows]


def create_stream(
    name: str,
    *,
    timestamping: TimestampMode | str = TimestampMode.CLIENT_PREFER,
    uncapped: bool = False,
    retention_ms: int | None = None,
    exist_ok: bool = True,
) -> Gen[StreamInfo]:
    """Create a stream and its sequence (idempotent when the settings match)."""
    validate_stream_name(name)
    mode = TimestampMode(timestamping)
    if retention_ms is not None and (isinstance(retention_ms, bool) or retention_ms <= 0):
        raise ValueError("retention_ms must be a positive number of milliseconds or None")
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
        ):
            raise StreamExists(f"stream {name!r} exists already with settings {existing.as_dict()}")
        yield Commit()
        return existing
    rows = yield Query("SELECT nextval(pg_get_serial_sequence('streams_registry', 'id'))")
    stream_key = int(rows[0][0])
    rows = yield Query(
        f"""
        INSERT INTO streams_registry
            (id, name, sequence_name, timestamping, uncapped, retention_ms)
        OVERRIDING SYSTEM VALUE
        VALUES (%s, %s, %s, %s, %s, %s)
        RETURNING {_STREAM_COLUMNS}
        """,
        (stream_key, name, f"streams_seq_{stream_key}", str(mode), uncapped, retention_ms),
    )
    info = _stream_from_row(rows[0])
    # Synapse's pitfall: a fresh sequence's START value is not "allocated" until nextval is
    # called (pg_sequence_last_value() is NULL until then), so nothing may assume ID 1 exists.
    yield Query(
        sql.SQL("CREATE SEQUENCE {} AS bigint MINVALUE 1 START WITH 1 NO CYCLE").format(
            info.sequence
        )
    )
    yield Commit()
    return info


def drop_stream(name: str) -> Gen[bool]:
    rows = yield Query(
        "DELETE FROM streams_registry WHERE name = %s RETURNING id, sequence_name", (name,)
    )
    if rows:
        yield Query("DELETE FROM streams_facts WHERE stream = %s", (rows[0][0],))
        yield Query(sql.SQL("DROP SEQUENCE IF EXISTS {}").format(sql.Identifier(rows[0][1])))
    yield Commit()
    return bool(rows)


def max_allocated_sql(info: StreamInfo) -> sql.Composed:
    """``pg_sequence_last_value`` is NULL before the first nextval: that means 0 allocated."""
    return sql.SQL("COALESCE(pg_sequence_last_value({}::regclass), 0)").format(
        sql.Literal(info.sequence_name)
    )


def repair_sequence(info: StreamInfo) -> Gen[int | None]:
    """Move the sequence past the stored facts if it is behind them; returns the new value.

    Runs under the stream's advisory lock (the caller's transaction), so two starting writers
    do not both repair.
    """
    rows = yield Query(
        sql.SQL(
            "SELECT pg_sequence_last_value({}::regclass), "
            "(SELECT max(stream_id) FROM streams_facts WHERE stream = %s)"
        ).format(sql.Literal(info.sequence_name)),
        (info.id,),
    )
    target = sequence_repair_target(rows[0][0], rows[0][1])
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
    """The linear position: the minimum persisted position over writers that are not retired.

    With no live writer everything allocated has completed. Persisted positions are only ever
    values that were true when written, so the minimum is a safe (possibly slightly old)
    reading.
    """
    return min([*live_positions, max_allocated])


def linear_position(info: StreamInfo) -> Gen[tuple[int, int]]:
    """(linear position, max allocated) from the database alone, in one statement."""
    rows = yield Query(
        sql.SQL(
            "SELECT array(SELECT position FROM streams_writers WHERE stream = %s AND NOT retired),"
            " {}"
        ).format(max_allocated_sql(info)),
        (info.id,),
    )
    positions, max_allocated = rows[0]
    return linear_from(list(positions), int(max_allocated)), int(max_allocated)


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
                   w.pending
            FROM (SELECT 1) AS one
            LEFT JOIN streams_writers w ON w.stream = %s
            ORDER BY w.instance
            """
        ).format(max_allocated=max_allocated_sql(info)),
        (info.id,),
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
        )
        for row in rows
        if row[1] is not None
    }
    linear = linear_from([w.position for w in writers.values() if not w.retired], max_allocated)
    return StreamPositions(
        stream=info.name, linear=linear, max_allocated=max_allocated, writers=writers
    )
