"""Reader groups and the positions report (`streams positions`).

``streams_reader_groups`` holds each named group's committed position per stream (Kafka's
consumer groups; a Spark query is a group too) and, in ``updated_at``, the time of its last
commit (every commit sets it, even one that moves nothing): `list_groups` reports how long each
group has been idle and whether it is stale (`streams.core.staleness`). `stream_positions` is
everything ``streams positions`` shows of one stream, read in one database snapshot.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from psycopg import sql

from ..core.staleness import (
    STALE_AFTER_MS,
    holds_retention,
    is_stale,
    retention_goal,
    retention_held,
)
from ..errors import GroupFenced, InvalidPosition, StoreError, UsageError
from ..types import GroupRow, StreamInfo, StreamPositions, WriterRow
from ._common import NOW_MS_SQL
from .driver import Commit, Gen, Query
from .holders import reservation_lock_holders
from .leases import (
    linear_from,
    max_allocated_sql,
    retire_if_allowed,
)
from .probe import probe
from .rows import partition_sql, position_before_time

# --- reader groups ----------------------------------------------------------------------------


class GroupPosition(NamedTuple):
    """A group's committed position on one stream, as `group_position` reads it."""

    position: int
    ts_floor: int
    #: The database incarnation its last commit was made under (None: not recorded).
    incarnation: str | None


def group_position(info: StreamInfo, group: str) -> Gen[GroupPosition | None]:
    """What ``group`` committed on this stream, or None if it never did."""
    rows = yield Query(
        "SELECT position, ts_floor, incarnation FROM streams_reader_groups "
        "WHERE stream = %s AND group_name = %s",
        (info.id, group),
    )
    yield Commit()
    if not rows:
        return None
    position, ts_floor, incarnation = rows[0]
    return GroupPosition(int(position), int(ts_floor), incarnation)


@dataclass(frozen=True, slots=True)
class Generation:
    """What a consumer holds of its group on one stream (`take_generations`): the generation
    it took and that generation's token. Its commits move the group only while the group's
    generation row still holds this token (`commit_group`)."""

    generation: int
    token: uuid.UUID


def take_generations(
    group: str, infos: Sequence[StreamInfo], owner: str
) -> Gen[dict[str, Generation]]:
    """Open ``group`` on these streams for a new consumer: take the next generation of each
    (1 for a group never opened; ``owner`` and the time recorded, a fresh token drawn), one
    statement, committed here. Call it before reading the group's positions (why that order:
    docs/design/fencing.md). The rows are taken in stream
    order, so two consumers opening overlapping sets of streams do not deadlock (if they did,
    PostgreSQL would fail one open; nothing would move)."""
    by_id = {info.id: info.name for info in infos}
    # The statement runs in the database (revision 0015's ``streams_open_group``), behind the
    # check that this login may use the group: a group reader needs no write on the table.
    rows = yield Query(
        "SELECT * FROM streams_open_group(%(group)s, %(streams)s::integer[], %(owner)s)",
        {"group": group, "owner": owner, "streams": sorted(by_id)},
    )
    yield Commit()
    return {by_id[int(s)]: Generation(int(generation), token) for s, generation, token in rows}


#: Marker of the text cast by which a commit under a generation that is no longer the group's
#: fails (`GroupFenced`), followed by the stream's id, the generation held and the group's now.
GROUP_FENCED = "streams-group-fenced"

# A commit under a generation that is no longer the group's fails its statement with an invalid
# cast whose text is `GROUP_FENCED`, the stream's id, the generation held and the group's now
# (-1: no row); one of a position beyond max allocated with `POSITION_BEYOND`, the stream's id,
# the position and max allocated; an exact commit that finds the row moved with `GROUP_MOVED`,
# the stream's id and the base. The statement is the database's (``streams_commit_group``,
# revision 0015: the fence, the bound and the upsert, behind the group's check).
_FENCED_TEXT = re.compile(rf"{GROUP_FENCED} (\d+) (-?\d+) (-?\d+)")


#: Marker of the text cast by which a commit of a position beyond its stream's max allocated ID
#: fails (`InvalidPosition`): no reader can have reached it, since it passes only IDs a probe
#: proved complete, and every such ID is at or below the sequence, which only grows.
POSITION_BEYOND = "streams-position-beyond"
_BEYOND_TEXT = re.compile(rf"{POSITION_BEYOND} (\d+) (-?\d+) (-?\d+)")


def _fence_params(
    group: str, infos: Sequence[StreamInfo], held: Mapping[str, Generation]
) -> dict[str, Any]:
    missing = [info.name for info in infos if info.name not in held]
    if missing:
        raise UsageError(f"group {group!r} was not opened on {', '.join(missing)}")
    return {
        "group": group,
        "streams": [info.id for info in infos],
        "generations": [held[info.name].generation for info in infos],
        "tokens": [held[info.name].token for info in infos],
    }


