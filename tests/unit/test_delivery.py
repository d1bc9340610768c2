"""`streams.core.delivery`: the one "what may be delivered" decision, by its properties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.core.delivery import behind, deliverable

positions = st.integers(min_value=0, max_value=10**6)
names = st.sampled_from(["a", "b", "c"])


@given(
    st.dictionaries(names, positions, min_size=1),
    st.dictionaries(names, positions),
    st.booleans(),
    st.data(),
)
def test_never_back_never_past_the_proof_or_the_bound(
    lower: dict[str, int], proven: dict[str, int], bounded: bool, data: st.DataObject
) -> None:
    until = {n: data.draw(positions) for n in lower} if bounded else None
    ends = deliverable(lower, proven, until)
    assert ends.keys() == lower.keys()
    for name, position in lower.items():
        end = ends[name]
        assert end >= position  # never takes a position back
        assert end <= max(position, proven.get(name, position))  # never past the proof
        if until is not None:
            assert end <= max(position, until[name])  # never past the read's bound
        if until is None and proven.get(name, position) > position:
            assert end == proven[name]  # everything proven is offered
    assert behind(lower, ends) == any(ends[n] > lower[n] for n in lower)


def test_examples() -> None:
    assert deliverable({"a": 5, "b": 9}, {"a": 8, "b": 7}) == {"a": 8, "b": 9}
    assert deliverable({"a": 5}, {"a": 8}, {"a": 6}) == {"a": 6}
    assert deliverable({"a": 5}, {}) == {"a": 5}
    assert not behind({"a": 5}, {"a": 5}) and behind({"a": 5}, {"a": 6})
