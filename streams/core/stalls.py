"""When a stream is held back, when to look, and which sessions have held it too long (no I/O).

A stream is *held* while PostgreSQL proves it complete only below max allocated. `HeldStreams`
tells readers, the elected prover and the Spark source when to check a held stream (after
`CHECK_AFTER` seconds at one position, then at most every `CHECK_EVERY`) and, from the max
allocated of the probes it saw, which sessions are overdue (`overdue`: the holding rule).
Times are passed in (monotonic seconds), so this is tested without clocks.

The arguments: docs/design/liveness.md (the liveness and the holding arguments).
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .constants import RESERVATION_LOCK_SPAN

__all__ = [
    "CHECK_AFTER",
    "CHECK_EVERY",
    "DEFAULT_LEASE",
    "HeldStreams",
    "Hold",
    "Overdue",
    "holding_bound",
    "reservation_floor",
]

#: Seconds a stream must stay held at one position before anyone looks for an expired writer.
CHECK_AFTER = 1.0
#: Least seconds between two looks at one stream while it stays held.
CHECK_EVERY = 1.0
#: The observer's own lease when it is given none: `streams.config.DEFAULT_LEASE_SECONDS` (the
#: pure core imports no configuration; a test checks that the two agree).
DEFAULT_LEASE = 10.0
#: Least seconds between two recorded probes of one stream (more often when the bound is long:
#: a 128th of it), so the record stays small: a probe not recorded only makes `overdue` later
#: by at most that much, never earlier.
MIN_SPACING = 0.05


def holding_bound(own_lease: float, writers_lease: float | None) -> float:
    """How long a session may hold a stream back: the longest lease of the stream's writers
    that are not retired (None: there are none), at least the observer's own lease."""
    return max(own_lease, writers_lease or 0.0)


def reservation_floor(key: int, allocated: int) -> int:
    """``L`` from a reservation lock's second key as ``pg_locks`` shows it (``L mod 2**32``,
    unsigned): the one value in ``[allocated + 1 - 2**31, allocated + 1 + 2**31)``, as the
    probe reads it (`streams.store.probe`)."""
    half = RESERVATION_LOCK_SPAN // 2
    return allocated + 1 + (key - allocated - 1 + half) % RESERVATION_LOCK_SPAN - half


@dataclass(frozen=True, slots=True)
class Hold:
    """One session seen holding (or waiting for) one of a stream's reservation locks."""

    pid: int
    #: When its backend started (None: not visible to this role); with ``pid``, the session.
    backend_start: dt.datetime | None
    #: The lock's second key as ``pg_locks`` shows it: ``L mod 2**32``, unsigned.
    key: int


@dataclass(frozen=True, slots=True)
class Overdue:
    """A hold that no library transaction could have: to be ended."""

    hold: Hold
    #: ``L``, the ID the session holds the stream back at.
    floor: int
    #: Seconds this observer has seen the session hold that key (0 at the first sighting).
    seen_for: float


@dataclass(slots=True)
class _Held:
    position: int
    since: float
    checked: float | None = None


class HeldStreams:
    """Per stream: held since when, at which position, when it was last checked, and what the
    probes saw of its sequence (see "the holding rule" in the module doc).

    ``lease``: the observer's own lease (``Settings.lease_seconds``), the least `bound`.
    """

    def __init__(
        self,
        check_after: float = CHECK_AFTER,
        check_every: float = CHECK_EVERY,
        lease: float = DEFAULT_LEASE,
    ) -> None:
        self.check_after = check_after
        self.check_every = check_every
        self.lease = lease
        self._held: dict[str, _Held] = {}
        # stream -> (when, max allocated) of recorded probes, both strictly increasing.
        self._passed: dict[str, deque[tuple[float, int]]] = {}
        # stream -> the longest bound asked about: how much of the record to keep.
        self._horizon: dict[str, float] = {}
        # stream -> when each hold was first seen, as of the last check.
        self._seen: dict[str, dict[Hold, float]] = {}

    def observe(self, now: float, probes: Iterable[tuple[str, int, int]]) -> list[str]:
        """``(stream, complete, max_allocated)`` from a probe at ``now`` (taken after the probe
        returned): the streams to check now (held for `check_after` at one position, not
        checked for `check_every`)."""
        due = []
        for stream, complete, max_allocated in probes:
            self._record(stream, now, max_allocated)
            if complete >= max_allocated:
                self._held.pop(stream, None)
                self._seen.pop(stream, None)
                continue
            held = self._held.get(stream)
            if held is None or held.position != complete:
                self._held[stream] = _Held(complete, now)
                continue
            if now - held.since < self.check_after:
                continue
            if held.checked is not None and now - held.checked < self.check_every:
                continue
            held.checked = now
            due.append(stream)
        return due

    def forget(self, stream: str) -> None:
        """A reader stopped following ``stream`` (dropped: a stream of that name created later
        is another sequence)."""
        for record in (self._held, self._passed, self._horizon, self._seen):
            record.pop(stream, None)

    def bound(self, writers_lease: float | None) -> float:
        """`holding_bound`, with this observer's own lease."""
        return holding_bound(self.lease, writers_lease)

    def passed_before(self, stream: str, at: float) -> int | None:
        """The max allocated ID of the newest recorded probe taken at or before ``at`` (None:
        none): the sequence had passed every ID up to it by then."""
        found = None
        for when, allocated in self._passed.get(stream, ()):
            if when > at:
                break
            found = allocated
        return found

    def overdue(
        self, stream: str, now: float, bound: float, allocated: int, holds: Iterable[Hold]
    ) -> list[Overdue]:
        """A check at ``now`` (after its own look at ``pg_locks``, whose ``holds`` these are,
        with the sequence at ``allocated``): the holds that have held ``stream`` back past
        ``bound`` ("the holding rule"), oldest key first. Remembers when each hold was first
        seen and forgets those not seen any more."""
        self._horizon[stream] = max(self._horizon.get(stream, 0.0), bound)
        seen = self._seen.get(stream, {})
        current = {hold: seen.get(hold, now) for hold in holds}
        self._seen[stream] = current
        passed = self.passed_before(stream, now - bound)
        record = self._passed.get(stream)
        if record and allocated < record[-1][1]:
            # The sequence went back (a restore): what it passed before says nothing now.
            record.clear()
            return []
        if passed is None:
            return []
        found = [
            Overdue(hold, floor, now - first)
            for hold, first in current.items()
            if (floor := reservation_floor(hold.key, allocated)) <= passed
        ]
        return sorted(found, key=lambda o: (o.floor, o.hold.pid))

    def _record(self, stream: str, now: float, allocated: int) -> None:
        record = self._passed.setdefault(stream, deque())
        if record and allocated < record[-1][1]:
            record.clear()  # the sequence went back (a restore, a failover to a lagging standby)
        horizon = max(self.lease, self._horizon.get(stream, 0.0))
        if not record or (
            allocated > record[-1][1] and now - record[-1][0] >= max(MIN_SPACING, horizon / 128)
        ):
            record.append((now, allocated))
        # Keep the newest probe at or before now - horizon (a check may look that far back)
        # and everything after it.
        while len(record) > 1 and record[1][0] <= now - horizon:
            record.popleft()
