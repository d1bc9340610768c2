"""The Spark source's planning decisions (pure): sharing a fact budget between streams without
starving any, running timestamp floors, streams that went backwards, transient errors."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from streams_spark.planning import (
    lost_streams,
    running_floors,
    share_budget,
)

from streams.store.driver import transient_sqlstate

names = st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=6, unique=True)
cases = names.flatmap(
    lambda ns: st.tuples(
        st.fixed_dictionaries({n: st.integers(0, 50) for n in ns}),
        st.integers(1, 40),
        st.integers(0, 1000),
    )
)


@given(cases)
def test_shares_are_proportional_and_use_the_whole_budget(
    case: tuple[dict[str, int], int, int],
) -> None:
    counts, budget, turn = case
    shares = share_budget(counts, budget, turn)
    total = sum(counts.values())
    assert set(shares) == set(counts)
    assert sum(shares.values()) == min(budget, total)
    for name, count in counts.items():
        assert 0 <= shares[name] <= count
        if total > budget:  # at least the proportional share, rounded down
            assert shares[name] >= budget * count // total


@given(cases)
def test_no_stream_with_facts_starves_over_one_rotation(
    case: tuple[dict[str, int], int, int],
) -> None:
    """Over as many consecutive turns as there are streams, every stream that has facts gets
    some, however small the budget (the remainder rotates)."""
    counts, budget, turn = case
    served: set[str] = set()
    for k in range(len(counts)):
        shares = share_budget(counts, budget, turn + k)
        served |= {n for n, s in shares.items() if s > 0}
    # Even with fewer facts per batch than streams: each is served within a rotation.
    assert served == {n for n, c in counts.items() if c > 0}


def test_the_issue_example_rotates() -> None:
    """Budget 2 over a, b, c: {a: 1, b: 1, c: 0} every batch before; now c gets its turn."""
    counts = {"a": 5, "b": 5, "c": 5}
    seen = [share_budget(counts, 2, turn) for turn in range(3)]
    assert all(sum(s.values()) == 2 for s in seen)
    assert {n for s in seen for n, v in s.items() if v} == {"a", "b", "c"}


@given(st.integers(0, 2**40), st.lists(st.one_of(st.none(), st.integers(0, 2**40)), max_size=8))
def test_running_floors_are_the_running_maximum(start: int, maxima: list[int | None]) -> None:
    floors = running_floors(start, maxima)
    assert len(floors) == len(maxima)
    expected, floor = [], start
    for value in maxima:
        floor = max(floor, value if value is not None else floor)
        expected.append(floor)
    assert floors == expected


def test_lost_streams_are_those_below_the_query_not_waiting_for_a_start() -> None:
    lower = {"a": 5, "b": 9, "c": 2}
    found = {"a": 7, "b": 4, "c": 1}
    assert lost_streams(lower, found, waiting=frozenset()) == ["b", "c"]
    assert lost_streams(lower, found, waiting=frozenset({"c"})) == ["b"]


def test_transient_sqlstates() -> None:
    for code in ("57014", "57P01", "57P03", "08006", "40001", "40P01", "53300", "55P03"):
        assert transient_sqlstate(code), code
    for other in (None, "42P01", "23505", "22P02", "XX000"):
        assert not transient_sqlstate(other), other