def _fenced(group: str, infos: Sequence[StreamInfo], exc: StoreError) -> GroupFenced | None:
    """The `GroupFenced` a commit's failing cast stands for (None: another error)."""
    found = _FENCED_TEXT.search(str(exc))
    if found is None:
        return None
    stream, generation, current = (int(x) for x in found.groups())
    name = next((i.name for i in infos if i.id == stream), str(stream))
    return GroupFenced(group, name, generation, None if current < 0 else current)


def _beyond(group: str, infos: Sequence[StreamInfo], exc: StoreError) -> InvalidPosition | None:
    """The `InvalidPosition` a commit's failing cast stands for (None: another error)."""
    found = _BEYOND_TEXT.search(str(exc))
    if found is None:
        return None
    stream, position, allocated = (int(x) for x in found.groups())
    name = next((i.name for i in infos if i.id == stream), str(stream))
    return InvalidPosition(f"group {group!r}", name, position, allocated)


def commit_group(
    group: str,
    commits: Sequence[tuple[StreamInfo, int, int]],
    held: Mapping[str, Generation],
    *,
    incarnation: str | None = None,
) -> Gen[dict[str, int]]:
    """Record that ``group`` consumed everything ``<= position`` of each stream, given as
    ``(info, position, ts_floor)``, in one statement and one transaction (all streams or none).

    Forward-only: returns the committed position by stream name, higher than the one given
    where another reader committed more. ``held``: the generation this consumer took of each
    stream (`take_generations`); ``incarnation``: written into the group's rows. Raises
    `GroupFenced` if another consumer opened the group since (the fencing of groups:
    docs/design/fencing.md), `InvalidPosition` for a position beyond its stream's max
    allocated ID (a forged signed range could otherwise make a group skip facts); nothing
    moves on any stream then.
    """
    committed = yield from _commit(
        group, [(i, p, f, None) for i, p, f in commits], held, incarnation, exact=False
    )
    yield Commit()
    return committed


#: Marker of the text cast by which `commit_group_in` fails the caller's transaction.
GROUP_MOVED = "streams-group-moved"


def commit_group_in(
    group: str,
    commits: Sequence[tuple[StreamInfo, int, int, int | None]],
    held: Mapping[str, Generation],
    *,
    incarnation: str | None = None,
) -> Gen[dict[str, int]]:
    """`commit_group` inside the caller's transaction, *exactly* from where this reader left
    the group: ``(info, position, ts_floor, base)`` per stream, ``base`` being the group's
    position when this reader opened it or last committed it (None: the group had no row).

    Raises (failing the caller's transaction, effects and all) `GroupFenced` and
    `InvalidPosition` as `commit_group` does; if the group's row no longer holds ``base`` the
    statement fails with `GROUP_MOVED` (the reader raises `GroupMoved`). So a consumer that
    commits its effects with this applies each fact once (the group argument:
    docs/design/fencing.md). Forward-only; returns the committed position by stream name.
    """
    return (yield from _commit(group, commits, held, incarnation, exact=True))


def _commit(
    group: str,
    commits: Sequence[tuple[StreamInfo, int, int, int | None]],
    held: Mapping[str, Generation],
    incarnation: str | None,
    *,
    exact: bool,
) -> Gen[dict[str, int]]:
    """The one statement of `commit_group` and `commit_group_in` (no commit of its own)."""
    infos = [info for info, _, _, _ in commits]
    by_id = {info.id: info.name for info in infos}
    try:
        rows = yield Query(
            "SELECT * FROM streams_commit_group(%(group)s, %(streams)s::integer[], "
            "%(positions)s::bigint[], %(floors)s::bigint[], %(bases)s::bigint[], "
            "%(generations)s::bigint[], %(tokens)s::uuid[], %(incarnation)s, %(exact)s)",
            {
                **_fence_params(group, infos, held),
                "positions": [position for _, position, _, _ in commits],
                "floors": [floor for _, _, floor, _ in commits],
                "bases": [base for _, _, _, base in commits],
                "incarnation": incarnation,
                "exact": exact,
            },
        )
    except StoreError as exc:
        refused = _fenced(group, infos, exc) or _beyond(group, infos, exc)
        if refused is None:
            raise
        raise refused from None
    return {by_id[int(stream)]: int(position) for stream, position in rows}


def delete_group(info: StreamInfo, group: str) -> Gen[bool]:
    """Delete ``group`` on this stream: its generation row, then its position (True if it had
    one). In this order, in one transaction of two statements: deleting the generation row
    waits for a commit that holds it (``FOR SHARE``, `commit_group`) and fences every consumer
    of the group (a commit finds no row), so the second statement, with a newer snapshot,
    sees and deletes every position they committed: none survives the deletion."""
    yield Query(
        "DELETE FROM streams_group_generations WHERE stream = %s AND group_name = %s",
        (info.id, group),
    )
    rows = yield Query(
        "DELETE FROM streams_reader_groups WHERE stream = %s AND group_name = %s RETURNING 1",
        (info.id, group),
    )
    yield Commit()
    return bool(rows)


