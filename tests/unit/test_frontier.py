"""Tests for antichains, probes and the live filter (streams.core.frontier), against brute force."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.core.frontier import (
    Antichain,
    FrontierProbe,
    FrontierSnapshot,
    LiveFilter,
    MutableAntichain,
    UpperAntichain,
    less_equal,
    less_than,
    position_frontier,
)

# --- brute force, written independently of the module -----------------------------------------


def bf_le(a: Any, b: Any) -> bool:
    if isinstance(a, int):
        return bool(a <= b)
    return all(x <= y for x, y in zip(a, b, strict=True))


def bf_minimal(times: Iterable[Any]) -> tuple[Any, ...]:
    s = set(times)
    return tuple(sorted(t for t in s if not any(u != t and bf_le(u, t) for u in s)))


def bf_maximal(times: Iterable[Any]) -> tuple[Any, ...]:
    s = set(times)
    return tuple(sorted(t for t in s if not any(u != t and bf_le(t, u) for u in s)))


def grid(dim: int) -> list[Any]:
    """Every time with coordinates 0..6 (one beyond the generated range)."""
    if dim == 0:
        return list(range(25))
    return list(itertools.product(range(7), repeat=dim))


# dim 0 means plain ints.
TIME_KINDS: dict[int, st.SearchStrategy[Any]] = {
    0: st.integers(min_value=0, max_value=20),
    2: st.tuples(st.integers(0, 5), st.integers(0, 5)),
    3: st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 5)),
}
DIMS = pytest.mark.parametrize("dim", sorted(TIME_KINDS))


def times_lists(dim: int, max_size: int = 12) -> st.SearchStrategy[list[Any]]:
    return st.lists(TIME_KINDS[dim], max_size=max_size)


# --- the order --------------------------------------------------------------------------------


def test_less_equal_examples() -> None:
    assert less_equal(3, 3)
    assert less_than(2, 3)
    assert not less_than(3, 3)
    assert less_equal((1, 2), (1, 3))
    assert not less_equal((1, 2), (2, 1))
    assert not less_equal((2, 1), (1, 2))
    assert less_than((0, 0, 0), (0, 0, 1))
    assert not less_than((1, 1), (1, 1))
    with pytest.raises(ValueError):
        less_equal((1, 2), (1, 2, 3))
    with pytest.raises(TypeError):
        less_equal(1, (1,))  # type: ignore[type-var]
    with pytest.raises(TypeError):
        Antichain(["a"])  # type: ignore[type-var]
    with pytest.raises(TypeError):
        Antichain([True])


@DIMS
@given(data=st.data())
def test_order_matches_brute_force(dim: int, data: st.DataObject) -> None:
    a, b = data.draw(TIME_KINDS[dim]), data.draw(TIME_KINDS[dim])
    assert less_equal(a, b) == bf_le(a, b)
    assert less_than(a, b) == (bf_le(a, b) and a != b)


# --- Antichain / UpperAntichain ---------------------------------------------------------------


@DIMS
@given(data=st.data())
def test_from_elements_is_minimal_set(dim: int, data: st.DataObject) -> None:
    times = data.draw(times_lists(dim))
    assert Antichain.from_elements(times).elements == bf_minimal(times)
    assert UpperAntichain.from_elements(times).elements == bf_maximal(times)
    assert Antichain(reversed(times)) == Antichain(times)
    assert hash(Antichain(reversed(times))) == hash(Antichain(times))


@DIMS
@given(data=st.data())
def test_insert_sequence(dim: int, data: st.DataObject) -> None:
    times = data.draw(times_lists(dim))
    lower: Antichain[Any] = Antichain()
    upper: UpperAntichain[Any] = UpperAntichain()
    for i, t in enumerate(times):
        seen = times[:i]
        assert lower.insert(t) == (not any(bf_le(s, t) for s in seen))
        assert upper.insert(t) == (not any(bf_le(t, s) for s in seen))
        assert lower.elements == bf_minimal(times[: i + 1])
        assert upper.elements == bf_maximal(times[: i + 1])


@DIMS
@settings(deadline=None)  # brute force over a grid; slow CI must not flake
@given(data=st.data())
def test_queries(dim: int, data: st.DataObject) -> None:
    times = data.draw(times_lists(dim))
    lower, upper = Antichain(times), UpperAntichain(times)
    for t in grid(dim):
        assert lower.less_equal(t) == any(bf_le(s, t) for s in times)
        assert lower.less_than(t) == any(bf_le(s, t) and s != t for s in times)
        assert upper.greater_equal(t) == any(bf_le(t, s) for s in times)
        # ``t <`` some element: an element of an antichain is below none of the others.
        assert (upper.greater_equal(t) and t not in upper) == any(
            bf_le(t, s) and s != t for s in times
        )


@DIMS
@settings(deadline=None)  # brute force over a grid; slow CI must not flake
@given(data=st.data())
def test_lattice_operations(dim: int, data: st.DataObject) -> None:
    xs, ys = data.draw(times_lists(dim, 6)), data.draw(times_lists(dim, 6))
    a, b = Antichain(xs), Antichain(ys)
    meet, join = Antichain.meet_all([a, b]), a.join(b)
    assert meet.elements == bf_minimal(xs + ys)
    assert Antichain.meet_all([b, a]) == meet
    for t in grid(dim):
        # meet: either may still produce t; join: both may.
        assert meet.less_equal(t) == (a.less_equal(t) or b.less_equal(t))
        assert join.less_equal(t) == (a.less_equal(t) and b.less_equal(t))
    assert a.dominates(b) == all(any(bf_le(x, y) for x in a) for y in b)
    assert meet.dominates(a)
    assert meet.dominates(b)
    assert a.dominates(join)
    assert b.dominates(join)
    assert UpperAntichain(xs).join(UpperAntichain(ys)).elements == bf_maximal(xs + ys)


def test_antichain_value_semantics() -> None:
    a = Antichain([(1, 2), (2, 1), (3, 3)])
    assert a.elements == ((1, 2), (2, 1))
    assert repr(a) == "Antichain([(1, 2), (2, 1)])"
    assert (2, 1) in a
    assert list(a) == [(1, 2), (2, 1)]
    assert Antichain([5]) != UpperAntichain([5])
    assert len({Antichain([1, 2]), Antichain([1])}) == 1
    assert Antichain().is_empty
    assert not Antichain([0]).is_empty
    # The empty frontier is behind nothing and beyond everything.
    assert Antichain([7]).dominates(Antichain())
    assert not Antichain().dominates(Antichain([7]))
    assert Antichain([7]).join(Antichain()).is_empty
    assert Antichain.meet_all([Antichain([7]), Antichain()]) == Antichain([7])
    assert Antichain.meet_all([]).is_empty


# --- MutableAntichain -------------------------------------------------------------------------


def valid_batches(dim: int) -> st.SearchStrategy[list[list[tuple[Any, int]]]]:
    """Batches of (time, delta) whose running counts never go below zero."""

    @st.composite
    def build(draw: st.DrawFn) -> list[list[tuple[Any, int]]]:
        raw = draw(
            st.lists(
                st.lists(st.tuples(TIME_KINDS[dim], st.integers(-2, 3)), max_size=8), max_size=8
            )
        )
        counts: Counter[Any] = Counter()
        batches = []
        for batch in raw:
            fixed = []
            for t, wanted in batch:
                delta = max(wanted, -counts[t])  # clamp: never below zero
                counts[t] += delta
                fixed.append((t, delta))
            batches.append(fixed)
        return batches

    return build()


@DIMS
@settings(deadline=None)  # brute force over a grid; slow CI must not flake
@given(data=st.data())
def test_mutable_antichain_matches_brute_force(dim: int, data: st.DataObject) -> None:
    batches = data.draw(valid_batches(dim))
    m: MutableAntichain[Any] = MutableAntichain()
    counts: Counter[Any] = Counter()
    accumulated: Counter[Any] = Counter()
    for batch in batches:
        before = bf_minimal(t for t, c in counts.items() if c > 0)
        changes = m.update_iter(batch)
        for t, delta in batch:
            counts[t] += delta
        after = bf_minimal(t for t, c in counts.items() if c > 0)
        assert m.frontier().elements == after
        left = [(t, -1) for t in before if t not in after]
        entered = [(t, +1) for t in after if t not in before]
        assert sorted(changes) == sorted(left + entered)
        accumulated.update(dict(changes))
        assert tuple(sorted(t for t, c in accumulated.items() if c)) == after
        assert all(c in (0, 1) for c in accumulated.values())
        for t in grid(dim)[::7]:
            assert m.count(t) == counts[t]
            assert m.less_equal(t) == any(bf_le(s, t) for s in after)
            assert m.less_than(t) == any(bf_le(s, t) and s != t for s in after)
    assert m.is_empty == (not +counts)


@DIMS
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_mutable_antichain_order_independence(dim: int, data: st.DataObject) -> None:
    batches = data.draw(valid_batches(dim))
    updates = [u for batch in batches for u in batch]
    expected = MutableAntichain(updates).frontier()

    shuffled = data.draw(st.permutations(updates))
    one_batch: MutableAntichain[Any] = MutableAntichain()
    one_batch.update_iter(shuffled)
    assert one_batch.frontier() == expected

    # As singleton batches in another order that never goes negative: increments first.
    singles: MutableAntichain[Any] = MutableAntichain()
    for u in [u for u in shuffled if u[1] > 0] + [u for u in shuffled if u[1] <= 0]:
        singles.update_iter([u])
    assert singles.frontier() == expected

    # Re-split the original sequence into different batches.
    cut = data.draw(st.integers(0, len(updates)))
    resplit: MutableAntichain[Any] = MutableAntichain()
    resplit.update_iter(updates[:cut])
    resplit.update_iter(updates[cut:])
    assert resplit.frontier() == expected


def test_mutable_antichain_examples() -> None:
    m = MutableAntichain([(0, 1)])
    assert m.frontier() == Antichain([0])
    assert m.update_iter([(3, 1), (0, -1)]) == [(0, -1), (3, 1)]
    assert m.update_iter([(5, 2)]) == []  # above the frontier: no change
    assert m.update_iter([(3, -1), (3, +1)]) == []  # nets to nothing
    assert m.update_iter([(3, -1)]) == [(3, -1), (5, 1)]
    v: MutableAntichain[tuple[int, ...]] = MutableAntichain()
    assert v.update_iter([((1, 2), 1), ((2, 1), 1), ((3, 3), 1)]) == [((1, 2), 1), ((2, 1), 1)]
    assert v.update_iter([((1, 2), -1)]) == [((1, 2), -1)]  # (3, 3) still above (2, 1)


def test_mutable_antichain_rejects_negative_counts_atomically() -> None:
    m = MutableAntichain([(1, 1), (2, 1)])
    with pytest.raises(ValueError):
        m.update_iter([(2, -1), (1, -2)])
    assert m.count(1) == 1
    assert m.count(2) == 1
    assert m.frontier() == Antichain([1])
    with pytest.raises(ValueError):
        m.update_iter([(9, -1)])
    with pytest.raises(TypeError):
        m.update_iter([(9, True)])


# --- probes -----------------------------------------------------------------------------------


def test_probe_for_one_stream() -> None:
    probe = FrontierProbe(position_frontier(5))
    assert probe.frontier == position_frontier(5) == Antichain([6])
    assert not probe.less_than(6)  # nothing below 6 (i.e. <= 5) can still appear
    assert probe.less_than(7)  # 6 can
    assert probe.less_equal(6)
    assert not probe.less_equal(5)
    assert not probe.done
    assert FrontierProbe(Antichain[int]()).done


def test_probe_owns_its_frontier() -> None:
    frontier = Antichain([4])
    probe = FrontierProbe(frontier)
    frontier.insert(1)
    assert probe.frontier == Antichain([4])


@DIMS
@settings(deadline=None)  # brute force over a grid; slow CI must not flake
@given(data=st.data())
def test_probe_semantics(dim: int, data: st.DataObject) -> None:
    pending = data.draw(times_lists(dim))
    probe = FrontierProbe(Antichain(pending))
    for t in grid(dim):
        assert probe.less_than(t) == any(bf_le(p, t) and p != t for p in pending)
        assert probe.less_equal(t) == any(bf_le(p, t) for p in pending)


# --- live filter ------------------------------------------------------------------------------


def test_strymon_example() -> None:
    # completed [0, 1, 2], active [3, 5], latent [4, 6, 7, ...]
    active = [3, 5]
    snapshot = FrontierSnapshot(Antichain(active), UpperAntichain(active))
    assert snapshot.upper == UpperAntichain([5])
    f = LiveFilter(snapshot)
    assert f.active
    assert [t for t in range(3, 10) if f.admit(t)] == [6, 7, 8, 9]  # no hole at 5: 4 dropped too
    f.advance_lower(Antichain([5]))  # 3 (and 4) completed; 5 still active
    assert f.active
    assert not f.admit(5)
    f.advance_lower(Antichain([6]))  # 5 completed: the lower frontier passed the upper one
    assert not f.active
    assert f.upper.is_empty
    assert all(f.admit(t) for t in range(12))
    with pytest.raises(ValueError):
        f.advance_lower(Antichain([2]))


def test_merged_partitions() -> None:
    a = FrontierSnapshot(Antichain([3]), UpperAntichain([5]))
    b = FrontierSnapshot(Antichain([7]), UpperAntichain([9]))
    merged = FrontierSnapshot.merge([a, b])
    assert merged == FrontierSnapshot(Antichain([3]), UpperAntichain([9]))
    f = LiveFilter(merged)
    assert [t for t in range(3, 12) if f.admit(t)] == [10, 11]
    f.advance_lower(Antichain([10]))
    assert not f.active

    # Vector times: two incomparable maximal active epochs.
    c = FrontierSnapshot(Antichain([(0, 0)]), UpperAntichain([(2, 1), (0, 3)]))
    d = FrontierSnapshot(Antichain([(1, 0)]), UpperAntichain([(1, 1), (3, 0)]))
    g = LiveFilter(FrontierSnapshot.merge([c, d]))
    assert g.upper == UpperAntichain([(2, 1), (0, 3), (3, 0)])
    assert not g.admit((1, 1))
    assert g.admit((1, 2))
    assert g.admit((3, 1))
    g.advance_lower(Antichain([(1, 0), (0, 4)]))  # (0, 3) is complete now
    assert g.upper == UpperAntichain([(2, 1), (3, 0)])
    assert g.admit((0, 3)) and g.active
    g.advance_lower(Antichain([(3, 2)]))
    assert not g.active


def test_empty_snapshots() -> None:
    assert not LiveFilter(FrontierSnapshot(Antichain([4]), UpperAntichain[int]())).active
    assert not LiveFilter(FrontierSnapshot[int].merge([])).active


@DIMS
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_live_filter_property(dim: int, data: st.DataObject) -> None:
    active = data.draw(times_lists(dim, 8))
    snapshot = FrontierSnapshot(Antichain(active), UpperAntichain(active))
    f = LiveFilter(snapshot)
    lower = snapshot.lower
    for _ in range(data.draw(st.integers(0, 4))):
        # join with anything is at or beyond the current frontier: a legal advance.
        lower = lower.join(Antichain(data.draw(times_lists(dim, 3))))
        f.advance_lower(lower)
        assert f.lower == lower
        if f.active:
            for t in grid(dim):
                if lower.less_equal(t):  # t may still appear: the snapshot's rule decides
                    assert f.admit(t) == (not any(bf_le(t, u) for u in active))
        else:
            assert all(f.admit(t) for t in grid(dim))
        # Inactive exactly when every active epoch of the snapshot is complete.
        assert f.active == any(lower.less_equal(u) for u in active)
