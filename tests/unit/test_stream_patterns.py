"""`streams.core.stream_patterns`: which streams a pattern reader follows, against a model of a
registry whose ids are handed out in order but committed (made visible) in any order,
aborted, or dropped again."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.core.stream_patterns import (
    HOLE_WAIT,
    MAX_HOLES,
    RegistryCursor,
    Subscription,
    compile_pattern,
)
from streams.errors import InvalidPattern

NAMES = ["a1", "a2", "a3", "b1", "a10"]
PATTERN = r"a\d"  # a1, a2, a3 match; b1 and a10 do not (a full match)

# An action: ("create", name), ("commit", k), ("abort", k), ("drop", name), ("list", 0)
# (k picks one of the pending creates).
actions = st.lists(
    st.one_of(
        st.tuples(st.just("create"), st.sampled_from(NAMES)),
        st.tuples(st.sampled_from(["commit", "abort"]), st.integers(0, 5)),
        st.tuples(st.just("drop"), st.sampled_from(NAMES)),
        st.tuples(st.just("list"), st.just(0)),
    ),
    max_size=60,
)


class Model:
    def __init__(self) -> None:
        self.sub = Subscription(compile_pattern(PATTERN))
        self.next_id = 1
        self.visible: dict[int, str] = {}
        self.pending: dict[int, str] = {}
        self.followed: dict[str, int] = {}
        self.joined_ids: list[int] = []
        self.now = 0.0

    def create(self, name: str) -> None:
        if name in self.visible.values() or name in self.pending.values():
            return  # the name is taken (UNIQUE)
        self.pending[self.next_id] = name
        self.next_id += 1

    def finish(self, k: int, commit: bool) -> None:
        if self.pending:
            key = sorted(self.pending)[k % len(self.pending)]
            name = self.pending.pop(key)
            if commit:
                self.visible[key] = name

    def drop(self, name: str) -> None:
        for key, found in list(self.visible.items()):
            if found == name:
                del self.visible[key]

    def list_and_probe(self) -> None:
        """A reader's step: the listing (when due), then a probe, which misses dropped ids."""
        self.now += 1.0
        low = self.sub.cursor.low()
        rows = [(k, n) for k, n in self.visible.items() if k > low]
        changes = self.sub.listed(rows, dict(self.followed), self.now)
        for name in changes.leaves:
            del self.followed[name]
        for key, name in changes.joins:
            assert name not in self.followed
            self.followed[name] = key
            self.joined_ids.append(key)
        probed = [n for n, k in self.followed.items() if k in self.visible]
        for name in Subscription.gone(self.followed, probed):
            del self.followed[name]


@settings(max_examples=300, deadline=None)
@given(actions)
def test_follows_exactly_the_matching_streams(script: list[tuple[str, object]]) -> None:
    model = Model()
    for what, arg in script:
        if what == "create":
            model.create(str(arg))
        elif what in ("commit", "abort"):
            model.finish(int(str(arg)), what == "commit")
        elif what == "drop":
            model.drop(str(arg))
        else:
            model.list_and_probe()
        # Never a stream that does not match, never one id twice.
        assert all(model.sub.matches(n) for n in model.followed)
        assert len(model.joined_ids) == len(set(model.joined_ids))
    while model.pending:  # every create ends: committed late ones must still be found
        model.finish(0, True)
    model.list_and_probe()
    matching = {n: k for k, n in model.visible.items() if model.sub.matches(n)}
    assert model.followed == matching


def test_late_commit_below_a_seen_id_is_found() -> None:
    sub = Subscription(compile_pattern("s.*"))
    first = sub.listed([(2, "s2")], {}, now=0.0)
    assert first.joins == [(2, "s2")]
    assert sub.cursor.low() == 0  # id 1 is a hole: listed again
    late = sub.listed([(1, "s1"), (2, "s2")], {"s2": 2}, now=1.0)
    assert late.joins == [(1, "s1")]
    assert sub.cursor.low() == 2


def test_holes_expire_and_are_bounded() -> None:
    cursor = RegistryCursor()
    cursor.take([(5, "x")], now=0.0)
    assert cursor.low() == 0
    cursor.take([], now=HOLE_WAIT)
    assert cursor.low() == 5  # an aborted create (or a stream dropped unseen) is given up
    cursor.take([(5 + 10 * MAX_HOLES, "y")], now=HOLE_WAIT)
    assert len(cursor.holes) == MAX_HOLES


def test_same_name_new_id_replaces() -> None:
    sub = Subscription(compile_pattern("s"))
    sub.listed([(1, "s")], {}, now=0.0)
    changes = sub.listed([(3, "s")], {"s": 1}, now=1.0)
    assert changes.leaves == ["s"] and changes.joins == [(3, "s")]


def test_poll_started_at_most_once_per_interval() -> None:
    sub = Subscription(compile_pattern("s"))
    sub.listed([], {}, now=0.0)
    assert not sub.due
    sub.poll_started(10.0, 1.0)
    assert sub.due
    sub.listed([], {}, now=10.0)
    sub.poll_started(10.5, 1.0)
    assert not sub.due
    sub.poll_started(11.0, 1.0)
    assert sub.due


@pytest.mark.parametrize("bad", ["", "(", None, 3])
def test_bad_patterns(bad: object) -> None:
    with pytest.raises(InvalidPattern):
        compile_pattern(bad)
    with pytest.raises(ValueError):
        compile_pattern(bad)
