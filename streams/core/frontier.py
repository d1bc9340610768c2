"""Progress tracking with partially ordered logical times: antichains, probes, live filters.

Theory of operation
===================

Terms, each defined before it is used:

* A **time** is a fact's logical timestamp. Two kinds are supported: an ``int`` (a stream ID;
  totally ordered) and a ``tuple[int, ...]`` (a vector, e.g. one coordinate per stream or writer),
  ordered *pointwise*: ``a <= b`` iff every coordinate of ``a`` is ``<=`` the one of ``b``. Vectors
  can be **incomparable** (``(1, 2)`` vs ``(2, 1)``). `less_equal` and `less_than` implement this
  order; Python's own ``<`` on tuples is lexicographic and must not be used for it. (Lexicographic
  order *is* a linear extension of the pointwise one — if ``a <= b`` pointwise then ``a <= b``
  lexicographically — which is why sorting helps to find minimal elements below.)
* An **antichain** is a set of mutually incomparable times. `Antichain` keeps the *minimal*
  elements of whatever is inserted; `UpperAntichain` keeps the *maximal* ones. Both expose their
  elements as a sorted tuple so that equality, hashing and output are deterministic.
* A **frontier** is an `Antichain` of the minimal times that may still appear somewhere. A time
  ``t`` may still appear iff some frontier element is ``<= t``; it is **complete** otherwise. The
  empty frontier means "nothing more will ever appear". For a reader of one stream whose linear
  position is ``L`` the frontier is ``{L + 1}`` (`position_frontier`).
* Frontier **A dominates B** (timely's term, `Antichain.dominates`) iff every element of ``B`` is
  ``>=`` some element of ``A``: A is *at or behind* B, everything B may still produce A may too.
  Frontiers only advance, i.e. an older frontier dominates every newer one.
* **meet** (`Antichain.meet_all`) and **join** are lattice operations on frontiers ordered by
  dominance. The meet is the
  frontier of "either may still produce it" (minimal elements of the union): use it to combine the
  frontiers of several streams or partitions read together. The join is "both may still produce
  it" (minimal pointwise maxima): the least frontier that is at or beyond both.
* A **probe** (`FrontierProbe`) answers, for a frontier, ``less_than(t)``: may a time ``< t``
  still appear? and ``less_equal(t)``: may a time ``<= t`` still appear?
* A **mutable antichain** (`MutableAntichain`) tracks a multiset of times with counts, e.g. one
  per pending (reserved, not completed) stream ID or per held capability; its frontier is the
  minimal elements among times with a positive count. Updates are ``(time, delta)`` pairs and
  report how the frontier changed, as timely's ``MutableAntichain::update_iter`` does.
* Per Strymon, the **active** times are those seen but not yet complete; the **lower frontier** is
  the antichain of minimal active times (a frontier as above) and the **upper frontier** the
  `UpperAntichain` of maximal active times. A late, live-only subscriber takes a
  `FrontierSnapshot` of both and runs a `LiveFilter`: it drops every time ``<=`` some snapshot
  upper element (the epoch may have started before it joined, so it may only see part of it) until
  the lower frontier has passed all of them, then admits everything.

Everything here is pure computation on values; nothing does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "Antichain",
    "FrontierProbe",
    "FrontierSnapshot",
    "LiveFilter",
    "MutableAntichain",
    "UpperAntichain",
    "less_equal",
    "less_than",
    "position_frontier",
]

#: A logical time: a stream ID, or a vector of them compared pointwise.
T = TypeVar("T", int, tuple[int, ...])


def less_equal(a: T, b: T) -> bool:
    """``a <= b`` in the partial order of times (pointwise for tuples)."""
    if isinstance(a, tuple):
        if not isinstance(b, tuple):
            raise TypeError("cannot compare a vector time with a scalar time")
        if len(a) != len(b):
            raise ValueError(f"vector times of different lengths: {a!r} and {b!r}")
        return all(x <= y for x, y in zip(a, b, strict=True))
    if isinstance(b, tuple):
        raise TypeError("cannot compare a scalar time with a vector time")
    return a <= b


def less_than(a: T, b: T) -> bool:
    """``a < b`` in the partial order: ``a <= b`` and ``a != b``."""
    return a != b and less_equal(a, b)


def _check_time(time: object) -> None:
    # Catch bugs (a str, a bool, a list) where they are made, not at some later comparison.
    if isinstance(time, tuple):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in time):
            return
    elif isinstance(time, int) and not isinstance(time, bool):
        return
    raise TypeError(f"a time is an int or a tuple of ints, not {time!r}")


def _lub(a: T, b: T) -> T:
    """Least upper bound: the smallest time >= both (pointwise max)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        less_equal(a, b)  # raises on mismatched kinds or lengths
        return tuple(max(x, y) for x, y in zip(a, b, strict=True))
    less_equal(a, b)
    return a if b <= a else b


