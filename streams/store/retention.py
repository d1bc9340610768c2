"""Retention: removing facts older than a stream's retention, never past a reader."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.fact_columns import KEY_ORDER
from ..errors import (
    UnknownStream,
)
from ..types import PruneResult, StreamInfo
from ._common import NOW_MS_SQL
from .driver import Commit, Gen, Query
from .idempotency import prune_keys
from .probe import probe
from .rows import position_before_time

# Retention removes facts older than a stream's retention in short transactions, moving
# ``pruned_through`` with the rows it deletes; never past the complete position or a group's
# committed position. The argument (why a read followed by `check_retained` lost nothing, and
# why rows are deleted rather than partitions dropped): docs/design/retention.md.

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


def prune_target(info: StreamInfo, now_ms: int | None = None) -> Gen[PruneTarget]:
    """How far `prune` may go now: facts older than the retention period (by the database's
    clock, or ``now_ms``), capped by the complete position and every reader group that has not
    already lost facts."""
    probes = yield from probe([info])
    complete = probes[info.name].complete
    rows = yield Query(
        f"""
        SELECT r.pruned_through, {NOW_MS_SQL},
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
        f"""
        SELECT LEAST(%(target)s::bigint,
                     (SELECT min(position) FROM streams_reader_groups
                      WHERE stream = %(stream)s AND position >= %(old)s),
                     (SELECT stream_id FROM streams_facts
                      WHERE stream = {int(info.id)} AND stream_id > %(old)s
                      ORDER BY {KEY_ORDER} OFFSET %(batch)s LIMIT 1))
        """,
        {"stream": info.id, "old": old, "target": target, "batch": batch},
    )
    new = int(rows[0][0])
    deleted = 0
    if new > old:
        yield Query("UPDATE streams_registry SET pruned_through = %s WHERE id = %s", (new, info.id))
        # Through the parent (an operator may delete there, not in a partition by name), the
        # stream a literal: the plan locks its partition only.
        rows = yield Query(
            f"WITH d AS (DELETE FROM streams_facts WHERE stream = {int(info.id)} "
            "AND stream_id > %s AND stream_id <= %s RETURNING 1) "
            "SELECT count(*) FROM d",
            (old, new),
        )
        deleted = int(rows[0][0])
    yield Commit()
    return max(old, new), deleted


def prune(
    info: StreamInfo, *, batch: int = PRUNE_BATCH, now_ms: int | None = None
) -> Gen[PruneResult]:
    """Apply the stream's retention: `prune_step` after `prune_step` up to `prune_target`; then
    remove its idempotency keys older than its key window (`prune_keys`)."""
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
    keys = yield from prune_keys(info, batch)
    return PruneResult(
        info.name, goal.pruned_through, position, goal.target, goal.limited_by, deleted,
        transactions, keys,
    )  # fmt: skip
