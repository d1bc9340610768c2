"""Writer rows, sequences and their repair: who may still complete IDs.

``streams_writers`` has one row per (stream, writer instance): its generation, its persisted
position (forward-only) and its lease. This module reads and retires those rows, repairs a
sequence set back by a restore, and ends the sessions of writers whose lease expired. A
writer's own statements are in `streams.store.writer_sql` and `streams.store.writer_core`.

The arguments: docs/design/fencing.md (a retired writer completes no ID) and
docs/design/liveness.md (no stream stalls past a writer's lease).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from psycopg import sql

from ..core.constants import (
    REGISTRATION_LOCK,
    WRITER_LOCK,
)
from ..core.positions import sequence_repair_target
from ..errors import StoreError
from ..types import FactTable, StreamInfo
from ._common import MAY_END_SESSION
from .driver import Commit, Gen, Query
from .rows import partition_sql


def max_allocated_sql(info: StreamInfo) -> sql.Composed:
    """``pg_sequence_last_value`` is NULL before the first nextval: that means 0 allocated."""
    return sql.SQL("COALESCE(pg_sequence_last_value({}::regclass), 0)").format(
        sql.Literal(info.sequence_name)
    )


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


def _filter_params(tables: list[FactTable], params: dict[str, object]) -> dict[str, object]:
    """``params`` and the value of each declared table's filter, as ``where_<i>`` for the
    ``i``-th table (`FactTable.max_sql`, `FactTable.ids_sql`): a parameter, never SQL text."""
    for i, table in enumerate(tables):
        params.update(table.params(f"where_{i}"))
    return params


def sequence_state(info: StreamInfo, *, commit: bool = True) -> Gen[SequenceState]:
    """Read everything sequence repair needs, in one statement: the sequence, the largest ID in
    ``streams_facts`` and in each declared table, and the largest writer and group position (a
    writer persists positions up to max allocated; a group commits up to the linear position;
    both mean those IDs were handed out) or ``pruned_through`` (retention removed facts up to
    it: they existed even when no row is left).

    A declared table gives ``max(column) FROM table``, or, declared with a filter (a table
    shared by several streams), ``max(column) FROM table WHERE where_column = %(where_<i>)s``
    with the value as a parameter: only this stream's rows, so another stream's IDs in the
    same table do not move this stream's sequence. Index ``(where_column, column)`` (or
    ``(column)`` without a filter) so that each is one index probe.

    What stays invisible: facts in a table the stream does not declare (or rows its filter
    leaves out). `streams doctor` reports how many IDs have no row anywhere it can see
    (rollbacks, or such a table).
    """
    present, missing = yield from _existing_fact_tables(info)
    params = _filter_params(present, {"stream": info.id})
    maxima = [
        sql.SQL("(SELECT max(stream_id) FROM {} WHERE stream = %(stream)s)").format(
            sql.SQL(partition_sql(info.id))
        ),
        *(t.max_sql(f"where_{i}") for i, t in enumerate(present)),
    ]
    rows = yield Query(
        sql.SQL(
            "SELECT pg_sequence_last_value({seq}::regclass), GREATEST({maxima})::bigint, "
            "GREATEST((SELECT max(position) FROM streams_writers WHERE stream = %(stream)s), "
            "(SELECT max(position) FROM streams_reader_groups WHERE stream = %(stream)s), "
            "(SELECT NULLIF(pruned_through, 0) FROM streams_registry WHERE id = %(stream)s))"
        ).format(seq=sql.Literal(info.sequence_name), maxima=sql.SQL(", ").join(maxima)),
        params,
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
    declared table (only its rows of the stream, for a declaration with a filter): rolled back,
    or facts in a table the stream does not declare."""

    ids: int
    unseen: int


