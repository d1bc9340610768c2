"""Every stream at once: the set-based views behind ``streams list``, ``positions``, ``groups
list``, ``doctor`` and the metrics (issue 40, "ten thousand streams").

`overview` reads what `streams.store.reader_groups.stream_positions` reads of one stream, for
all the streams a ``LIKE`` pattern selects, in a constant number of statements: the registry,
every sequence, ``pg_locks`` (and `streams.store.probe.probe` for the streams some session
holds back), the writers, the groups and, for the groups behind, the time of their oldest
unconsumed fact; `PROBE_CHUNK` streams per transaction where sequences are read. No statement
reads ``streams_facts`` with a stream that is not a literal (that plans and locks every
partition): facts are read in the streams' own partitions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from psycopg import sql

from ..core.constants import facts_partition
from ..core.staleness import (
    STALE_AFTER_MS,
    retention_goal,
)
from ..types import GroupRow, StreamInfo, StreamPositions, WriterRow
from ._common import NOW_MS_SQL
from .driver import Commit, Gen, Query
from .leases import linear_from, retire_if_allowed
from .probe import PROBE_CHUNK, held_streams, probe_many
from .reader_groups import group_row, writer_row
from .registry import _STREAM_COLUMNS, _stream_from_row
from .rows import position_before_time

__all__ = [
    "Overview",
    "Sort",
    "StreamHealth",
    "StreamOverview",
    "overview",
    "stream_health",
]

Sort = Literal["name", "lag"]

#: Groups per statement that looks up the oldest unconsumed fact (one partition each).
LAG_CHUNK = 500


@dataclass(frozen=True, slots=True)
class StreamOverview:
    """One stream as `overview` sees it: its registry row and its positions."""

    info: StreamInfo
    positions: StreamPositions

    @property
    def lag(self) -> int:
        """The largest lag of its reader groups (0: none, or all caught up)."""
        return max((g.lag for g in self.positions.groups), default=0)

    @property
    def live_writers(self) -> int:
        """Writers not retired (their lease may have expired)."""
        return sum(not w.retired for w in self.positions.writers.values())


@dataclass(frozen=True, slots=True)
class Overview:
    """What `overview` found: the streams shown, and how many matched before ``limit``."""

    streams: list[StreamOverview]
    matched: int
    #: Streams in the database, matched or not.
    total: int
    #: Registry ids of the streams some session holds back (a reservation lock held or waited
    #: for), with the age in ms of the oldest such transaction; of every stream, shown or not.
    held: dict[int, int] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return len(self.streams) < self.matched


_REGISTRY_SQL = f"""
SELECT {", ".join("r." + c.strip() for c in _STREAM_COLUMNS.split(","))}, r.pruned_through
FROM streams_registry r
WHERE (%(like)s::text IS NULL OR r.name LIKE %(like)s)
  AND (NOT %(grouped)s OR EXISTS (SELECT 1 FROM streams_reader_groups g WHERE g.stream = r.id))
  AND (NOT %(active)s OR r.id = ANY(%(held)s::int[])
       OR EXISTS (SELECT 1 FROM streams_writers w WHERE w.stream = r.id AND NOT w.retired)
       OR EXISTS (SELECT 1 FROM streams_reader_groups g WHERE g.stream = r.id))
ORDER BY r.name
"""

_WRITERS_SQL = """
SELECT w.stream, w.instance, w.generation, w.position, w.retired,
       (extract(epoch FROM w.lease_expires_at - clock_timestamp()) * 1000)::bigint,
       w.pending, (extract(epoch FROM clock_timestamp() - w.heartbeat_at) * 1000)::bigint
FROM streams_writers w WHERE w.stream = ANY(%(ids)s::int[])
ORDER BY w.stream, w.instance
"""

_GROUPS_SQL = f"""
SELECT g.stream, g.group_name, g.position, g.ts_floor, g.updated_at,
       (extract(epoch FROM clock_timestamp() - g.updated_at) * 1000)::bigint,
       n.generation, n.owner, n.taken_at,
       (extract(epoch FROM clock_timestamp() - n.taken_at) * 1000)::bigint, {NOW_MS_SQL}
