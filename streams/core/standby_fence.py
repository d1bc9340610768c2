"""Reads from a hot standby: the fence, and when to stop waiting for it (pure).

Terms. A *read URL* names a hot standby of the primary. A reader with one proves completeness
on the primary, as always (probes, shared proofs, signed ranges, group commits: nothing of the
proof moves), and reads the *rows* of what it proved from the standby. A *proof LSN* is the
primary's WAL insert position read with a proof (`streams.store.probe`, "the standby fence"):
every fact the proof found complete has its commit record below it. The standby's *replay
position* is ``pg_last_wal_replay_lsn()``.

The fence: a reader reads the rows of facts at or below a proven position from the standby only
after a statement on the standby session found the replay position at or past the proof's LSN
(`streams.store.standby`), so the rows statement's snapshot, taken later, shows every one of
them. A standby that is behind *delays* the read; it never makes the reader skip a fact.

How long to wait (`StandbyRoute`): a reader whose standby is behind (or cannot be reached, or
is on another timeline) waits with a small backoff for up to ``max_wait`` seconds in all, then
reads from the primary (a *fallback*) for ``retry_after`` seconds before it tries the standby
again: reads keep flowing when the standby is down or far behind, at the primary's cost, and
every fallback is logged and counted. ``max_wait=0`` falls back at once; a reader that must
never add read load to the primary sets a large ``max_wait`` (it then waits for the standby).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigurationError, StandbyBehind
from .incarnation import Incarnation, changes

__all__ = [
    "DEFAULT_MAX_WAIT",
    "DEFAULT_RETRY_AFTER",
    "OUTCOMES",
    "StandbyRoute",
    "format_lsn",
    "parse_lsn",
    "standby_mismatch",
]

#: Seconds a reader waits in all for its standby (behind, unreachable) before it reads from
#: the primary instead (``STREAMS_STANDBY_MAX_WAIT``).
DEFAULT_MAX_WAIT = 5.0
#: Seconds a reader reads from the primary after a fallback before it tries the standby again.
DEFAULT_RETRY_AFTER = 10.0
#: First and largest pause between two looks at a standby that is behind (seconds).
FIRST_PAUSE = 0.005
MAX_PAUSE = 0.2

#: The outcomes of a read, for ``streams_reader_standby_reads_total{outcome}``: rows read on
#: the standby; rows read on the primary because the standby was behind for ``max_wait``,
#: unreachable for ``max_wait``, on another timeline, or in the ``retry_after`` after a
#: fallback.
OUTCOMES = ("standby", "fallback_lag", "fallback_unreachable", "fallback_timeline", "primary")


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` (PostgreSQL's ``pg_lsn`` text) as an int; `ValueError` otherwise."""
    high, sep, low = text.partition("/")
    if not sep or not high or not low or len(high) > 8 or len(low) > 8:
        raise ValueError(f"not an LSN: {text!r}")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(lsn: int) -> str:
    """An int LSN as PostgreSQL writes it (the inverse of `parse_lsn`)."""
    if lsn < 0 or lsn >= 1 << 64:
        raise ValueError(f"not an LSN: {lsn}")
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def standby_mismatch(expected: Incarnation, found: Incarnation) -> str | None:
    """How the standby's incarnation differs from the reader's: None (the same history),
    ``"timeline"`` (only the timeline: a standby that has not yet passed a restartpoint on the
    primary's new timeline, or one that still follows a primary that was failed over; its rows
    are not read, the reader falls back), or the words of every other difference (the read URL
    names another database: `streams.errors.DatabaseChanged`)."""
    if found.timeline != expected.timeline and all(
        (
            found.id == expected.id,
            found.system_identifier == expected.system_identifier,
            found.database_oid == expected.database_oid,
            found.table_oid == expected.table_oid,
        )
    ):
        return "timeline"
    words = changes(expected, found)
    return "; ".join(words) if words else None


def _check_seconds(value: float, name: str) -> float:
    """Seconds, >= 0 (infinity allowed: never)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigurationError(f"{name} must be a number of seconds, not {value!r}")
    if value < 0:
        raise ConfigurationError(f"{name} must not be negative")
    return float(value)


@dataclass
class StandbyRoute:
    """Where a reader's next rows come from, and how long it waits for its standby.

    The shells ask `use_standby` before a read, report what happened (`read_on_standby`,
    `behind`, `unreachable`, `other_timeline`) and follow the answer: a pause in seconds (wait,
    then look again), or None (read this time from the primary). Times are monotonic seconds
    the caller passes in, so the logic is tested without clocks."""

    max_wait: float = DEFAULT_MAX_WAIT
    retry_after: float = DEFAULT_RETRY_AFTER
    #: When the current wait began (None: not waiting).
    waiting_since: float | None = None
    #: Until when reads go to the primary after a fallback.
    primary_until: float = -math.inf
    #: Looks at the standby in the current wait.
    looks: int = 0
    #: Reads by outcome (`OUTCOMES`).
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    #: Bytes of WAL the standby was behind the proof at the last look (0: not behind).
    lag_bytes: int = 0

    def __post_init__(self) -> None:
        self.max_wait = _check_seconds(self.max_wait, "the standby's max wait")
        self.retry_after = _check_seconds(self.retry_after, "the standby's retry interval")

    def use_standby(self, now: float) -> bool:
        """Read the next rows from the standby (else the primary, and count it so)?"""
        if now < self.primary_until:
            self.outcomes["primary"] += 1
            return False
        return True

    def read_on_standby(self) -> None:
        """The rows were read on the standby: the wait, if any, is over."""
        self.outcomes["standby"] += 1
        self.waiting_since = None
        self.looks = 0
        self.lag_bytes = 0

    def behind(self, now: float, proof_lsn: int, replayed: int) -> float | None:
        """The standby has replayed only to ``replayed``, below ``proof_lsn``: the seconds to
        pause before looking again, or None (fall back: it has been behind for ``max_wait``)."""
        self.lag_bytes = max(0, proof_lsn - replayed)
        return self._wait(now, "fallback_lag")

    def unreachable(self, now: float) -> float | None:
        """The standby could not be reached (or failed the read): as `behind`."""
        return self._wait(now, "fallback_unreachable")

    def other_timeline(self, now: float) -> None:
        """The standby is on another timeline than the primary: fall back now."""
        self._fall_back(now, "fallback_timeline")

    def failed(self, now: float, error: BaseException) -> float | None:
        """The standby could not serve a read, for ``error``: the seconds to pause before
        looking again, or None (read from the primary). The one decision of every reader
        (Python and Spark): another timeline falls back at once, behind or unreachable waits
        up to ``max_wait``."""
        if isinstance(error, StandbyBehind) and error.timeline:
            self.other_timeline(now)
            return None
        if isinstance(error, StandbyBehind):
            return self.behind(now, error.proof_lsn, error.replayed)
        return self.unreachable(now)

    def _wait(self, now: float, outcome: str) -> float | None:
        if self.waiting_since is None:
            self.waiting_since = now
            self.looks = 0
        waited = now - self.waiting_since
        if waited >= self.max_wait:
            self._fall_back(now, outcome)
            return None
        pause: float = min(MAX_PAUSE, FIRST_PAUSE * 2.0 ** min(self.looks, 32))
        self.looks += 1
        return min(pause, self.max_wait - waited)

    def _fall_back(self, now: float, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.waiting_since = None
        self.looks = 0
        self.primary_until = now + self.retry_after
