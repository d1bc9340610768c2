"""The database incarnation, pure (`streams.core.incarnation`)."""

from __future__ import annotations

import pickle
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.incarnation import (
    Guard,
    Incarnation,
    changes,
    format_lsn,
    token_changes,
    written_elsewhere,
)
from streams.errors import DatabaseChanged, UsageError

incarnations = st.builds(
    Incarnation,
    id=st.uuids().map(str),
    system_identifier=st.integers(0, 2**64 - 1),
    database_oid=st.integers(1, 2**32 - 1),
    table_oid=st.integers(1, 2**32 - 1),
    timeline=st.integers(1, 2**32 - 1),
)


@given(incarnations)
def test_a_token_names_its_incarnation(found: Incarnation) -> None:
    assert Incarnation.from_token(found.token) == found
    assert changes(found, found) == []
    assert token_changes(found.token, found) == []


@given(incarnations, incarnations)
def test_two_incarnations_differ_exactly_when_changes_says_so(
    a: Incarnation, b: Incarnation
) -> None:
    assert (changes(a, b) == []) == (a == b)


@pytest.mark.parametrize("token", ["", "x", "a/1/2/3", "a/1/2/3/x", "/1/2/3/4", "a/1/2/3/4/5"])
def test_a_malformed_token_is_a_change_of_everything(token: str) -> None:
    found = Incarnation("a", 1, 2, 3, 4)
    with pytest.raises(UsageError):
        Incarnation.from_token(token)
    assert token_changes(token, found) == [f"an unreadable incarnation {token!r}"]


def test_changes_name_what_changed_in_words_an_operator_acts_on() -> None:
    old = Incarnation("a", 1, 2, 3, 1)
    assert changes(old, Incarnation("a", 1, 2, 3, 2)) == [
        "timeline 1 -> 2 (a failover to a standby, or a point-in-time recovery: what the old "
        "timeline acknowledged may be missing)"
    ]
    found = changes(old, Incarnation("b", 9, 5, 6, 1))
    assert [line.split(":")[0] for line in found] == [
        "another cluster",
        "another database",
        "the streams schema was recreated",
    ]


def test_the_guard_records_the_first_and_refuses_another() -> None:
    guard = Guard()
    first = Incarnation("a", 1, 2, 3, 1)
    assert guard.check(first, "reader") == first
    assert guard.check(Incarnation("a", 1, 2, 3, 1), "reader") == first
    with pytest.raises(DatabaseChanged, match=r"^writer 'w' of 's': the database changed") as e:
        guard.check(Incarnation("a", 1, 7, 3, 1), "writer 'w' of 's'")
    assert e.value.where == "writer 'w' of 's'"
    assert "OID 2 -> 7" in e.value.changed
    assert guard.expected == first  # a refused one is not taken


