"""Tests of the pure position bookkeeping (`streams.core.positions`), no servers needed.

The reference is the module docstring of `streams.core.positions` and Matrix Synapse's
description of its stream model (its developer documentation, "Streams", whose worked example
of one writer is the test vector below): per-writer positions (minimal and announceable),
in-flight reservations with floors, max allocated and the linear position.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from streams.core.positions import PositionTracker, ReservationToken, sequence_repair_target
from streams.errors import SequenceRewound

# ---------------------------------------------------------------------------------------------
# Synapse's worked example ("Reserve 2 ... Complete 6"), as an exact test vector


def test_synapse_worked_example_single_writer() -> None:
    """Synapse's "Reserve 2 ... Complete 6" example, row by row."""
    tracker = PositionTracker(local_instance="w", local_position=1, max_allocated=1)
    assert tracker.local_position == 1
    assert tracker.local_minimal_position == 1

    def reserve(stream_id: int) -> None:
        token = tracker.begin_reservation()
        tracker.reserved(token, [stream_id])

    def complete(stream_id: int) -> None:
        tracker.complete([stream_id])

    # (action, argument, current stream ID, minimal position) from that example.
    table = [
        (reserve, 2, 1, 1),
        (reserve, 3, 1, 1),
        (complete, 3, 1, 1),  # waiting for 2 to complete
        (complete, 2, 3, 3),  # jumps 1 -> 3
        (reserve, 4, 3, 3),
        (reserve, 5, 3, 3),
        (reserve, 6, 3, 3),
        (complete, 5, 3, 3),
        (complete, 4, 5, 5),  # jumps 3 -> 5 even though 6 is pending
        (complete, 6, 6, 6),
    ]
    for action, stream_id, current, minimal in table:
        action(stream_id)
        where = f"after {action.__name__} {stream_id}"
        assert tracker.local_position == current, where
        assert tracker.local_minimal_position == minimal, where
        # Single writer: the linear position is the per-writer one.
        assert tracker.linear_position == current, where
    assert tracker.pending_count == 0
    assert tracker.in_flight_count == 0


# ---------------------------------------------------------------------------------------------
# Stateful test against a brute-force model

LOCAL = "w"
OTHERS = ("a", "b")
MAX_IN_FLIGHT = 4
MAX_IDS_PER_RESERVATION = 3


@dataclass
class InFlight:
    """One of the local writer's in-flight reservations, as the model sees it."""

    token: ReservationToken
    drawn: list[int] = field(default_factory=list)  # ids the database already handed out


@dataclass
class OtherWriter:
    """A remote writer, known to the model exactly and to the tracker only by announcements."""

    pending: set[int] = field(default_factory=set)
    active: bool = True