FROM streams_reader_groups g
LEFT JOIN streams_group_generations n ON n.stream = g.stream AND n.group_name = g.group_name
WHERE g.stream = ANY(%(ids)s::int[])
ORDER BY g.stream, g.group_name
"""

# Expired leases not retired yet, of any stream: `overview` retires those streams' writers.
_EXPIRED_SQL = """
SELECT DISTINCT stream FROM streams_writers
WHERE NOT retired AND lease_expires_at < clock_timestamp()
"""


def overview(
    like: str | None = None,
    *,
    limit: int | None = None,
    sort: Sort = "name",
    stale_after_ms: int = STALE_AFTER_MS,
    retire: bool = True,
    grouped: bool = False,
    active: bool = False,
) -> Gen[Overview]:
    """Positions of every stream whose name matches the SQL ``LIKE`` pattern ``like`` (None:
    all), as `stream_positions` reports them, sorted by name or by lag (the largest group lag,
    descending, then name), the first ``limit`` of them. ``retire``: first retire the writers
    whose lease expired (as ``streams positions`` always did), on those streams only;
    ``grouped``: only streams some reader group committed on; ``active``: only streams with a
    writer not retired, a reader group, or a session holding them back (the metrics')."""
    held = yield from held_streams()
    rows = yield Query(
        _REGISTRY_SQL, {"like": like, "grouped": grouped, "active": active, "held": list(held)}
    )
    counted = yield Query("SELECT count(*) FROM streams_registry")
    yield Commit()
    total = int(counted[0][0])
    infos = [_stream_from_row(tuple(row[:8])) for row in rows]
    pruned = {int(row[0]): int(row[8] or 0) for row in rows}
    if limit is not None and sort == "name":
        infos = infos[:limit]  # the rest need not be probed
    if retire and infos:
        expired = yield Query(_EXPIRED_SQL)
        yield Commit()
        stale_ids = {int(s) for (s,) in expired}
        for info in infos:
            if info.id in stale_ids:
                yield from retire_if_allowed(info)
    probes = yield from probe_many(infos)
    infos = [info for info in infos if info.id in probes]  # not dropped meanwhile
    ids = [info.id for info in infos]
    writers: dict[int, dict[str, WriterRow]] = {i: {} for i in ids}
    group_rows: dict[int, list[Any]] = {i: [] for i in ids}
    if ids:
        for row in (yield Query(_WRITERS_SQL, {"ids": ids})):
            writers[int(row[0])][row[1]] = writer_row(row[1:8])
        for row in (yield Query(_GROUPS_SQL, {"ids": ids})):
            group_rows[int(row[0])].append(row)
        yield Commit()
    linear = {i: probes[i].complete for i in ids}
    behind = [(i, int(row[2])) for i in ids for row in group_rows[i] if int(row[2]) < linear[i]]
    oldest = yield from _oldest_unconsumed(behind, linear)
    found = []
    for info in infos:
        p = probes[info.id]
        groups = yield from _groups(
            info, group_rows[info.id], linear[info.id], pruned[info.id], oldest, stale_after_ms
        )
        live = [w.position for w in writers[info.id].values() if not w.retired]
        positions = StreamPositions(
            stream=info.name,
            linear=p.complete,
            max_allocated=p.max_allocated,
            writers=writers[info.id],
            persisted_linear=linear_from(live, p.max_allocated),
            groups=tuple(groups),
            oldest_pending_ms=held.get(info.id),
            pruned_through=pruned[info.id],
            key_window_ms=info.key_window_ms,
        )
        found.append(StreamOverview(info, positions))
    if sort == "lag":
        found.sort(key=lambda s: (-s.lag, s.info.name))
    matched = len(rows)
    if limit is not None:
        found = found[:limit]
    return Overview(found, matched, total, held)


def _oldest_unconsumed(
    behind: Sequence[tuple[int, int]], linear: dict[int, int]
) -> Gen[dict[tuple[int, int], int]]:
    """The timestamp of the first complete fact above each ``(stream, position)``: one
    primary-key lookup in the stream's own partition, `LAG_CHUNK` of them per statement."""
    found: dict[tuple[int, int], int] = {}
    keys = sorted(set(behind))
    for start in range(0, len(keys), LAG_CHUNK):
        chunk = keys[start : start + LAG_CHUNK]
        parts = [
            sql.SQL(
                "(SELECT {stream}::int, {position}::bigint, (SELECT f.ts FROM {partition} f "
                "WHERE f.stream_id > {position} AND f.stream_id <= {linear} "
                "ORDER BY f.stream_id LIMIT 1))"
            ).format(
                stream=sql.Literal(stream),
                position=sql.Literal(position),
                linear=sql.Literal(linear[stream]),
                partition=sql.Identifier(facts_partition(stream)),
            )
            for stream, position in chunk
        ]
        rows = yield Query(sql.SQL(" UNION ALL ").join(parts))
        yield Commit()
        for stream, position, ts in rows:
            if ts is not None:
                found[(int(stream), int(position))] = int(ts)
    return found


def _groups(
    info: StreamInfo,
    rows: Sequence[Any],
    linear: int,
    pruned: int,
    oldest: dict[tuple[int, int], int],
    stale_after_ms: int,
) -> Gen[list[GroupRow]]:
    """`GroupRow`s as `streams.store.reader_groups.list_groups` makes them."""
    if not rows:
        return []
    now_ms = int(rows[0][10])
    goal: int | None = None
    if info.retention_ms is not None:
        # Only streams with retention and groups: a few index lookups in one partition.
        before = yield from position_before_time(info, now_ms - info.retention_ms)
        goal = retention_goal(info.retention_ms, linear, before)
    found = []
    for row in rows:
        _, name, position, ts_floor, updated_at, idle_ms = row[:6]
        ts = oldest.get((info.id, int(position)))
        found.append(
            group_row(
                info.name, name, int(position), ts_floor, updated_at,
                None if ts is None else now_ms - ts, idle_ms,
                linear=linear, pruned=pruned, goal=goal, stale_after_ms=stale_after_ms,
                taken=row[6:10],
            )
        )  # fmt: skip
    return found


@dataclass(frozen=True, slots=True)
class StreamHealth:
    """What `stream_health` reads of one stream for `streams doctor`'s set-based checks."""

    #: The sequence's last value (0: never used).
    allocated: int
    #: The largest writer or group position, or ``pruned_through`` (None: none): IDs used.
    max_position: int | None
    #: Writers whose lease expired that are not retired yet, and writers not retired.
    expired_writers: int
    live_writers: int
    #: Every reader group's ``(name, position)``.
    groups: tuple[tuple[str, int], ...]


_HEALTH_SQL = """
SELECT r.id, COALESCE(pg_sequence_last_value(r.sequence_name::regclass), 0),
       GREATEST(w.max_position, (SELECT max(g.position) FROM streams_reader_groups g
                                  WHERE g.stream = r.id), NULLIF(r.pruned_through, 0)),
       COALESCE(w.expired, 0), COALESCE(w.live, 0),
       (SELECT array_agg(g.group_name || ' ' || g.position ORDER BY g.group_name)
        FROM streams_reader_groups g WHERE g.stream = r.id)
FROM streams_registry r
LEFT JOIN (
    SELECT stream, max(position) AS max_position,
           count(*) FILTER (WHERE NOT retired AND lease_expires_at < clock_timestamp()) AS expired,
           count(*) FILTER (WHERE NOT retired) AS live
    FROM streams_writers GROUP BY stream
) w ON w.stream = r.id
WHERE r.id = ANY(%(ids)s::int[])
"""


def stream_health(infos: Sequence[StreamInfo]) -> Gen[dict[int, StreamHealth]]:
    """`StreamHealth` of every stream in ``infos`` by registry id: `PROBE_CHUNK` streams per
    statement and transaction (each sequence read holds a lock until commit), no facts read."""
    found: dict[int, StreamHealth] = {}
    ids = [info.id for info in infos]
    for start in range(0, len(ids), PROBE_CHUNK):
        rows = yield Query(_HEALTH_SQL, {"ids": ids[start : start + PROBE_CHUNK]})
        yield Commit()
        for stream, allocated, position, expired, live, groups in rows:
            pairs = (str(g).rsplit(" ", 1) for g in groups or ())
            found[int(stream)] = StreamHealth(
                int(allocated),
                None if position is None else int(position),
                int(expired),
                int(live),
                tuple((name, int(p)) for name, p in pairs),
            )
    return found
