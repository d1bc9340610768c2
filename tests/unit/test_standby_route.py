"""The pure side of reads from a hot standby (`streams.core.standby_fence`): LSNs, the incarnation
comparison, and when a reader stops waiting for its standby."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.config import DEFAULT_STANDBY_MAX_WAIT
from streams.core.incarnation import Incarnation
from streams.core.standby_fence import (
    DEFAULT_MAX_WAIT,
    MAX_PAUSE,
    OUTCOMES,
    StandbyRoute,
    format_lsn,
    parse_lsn,
    standby_mismatch,
)
from streams.errors import ConfigurationError


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_lsn_text_round_trips(lsn: int) -> None:
    assert parse_lsn(format_lsn(lsn)) == lsn


def test_lsn_text_is_postgresqls() -> None:
    assert parse_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert format_lsn(parse_lsn("0/3000060")) == "0/3000060"
    for bad in ("", "16", "/1", "1/", "x/1", "123456789/0"):
        with pytest.raises(ValueError):
            parse_lsn(bad)


def test_the_defaults_agree() -> None:
    assert DEFAULT_STANDBY_MAX_WAIT == DEFAULT_MAX_WAIT


PRIMARY = Incarnation("id", 1, 2, 3, 4)


def test_a_standby_of_the_same_history_matches() -> None:
    assert standby_mismatch(PRIMARY, Incarnation("id", 1, 2, 3, 4)) is None


def test_a_standby_on_another_timeline_only_is_told_apart() -> None:
    assert standby_mismatch(PRIMARY, Incarnation("id", 1, 2, 3, 3)) == "timeline"
    assert standby_mismatch(PRIMARY, Incarnation("id", 1, 2, 3, 5)) == "timeline"


def test_another_database_behind_the_read_url_is_named() -> None:
    found = standby_mismatch(PRIMARY, Incarnation("id", 9, 2, 3, 3))
    assert found is not None and "another cluster" in found
    found = standby_mismatch(PRIMARY, Incarnation("other", 1, 2, 3, 4))
    assert found is not None and "recreated" in found


def test_a_behind_standby_is_waited_for_then_the_primary_reads() -> None:
    route = StandbyRoute(max_wait=1.0, retry_after=10.0)
    assert route.use_standby(0.0)
    pauses = []
    now = 0.0
    while (pause := route.behind(now, 1000, 400)) is not None:
        assert 0 < pause <= MAX_PAUSE
        pauses.append(pause)
        now += pause
    assert now >= 1.0 and pauses[:-1] == sorted(pauses[:-1])  # backoff, bounded by max_wait
    assert route.lag_bytes == 600
    assert route.outcomes["fallback_lag"] == 1
    # The primary reads for retry_after, then the standby is tried again.
    assert not route.use_standby(now + 9.9)
    assert route.outcomes["primary"] == 1
    assert route.use_standby(now + 10.0)
    route.read_on_standby()
    assert route.outcomes["standby"] == 1 and route.lag_bytes == 0


def test_a_read_on_the_standby_ends_the_wait() -> None:
    route = StandbyRoute(max_wait=1.0)
    assert route.unreachable(0.0) is not None
    route.read_on_standby()
    # A new wait starts from scratch: a whole max_wait again.
    assert route.unreachable(5.0) is not None
    assert route.unreachable(5.9) is not None
    assert route.unreachable(6.0) is None
    assert route.outcomes["fallback_unreachable"] == 1


def test_no_wait_falls_back_at_once_and_another_timeline_too() -> None:
    assert StandbyRoute(max_wait=0).behind(0.0, 2, 1) is None
    route = StandbyRoute(retry_after=math.inf)
    route.other_timeline(0.0)
    assert route.outcomes["fallback_timeline"] == 1
    assert not route.use_standby(1e9)


@given(
    st.floats(min_value=0, max_value=30),
    st.lists(st.floats(min_value=0, max_value=5), min_size=1, max_size=50),
)
def test_a_wait_never_outlasts_max_wait(max_wait: float, gaps: list[float]) -> None:
    route = StandbyRoute(max_wait=max_wait)
    now = 0.0
    for gap in gaps:
        pause = route.behind(now, 10, 5)
        if pause is None:
            assert now >= max_wait
            assert route.outcomes["fallback_lag"] == 1
            return
        assert now + pause <= max_wait + 1e-9
        now += max(pause, gap)
    assert sum(route.outcomes.values()) == route.outcomes["fallback_lag"] <= 1
    assert set(route.outcomes) == set(OUTCOMES)


@pytest.mark.parametrize("bad", [-1, math.nan, "1", True])
def test_bad_waits_are_configuration_errors(bad: object) -> None:
    with pytest.raises(ConfigurationError):
        StandbyRoute(max_wait=bad)  # type: ignore[arg-type]


def test_a_read_url_is_checked_and_never_shown_with_its_password() -> None:
    from streams.config import Settings

    settings = Settings.resolve(
        "postgresql://app@primary/db",
        read_database_url="postgresql://app:s3cret@standby/db",
        standby_max_wait=2,
    )
    assert settings.read_database_url == "postgresql://app:s3cret@standby/db"
    assert settings.standby_max_wait == 2.0
    assert "s3cret" not in repr(settings)
    with pytest.raises(ConfigurationError, match="read URL"):
        Settings.resolve("postgresql://app@primary/db", read_database_url="redis://standby")
    with pytest.raises(ConfigurationError, match="standby_max_wait"):
        Settings.resolve("postgresql://app@primary/db", standby_max_wait=-1)