def _minimal(times: Iterable[T]) -> tuple[T, ...]:
    # In lexicographic order every element comes after everything pointwise-below it, so one
    # pass that keeps t unless an already kept element is <= t yields exactly the minimal set.
    kept: list[T] = []
    for t in sorted(set(times)):
        if not any(less_equal(k, t) for k in kept):
            kept.append(t)
    return tuple(kept)


def _maximal(times: Iterable[T]) -> tuple[T, ...]:
    # Mirror image of _minimal: walk from the top of the linear extension.
    kept: list[T] = []
    for t in sorted(set(times), reverse=True):
        if not any(less_equal(t, k) for k in kept):
            kept.append(t)
    return tuple(reversed(kept))


class _AntichainBase(Generic[T]):
    __slots__ = ("_elements",)

    _elements: tuple[T, ...]

    @property
    def elements(self) -> tuple[T, ...]:
        """The elements, sorted (lexicographically for vectors)."""
        return self._elements

    @property
    def is_empty(self) -> bool:
        return not self._elements

    def __iter__(self) -> Iterator[T]:
        return iter(self._elements)

    def __contains__(self, time: object) -> bool:
        return time in self._elements

    # No __len__ on purpose: it would make an empty frontier falsy, and "if frontier:" reading
    # as "if anything may still appear" is a trap. Use `is_empty`.

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _AntichainBase) or type(other) is not type(self):
            return NotImplemented
        return bool(self._elements == other._elements)

    def __hash__(self) -> int:
        # Hashable for use in sets and as keys; do not `insert` into one while it is used so.
        return hash((type(self).__name__, self._elements))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._elements)!r})"


class Antichain(_AntichainBase[T]):
    """The minimal elements of a set of times: a frontier.

    Mutable only through `insert`; every other operation returns a new antichain.
    """

    __slots__ = ()

    def __init__(self, elements: Iterable[T] = ()) -> None:
        elements = list(elements)
        for t in elements:
            _check_time(t)
        self._elements = _minimal(elements)

    @classmethod
    def from_elements(cls, elements: Iterable[T]) -> Antichain[T]:
        """The minimal elements of ``elements`` (the rest are implied by them)."""
        return cls(elements)

    def copy(self) -> Antichain[T]:
        new: Antichain[T] = Antichain()
        new._elements = self._elements
        return new

    def insert(self, time: T) -> bool:
        """Add ``time`` unless some element is ``<=`` it; drop elements it is ``<=``.

        Returns whether ``time`` was added.
        """
        _check_time(time)
        if self.less_equal(time):
            return False
        kept = [e for e in self._elements if not less_equal(time, e)]
        kept.append(time)
        self._elements = tuple(sorted(kept))
        return True

    def less_equal(self, time: T) -> bool:
        """Is some element ``<= time``, i.e. may ``time`` still appear?"""
        return any(less_equal(e, time) for e in self._elements)

    def less_than(self, time: T) -> bool:
        """Is some element ``< time``, i.e. may a time before ``time`` still appear?"""
        return any(less_than(e, time) for e in self._elements)

    def dominates(self, other: Antichain[T]) -> bool:
        """Is every element of ``other`` ``>=`` some element of ``self`` (self at or behind)?"""
        return all(self.less_equal(t) for t in other._elements)

    def join(self, other: Antichain[T]) -> Antichain[T]:
        """The frontier beyond both: minimal pointwise maxima. Empty if either is empty."""
        return Antichain(_lub(a, b) for a in self._elements for b in other._elements)

    @classmethod
    def meet_all(cls, frontiers: Iterable[Antichain[T]]) -> Antichain[T]:
        """The meet of several frontiers (the empty frontier, "all done", for none)."""
        return cls(t for f in frontiers for t in f._elements)


