"""The checks `streams doctor` runs on one stream (`streams.ops.doctor` chooses the streams and
runs the checks of the whole deployment): its sequence, writers, groups, retention and who
holds it back, each a `Check`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ..core.stalls import holding_bound
from ..store.driver import run
from ..store.holders import (
    LockHolder,
    holding_state,
)
from ..store.leases import (
    sequence_state,
    unseen_ids,
)
from ..store.overview import StreamHealth
from ..store.probe import probe
from ..store.reader_groups import list_groups
from ..store.retention import prune_target
from ..types import StreamInfo
from .render import age

#: A reservation held open longer than this is reported: it holds every reader back.
HELD_WARNING_SECONDS = 5.0

#: A sequence at or above this is reported: near the bigint limit (``2**63 - 1``), where the
#: next appends fail. No stream gets there by appending (4.6e18 IDs); a sequence moved there
#: by repair after a forged position does, which bricks the stream.
SEQUENCE_NEAR_LIMIT = 2**62

__all__ = [
    "HELD_WARNING_SECONDS",
    "SEQUENCE_NEAR_LIMIT",
    "UNSEEN_WINDOW",
    "Check",
    "held_check",
    "quick_checks",
    "stream_checks",
]

#: How many of the most recent IDs `streams doctor` looks up in every table it knows.
UNSEEN_WINDOW = 10_000


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def quick_checks(info: StreamInfo, h: StreamHealth) -> list[Check]:
    """The set-based checks of one stream (`streams.store.overview.stream_health`)."""
    checks = []
    behind = h.max_position is not None and h.max_position > h.allocated
    if behind or h.allocated >= SEQUENCE_NEAR_LIMIT:
        checks.append(
            _sequence_check(info, h.allocated, h.max_position, "not read", h.max_position, behind)
        )
    checks.append(_groups_check(info, h))
    checks.append(_writers_check(info, h.expired_writers))
    return checks


def _sequence_check(
    info: StreamInfo,
    allocated: int,
    max_used: int | None,
    stored: int | str | None,
    max_position: int | None,
    behind: bool,
) -> Check:
    near_limit = allocated >= SEQUENCE_NEAR_LIMIT
    return Check(
        f"stream {info.name}: sequence",
        not behind and not near_limit,
        f"sequence at {allocated}, "
        + ("no ID used yet" if max_used is None else f"highest ID used {max_used}")
        + (" (no facts, " if stored is None else f" (facts {stored}, ")
        + (
            "no writer or group positions)"
            if max_position is None
            else f"writer and group positions {max_position})"
        )
        + (
            "; BEHIND: the next writer to start repairs it (or `streams doctor --repair`)"
            if behind
            else ""
        )
        + (
            f"; NEAR THE BIGINT LIMIT ({2**63 - 1}): appends will fail; no stream gets "
            "there by appending: a repair moved it to a forged or restored position "
            "(see the reader groups check)"
            if near_limit
            else ""
        ),
    )


def _writers_check(info: StreamInfo, expired: int) -> Check:
    return Check(
        f"stream {info.name}: writers",
        expired == 0,
        "no expired lease"
        if expired == 0
        else f"{expired} writer(s) with an expired lease not yet retired "
        "(retired by the next positions call or writer heartbeat; if it stays, a "
        "transaction of theirs is still open)",
    )


def stream_checks(
    conn: psycopg.Connection[Any],
    info: StreamInfo,
    health: StreamHealth,
    held: bool,
    stale_after_ms: int,
    lease_seconds: float,
) -> list[Check]:
    state = run(conn, sequence_state(info))
    allocated = state.last_value or 0
    checks = [
        _sequence_check(
            info,
            allocated,
            state.max_used,
            state.max_stored,
            state.max_position,
            state.repair_target is not None,
        ),
        _groups_check(info, health),
    ]
    declared = ", ".join(str(t) for t in info.fact_tables) or "none"
    if state.missing_tables:
        missing = ", ".join(str(t) for t in state.missing_tables)
        checks.append(
            Check(
                f"stream {info.name}: declared tables",
                False,
                f"declared tables do not exist: {missing}; their IDs cannot be seen by repair "
                f"(`streams tables {info.name} ...` to fix the declaration)",
            )
        )
    unseen = run(conn, unseen_ids(info, UNSEEN_WINDOW))
    detail = f"besides streams_facts: {declared}"
    if unseen.unseen:
        detail += (
            f"; {unseen.unseen} of the last {unseen.ids} IDs have no row in any of them: "
            "rolled back, or facts in a table this stream does not declare (or in rows a "
            "declaration's WHERE leaves out), which sequence repair cannot see (`streams "
            f"tables {info.name} \"TABLE.COLUMN [WHERE KEY = 'VALUE']\"`; index TABLE on "
            "(COLUMN), or on (KEY, COLUMN) when a WHERE says which rows are this stream's)"
        )
    checks.append(Check(f"stream {info.name}: fact tables", True, detail))
    if held:
        checks.append(held_check(conn, info, lease_seconds))
    else:  # no session holds it: complete is max allocated, no need to probe
        checks.append(
            Check(
                f"stream {info.name}: linear position",
                True,
                f"{health.allocated} (max allocated {health.allocated})",
            )
        )
    retention = _retention_check(conn, info, stale_after_ms)
    if retention is not None:
        checks.append(retention)
    checks.append(_writers_check(info, health.expired_writers))
    return checks


def _groups_check(info: StreamInfo, health: StreamHealth) -> Check:
    """Reader groups committed beyond the stream's max allocated ID: no reader reaches such a
    position by itself (commits refuse it: `streams.errors.InvalidPosition`), so the row was
    written by hand or by a role that may write ``streams_reader_groups``, or a restore set
    the sequence back. The group skips every fact up to it, and sequence repair would move the
    sequence there."""
    allocated = health.allocated
    beyond = [(group, position) for group, position in health.groups if position > allocated]
    name = f"stream {info.name}: reader groups"
    if not beyond:
        return Check(name, True, f"none beyond max allocated ({allocated})")
    shown = ", ".join(f"{group} (at {position})" for group, position in beyond)
    return Check(
        name,
        False,
        f"group(s) {shown} beyond max allocated {allocated}: no fact above it was ever "
        "written, so the position is forged (a role that may write streams_reader_groups) or "
        "from before a restore; the group would skip every fact up to it, and sequence repair "
        "(a writer's start, `streams doctor --repair`) would move the sequence there. Delete "
        f"the group (`streams groups delete GROUP --stream {info.name}`) first",
    )


def _retention_check(
    conn: psycopg.Connection[Any], info: StreamInfo, stale_after_ms: int
) -> Check | None:
    """Retention at a glance: how far it pruned, what waits for `streams prune` and what holds
    it back; failing when a reader group lost facts (its position is below what was pruned) or
    is stale (no commit for ``stale_after_ms`` while holding retention back: an abandoned
    reader or Spark checkpoint, `streams.core.staleness`)."""
    goal = run(conn, prune_target(info))
    if info.retention_ms is None and goal.pruned_through == 0:
        return None
    keeps = "forever" if info.retention_ms is None else f"{info.retention_ms} ms"
    groups = run(conn, list_groups(info, stale_after_ms=stale_after_ms))
    lost = [g for g in groups if g.position < goal.pruned_through]
    stale = [g for g in groups if g.stale]
    detail = f"keeps {keeps}, pruned through {goal.pruned_through}"
    if goal.target > goal.pruned_through:
        detail += f"; IDs up to {goal.target} may go now (`streams prune {info.name}`)"
    elif info.retention_ms is not None:
        detail += f"; held by: {goal.limited_by}"
    if lost:
        names = ", ".join(f"{g.group} (at {g.position})" for g in lost)
        detail += (
            f"; reader group(s) {names} are below what was pruned and lost facts: their "
            "readers fail with FactsPruned (delete the group, or start it again)"
        )
    if stale:
        names = ", ".join(
            f"{g.group} (at {g.position}, last commit {age(g.idle_ms)} ago)" for g in stale
        )
        detail += (
            f"; stale reader group(s) {names} hold retention back: no commit for "
            f"{age(stale_after_ms)} or more; if its reader or Spark checkpoint is gone, "
            f"`streams groups delete GROUP --stream {info.name}`"
        )
    return Check(f"stream {info.name}: retention", not lost and not stale, detail)


def held_check(conn: psycopg.Connection[Any], info: Any, lease_seconds: float) -> Check:
    """Which sessions hold the stream's linear position back, who they are (role, application,
    address), for how long, and when the bound of docs/design/liveness.md
    (`streams.store.holders`: the longest lease of the stream's writers, at least
    ``lease_seconds``) passes for them."""
    found = run(conn, probe([info]))[info.name]
    state = run(conn, holding_state(info))
    holders = state.holders
    name = f"stream {info.name}: linear position"
    if not holders:
        return Check(name, True, f"{found.complete} (max allocated {found.max_allocated})")
    bound = holding_bound(lease_seconds, state.writers_lease)
    oldest = holders[0]
    # Named first: a session whose writer's lease expired (it should have been ended: this
    # role may not end it, or nobody has looked since), then sessions that are no writer's
    # (anyone may take a reservation lock), else the oldest.
    expired = [h for h in holders if (h.lease_expired_seconds or 0) > 0]
    strangers = [h for h in holders if h.instance is None]
    past = [h for h in holders if _past_bound(h, bound)]
    exclusive = [h for h in holders if h.exclusive]
    shown = (exclusive or expired or past or strangers or [oldest])[0]
    label = "expired: " if expired else "past the bound: " if past else "oldest: "
    if not expired and not past and strangers:
        label = "no writer's: "
    if exclusive:
        label = "blocking every writer: "
    detail = (
        f"{found.complete} (max allocated {found.max_allocated}); {len(holders)} session(s) "
        f"holding its reservation locks; {label}{shown.describe()}; " + _bound_detail(shown, bound)
    )
    others = [h for h in strangers if h is not shown][:4]
    if others:
        detail += "; also no writer's: " + "; ".join(h.who() for h in others)
    if expired:
        detail += (
            "; it holds the stream past its writer's lease: `streams doctor --repair` (or any "
            "reader) ends it if this role may signal that session"
        )
    longest = max(
        h.transaction_seconds if h.holding_seconds is None else h.holding_seconds for h in holders
    )
    healthy = not expired and not past and not exclusive and longest < HELD_WARNING_SECONDS
    return Check(name, healthy, detail)


def _past_bound(holder: LockHolder, bound: float) -> bool:
    return holder.holding_seconds is not None and holder.holding_seconds > bound


def _bound_detail(holder: LockHolder, bound: float) -> str:
    """When the bound passes for ``holder``, and what then ends it."""
    ends = (
        "the next reader or prover to look ends it (if its role may signal that session), "
        "and so does `streams doctor --repair`"
        if holder.may_end
        else "this role may not end that session (a superuser's, or another role's without "
        "pg_signal_backend); readers and provers of a role that may will"
    )
    if holder.holding_seconds is None:
        return (
            f"bound {bound:.1f} s (the longest lease); how long it has held the stream is not "
            "visible to this role (pg_read_all_stats, or a superuser, sees it); readers and "
            "the prover end it one bound after the sequence passed its key"
        )
    left = bound - holder.holding_seconds
    if left > 0:
        return (
            f"the bound ({bound:.1f} s, the longest lease) passes in {left:.1f} s at the "
            f"latest; then {ends}"
        )
    return f"past the bound ({bound:.1f} s, the longest lease) by {-left:.1f} s: {ends}"
