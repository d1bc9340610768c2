"""`streams.core.stalls.HeldStreams` against a brute-force model of its rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.core.stalls import HeldStreams

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
        assert watch.held_for(stream, now) == (now - since[stream][1] if stream in since else 0)


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
    assert watch.held_for("s", 3.0) == 0.0