class UpperAntichain(_AntichainBase[T]):
    """The maximal elements of a set of times: Strymon's upper frontier.

    A separate class, not a flag on `Antichain`, because `insert` and the queries mean the
    mirror-image thing and mixing the two up silently would be a nasty bug.
    """

    __slots__ = ()

    def __init__(self, elements: Iterable[T] = ()) -> None:
        elements = list(elements)
        for t in elements:
            _check_time(t)
        self._elements = _maximal(elements)

    @classmethod
    def from_elements(cls, elements: Iterable[T]) -> UpperAntichain[T]:
        """The maximal elements of ``elements``."""
        return cls(elements)

    def copy(self) -> UpperAntichain[T]:
        new: UpperAntichain[T] = UpperAntichain()
        new._elements = self._elements
        return new

    def insert(self, time: T) -> bool:
        """Add ``time`` unless it is ``<=`` some element; drop elements ``<=`` it.

        Returns whether ``time`` was added.
        """
        _check_time(time)
        if self.greater_equal(time):
            return False
        kept = [e for e in self._elements if not less_equal(e, time)]
        kept.append(time)
        self._elements = tuple(sorted(kept))
        return True

    def greater_equal(self, time: T) -> bool:
        """Is ``time <=`` some element?"""
        return any(less_equal(time, e) for e in self._elements)

    def join(self, other: UpperAntichain[T]) -> UpperAntichain[T]:
        """Maximal elements of the union: merges several partitions' upper frontiers."""
        return UpperAntichain(self._elements + other._elements)


def position_frontier(linear_position: int) -> Antichain[int]:
    """The frontier ``{L + 1}`` of a reader of one stream at linear position ``L``."""
    _check_time(linear_position)
    return Antichain([linear_position + 1])


@dataclass(frozen=True, slots=True)
class FrontierProbe(Generic[T]):
    """Answers "may a time before (or at) ``t`` still appear?" for one frontier, à la timely.

    An immutable snapshot: whoever owns the live frontier hands out a new probe when it moves.
    """

    frontier: Antichain[T]

    def __post_init__(self) -> None:
        # Own a private copy: Antichain.insert on the caller's object must not change us.
        object.__setattr__(self, "frontier", self.frontier.copy())

    def less_than(self, time: T) -> bool:
        """May a fact with a time ``< time`` still appear?"""
        return self.frontier.less_than(time)

    def less_equal(self, time: T) -> bool:
        """May a fact with a time ``<= time`` still appear?"""
        return self.frontier.less_equal(time)

    @property
    def done(self) -> bool:
        """Nothing at all may appear any more (the frontier is empty)."""
        return self.frontier.is_empty


class MutableAntichain(Generic[T]):
    """A multiset of times with counts, whose frontier is the minimal positively counted times.

    The frontier depends only on the final counts, so applying the same updates in any order or
    batching gives the same result, provided no count ever goes below zero. Within one
    `update_iter` call updates are summed per time first, so ``[(t, -1), (t, +1)]`` is fine.
    """

    __slots__ = ("_counts", "_frontier")

    def __init__(self, updates: Iterable[tuple[T, int]] = ()) -> None:
        self._counts: dict[T, int] = {}
        self._frontier: Antichain[T] = Antichain()
        self.update_iter(updates)

    def update_iter(self, updates: Iterable[tuple[T, int]]) -> list[tuple[T, int]]:
        """Apply ``(time, delta)`` updates; return the frontier's changes.

        The result lists ``(time, -1)`` for each element that left the frontier, then
        ``(time, +1)`` for each that entered, each group sorted. Raises ``ValueError`` (leaving
        the counts untouched) if a count would become negative: that is always a caller's bug.
        """
        net: dict[T, int] = {}
        for time, delta in updates:
            _check_time(time)
            if isinstance(delta, bool) or not isinstance(delta, int):
                raise TypeError(f"a count delta is an int, not {delta!r}")
            net[time] = net.get(time, 0) + delta
        for time, delta in net.items():
            if self._counts.get(time, 0) + delta < 0:
                raise ValueError(f"count of time {time!r} would become negative")

        # Only two kinds of change can move the frontier: a frontier element's count reaching
        # zero, or a time appearing that no frontier element is <= (it is not implied). Anything
        # else happens strictly above the frontier, so the expensive rebuild is skipped.
        old_frontier = self._frontier
        rebuild = False
        for time, delta in net.items():
            before = self._counts.get(time, 0)
            after = before + delta
            if after == 0:
                self._counts.pop(time, None)
                rebuild = rebuild or time in old_frontier
            else:
                self._counts[time] = after
                rebuild = rebuild or (before == 0 and not old_frontier.less_equal(time))
        if not rebuild:
            return []
        self._frontier = Antichain(self._counts)
        left = [(t, -1) for t in old_frontier if t not in self._frontier]
        entered = [(t, +1) for t in self._frontier if t not in old_frontier]
        return left + entered

    def frontier(self) -> Antichain[T]:
        """A copy of the current frontier."""
        return self._frontier.copy()

    def count(self, time: T) -> int:
        return self._counts.get(time, 0)

    @property
    def is_empty(self) -> bool:
        """No time has a positive count."""
        return not self._counts

    def less_than(self, time: T) -> bool:
        return self._frontier.less_than(time)

    def less_equal(self, time: T) -> bool:
        return self._frontier.less_equal(time)

    def __repr__(self) -> str:
        return f"MutableAntichain({sorted(self._counts.items())!r})"