def test_a_guard_survives_pickling_and_threads() -> None:
    guard = pickle.loads(pickle.dumps(Guard(Incarnation("a", 1, 2, 3, 1))))
    assert guard.expected == Incarnation("a", 1, 2, 3, 1)
    fresh = Guard()
    seen: list[Incarnation] = []
    threads = [
        threading.Thread(
            target=lambda n=n: seen.append(fresh.check(Incarnation("a", 1, 2, 3, 1), str(n)))
        )
        for n in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and fresh.expected == Incarnation("a", 1, 2, 3, 1)


def test_written_elsewhere_takes_rows_from_before_incarnations_as_they_are() -> None:
    current = Incarnation("a", 1, 2, 3, 1)
    assert written_elsewhere(None, current) is None
    assert written_elsewhere(current.token, current) is None
    assert written_elsewhere("a/1/2/3/2", current) == "; ".join(
        changes(Incarnation("a", 1, 2, 3, 2), current)
    )


@given(incarnations, st.integers(0, 5))
def test_the_guard_takes_a_later_timeline_and_refuses_an_earlier_one(
    first: Incarnation, later: int
) -> None:
    guard = Guard(first)
    promoted = Incarnation(
        first.id, first.system_identifier, first.database_oid, first.table_oid,
        first.timeline + later,
    )  # fmt: skip
    assert guard.check(promoted, "reader") == promoted  # a failover: the role checks the rest
    assert guard.expected == promoted
    if later:
        with pytest.raises(DatabaseChanged, match="split brain"):
            guard.check(first, "writer")  # the old primary, writable again
        assert guard.expected == promoted


def test_a_group_row_of_an_earlier_timeline_holds_across_a_failover_only() -> None:
    current = Incarnation("a", 1, 2, 3, 2)
    assert written_elsewhere("a/1/2/3/1", current, across_failover=True) is None
    assert written_elsewhere("a/1/2/3/3", current, across_failover=True) is not None
    assert written_elsewhere("a/1/9/3/1", current, across_failover=True) is not None
    assert written_elsewhere("nonsense", current, across_failover=True) is not None
    assert written_elsewhere("a/1/2/3/1", current) is not None


# ------------------------------------------------------------------------------ a rewind

HISTORY = Incarnation("a", 1, 2, 3, 1)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**40)), max_size=40))
def test_durable_positions_that_only_grow_on_each_timeline_never_stop_a_process(
    steps: list[tuple[int, int]],
) -> None:
    """Readings of an intact history: timelines only rise, and on each one the durable
    position only grows (crash recovery replays at least what was flushed)."""
    guard, timeline, lsn = Guard(), 1, 0
    for rise, grow in steps:
        if rise == 3:  # a failover: the new timeline starts at or below the old position
            timeline, lsn = timeline + 1, grow // 2
        else:
            lsn += grow
        found = Incarnation("a", 1, 2, 3, timeline)
        if rise % 2:
            guard.check(found, "reader", lsn, guard.seen_lsn)  # a connect
        else:
            guard.check(found, "reader")
            guard.observed(timeline, lsn)  # a probe, a heartbeat
    assert guard.seen_lsn is None or guard.seen_lsn[0] == timeline


@given(st.integers(1, 2**40), st.integers(1, 2**40))
def test_a_durable_position_below_one_seen_on_the_same_timeline_is_a_rewind(
    seen: int, back: int
) -> None:
    guard = Guard()
    guard.check(HISTORY, "reader", seen)
    guard.observed(1, seen + back)
    below = seen + back - min(back, seen)
    with pytest.raises(DatabaseChanged) as raised:
        guard.check(HISTORY, "group 'g' of s", below, guard.seen_lsn)
    text = str(raised.value)
    assert "group 'g' of s" in text and "went back on timeline 1" in text
    assert format_lsn(seen + back) in text  # both positions, as PostgreSQL writes them
    assert format_lsn(below) in text


def test_readings_that_arrive_out_of_order_are_no_rewind() -> None:
    """Two threads: one reads 100 and is slow, the other reads 200 and records it first.
    The first reading is bounded only by what was seen before it was taken."""
    guard = Guard()
    guard.check(HISTORY, "writer", 50, None)
    floor = guard.seen_lsn  # the slow reading starts
    guard.observed(1, 200)  # a heartbeat of another thread, read later, recorded first
    guard.check(HISTORY, "writer", 100, floor)  # no rewind
    assert guard.seen_lsn == (1, 200)


def test_a_failover_starts_counting_again_and_a_former_primary_says_nothing() -> None:
    guard = Guard()
    guard.check(HISTORY, "writer", 5_000)
    later = Incarnation("a", 1, 2, 3, 2)
    guard.check(later, "writer", 4_000, guard.seen_lsn)  # the new timeline left lower: no rewind
    assert guard.seen_lsn == (2, 4_000)
    guard.observed(1, 9_000)  # a late answer from the old primary
    assert guard.seen_lsn == (2, 4_000)
    guard.check(later, "writer", None, guard.seen_lsn)  # a standby's reading: no position
    with pytest.raises(DatabaseChanged, match="0/F9F"):
        guard.check(later, "writer", 3_999, guard.seen_lsn)


def test_lsns_are_written_as_postgresql_writes_them() -> None:
    assert format_lsn(0) == "0/0"
    assert format_lsn(0x1_0300_0060) == "1/3000060"
