"""Tests of fact timestamps, S2's way (`streams.core.timestamps`), no servers needed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.timestamps import (
    MAX_TIMESTAMP,
    TimestampMode,
    resolve_timestamps,
    validate_client_timestamp,
)
from streams.errors import InvalidTimestamp

ARRIVAL = 1_000


def _resolve(
    client: list[int | None],
    mode: TimestampMode,
    *,
    uncapped: bool = False,
    arrival_ms: int = ARRIVAL,
    floor: int = 0,
) -> list[int]:
    return resolve_timestamps(
        client, mode=mode, uncapped=uncapped, arrival_ms=arrival_ms, floor=floor
    )


def test_modes_are_named_like_s2() -> None:
    assert TimestampMode("client-prefer") is TimestampMode.CLIENT_PREFER
    assert TimestampMode("client-require") is TimestampMode.CLIENT_REQUIRE
    assert TimestampMode("arrival") is TimestampMode.ARRIVAL


def test_client_prefer_uses_client_else_arrival() -> None:
    assert _resolve([10, None, 500], TimestampMode.CLIENT_PREFER) == [10, ARRIVAL, ARRIVAL]
    assert _resolve([None], TimestampMode.CLIENT_PREFER) == [ARRIVAL]
    assert _resolve([10, 20], TimestampMode.CLIENT_PREFER) == [10, 20]


def test_client_require_uses_client() -> None:
    assert _resolve([10, 20, 15], TimestampMode.CLIENT_REQUIRE) == [10, 20, 20]


@pytest.mark.parametrize("missing", [0, 1, 3])
def test_client_require_rejects_missing_and_names_the_index(missing: int) -> None:
    client: list[int | None] = [10, 20, 30, 40]
    client[missing] = None
    with pytest.raises(InvalidTimestamp, match=rf"\bfact {missing}\b"):
        _resolve(client, TimestampMode.CLIENT_REQUIRE)


def test_arrival_ignores_client() -> None:
    assert _resolve([10, None, 5_000], TimestampMode.ARRIVAL) == [ARRIVAL] * 3
    assert _resolve([10], TimestampMode.ARRIVAL, uncapped=True) == [ARRIVAL]


def test_empty_batch() -> None:
    for mode in TimestampMode:
        assert _resolve([], mode, floor=7) == []


@pytest.mark.parametrize("mode", [TimestampMode.CLIENT_PREFER, TimestampMode.CLIENT_REQUIRE])
def test_capped_at_arrival_unless_uncapped(mode: TimestampMode) -> None:
    assert _resolve([ARRIVAL + 500], mode) == [ARRIVAL]
    assert _resolve([ARRIVAL + 500], mode, uncapped=True) == [ARRIVAL + 500]
    assert _resolve([ARRIVAL - 1], mode) == [ARRIVAL - 1]


def test_s2_example() -> None:
    """S2's documented example: smaller timestamps are raised to the running maximum."""
    result = resolve_timestamps(
        [42, 44, 42, 50, 50, 48, 55],
        mode=TimestampMode.CLIENT_PREFER,
        uncapped=False,
        arrival_ms=100,
        floor=0,
    )
    assert result == [42, 44, 44, 50, 50, 50, 55]


def test_floor_is_respected() -> None:
    assert _resolve([5, 60, 50], TimestampMode.CLIENT_PREFER, floor=55) == [55, 60, 60]
    # The floor wins even over the arrival cap: time never goes backwards.
    assert _resolve([None], TimestampMode.ARRIVAL, arrival_ms=10, floor=20) == [20]
    assert _resolve([30], TimestampMode.CLIENT_PREFER, arrival_ms=10, floor=20) == [20]


def test_invalid_client_timestamp_rejected_before_anything() -> None:
    with pytest.raises(InvalidTimestamp):
        _resolve([10, -1], TimestampMode.CLIENT_PREFER)


@pytest.mark.parametrize("value", [True, False, 1.0, 1.5, "1", b"1", -1, 2**63, 2**64, [1]])
def test_validate_client_timestamp_rejects(value: object) -> None:
    with pytest.raises(InvalidTimestamp):
        validate_client_timestamp(value)


@pytest.mark.parametrize("value", [0, 1, 1_700_000_000_000, 2**63 - 1])
def test_validate_client_timestamp_accepts(value: int) -> None:
    assert validate_client_timestamp(value) == value


def test_validate_client_timestamp_none_and_bound() -> None:
    assert validate_client_timestamp(None) is None
    assert MAX_TIMESTAMP == 2**63 - 1


_timestamps = st.integers(0, 10_000)


def _chosen(given_ts: int | None, mode: TimestampMode, uncapped: bool, arrival: int) -> int:
    """The capped input: what one fact asks for before the running maximum is applied."""
    if mode is TimestampMode.ARRIVAL or given_ts is None:
        return arrival
    return given_ts if uncapped else min(given_ts, arrival)


@given(
    client=st.lists(st.none() | _timestamps, max_size=20),
    mode=st.sampled_from([TimestampMode.CLIENT_PREFER, TimestampMode.ARRIVAL]),
    uncapped=st.booleans(),
    arrival=_timestamps,
    floor=_timestamps,
)
def test_resolve_properties(
    client: list[int | None], mode: TimestampMode, uncapped: bool, arrival: int, floor: int
) -> None:
    result = resolve_timestamps(
        client, mode=mode, uncapped=uncapped, arrival_ms=arrival, floor=floor
    )
    assert len(result) == len(client)
    assert all(a <= b for a, b in itertools.pairwise(result))
    assert all(r >= floor for r in result)
    chosen = [_chosen(given_ts, mode, uncapped, arrival) for given_ts in client]
    for wanted, out in zip(chosen, result, strict=True):
        assert out >= wanted
        if not uncapped:
            assert out <= max(floor, arrival)
    # Exactly the running maximum: nothing is raised more than needed.
    running = floor
    for wanted, out in zip(chosen, result, strict=True):
        running = max(running, wanted)
        assert out == running


@given(
    client=st.lists(_timestamps, max_size=20),
    uncapped=st.booleans(),
    arrival=_timestamps,
    floor=_timestamps,
)
def test_client_require_matches_client_prefer_when_all_given(
    client: list[int], uncapped: bool, arrival: int, floor: int
) -> None:
    batch: list[int | None] = list(client)
    required = _resolve(
        batch, TimestampMode.CLIENT_REQUIRE, uncapped=uncapped, arrival_ms=arrival, floor=floor
    )
    preferred = _resolve(
        batch, TimestampMode.CLIENT_PREFER, uncapped=uncapped, arrival_ms=arrival, floor=floor
    )
    assert required == preferred