@dataclass(frozen=True, slots=True)
class FrontierSnapshot(Generic[T]):
    """Strymon's ``InitialFrontierSnapshot``: both frontiers when a subscriber joined."""

    lower: Antichain[T]
    upper: UpperAntichain[T]

    def __post_init__(self) -> None:
        # Frozen means frozen: do not share antichains the caller might still `insert` into.
        object.__setattr__(self, "lower", self.lower.copy())
        object.__setattr__(self, "upper", self.upper.copy())

    @classmethod
    def merge(cls, snapshots: Iterable[FrontierSnapshot[T]]) -> FrontierSnapshot[T]:
        """One snapshot for a subscriber of several partitions: meet of lowers, join of uppers."""
        snapshots = list(snapshots)
        lower: Antichain[T] = Antichain.meet_all(s.lower for s in snapshots)
        upper: UpperAntichain[T] = UpperAntichain(t for s in snapshots for t in s.upper)
        return cls(lower, upper)


class LiveFilter(Generic[T]):
    """Strymon's subscriber-side filter that preserves epoch atomicity for a late subscriber.

    While `active`, `admit` drops every time ``<=`` some remaining upper element: such an epoch
    may have been active when the subscriber joined, so part of it may already be gone. As the
    lower frontier advances (`advance_lower`), upper elements it has passed (complete times) are
    forgotten; that never changes the verdict for a time that may still appear, because a time
    ``<=`` a complete time is complete too. When none are left the filter is inactive for good.
    """

    __slots__ = ("_lower", "_upper")

    def __init__(self, snapshot: FrontierSnapshot[T]) -> None:
        self._lower: Antichain[T] = snapshot.lower.copy()
        self._upper: UpperAntichain[T] = snapshot.upper.copy()
        self._prune()

    @property
    def active(self) -> bool:
        return not self._upper.is_empty

    @property
    def lower(self) -> Antichain[T]:
        """A copy of the current lower frontier."""
        return self._lower.copy()

    @property
    def upper(self) -> UpperAntichain[T]:
        """A copy of the upper elements still filtered on (empty once inactive)."""
        return self._upper.copy()

    def admit(self, time: T) -> bool:
        """Should a fact with this time be delivered?"""
        return not self._upper.greater_equal(time)

    def advance_lower(self, new_lower: Antichain[T]) -> None:
        """Move the lower frontier forward and forget upper elements it has passed.

        Raises ``ValueError`` if ``new_lower`` is behind the current one: frontiers only advance,
        so that is a caller's bug (stale messages must be dropped before they get here).
        """
        if not self._lower.dominates(new_lower):
            raise ValueError(f"lower frontier went backwards: {self._lower!r} -> {new_lower!r}")
        self._lower = new_lower.copy()
        self._prune()

    def _prune(self) -> None:
        # Keep the upper elements that may still appear (some lower element is <= them).
        kept = [u for u in self._upper if self._lower.less_equal(u)]
        if len(kept) != len(self._upper.elements):
            self._upper = UpperAntichain(kept)
