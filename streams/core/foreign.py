"""Another deployment on a replication channel: the verdict, and the quarantine it earns. Pure.

`foreign_verdict` says whether what was heard shows another deployment on the channel (the
rules are in `streams.core.replication`, "Foreign deployments"); `streams doctor` reports it,
and a process's link acts on it: it goes quiet for a while, a *quarantine* (`Quarantines`).

Quarantines
===========

While a link is quarantined it publishes nothing on its channels and is not live: its readers
poll PostgreSQL and use no signed range, and its prover's lines stay unsent. When the quarantine
ends the link is live again and re-runs initialization as on a reconnect (its writers'
``POSITION``, ``REPLICATE`` if it has readers); new evidence starts a new quarantine.

How long: the first quarantine lasts `QUARANTINE_BASE` (60 s). One that starts less than
`QUARANTINE_CAP` (15 min) after the previous one ended lasts twice as long as that one, up to
the cap; a whole cap without a quarantine resets the doubling. Evidence heard during a
quarantine is counted, not acted on: it does not extend the quarantine.

Why this and not "quiet for good", as before: one line that anyone who may publish on Redis can
send (``POSITION <unknown stream> x 0 5``) switched a process's fast path off until it
restarted. Now that line costs the fast path 60 s. Keeping it off takes a line after every
quarantine, each counted (``streams_link_foreign_convictions_total``) and logged, and costs
readers latency only: PostgreSQL is always correct.

What a real Synapse sharing the channel sees: it is broken by a ``POSITION`` for a stream it
does not know (its subscriber drops the connection and sends ``REPLICATE`` on reconnect). Each
quarantine's end publishes our writers' positions once; Synapse drops, reconnects and asks
again, its workers' answers and its own commands convict us again within moments (a
Synapse-only command at once; an unknown stream after one registry read, at most
`streams.core.replication.REFRESH_INTERVAL` later), and we are quiet again, for longer. So
Synapse is disturbed for a few seconds 1, 3, 7, 15 and 30 minutes after the first conviction,
then once per cap (every 15 min): the cap bounds both how often a real neighbour is disturbed
and how long one forged line, sent right after a quarantine ends, keeps the fast path off. A
longer cap would protect Synapse better and make a forger's line last longer; 15 min keeps
both small next to the real fix, which the log names: give `streams` its own prefix.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final, Literal

from .protocol import SYNAPSE_ONLY_COMMANDS

__all__ = [
    "FOREIGN_REASONS",
    "QUARANTINE_BASE",
    "QUARANTINE_CAP",
    "ForeignDeployment",
    "ForeignReason",
    "Quarantine",
    "Quarantines",
    "foreign_verdict",
]

#: Seconds of the first quarantine (and of any after a clean `QUARANTINE_CAP`). Read when a
#: link is made (tests shorten it by patching this name).
QUARANTINE_BASE: Final = 60.0
#: Most seconds of one quarantine; a whole cap without one resets the doubling.
QUARANTINE_CAP: Final = 900.0
#: Most names listed as evidence in a `ForeignDeployment`.
MAX_EVIDENCE: Final = 8

_FIX: Final = "Give streams its own prefix: STREAMS_PREFIX / prefix= / --prefix (default 'streams')"

ForeignReason = Literal["synapse-commands", "unknown-streams"]
#: Every `ForeignReason` (a metric's label values: always both, so the series exist at 0).
FOREIGN_REASONS: Final[tuple[ForeignReason, ...]] = ("synapse-commands", "unknown-streams")


@dataclass(frozen=True, slots=True)
class ForeignDeployment:
    """Another deployment publishes on the channel: why we think so.

    ``reason`` is ``"synapse-commands"`` (``evidence``: the Synapse-only command names heard) or
    ``"unknown-streams"`` (``evidence``: stream names announced that the registry does not know).
    ``line`` is a short repr of one line that gave it away (empty if unknown).
    """

    reason: ForeignReason
    evidence: tuple[str, ...]
    line: str = ""

    def describe(self, prefix: str, seconds: float | None = None) -> str:
        """The operator-facing explanation, naming the channel and the fix. ``seconds``: the
        length of this process's quarantine (None: what any process that hears it does)."""
        listed = ", ".join(self.evidence)
        if self.reason == "synapse-commands":
            who = f"it speaks Synapse's replication: {listed}"
        else:
            who = f"it announces streams this database does not have: {listed}"
        if seconds is None:
            base, cap = QUARANTINE_BASE, QUARANTINE_CAP
            quiet = (
                f"a streams process that hears it goes quiet for {base:.0f} s (doubling while "
                f"it recurs, up to {cap:.0f} s)"
            )
        else:
            quiet = f"this streams process goes quiet for {seconds:.0f} s"
        return (
            f"another deployment ({who}) shares the Redis channel {prefix!r}; {quiet}: it "
            "publishes nothing there, so as not to break it, and its readers poll PostgreSQL "
            f"instead of using signed ranges; then it checks again. {_FIX}"
        )


def foreign_verdict(
    *,
    commands: Iterable[str] = (),
    streams: Iterable[str] = (),
    known_streams: Collection[str] | None = None,
    line: str = "",
) -> ForeignDeployment | None:
    """Whether what was heard on a channel shows another deployment there (pure).

    ``commands``: names of the commands heard; any in `SYNAPSE_ONLY_COMMANDS` convicts.
    ``streams``: stream names heard in ``POSITION``/``RDATA``; with ``known_streams`` (the
    registry, read *after* they were heard), any not in it convicts. Without ``known_streams``
    only the commands count.
    """
    synapse = sorted(set(commands) & SYNAPSE_ONLY_COMMANDS)
    if synapse:
        return ForeignDeployment("synapse-commands", tuple(synapse[:MAX_EVIDENCE]), line)
    if known_streams is not None:
        unknown = sorted(set(streams).difference(known_streams))
        if unknown:
            return ForeignDeployment("unknown-streams", tuple(unknown[:MAX_EVIDENCE]), line)
    return None


@dataclass(frozen=True, slots=True)
class Quarantine:
    """One quarantine of a link: why, and from when to when (monotonic seconds)."""

    verdict: ForeignDeployment
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def left(self, now: float) -> float:
        """Seconds left at ``now`` (0 once over)."""
        return max(0.0, self.end - now)


class Quarantines:
    """The quarantines of one link and how long each lasts (see the module docstring).

    Not thread-safe: `streams.core.replication.LinkCore` calls it under its lock. ``base`` and
    ``cap`` default to `QUARANTINE_BASE` and `QUARANTINE_CAP` as they are when it is made.
    """

    def __init__(self, base: float | None = None, cap: float | None = None) -> None:
        self.cap = QUARANTINE_CAP if cap is None else cap
        self.base = min(self.cap, QUARANTINE_BASE if base is None else base)
        #: The quarantine in force, or None.
        self.current: Quarantine | None = None
        self._previous: Quarantine | None = None

    def period(self, now: float) -> float:
        """How long a quarantine starting at ``now`` would last."""
        previous = self._previous
        if previous is None or now - previous.end >= self.cap:
            return self.base
        return min(self.cap, 2 * previous.seconds)

    def begin(self, verdict: ForeignDeployment, now: float) -> Quarantine | None:
        """Start a quarantine at ``now``: it, or None if one is in force already."""
        if self.current is not None:
            return None
        self.current = Quarantine(verdict, now, now + self.period(now))
        return self.current

    def end(self, now: float) -> Quarantine | None:
        """End the quarantine in force if it is over at ``now``: the one that ended, or None."""
        current = self.current
        if current is None or now < current.end:
            return None
        self.current, self._previous = None, current
        return current
