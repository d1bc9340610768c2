"""A writer's heartbeats (its lease renewed, its position persisted) and its retiring.

Leases, and who retires a writer whose lease has expired: docs/design/liveness.md; the
generation that fences a writer taken over: docs/design/fencing.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from psycopg import sql

from .driver import Autocommit, Commit, Gen, Query
from .holders import end_exclusive_holders
from .identity import FLUSHED_LSN_SQL, TIMELINE_SQL
from .leases import max_allocated_sql, retire_expired_writers
from .writer_sql import NOW_MS
from .writer_state import WriterState

#: Retire expired peers every this many heartbeats.
RETIRE_EVERY = 4


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    alive: bool
    persisted_position: int
    max_allocated: int


def heartbeat(core: WriterState) -> Gen[HeartbeatResult]:
    """Renew the lease, persist the position (forward-only), read max allocated and time.

    Reading max allocated lets an idle writer's announceable position climb to it (see
    `PositionTracker`); the next heartbeat persists that, so an idle writer never pins
    the linear position.
    """
    tracker = core.tracker
    position = tracker.local_position
    sent = time.time()
    # One statement in autocommit (one round trip). Asynchronous commit, set for this
    # statement's own transaction: a heartbeat lost in a crash only leaves a lower position
    # or an earlier lease expiry behind, both safe; waiting for fsync here is not needed.
    rows = yield Autocommit(
        sql.SQL(
            """
            WITH c AS (SELECT set_config('synchronous_commit', 'off', true) AS v)
            UPDATE streams_writers
            SET position = GREATEST(position, %(position)s), pending = %(pending)s,
                lease_expires_at = clock_timestamp() + make_interval(secs => %(lease)s),
                heartbeat_at = clock_timestamp()
            FROM c
            WHERE stream = %(stream)s AND instance = %(instance)s
              AND generation = %(generation)s AND NOT retired AND c.v IS NOT NULL
            RETURNING position, {max_allocated}, {now}, {timeline}, {flushed}
            """
        ).format(
            max_allocated=max_allocated_sql(core.info),
            now=sql.SQL(NOW_MS),
            timeline=sql.SQL(TIMELINE_SQL),
            flushed=sql.SQL(FLUSHED_LSN_SQL),
        ),
        {
            "position": position,
            "pending": tracker.take_peak_pending(),
            "lease": core.lease_seconds,
            "stream": core.info.id,
            "instance": core.instance,
            "generation": core.generation,
        },
    )
    if not rows:
        core.fenced = True
        return HeartbeatResult(False, core._persisted, tracker.max_allocated)
    persisted, max_allocated, db_ms, timeline = (int(v) for v in rows[0][:4])
    core.clock.sample(db_ms, sent, time.time())
    if rows[0][4] is not None:  # what a rewind would take back (`Guard`, "A rewind")
        core.guard.observed(timeline, int(rows[0][4]))
    core._persisted = max(core._persisted, persisted)
    tracker.note_allocated(max_allocated)
    return HeartbeatResult(True, core._persisted, max_allocated)


def beat(core: WriterState) -> Gen[HeartbeatResult]:
    """One scheduled heartbeat; every `RETIRE_EVERY`-th also retires expired peers, so a
    dead writer stops pinning the linear position even when nobody reads positions."""
    result = yield from heartbeat(core)
    core._beats += 1
    if result.alive and core._beats % RETIRE_EVERY == 0:
        yield from retire_expired_writers(core.info)
    if result.alive and core.blocked:
        # An append found the reservation lock held exclusively: end that session.
        core.blocked = False
        yield from end_exclusive_holders(core.info)
    return result


def retire(core: WriterState) -> Gen[None]:
    """Graceful close: persist the position, then retire (treated as caught up)."""
    if core._tracker is None or core.fenced:
        return
    if core.tracker.pending_count or core.tracker.in_flight_count:
        # Facts are still being written through this writer: leave the row to its lease.
        yield from heartbeat(core)
        return
    yield Query(
        """
        UPDATE streams_writers
        SET position = GREATEST(position, %s), retired = true, generation = generation + 1,
            pending = 0
        WHERE stream = %s AND instance = %s AND generation = %s AND NOT retired
        """,
        (core.tracker.local_position, core.info.id, core.instance, core.generation),
    )
    yield Commit()
    core.fenced = True