def unseen_ids(info: StreamInfo, window: int) -> Gen[UnseenIds]:
    """Count the most recent ``window`` allocated IDs that no known table holds (`doctor`)."""
    present, _ = yield from _existing_fact_tables(info)
    tables: list[sql.Composable] = [
        sql.SQL("SELECT stream_id FROM {} WHERE stream = %(stream)s").format(
            sql.SQL(partition_sql(info.id))
        ),
        *(t.ids_sql(f"where_{i}") for i, t in enumerate(present)),
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
        _filter_params(present, {"stream": info.id, "window": window}),
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
    and sequence repair of one stream run one at a time (`streams.core.constants`)."""
    yield Query("SELECT pg_advisory_xact_lock(%s, %s)", (REGISTRATION_LOCK, info.id))


def repair_sequence_now(info: StreamInfo) -> Gen[int | None]:
    """`repair_sequence` in a transaction of its own, under the registration lock (for
    ``streams doctor --repair``); returns the new value, or None."""
    yield from registration_lock(info)
    target = yield from repair_sequence(info)
    yield Commit()
    return target


def repair_sequence(info: StreamInfo) -> Gen[int | None]:
    """Move the sequence past every ID known to be used if it is behind; returns the new
    value (None: it was not behind).

    The database moves it (``streams_repair_sequence``, revision 0015), forward only, to the
    highest ID it holds for the stream (facts, writers' and groups' positions, how far
    retention pruned) or the highest ID of the stream's declared tables, which this session
    reads (they are the application's: the function cannot) and hands over. Roles that may
    not set a sequence themselves (writers, operators: ``UPDATE`` would let them set it back)
    repair through it; it checks that the login may write this stream or is an operator.

    Runs in the caller's transaction under the stream's registration lock, so two starting
    writers do not both repair. ``setval`` is not transactional: the repair stands even if the
    caller's transaction rolls back, which is what it should do.
    """
    present, _ = yield from _existing_fact_tables(info)
    seen: int | None = None
    if present:
        rows = yield Query(
            sql.SQL("SELECT GREATEST({})::bigint").format(
                sql.SQL(", ").join(t.max_sql(f"where_{i}") for i, t in enumerate(present))
            ),
            _filter_params(present, {}),
        )
        seen = None if rows[0][0] is None else int(rows[0][0])
    rows = yield Query("SELECT streams_repair_sequence(%s, %s)", (info.id, seen))
    return None if rows[0][0] is None else int(rows[0][0])


def writer_lock_sql(stream: sql.Composable, instance: sql.Composable) -> sql.Composed:
    """Take the writer's own lock (`WRITER_LOCK`, see docs/design/liveness.md) for the rest of
    the transaction: ``stream`` and ``instance`` are SQL expressions (parameters, columns)."""
    return sql.SQL("pg_advisory_xact_lock_shared({cls}, {key})").format(
        cls=sql.Literal(WRITER_LOCK), key=writer_lock_key(stream, instance)
    )


def writer_lock_key(stream: sql.Composable, instance: sql.Composable) -> sql.Composed:
    return sql.SQL("hashtext(({stream})::text || '/' || ({instance}))").format(
        stream=stream, instance=instance
    )


#: Milliseconds `end_expired_sessions` waits for each ended session to be gone.
END_SESSION_WAIT_MS = 1000


def end_expired_sessions(
    info: StreamInfo, instance: str | None = None
) -> Gen[list[tuple[str, int]]]:
    """End the sessions still in a transaction of a writer of ``info`` (or of ``instance``
    only) whose lease has expired, so that its retirement can go through (see "the liveness
    argument"); returns ``(instance, pid)`` of each session ended.

    Reads ``pg_locks`` only when there is an expired writer that is not retired: a nested loop
    over the (usually empty) set of such writers. Skips sessions the caller may not signal.
    """
    rows = yield Query(
        sql.SQL(
            """
            WITH expired AS (
                SELECT w.stream, w.instance FROM streams_writers w
                WHERE w.stream = %(stream)s AND NOT w.retired
                  AND w.lease_expires_at < clock_timestamp()
                  AND (%(instance)s::text IS NULL OR w.instance = %(instance)s)
            )
            SELECT e.instance, h.pid, pg_terminate_backend(h.pid, {wait})
            FROM expired e
            CROSS JOIN LATERAL (
                SELECT l.pid FROM pg_locks l
                JOIN pg_stat_activity a ON a.pid = l.pid
                WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
                  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                  AND l.classid = {cls}::bigint::oid
                  AND l.objid = ({key}::bigint & 4294967295)::oid
                  AND l.pid <> pg_backend_pid()
                  AND {may_end}
            ) h
            """
        ).format(
            wait=sql.Literal(END_SESSION_WAIT_MS),
            may_end=sql.SQL(MAY_END_SESSION),
            cls=sql.Literal(WRITER_LOCK),
            key=writer_lock_key(sql.SQL("e.stream"), sql.SQL("e.instance")),
        ),
        {"stream": info.id, "instance": instance},
    )
    yield Commit()
    return [(str(name), int(pid)) for name, pid, _ in rows]


def retire_expired_writers(info: StreamInfo) -> Gen[list[str]]:
    """Retire writers whose lease has expired, ending first what they still hold open.

    ``FOR UPDATE SKIP LOCKED`` skips a writer whose transaction is still open (it holds
    ``FOR KEY SHARE`` on its row): that transaction may still commit, so the writer is not
    caught up yet. The server aborts it when the connection dies, when it has been idle or run
    a statement for the lease, and otherwise `end_expired_sessions` ends its session first (see
    docs/design/liveness.md); a writer whose session could not be ended is retired by a later
    call.
    """
    yield from end_expired_sessions(info)
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


log = logging.getLogger("streams.writer")

#: SQLSTATE of "insufficient privilege": a caller that may not retire writers (a read-only
#: role) leaves it to others.
NOT_ALLOWED = "42501"


def retire_if_allowed(info: StreamInfo, who: str = "this role") -> Gen[list[str]]:
    """`retire_expired_writers`, for a caller that only reads otherwise (a reader, the prover,
    the Spark source, ``streams positions``): a role that may not retire writers (a
    ``streams_reader``) gets one warning per stream and carries on, since writers' heartbeats
    and the roles that may (prover, operator) retire them."""
    try:
        return (yield from retire_expired_writers(info))
    except StoreError as exc:
        if exc.sqlstate != NOT_ALLOWED:
            raise
        if info.name not in _WARNED:
            _WARNED.add(info.name)
            log.warning("stream %r: %s may not retire expired writers: %s", info.name, who, exc)
        return []


_WARNED: set[str] = set()


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


def persisted_writer_position(info: StreamInfo, instance: str) -> Gen[int | None]:
    """The position writer ``instance`` persisted (None if it never registered)."""
    rows = yield Query(
        "SELECT position FROM streams_writers WHERE stream = %s AND instance = %s",
        (info.id, instance),
    )
    yield Commit()
    return int(rows[0][0]) if rows else None


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
