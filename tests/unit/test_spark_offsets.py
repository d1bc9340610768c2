"""The Spark source's offsets (pure): canonical, versioned frontiers, with start times."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from streams_spark.offsets import (
    floors_of,
    frontier_from_json,
    frontier_offset,
    positions_of,
    since_of,
    waiting_of,
)

from streams.errors import ConfigurationError

names = st.lists(st.text("abcxyz_", min_size=1, max_size=6), min_size=1, max_size=4, unique=True)


@given(names.flatmap(lambda ns: st.tuples(
    st.just(tuple(ns)),
    st.fixed_dictionaries({n: st.integers(0, 2**62) for n in ns}),
    st.dictionaries(st.sampled_from(ns), st.integers(0, 2**45)),
)))  # fmt: skip
def test_offsets_round_trip_and_are_canonical(
    case: tuple[tuple[str, ...], dict[str, int], dict[str, int]],
) -> None:
    ns, positions, since = case
    offset = frontier_offset(positions, since)
    # Through JSON, as Spark logs it: same positions, same start times, same text.
    back = json.loads(json.dumps(offset))
    assert positions_of(back, ns) == positions
    assert since_of(back, ns) == since
    shuffled = frontier_offset(dict(reversed(list(positions.items()))), dict(since))
    assert json.dumps(shuffled) == json.dumps(offset)
    # No start times: the plain v1 offset, unchanged for checkpoints written before them.
    if not since:
        assert set(offset) == {"v", "streams"}


def test_bad_offsets_are_clear_errors() -> None:
    with pytest.raises(ConfigurationError, match="version-1"):
        positions_of({"v": 2, "streams": {"a": 1}}, ("a",))
    with pytest.raises(ConfigurationError, match="cannot change across restarts"):
        positions_of({"v": 1, "streams": {"a": 1}}, ("a", "b"))
    with pytest.raises(ConfigurationError, match="since"):
        since_of({"v": 1, "streams": {"a": 1}, "since": {"b": 5}}, ("a",))
    with pytest.raises(ConfigurationError, match="integer"):
        since_of({"v": 1, "streams": {"a": 1}, "since": {"a": "soon"}}, ("a",))
    with pytest.raises(ConfigurationError, match="startingPosition"):
        frontier_from_json('{"a": -1}', "startingPosition")
    assert frontier_from_json('{"v": 1, "streams": {"a": 3}}', "x") == {"a": 3}


@given(names.flatmap(lambda ns: st.tuples(
    st.just(tuple(ns)),
    st.fixed_dictionaries({n: st.integers(0, 2**62) for n in ns}),
    st.fixed_dictionaries({n: st.integers(0, 2**45) for n in ns}),
    st.frozensets(st.sampled_from(ns)),
)))  # fmt: skip
def test_floors_and_waiting_streams_round_trip(
    case: tuple[tuple[str, ...], dict[str, int], dict[str, int], frozenset[str]],
) -> None:
    ns, positions, floors, waiting = case
    offset = frontier_offset(positions, floors=floors, waiting=waiting)
    back = json.loads(json.dumps(offset))
    assert positions_of(back, ns) == positions
    assert floors_of(back, ns) == floors
    assert waiting_of(back, ns) == waiting
    again = frontier_offset(dict(reversed(list(positions.items()))), floors=floors, waiting=waiting)
    assert json.dumps(again) == json.dumps(offset)


def test_offsets_of_the_previous_version_still_read() -> None:
    """A checkpoint written before floors and waiting streams existed resumes: no floors
    (the caller falls back to computing them), nothing waiting."""
    old = json.loads('{"v": 1, "streams": {"a": 7}, "since": {"a": 1700000000000}}')
    assert positions_of(old, ("a",)) == {"a": 7}
    assert floors_of(old, ("a",)) is None
    assert waiting_of(old, ("a",)) == frozenset()
    assert since_of(old, ("a",)) == {"a": 1700000000000}
    with pytest.raises(ConfigurationError, match="floors"):
        floors_of({"v": 1, "streams": {"a": 1}, "floors": {"b": 5}}, ("a",))
    with pytest.raises(ConfigurationError, match="waiting"):
        waiting_of({"v": 1, "streams": {"a": 1}, "waiting": ["b"]}, ("a",))


def test_offsets_carry_the_incarnation_and_older_ones_have_none() -> None:
    from streams_spark.offsets import frontier_offset, incarnation_of

    offset = frontier_offset({"b": 2, "a": 1}, incarnation="id/1/2/3/1")
    assert offset == {"v": 1, "streams": {"a": 1, "b": 2}, "incarnation": "id/1/2/3/1"}
    assert incarnation_of(offset) == "id/1/2/3/1"
    assert incarnation_of(frontier_offset({"a": 1})) is None
    with pytest.raises(ConfigurationError, match="'incarnation' must be a string"):
        incarnation_of({"v": 1, "streams": {"a": 1}, "incarnation": 7})


def test_offsets_carry_their_proofs_wal_position_and_older_ones_have_none() -> None:
    from streams_spark.offsets import lsn_of

    offset = frontier_offset({"a": 3}, incarnation="x/1/2/3/1", lsn=50331648)
    assert json.loads(json.dumps(offset)) == offset and lsn_of(offset) == 50331648
    assert "lsn" not in frontier_offset({"a": 3}) and lsn_of(frontier_offset({"a": 3})) is None
    for bad in ("12", -1, 1.5, True):
        with pytest.raises(ConfigurationError, match="'lsn' must be an integer"):
            lsn_of({**offset, "lsn": bad})
