"""Stale reader groups: when a group that stopped committing holds retention back. Pure; no I/O.

Terms:

* A **reader group** has a committed **position** on a stream (everything ``<=`` it consumed)
  and the time of its last commit; its **idle time** is how long ago that was. A Spark query is
  a group too: with no ``group`` option it commits to ``spark-<digest>``, so a query whose
  checkpoint was abandoned leaves such a group behind, never to commit again.
* **Retention's goal** is how far `prune` would go for the retention period alone: the position
  before the first fact younger than the period, capped by the complete position (every fact,
  when all are older than the period); a stream without retention has none.
* A group **holds retention back** when it is what stops `prune` short of that goal: its
  position is below the goal, and at or above what was already pruned (a group below that lost
  facts and holds nothing back: `prune` passes it, and `streams doctor` reports it).
* The **retention it holds back** is how many IDs `prune` would remove for the period but for
  that group: retention's goal minus its position when it holds retention back, else 0.
* A group is **stale** when it holds retention back and has been idle for at least the
  *stale-after* time. A live reader that falls behind commits as it goes (not stale); a caught-up
  group that stops committing holds nothing back (not stale). A stale group is shown by
  ``streams positions`` and ``streams doctor``, never deleted by itself: ``streams groups
  delete`` drops it once its reader is known to be gone.
"""

from __future__ import annotations

__all__ = [
    "STALE_AFTER_MS",
    "holds_retention",
    "is_stale",
    "retention_goal",
    "retention_held",
]

#: Default stale-after time: one day without a commit.
STALE_AFTER_MS = 86_400_000


def retention_goal(
    retention_ms: int | None, complete: int, before_cutoff: int | None
) -> int | None:
    """How far retention alone would prune: ``before_cutoff`` (the position before the first
    fact younger than the period; None when every fact is older) capped by ``complete``;
    None for a stream that keeps its facts forever."""
    if retention_ms is None:
        return None
    return complete if before_cutoff is None else min(complete, before_cutoff)


def holds_retention(position: int, pruned_through: int, goal: int | None) -> bool:
    """Whether a group at ``position`` stops `prune` short of retention's ``goal``."""
    return goal is not None and pruned_through <= position < goal


def retention_held(position: int, pruned_through: int, goal: int | None) -> int:
    """How many IDs a group at ``position`` keeps `prune` from removing: ``goal - position``
    when it holds retention back (`holds_retention`), else 0."""
    if goal is None or not holds_retention(position, pruned_through, goal):
        return 0
    return goal - position


def is_stale(idle_ms: int, holds: bool, stale_after_ms: int) -> bool:
    """Idle for at least ``stale_after_ms`` while holding retention back."""
    return holds and idle_ms >= stale_after_ms