class PositionsMachine(RuleBasedStateMachine):
    """Several writers share one sequence; the tracker follows the local one exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = 0
        self.tracker = PositionTracker(local_instance=LOCAL)
        self.in_flight: dict[int, InFlight] = {}
        self.local_pending: set[int] = set()
        self.others: dict[str, OtherWriter] = {}
        self.noted = 0  # the last sequence value a heartbeat read
        self.last = (0, 0, 0, 0)

    @initialize(start=st.integers(0, 20))
    def start(self, start: int) -> None:
        """All writers begin caught up at `start` (every ID up to it completed)."""
        self.seq = start
        self.tracker = PositionTracker(
            local_instance=LOCAL,
            local_position=start,
            max_allocated=start,
            writers=dict.fromkeys(OTHERS, start),
        )
        self.others = {name: OtherWriter() for name in OTHERS}
        self.last = self._readings()

    # ---------------------------------------------------------------- helpers

    def _draw(self) -> int:
        self.seq += 1
        return self.seq

    def _readings(self) -> tuple[int, int, int, int]:
        t = self.tracker
        return (t.local_position, t.local_minimal_position, t.linear_position, t.max_allocated)

    def _pick(self, keys: list[int], index: int) -> int:
        return sorted(keys)[index % len(keys)]

    def _local_outstanding(self) -> set[int]:
        """IDs the local writer got from the database that have not completed."""
        outstanding = set(self.local_pending)
        for reservation in self.in_flight.values():
            outstanding.update(reservation.drawn)
        return outstanding

    def _all_outstanding(self) -> set[int]:
        outstanding = self._local_outstanding()
        for writer in self.others.values():
            outstanding |= writer.pending
        return outstanding

    def _announceable(self, name: str) -> int:
        """The true largest per-writer position of a remote writer (it has no in-flight)."""
        pending = self.others[name].pending
        return min(pending) - 1 if pending else self.seq

    # ---------------------------------------------------------------- local writer

    @precondition(lambda self: len(self.in_flight) < MAX_IN_FLIGHT)
    @rule()
    def begin(self) -> None:
        token = self.tracker.begin_reservation()
        assert token.number not in self.in_flight
        assert token.floor <= self.seq
        self.in_flight[token.number] = InFlight(token)

    @precondition(
        lambda self: any(len(r.drawn) < MAX_IDS_PER_RESERVATION for r in self.in_flight.values())
    )
    @rule(index=st.integers(0, MAX_IN_FLIGHT))
    def database_draws_id(self, index: int) -> None:
        """The database executes nextval for an in-flight reservation; the tracker is not told."""
        candidates = [
            number for number, r in self.in_flight.items() if len(r.drawn) < MAX_IDS_PER_RESERVATION
        ]
        reservation = self.in_flight[self._pick(candidates, index)]
        reservation.drawn.append(self._draw())

    @precondition(lambda self: bool(self.in_flight))
    @rule(index=st.integers(0, MAX_IN_FLIGHT), k=st.integers(1, MAX_IDS_PER_RESERVATION))
    def resolve(self, index: int, k: int) -> None:
        """The reservation returns its IDs (drawing the rest now, up to k in all)."""
        number = self._pick(list(self.in_flight), index)
        reservation = self.in_flight.pop(number)
        while len(reservation.drawn) < k:
            reservation.drawn.append(self._draw())
        assert all(i > reservation.token.floor for i in reservation.drawn)
        self.tracker.reserved(reservation.token, reservation.drawn)
        self.local_pending.update(reservation.drawn)

    @precondition(lambda self: bool(self.in_flight))
    @rule(index=st.integers(0, MAX_IN_FLIGHT))
    def abandon(self, index: int) -> None:
        """The reservation's transaction rolled back: whatever it drew has completed."""
        number = self._pick(list(self.in_flight), index)
        reservation = self.in_flight.pop(number)
        self.tracker.abandon(reservation.token)

    @precondition(lambda self: bool(self.local_pending))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        ids = data.draw(
            st.lists(st.sampled_from(sorted(self.local_pending)), min_size=1, unique=True)
        )
        self.tracker.complete(ids)
        self.local_pending.difference_update(ids)

    # ---------------------------------------------------------------- other writers

    @rule(name=st.sampled_from(OTHERS), k=st.integers(1, MAX_IDS_PER_RESERVATION))
    def other_reserves(self, name: str, k: int) -> None:
        writer = self.others[name]
        if writer.active:
            writer.pending.update(self._draw() for _ in range(k))

    @rule(name=st.sampled_from(OTHERS), data=st.data())
    def other_completes(self, name: str, data: st.DataObject) -> None:
        writer = self.others[name]
        if writer.pending:
            ids = data.draw(
                st.lists(st.sampled_from(sorted(writer.pending)), min_size=1, unique=True)
            )
            writer.pending.difference_update(ids)

    @rule(name=st.sampled_from(OTHERS))
    def other_announces(self, name: str) -> None:
        if self.others[name].active:
            self.tracker.advance(name, self._announceable(name))

    @rule(name=st.sampled_from(OTHERS))
    def other_retires(self, name: str) -> None:
        """A writer with nothing open is retired (its lease expired): it counts as caught up."""
        writer = self.others[name]
        if writer.active and not writer.pending:
            self.tracker.remove_writer(name)
            writer.active = False
            assert self.tracker.writer_position(name) is None

    @rule(name=st.sampled_from(OTHERS))
    def other_rejoins(self, name: str) -> None:
        writer = self.others[name]
        if not writer.active:
            linear = self.tracker.linear_position
            assert self.tracker.add_writer(name) == linear
            assert self.tracker.linear_position == linear
            writer.active = True

    # ---------------------------------------------------------------- heartbeat

    @rule()
    def note_allocated(self) -> None:
        """A heartbeat reads the sequence: its value at this moment."""
        self.tracker.note_allocated(self.seq)
        self.noted = self.seq
        if not self.in_flight and not self.local_pending:
            assert self.tracker.local_position == self.tracker.max_allocated == self.seq

    # ---------------------------------------------------------------- invariants

    @invariant()
    def local_position_is_valid(self) -> None:
        position = self.tracker.local_position
        outstanding = self._local_outstanding()
        assert all(i > position for i in outstanding), (position, sorted(outstanding))
        assert position <= self.seq

    @invariant()
    def minimal_at_most_announceable(self) -> None:
        assert self.tracker.local_minimal_position <= self.tracker.local_position

    @invariant()
    def remote_positions_are_valid(self) -> None:
        for name, writer in self.others.items():
            position = self.tracker.writer_position(name)
            if writer.active:
                assert position is not None
                assert all(i > position for i in writer.pending), (name, position)

    @invariant()
    def linear_is_safe(self) -> None:
        outstanding = self._all_outstanding()
        true_linear = min(outstanding) - 1 if outstanding else self.seq
        assert self.tracker.linear_position <= true_linear, (
            self.tracker.linear_position,
            sorted(outstanding),
        )

    @invariant()
    def monotonic(self) -> None:
        now = self._readings()
        assert all(a <= b for a, b in zip(self.last, now, strict=True)), (self.last, now)
        self.last = now

    @invariant()
    def counts_match(self) -> None:
        assert self.tracker.pending_count == len(self.local_pending)
        assert self.tracker.in_flight_count == len(self.in_flight)

    @invariant()
    def idle_writer_is_live(self) -> None:
        if not self.in_flight and not self.local_pending:
            assert self.tracker.local_position == self.tracker.max_allocated
            assert self.tracker.local_position >= self.noted


PositionsMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestPositionsMachine = PositionsMachine.TestCase


# ---------------------------------------------------------------------------------------------
# Memory


def test_memory_does_not_grow_with_completed_facts() -> None:
    tracker = PositionTracker(local_instance="w")
    last = 10**5
    for stream_id in range(1, last + 1):
        token = tracker.begin_reservation()
        tracker.reserved(token, [stream_id])
        tracker.complete([stream_id])
    assert tracker.pending_count == 0
    assert tracker.in_flight_count == 0
    assert len(tracker._pending) == 0
    assert len(tracker._in_flight) == 0
    assert tracker.local_position == last
    assert tracker.linear_position == last


# ---------------------------------------------------------------------------------------------
# Named scenarios


def _reserve(tracker: PositionTracker, *ids: int) -> None:
    tracker.reserved(tracker.begin_reservation(), ids)


def test_out_of_order_finish() -> None:
    tracker = PositionTracker(local_instance="w", local_position=1, max_allocated=1)
    _reserve(tracker, 2)
    _reserve(tracker, 3)
    _reserve(tracker, 4)
    assert tracker.complete([4]) is False
    assert tracker.complete([3]) is False
    assert tracker.local_position == 1
    assert tracker.local_minimal_position == 1
    # 2 is all that is left of this writer: completing it moves the position past 4.
    assert (tracker.pending_count, tracker.in_flight_count) == (1, 0)
    assert tracker.complete([2]) is True
    assert tracker.local_position == 4
    assert tracker.local_minimal_position == 4
    assert tracker.pending_count == 0


def test_restart_during_out_of_order_persistence_minimal() -> None:
    """Persisted 5 while 7, 8 completed and 6 was pending, then crashed; restarted at 8."""
    persisted, rescanned_max = 5, 8
    tracker = PositionTracker(
        local_instance="w", local_position=max(persisted, rescanned_max), max_allocated=9
    )
    assert tracker.pending_count == 0
    assert tracker.in_flight_count == 0
    assert tracker.local_minimal_position == 8
    assert tracker.max_allocated == 9
    # The next reservation starts above everything allocated before the crash.
    token = tracker.begin_reservation()
    assert token.floor == 9
    tracker.reserved(token, [10])
    assert tracker.local_position == 9
    tracker.complete([10])
    assert tracker.local_position == 10


def test_restart_during_out_of_order_persistence_announceable() -> None:
    tracker = PositionTracker(local_instance="w", local_position=8, max_allocated=9)
    assert tracker.local_position == 9
    tracker.note_allocated(9)  # an idle writer's heartbeat reads the sequence at 9
    assert tracker.local_position == 9
    assert tracker.linear_position == 9


@pytest.mark.parametrize("gap", ["completed", "rolled-back", "abandoned"])
def test_linear_position_with_gaps_across_two_writers(gap: str) -> None:
    """w1 holds 4, w2 completed 5 and announced it: linear waits for 4, then moves to 5."""
    tracker = PositionTracker(
        local_instance="w1", local_position=3, max_allocated=3, writers={"w2": 3}
    )
    token = tracker.begin_reservation()
    if gap != "abandoned":
        tracker.reserved(token, [4])
    assert tracker.advance("w2", 5) is True
    assert tracker.writer_position("w2") == 5
    assert tracker.max_allocated == 5
    assert tracker.local_position == 3
    assert tracker.linear_position == 3
    if gap == "abandoned":
        tracker.abandon(token)  # nextval's transaction rolled back: 4 is a gap
    else:
        tracker.complete([4])  # committed or rolled back, 4 has completed
    assert tracker.local_position == 5
    assert tracker.linear_position == 5


def test_linear_position_with_gaps_seen_by_a_reader() -> None:
    reader = PositionTracker(writers={"w1": 3, "w2": 3})
    assert reader.linear_position == 3
    assert reader.advance("w2", 5) is True
    assert reader.linear_position == 3
    assert reader.advance("w1", 5) is True
    assert reader.linear_position == 5
    with pytest.raises(RuntimeError):
        _ = reader.local_position


