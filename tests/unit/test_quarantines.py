"""Quarantines of a link that hears another deployment (streams.core.foreign, LinkCore).

A conviction (a Synapse-only command, or an unknown stream confirmed by a registry read) makes
the link quiet until a stated time; then `lift_quarantine` says to publish what a reconnect
publishes, and evidence convicts again. The periods follow a model: the base, doubled for a
conviction less than a cap after the previous quarantine ended, at most the cap, and the base
again after a clean cap.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.foreign import (
    QUARANTINE_BASE,
    QUARANTINE_CAP,
    ForeignDeployment,
    Quarantines,
)
from streams.core.protocol import SYNAPSE_ONLY_COMMANDS
from streams.core.replication import Announcer, Hint, LinkCore

INIT = [b"POSITION mine w1 7 7", b"REPLICATE"]  # what the core below publishes on (re)connect
SYNAPSE_LINES = [
    b'LOCK_RELEASED ["master","lock","key"]',
    b"USER_SYNC sync1 @a:x None start 17",
    b"REMOTE_SERVER_UP other.org",
]


def make_core(base: float | None = None, cap: float | None = None) -> LinkCore:
    """A connected link with one writer and one reader, checking stream names."""
    core = LinkCore("pfx", "me", check_streams=True, quarantine_base=base, quarantine_cap=cap)
    core.add_writer(Announcer("mine", "w1", 7))
    core.add_reader()
    assert core.on_connected() == INIT
    return core


def assert_quiet(core: LinkCore, now: float) -> None:
    """Quarantined: nothing at all is published, whatever asks for it."""
    before = core.stats.suppressed
    assert core.on_message(b"REPLICATE", now) == ([], [])  # a writer's answer, withheld
    assert core.outgoing([b"POSITION mine w1 7 8"]) == []
    assert core.outgoing([("pfx:proof:mine", b"RDATA mine _proof:me 8 {}")]) == []
    assert core.add_reader() == []
    core.remove_reader()
    assert core.replicate_if_live() == []
    assert core.on_connected() == []
    assert core.stats.suppressed == before + 1 + 1 + 1 + len(INIT)


def test_a_forged_unknown_stream_line_costs_a_while_not_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = make_core()
    now = 1000.0
    # A hint like any other: it only makes readers look (at PostgreSQL) sooner.
    assert core.on_message(b"POSITION nope x 0 5", now) == ([Hint("nope", 5, "x")], [])
    assert core.foreign is None and core.refresh_due(now)
    with caplog.at_level(logging.INFO, logger="streams.replication"):
        verdict = core.on_known_streams({"mine"}, now + 0.25)
    assert verdict == ForeignDeployment("unknown-streams", ("nope",), "b'POSITION nope x 0 5'")
    assert core.foreign == verdict
    quarantine = core.quarantine
    assert quarantine is not None and quarantine.verdict == verdict
    assert (quarantine.start, quarantine.end) == (now + 0.25, now + 0.25 + QUARANTINE_BASE)
    assert quarantine.left(now + 10.25) == QUARANTINE_BASE - 10
    assert core.stats.convictions == {"synapse-commands": 0, "unknown-streams": 1}
    (error,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "does not have: nope" in error.getMessage()
    assert f"goes quiet for {QUARANTINE_BASE:.0f} s:" in error.getMessage()
    assert_quiet(core, now + 1)
    # More unknown names meanwhile are no suspects: nothing to decide until it ends.
    core.on_message(b"POSITION other x 0 5", now + 2)
    assert not core.refresh_due(now + 100)
    # It ends at the stated time, not before, and then the link initializes as on a reconnect.
    assert core.lift_quarantine(quarantine.end - 0.001) is None
    assert core.foreign == verdict
    with caplog.at_level(logging.INFO, logger="streams.replication"):
        assert core.lift_quarantine(quarantine.end) == INIT
    assert "quarantine over" in caplog.records[-1].getMessage()
    assert core.foreign is None and core.quarantine is None
    assert core.lift_quarantine(quarantine.end + 1) is None  # ended once
    assert not core.refresh_due(quarantine.end + 100)  # suspects were cleared
    assert core.on_message(b"REPLICATE", quarantine.end) == ([], [b"POSITION mine w1 7 7"])
    assert core.add_reader() == [b"REPLICATE"]
    assert core.outgoing([b"x"]) == [b"x"]
    # Evidence convicts again, for twice as long: it came soon after the first ended.
    later = quarantine.end + 30
    core.on_message(b"POSITION nope x 5 6", later)
    assert core.refresh_due(later)
    renewed = core.on_known_streams({"mine"}, later)
    assert renewed is not None and renewed.evidence == ("nope",) and renewed == core.foreign
    again = core.quarantine
    assert again is not None and again.seconds == 2 * QUARANTINE_BASE
    assert core.stats.convictions["unknown-streams"] == 2


@pytest.mark.parametrize("line", SYNAPSE_LINES)
def test_a_synapse_only_command_quarantines_too(line: bytes) -> None:
    core = make_core(5.0)
    assert core.on_message(line, 50.0) == ([], [])
    name = line.split(b" ")[0].decode()
    assert core.foreign == ForeignDeployment("synapse-commands", (name,), repr(line))
    assert core.stats.convictions == {"synapse-commands": 1, "unknown-streams": 0}
    assert_quiet(core, 51.0)
    # Heard again during the quarantine: counted as heard, not a new conviction, no extension.
    for now in (52.0, 54.9):
        core.on_message(line, now)
    assert core.stats.foreign == 3
    assert core.stats.convictions["synapse-commands"] == 1
    quarantine = core.quarantine
    assert quarantine is not None and quarantine.end == 55.0
    assert core.lift_quarantine(55.0) == INIT


def test_a_quarantine_that_ends_while_disconnected_initializes_on_the_reconnect() -> None:
    core = make_core(1.0)
    core.on_message(SYNAPSE_LINES[0], 0.0)
    core.on_disconnected()
    assert core.lift_quarantine(1.0) == []  # nothing to say on a lost connection
    assert core.foreign is None
    assert core.on_connected() == INIT


def test_periods_double_up_to_the_cap_and_reset_after_a_clean_cap() -> None:
    core = make_core()
    now, seen = 0.0, []
    for gap in (0.0, 1.0, 10.0, 0.0, 0.0, 0.0, QUARANTINE_CAP - 1, QUARANTINE_CAP, 0.0):
        now += gap
        core.on_message(b"NEW_ACTIVE_TASK t", now)
        quarantine = core.quarantine
        assert quarantine is not None
        seen.append(quarantine.seconds)
        now = quarantine.end
        assert core.lift_quarantine(now) == INIT
    base, cap = QUARANTINE_BASE, QUARANTINE_CAP
    assert seen == [base, 2 * base, 4 * base, 8 * base, cap, cap, cap, base, 2 * base]
    assert core.stats.convictions["synapse-commands"] == len(seen)


@given(
    st.sampled_from([(60.0, 900.0), (1.0, 8.0), (3.0, 3.0), (10.0, 4.0)]),
    st.lists(st.integers(0, 40), min_size=1, max_size=12),
)
def test_periods_follow_the_model(base_cap: tuple[float, float], gaps: list[int]) -> None:
    """``gaps``: seconds from the end of one quarantine to the next conviction."""
    base, cap = base_cap
    quarantines = Quarantines(base, cap)
    verdict = ForeignDeployment("synapse-commands", ("USER_SYNC",))
    now, previous = 0.0, None
    for gap in gaps:
        now += gap
        # The first, or after a clean cap: the base; else twice the previous, at most the cap.
        want = min(base, cap) if previous is None or gap >= cap else min(cap, 2 * previous)
        assert quarantines.period(now) == want
        started = quarantines.begin(verdict, now)
        assert started is not None and started.seconds == want and min(base, cap) <= want <= cap
        assert quarantines.begin(verdict, now + 0.5) is None  # one at a time
        assert quarantines.end(started.end - 0.5) is None
        assert quarantines.end(started.end) == started
        previous, now = want, started.end


EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("hear"), st.sampled_from([
            b"USER_SYNC s @a:x None start 1", b"POSITION nope x 0 5", b"POSITION mine w9 0 5",
            b"REPLICATE", b"PING 1",
        ])),
        st.tuples(st.sampled_from(["wait", "tick", "read", "connect", "disconnect"]),
                  st.integers(0, 30)),
    ),
    max_size=40,
)  # fmt: skip


@given(EVENTS)
def test_nothing_is_published_while_quarantined_and_every_conviction_is_counted(
    events: list[tuple[str, object]],
) -> None:
    core = make_core(10.0, 40.0)
    now, connected, begun = 0.0, True, 0
    for kind, arg in events:
        was = core.quarantine
        if kind == "hear":
            assert isinstance(arg, bytes)
            _, replies = core.on_message(arg, now)
            if was is not None or core.quarantine is not None:
                assert replies == []
        elif kind == "wait":
            assert isinstance(arg, int)
            now += arg
        elif kind == "tick":
            lines = core.lift_quarantine(now)
            if was is None or now < was.end:
                assert lines is None and core.quarantine is was
            else:
                assert lines == (INIT if connected else []) and core.quarantine is None
        elif kind == "read" and core.refresh_due(now):
            core.on_known_streams({"mine"}, now)
        elif kind == "connect":
            connected = True
            assert core.on_connected() == ([] if was is not None else INIT)
        elif kind == "disconnect":
            connected = False
            core.on_disconnected()
        quarantine = core.quarantine
        if quarantine is not None and quarantine is not was:
            begun += 1
            assert was is None and quarantine.start == now
            assert 10.0 <= quarantine.seconds <= 40.0
        assert (core.foreign is None) == (quarantine is None)
        if quarantine is not None:
            assert core.outgoing([b"x"]) == [] and core.add_reader() == []
            core.remove_reader()
    assert sum(core.stats.convictions.values()) == begun


def test_synapse_lines_are_synapse_only() -> None:
    assert {line.split(b" ")[0].decode() for line in SYNAPSE_LINES} <= SYNAPSE_ONLY_COMMANDS
