"""Reader groups and the positions report (`streams positions`).

``streams_reader_groups`` holds each named group's committed position per stream (Kafka's
consumer groups; a Spark query is a group too) and, in ``updated_at``, the time of its last
commit (every commit sets it, even one that moves nothing): `list_groups` reports how long each
group has been idle and whether it is stale (`streams.core.groups`). `stream_positions` is
everything ``streams positions`` shows of one stream, read in one database snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from ..core.groups import STALE_AFTER_MS, holds_retention, is_stale, retention_goal
from ._common import NOW_MS_SQL
from .driver import Commit, Gen, Query
from .probe import probe
from .registry import DEFAULT_KEY_WINDOW_MS, StreamInfo
from .rows import position_before_time
from .writers import (
    linear_from,
    max_allocated_sql,
    reservation_lock_holders,
    retire_expired_writers,
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
    #: How long an append's idempotency key names it (`streams.store.idempotency`).
    key_window_ms: int = DEFAULT_KEY_WINDOW_MS

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
            "key_window_ms": self.key_window_ms,
            "groups": {g.group: g.as_dict() for g in self.groups},
            "writers": {name: row.as_dict() for name, row in shown.items()},
            "retired_writers": sum(w.retired for w in self.writers.values()),
        }


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
    #: Milliseconds since the group's last commit (``updated_at``, by the database's clock).
    idle_ms: int = 0
    #: It stops `prune` short of what the stream's retention period allows
    #: (`streams.core.groups.holds_retention`).
    holds_retention: bool = False
    #: Idle for the stale-after time while holding retention back (`streams.core.groups`).
    stale: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "position": self.position,
            "lag": self.lag,
            "lag_ms": self.lag_ms,
            "updated_at": self.updated_at,
            "idle_ms": self.idle_ms,
            "holds_retention": self.holds_retention,
            "stale": self.stale,
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


def commit_group(group: str, commits: Sequence[tuple[StreamInfo, int, int]]) -> Gen[dict[str, int]]:
    """Record that ``group`` consumed everything ``<= position`` of each stream, given as
    ``(info, position, ts_floor)``: one statement, one transaction, so a reader of several
    streams commits all of them or none. Forward-only; returns the committed position by
    stream name, higher than the one given where another reader committed more."""
    by_id = {info.id: info.name for info, _, _ in commits}
    rows = yield Query(
        """
        INSERT INTO streams_reader_groups (stream, group_name, position, ts_floor)
        SELECT c.stream, %(group)s, c.position, c.ts_floor
        FROM unnest(%(streams)s::integer[], %(positions)s::bigint[], %(floors)s::bigint[])
             AS c(stream, position, ts_floor)
        ON CONFLICT (stream, group_name) DO UPDATE
        SET position = GREATEST(streams_reader_groups.position, EXCLUDED.position),
            ts_floor = GREATEST(streams_reader_groups.ts_floor, EXCLUDED.ts_floor),
            updated_at = now()
        RETURNING stream, position
        """,
        {
            "group": group,
            "streams": [info.id for info, _, _ in commits],
            "positions": [position for _, position, _ in commits],
            "floors": [floor for _, _, floor in commits],
        },
    )
    yield Commit()
    return {by_id[int(stream)]: int(position) for stream, position in rows}


#: Marker of the text cast by which `commit_group_in` fails the caller's transaction.
GROUP_MOVED = "streams-group-moved"


def commit_group_in(
    group: str, commits: Sequence[tuple[StreamInfo, int, int, int | None]]
) -> Gen[dict[str, int]]:
    """`commit_group` inside the caller's transaction, *exactly* from where this reader left
    the group: ``(info, position, ts_floor, base)`` per stream, ``base`` being the group's
    position when this reader opened it or last committed it (None: the group had no row).

    Why a consumer that writes its effects and this commit in one transaction applies each fact
    once (the group argument): the row of each stream moves from ``base`` to ``position`` only
    where it still holds ``base``; ``ON CONFLICT DO UPDATE`` locks the row and judges its
    newest committed version, so of two consumers that read the same facts from ``base``
    (a stale process and its replacement, two processes of one group) the second to commit
    waits for the first, finds the row moved, and fails: the statement raises
    (`GROUP_MOVED`), which fails the caller's whole transaction, its effects with it. And the
    position commits or rolls back with the effects, so a consumer killed at any point has
    either committed both (it resumes after them) or neither (it resumes at ``base`` and applies
    them again, for the first time as far as the database knows). Forward-only as
    `commit_group`: a position below the row's never lowers it. Returns the committed position by
    stream name."""
    by_id = {info.id: info.name for info, _, _, _ in commits}
    rows = yield Query(
        f"""
        WITH c AS (
            SELECT * FROM unnest(%(streams)s::integer[], %(positions)s::bigint[],
                                 %(floors)s::bigint[], %(bases)s::bigint[])
                   AS c(stream, position, ts_floor, base)
        ), i AS (
            INSERT INTO streams_reader_groups AS g (stream, group_name, position, ts_floor)
            SELECT c.stream, %(group)s, c.position, c.ts_floor FROM c
            ON CONFLICT (stream, group_name) DO UPDATE
            SET position = GREATEST(g.position, EXCLUDED.position),
                ts_floor = GREATEST(g.ts_floor, EXCLUDED.ts_floor),
                updated_at = now()
            WHERE g.position = (SELECT c.base FROM c WHERE c.stream = g.stream)
            RETURNING g.stream, g.position
        )
        SELECT c.stream,
               CASE WHEN i.stream IS NOT NULL THEN i.position
                    ELSE ('{GROUP_MOVED} ' || c.stream || ' ' || COALESCE(c.base, -1))::bigint
               END
        FROM c LEFT JOIN i ON i.stream = c.stream
        """,
        {
            "group": group,
            "streams": [info.id for info, _, _, _ in commits],
            "positions": [position for _, position, _, _ in commits],
            "floors": [floor for _, _, floor, _ in commits],
            "bases": [base for _, _, _, base in commits],
        },
    )
    return {by_id[int(stream)]: int(position) for stream, position in rows}


def delete_group(info: StreamInfo, group: str) -> Gen[bool]:
    rows = yield Query(
        "DELETE FROM streams_reader_groups WHERE stream = %s AND group_name = %s RETURNING 1",
        (info.id, group),
    )
    yield Commit()
    return bool(rows)


def streams_of_group(group: str) -> Gen[list[str]]:
    """The names of the streams ``group`` has committed on, sorted."""
    rows = yield Query(
        "SELECT r.name FROM streams_reader_groups g JOIN streams_registry r ON r.id = g.stream "
        "WHERE g.group_name = %s ORDER BY r.name",
        (group,),
    )
    yield Commit()
    return [str(name) for (name,) in rows]


def list_groups(
    info: StreamInfo, linear: int | None = None, *, stale_after_ms: int = STALE_AFTER_MS
) -> Gen[list[GroupRow]]:
    """Every group of the stream with its lag (the linear position, by `probe` unless given,
    minus the committed one), its idle time and whether it holds retention back and is stale
    (idle ``stale_after_ms`` or longer while holding it: `streams.core.groups`)."""
    if linear is None:
        probes = yield from probe([info])
        linear = probes[info.name].complete
    # The oldest unconsumed fact: the first one above the group's position (a primary-key
    # lookup), if it is complete.
    rows = yield Query(
        f"""
        SELECT g.group_name, g.position, g.ts_floor, g.updated_at,
               {NOW_MS_SQL} - (SELECT f.ts FROM streams_facts f
                                 WHERE f.stream = g.stream AND f.stream_id > g.position
                                   AND f.stream_id <= %(linear)s
                                 ORDER BY f.stream_id LIMIT 1),
               (extract(epoch FROM clock_timestamp() - g.updated_at) * 1000)::bigint,
               {NOW_MS_SQL}, r.pruned_through
        FROM streams_reader_groups g JOIN streams_registry r ON r.id = g.stream
        WHERE g.stream = %(stream)s ORDER BY g.group_name
        """,
        {"stream": info.id, "linear": linear},
    )
    yield Commit()
    goal: int | None = None
    if rows and info.retention_ms is not None:
        # Where retention alone would prune to (as `retention.prune_target` computes it).
        before = yield from position_before_time(info, int(rows[0][6]) - info.retention_ms)
        goal = retention_goal(info.retention_ms, linear, before)
    found = []
    for name, position, ts_floor, updated_at, lag_ms, idle_ms, _, pruned in rows:
        holds = holds_retention(int(position), int(pruned), goal)
        idle = max(0, int(idle_ms))
        found.append(
            GroupRow(
                stream=info.name,
                group=name,
                position=int(position),
                ts_floor=int(ts_floor),
                lag=max(0, linear - int(position)),
                updated_at=updated_at.isoformat(),
                lag_ms=None if lag_ms is None else max(0, int(lag_ms)),
                idle_ms=idle,
                holds_retention=holds,
                stale=is_stale(idle, holds, stale_after_ms),
            )
        )
    return found


def stream_positions(
    info: StreamInfo, *, retire: bool = True, stale_after_ms: int = STALE_AFTER_MS
) -> Gen[StreamPositions]:
    """Positions of a stream: linear, max allocated, every writer's row and every group's (stale
    when idle ``stale_after_ms`` while holding retention back)."""
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
                   (SELECT r.pruned_through FROM streams_registry r WHERE r.id = %s),
                   (SELECT r.key_window_ms FROM streams_registry r WHERE r.id = %s)
            FROM (SELECT 1) AS one
            LEFT JOIN streams_writers w ON w.stream = %s
            ORDER BY w.instance
            """
        ).format(max_allocated=max_allocated_sql(info)),
        (info.id, info.id, info.id),
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
    groups = yield from list_groups(info, probes[info.name].complete, stale_after_ms=stale_after_ms)
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
        key_window_ms=int(rows[0][9]),
    )
