"""`streams.core.staleness`: when a reader group is stale (idle while holding retention back)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.core.staleness import (
    STALE_AFTER_MS,
    holds_retention,
    is_stale,
    retention_goal,
    retention_held,
)

positions = st.integers(0, 10**6)
optional = st.none() | positions


def test_examples() -> None:
    assert retention_goal(None, 100, 40) is None  # keeps everything: nothing to hold back
    assert retention_goal(3_600_000, 100, 40) == 40
    assert retention_goal(3_600_000, 30, 40) == 30  # never past the complete position
    assert retention_goal(3_600_000, 100, None) == 100  # every fact is older than the period
    assert holds_retention(10, 5, 40) and not holds_retention(40, 5, 40)
    assert not holds_retention(4, 5, 40)  # below what was pruned: it lost facts, holds nothing
    assert not holds_retention(10, 5, None)
    assert retention_held(10, 5, 40) == 30 and retention_held(40, 5, 40) == 0
    assert retention_held(4, 5, 40) == 0 and retention_held(10, 5, None) == 0
    assert is_stale(STALE_AFTER_MS, True, STALE_AFTER_MS)
    assert not is_stale(STALE_AFTER_MS - 1, True, STALE_AFTER_MS)
    assert not is_stale(10 * STALE_AFTER_MS, False, STALE_AFTER_MS)


@given(
    retention=st.none() | st.integers(1, 10**9),
    complete=positions,
    before=optional,
    pruned=positions,
    position=positions,
)
def test_a_group_holds_retention_exactly_when_prune_would_stop_at_it(
    retention: int | None, complete: int, before: int | None, pruned: int, position: int
) -> None:
    goal = retention_goal(retention, complete, before)
    assert goal is None or goal <= complete
    # Model: prune stops at the lowest group that has not lost facts; this group holds
    # retention back iff that stop is below where retention alone would go.
    alone = pruned if goal is None else max(pruned, goal)
    with_group = alone if position < pruned else max(pruned, min(alone, position))
    assert holds_retention(position, pruned, goal) == (with_group < alone)
    # What it holds back is exactly what prune would remove without it and does not with it.
    assert retention_held(position, pruned, goal) == alone - with_group


@given(idle=st.integers(0, 10**12), holds=st.booleans(), a=st.integers(0, 10**12),
       b=st.integers(0, 10**12))  # fmt: skip
def test_stale_is_monotone_in_the_threshold(idle: int, holds: bool, a: int, b: int) -> None:
    low, high = sorted((a, b))
    if is_stale(idle, holds, high):
        assert is_stale(idle, holds, low)
    assert is_stale(idle, holds, low) <= holds
