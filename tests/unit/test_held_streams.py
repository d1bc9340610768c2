"""`streams.core.stalls.HeldStreams` against a brute-force model of its rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.core.stalls import HeldStreams


def held_for(watch: HeldStreams, stream: str, now: float) -> float:
    """Seconds ``stream`` has been held at its position (0 if it is not held)."""
    held = watch._held.get(stream)
    return 0.0 if held is None else now - held.since


observations = st.lists(
    st.tuples(
        st.floats(0, 5, allow_nan=False),  # time step
        st.sampled_from(["a", "b"]),
        st.integers(0, 4),  # complete
        st.integers(0, 4),  # max allocated - complete
    ),
    max_size=60,
)


@given(observations)
def test_held_streams_match_the_rule(steps: list[tuple[float, str, int, int]]) -> None:
    watch = HeldStreams(check_after=1.0, check_every=1.0)
    now = 0.0
    since: dict[str, tuple[int, float]] = {}  # stream -> (position, held since)
    checked: dict[str, float] = {}
    for step, stream, complete, gap in steps:
        now += step
        due = watch.observe(now, [(stream, complete, complete + gap)])
        expected = False
        if gap == 0:
            since.pop(stream, None)
            checked.pop(stream, None)
        elif stream not in since or since[stream][0] != complete:
            since[stream] = (complete, now)
            checked.pop(stream, None)
        elif now - since[stream][1] >= 1.0 and (
            stream not in checked or now - checked[stream] >= 1.0
        ):
            checked[stream] = now
            expected = True
        assert due == ([stream] if expected else [])
        assert held_for(watch, stream, now) == (now - since[stream][1] if stream in since else 0)


def test_a_stream_held_at_one_position_is_checked_once_a_second() -> None:
    watch = HeldStreams()
    probe = [("s", 10, 12)]
    assert watch.observe(0.0, probe) == []
    assert watch.observe(0.5, probe) == []
    assert watch.observe(1.0, probe) == ["s"]
    assert watch.observe(1.5, probe) == []
    assert watch.observe(2.0, probe) == ["s"]
    assert watch.observe(2.1, [("s", 11, 12)]) == []  # it moved: held anew
    assert watch.observe(2.2, [("s", 12, 12)]) == []  # caught up
    assert held_for(watch, "s", 3.0) == 0.0


# ------------------------------------------------------------------------------------------
# The holding rule: which sessions have held a stream back past the bound


def test_the_cores_default_lease_is_the_configurations() -> None:
    from streams.config import DEFAULT_LEASE_SECONDS
    from streams.core.stalls import DEFAULT_LEASE

    assert DEFAULT_LEASE == DEFAULT_LEASE_SECONDS


@given(st.integers(-(2**40), 2**40), st.integers(-(2**31), 2**31 - 1))
def test_a_key_gives_back_its_floor(allocated: int, offset: int) -> None:
    """``L`` within 2**31 of max allocated comes back from ``L mod 2**32`` (the probe's rule)."""
    from streams.core.stalls import reservation_floor

    floor = allocated + 1 + offset
    assert reservation_floor(floor % 2**32, allocated) == floor


#: (seconds since the previous step, what happens, how many IDs) of a simulated stream.
_steps = st.lists(
    st.tuples(
        st.floats(0, 0.8, allow_nan=False),
        st.sampled_from(["probe", "begin", "end", "grow", "check"]),
        st.integers(1, 3),
    ),
    max_size=120,
)


@given(_steps, st.floats(0.5, 3.0, allow_nan=False))
def test_no_library_transaction_within_the_bound_is_ever_overdue(
    steps: list[tuple[float, str, int]], bound: float
) -> None:
    """Library transactions take ``L`` = the sequence's last value + 1 and reserve ``L`` and
    more at once; none lasts as long as the bound. However probes, appends and checks
    interleave, no check finds one of them overdue."""
    from streams.core.stalls import Hold

    watch = HeldStreams(lease=bound)
    now, allocated, pid = 0.0, 0, 0
    open_: dict[Hold, float] = {}  # hold -> when its transaction read the sequence
    for step, what, n in steps:
        now += step
        # A library transaction ends within the bound (less a nanosecond: at exactly the bound,
        # `now - began < bound` and the observer's `probe <= now - bound` may round apart).
        open_ = {h: began for h, began in open_.items() if now - began < bound - 1e-9}
        if what == "probe":
            watch.observe(now, [("s", 0, allocated)])
        elif what == "begin":
            pid += 1
            open_[Hold(pid, None, (allocated + 1) % 2**32)] = now
            allocated += n
        elif what == "end" and open_:
            open_.pop(next(iter(open_)))
        elif what == "grow":
            allocated += n
        elif what == "check":
            watch.observe(now, [("s", 0, allocated)])
            assert watch.overdue("s", now, bound, allocated, list(open_)) == []


_holds = st.lists(
    st.tuples(st.integers(1, 4), st.integers(-3, 60)), max_size=6
)  # (pid, floor), both from a small range: the same hold recurs from check to check


@given(_steps, _holds, st.floats(0.5, 3.0, allow_nan=False))
def test_overdue_matches_the_rule(
    steps: list[tuple[float, str, int]], holds: list[tuple[int, int]], bound: float
) -> None:
    """Against every probe the observer saw (brute force): a hold is overdue only if some probe
    at or before ``now - bound`` saw the sequence at or past its key (sound), and always if two
    probes at least a spacing apart, the first seeing the sequence past its key, came at or
    before ``now - bound`` (the record is thinned by at most that spacing); ``seen_for`` counts
    from the first of the checks in a row that saw it."""
    from streams.core.stalls import MIN_SPACING, Hold

    watch = HeldStreams(lease=bound)
    spacing = max(MIN_SPACING, bound / 128)
    seen: list[tuple[float, int]] = []  # every probe: (when, max allocated)
    first: dict[Hold, float] = {}
    now, allocated = 0.0, 0
    for step, what, n in steps:
        now += step
        if what in ("grow", "begin"):
            allocated += n
            continue
        watch.observe(now, [("s", 0, allocated)])
        seen.append((now, allocated))
        if allocated == 0:
            first = {}  # not held: nothing is remembered of its holders
        if what != "check":
            continue
        current = [Hold(pid, None, floor % 2**32) for pid, floor in holds]
        first = {h: first.get(h, now) for h in current}
        found = {o.hold: o for o in watch.overdue("s", now, bound, allocated, current)}
        for hold in current:
            floor = next(f for p, f in holds if Hold(p, None, f % 2**32) == hold)
            passed = [t for t, a in seen if t <= now - bound and a >= floor]
            if hold in found:
                assert passed, (hold, floor, seen, now)
                assert found[hold].floor == floor
                assert found[hold].seen_for == now - first[hold]
            sure = any(
                t2 - t1 >= spacing for t1 in passed for t2, _ in seen if t1 <= t2 <= now - bound
            )
            if sure:
                assert hold in found, (hold, floor, seen, now)


def test_sessions_taking_turns_on_one_key_are_each_overdue_at_once() -> None:
    """The sequence passed key 10 (its last value) long ago: a session that takes it now is
    overdue at the next check, however briefly this observer has seen it (a rule on how long
    each session held it would never end sessions that take turns)."""
    from streams.core.stalls import Hold

    watch = HeldStreams(lease=2.0)
    watch.observe(0.0, [("s", 9, 10)])
    assert watch.overdue("s", 1.0, 2.0, 10, [Hold(1, None, 10)]) == []  # within the bound
    watch.observe(3.0, [("s", 9, 10)])
    (found,) = watch.overdue("s", 3.0, 2.0, 10, [Hold(2, None, 10)])
    assert (found.hold.pid, found.floor, found.seen_for) == (2, 10, 0.0)


def test_a_key_above_max_allocated_holds_nothing_back_and_is_left_alone() -> None:
    from streams.core.stalls import Hold

    watch = HeldStreams(lease=1.0)
    watch.observe(0.0, [("s", 3, 4)])
    hold = Hold(1, None, 5)  # L = 5: what the next writer takes, before its nextval
    assert watch.overdue("s", 10.0, 1.0, 4, [hold]) == []
    watch.observe(10.0, [("s", 3, 6)])  # the sequence passes it
    assert watch.overdue("s", 10.5, 1.0, 6, [hold]) == []
    watch.observe(11.0, [("s", 3, 6)])
    assert [o.floor for o in watch.overdue("s", 11.0, 1.0, 6, [hold])] == [5]


def test_a_sequence_set_back_forgets_what_it_passed() -> None:
    """After a restore the sequence is lower: keys it passed before are a new writer's now."""
    from streams.core.stalls import Hold

    watch = HeldStreams(lease=1.0)
    watch.observe(0.0, [("s", 0, 100)])
    watch.observe(5.0, [("s", 0, 10)])
    assert watch.overdue("s", 5.5, 1.0, 10, [Hold(1, None, 11)]) == []
    assert watch.passed_before("s", 4.9) is None  # the probe at 0 s is forgotten


def test_the_bound_is_the_longest_lease_at_least_the_observers() -> None:
    watch = HeldStreams(lease=10.0)
    assert watch.bound(None) == 10.0
    assert watch.bound(2.0) == 10.0
    assert watch.bound(30.0) == 30.0