def test_new_writer_seeded_at_linear_position() -> None:
    tracker = PositionTracker(writers={"a": 3, "b": 7})
    assert tracker.linear_position == 3
    assert tracker.add_writer("c") == 3
    assert tracker.writer_position("c") == 3
    assert tracker.linear_position == 3
    assert tracker.add_writer("c") == 3  # already known: unchanged
    # Once the others move, a newcomer is seeded at the new linear, never above it.
    tracker.advance("a", 7)
    tracker.advance("c", 9)
    assert tracker.linear_position == 7
    assert tracker.add_writer("d") == 7
    assert tracker.linear_position == 7


def test_new_writer_with_position_does_not_lower_linear() -> None:
    tracker = PositionTracker(writers={"a": 5})
    assert tracker.linear_position == 5
    tracker.add_writer("b", 2)
    assert tracker.linear_position == 5


def test_removed_writer_is_treated_as_caught_up() -> None:
    tracker = PositionTracker(
        local_instance="w", local_position=10, max_allocated=10, writers={"stale": 3}
    )
    assert tracker.linear_position == 3
    tracker.remove_writer("stale")
    assert tracker.writer_position("stale") is None
    assert tracker.linear_position == 10
    tracker.remove_writer("stale")  # idempotent
    tracker.remove_writer("w")  # the local writer is not a remote one
    assert tracker.local_position == 10


@pytest.mark.parametrize("bad_id", [3, 5])
def test_reserved_at_or_below_floor_raises(bad_id: int) -> None:
    """A sequence that hands out an ID <= the floor was reset: refuse."""
    tracker = PositionTracker(local_instance="w", local_position=5, max_allocated=5)
    token = tracker.begin_reservation()
    assert token.floor == 5
    with pytest.raises(SequenceRewound, match="set back"):
        tracker.reserved(token, [bad_id])
    assert tracker.local_position == 5
    assert tracker.max_allocated == 5


def test_stale_advance_is_ignored() -> None:
    tracker = PositionTracker(writers={"a": 5, "b": 9})
    assert tracker.linear_position == 5
    assert tracker.advance("a", 3) is False
    assert tracker.advance("a", 5) is False
    assert tracker.writer_position("a") == 5
    assert tracker.linear_position == 5
    assert tracker.advance("a", 6) is True
    assert tracker.linear_position == 6
    assert tracker.advance("a", 4) is False
    assert tracker.writer_position("a") == 6
    assert tracker.linear_position == 6


def test_advance_for_local_instance_is_ignored() -> None:
    tracker = PositionTracker(local_instance="w", local_position=3, max_allocated=3)
    assert tracker.advance("w", 10) is False
    assert tracker.local_position == 3
    assert tracker.max_allocated == 3
    assert tracker.linear_position == 3
    assert tracker.writers() == {"w": 3}


@pytest.mark.parametrize(
    ("last_value", "max_stored", "expected"),
    [(None, None, None), (None, 0, None), (None, 5, 5), (3, 5, 5), (7, 5, None), (5, 5, None)],
)
def test_sequence_repair_target(
    last_value: int | None, max_stored: int | None, expected: int | None
) -> None:
    assert sequence_repair_target(last_value, max_stored) == expected


def test_snapshot_is_consistent() -> None:
    tracker = PositionTracker(
        local_instance="w", local_position=2, max_allocated=2, writers={"a": 2}
    )
    token = tracker.begin_reservation()
    _reserve(tracker, 3)
    snap = tracker.snapshot()
    assert snap.local_position == 2
    assert snap.local_minimal_position == 2
    assert snap.pending == 1
    assert snap.in_flight == 1
    assert snap.max_allocated == 3
    assert snap.linear == 2
    assert dict(snap.writers) == {"a": 2, "w": 2}
    tracker.abandon(token)


# ---------------------------------------------------------------------------------------------
# Thread safety


def test_thread_safety_smoke() -> None:
    tracker = PositionTracker(local_instance="w")
    counter = itertools.count(1)
    counter_lock = threading.Lock()
    drawn: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(2000):
                token = tracker.begin_reservation()
                with counter_lock:
                    stream_id = next(counter)
                    drawn.append(stream_id)
                tracker.reserved(token, [stream_id])
                tracker.complete([stream_id])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(drawn) == 8000
    assert tracker.pending_count == 0
    assert tracker.in_flight_count == 0
    assert tracker.local_position == max(drawn) == 8000
    assert tracker.linear_position == 8000


def test_peak_pending_counts_what_happened_between_heartbeats() -> None:
    tracker = PositionTracker(local_instance="w", local_position=0, max_allocated=0)
    assert tracker.take_peak_pending() == 0
    token = tracker.begin_reservation()
    tracker.reserved(token, [1])
    tracker.complete([1])
    assert tracker.pending_count == 0
    assert tracker.take_peak_pending() == 1  # it wrote since the last reading
    assert tracker.take_peak_pending() == 0  # and nothing since