def groups_beyond(info: StreamInfo) -> Gen[tuple[int, list[tuple[str, int]]]]:
    """The stream's max allocated ID and every group ``(name, position)`` committed beyond it
    (`streams doctor`): a position no reader reaches by itself (`InvalidPosition`), so one
    written by hand or by a role that may write ``streams_reader_groups``, or left by a
    database restored or failed over to an older state."""
    rows = yield Query(
        sql.SQL(
            "SELECT a.allocated, g.group_name, g.position "
            "FROM (SELECT {allocated} AS allocated) AS a "
            "LEFT JOIN streams_reader_groups g ON g.stream = %s AND g.position > a.allocated "
            "ORDER BY g.group_name"
        ).format(allocated=max_allocated_sql(info)),
        (info.id,),
    )
    yield Commit()
    beyond = [(str(name), int(position)) for _, name, position in rows if name is not None]
    return int(rows[0][0]), beyond


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
    (idle ``stale_after_ms`` or longer while holding it: `streams.core.staleness`), and its
    consumer's generation, owner and when it took the group. Groups that committed only: a
    group opened but never committed has no position to show."""
    if linear is None:
        probes = yield from probe([info])
        linear = probes[info.name].complete
    # The oldest unconsumed fact: the first one above the group's position (a primary-key
    # lookup), if it is complete. In the stream's own partition (`streams.store.rows`).
    rows = yield Query(
        f"""
        SELECT g.group_name, g.position, g.ts_floor, g.updated_at,
               {NOW_MS_SQL} - (SELECT f.ts FROM {partition_sql(info.id)} f
                                 WHERE f.stream = {int(info.id)} AND f.stream_id > g.position
                                   AND f.stream_id <= %(linear)s
                                 ORDER BY f.stream_id LIMIT 1),
               (extract(epoch FROM clock_timestamp() - g.updated_at) * 1000)::bigint,
               {NOW_MS_SQL}, r.pruned_through, n.generation, n.owner, n.taken_at,
               (extract(epoch FROM clock_timestamp() - n.taken_at) * 1000)::bigint
        FROM streams_reader_groups g JOIN streams_registry r ON r.id = g.stream
        LEFT JOIN streams_group_generations n
               ON n.stream = g.stream AND n.group_name = g.group_name
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
    for row in rows:
        name, position, ts_floor, updated_at, lag_ms, idle_ms, _, pruned = row[:8]
        found.append(
            group_row(
                info.name, name, int(position), ts_floor, updated_at, lag_ms, idle_ms,
                linear=linear, pruned=int(pruned), goal=goal, stale_after_ms=stale_after_ms,
                taken=row[8:],
            )
        )  # fmt: skip
    return found


def group_row(
    stream: str,
    group: str,
    position: int,
    ts_floor: Any,
    updated_at: Any,
    lag_ms: Any,
    idle_ms: Any,
    *,
    linear: int,
    pruned: int,
    goal: int | None,
    stale_after_ms: int,
    taken: Sequence[Any],
) -> GroupRow:
    """A `GroupRow` from what was read of one group (``taken``: its consumer's generation,
    owner, taken_at and age in ms), with the retention and staleness judgements
    (`streams.core.staleness`); for `list_groups` and `streams.store.overview`."""
    generation, owner, taken_at, taken_age_ms = taken
    holds = holds_retention(position, pruned, goal)
    idle = max(0, int(idle_ms))
    return GroupRow(
        stream=stream,
        group=group,
        position=position,
        ts_floor=int(ts_floor),
        lag=max(0, linear - position),
        updated_at=updated_at.isoformat(),
        lag_ms=None if lag_ms is None else max(0, int(lag_ms)),
        idle_ms=idle,
        holds_retention=holds,
        retention_held_ids=retention_held(position, pruned, goal),
        stale=is_stale(idle, holds, stale_after_ms),
        generation=None if generation is None else int(generation),
        owner=owner,
        taken_at=None if taken_at is None else taken_at.isoformat(),
        taken_age_ms=None if taken_age_ms is None else max(0, int(taken_age_ms)),
    )


def writer_row(row: Sequence[Any]) -> WriterRow:
    """A `WriterRow` from ``(instance, generation, position, retired, lease_expires_in_ms,
    pending, heartbeat_age_ms)``."""
    return WriterRow(
        instance=row[0],
        generation=row[1],
        position=row[2],
        retired=row[3],
        lease_expires_in_ms=row[4],
        pending=row[5],
        heartbeat_age_ms=row[6],
    )


def stream_positions(
    info: StreamInfo, *, retire: bool = True, stale_after_ms: int = STALE_AFTER_MS
) -> Gen[StreamPositions]:
    """Positions of a stream: linear, max allocated, every writer's row and every group's (stale
    when idle ``stale_after_ms`` while holding retention back)."""
    if retire:
        yield from retire_if_allowed(info)
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
    writers = {row[1]: writer_row(row[1:8]) for row in rows if row[1] is not None}
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
