"""What a process saw on its timeline, and what a failover may have lost of it.

Terms. A *failover* is a new timeline of the same database (`streams.core.incarnation`: the
same incarnation id, system identifier and OIDs, a higher timeline): a standby promoted, or a
point-in-time recovery. A PostgreSQL standby replays its primary's WAL in order, so the new
primary holds a *prefix* of the old one's history, everything up to the *switch point*: what
it lacks is the **last** things the old primary did. With a synchronous standby
(``synchronous_standby_names``) a commit is acknowledged only once the standby has it, so every
acknowledged commit is in the prefix; with an asynchronous one the last acknowledged commits may
not be. (Either way a commit is *visible* on the primary before the standby confirms it, so a
reader may have delivered a fact that no writer saw acknowledged and that the standby lacks.)

A *sighting* is what one role of a process (a writer, a reader) saw on its timeline, kept in
memory: the timeline it last verified, and per stream the IDs of the most recent facts it saw
exist (a writer: acknowledged; a reader: delivered), at most `RECENT_IDS` of them, oldest
dropped first. Because a failover loses a suffix of the history, a fact it lost that this role
saw is among the most recent the role saw, unless the loss reaches further back than
`RECENT_IDS` facts (then every remembered ID is missing, and `Loss.at_least` says so). Checking
those IDs on the new primary needs no WAL position, no timeline history file and no privilege
beyond reading the facts, so every role can do it on a managed service.

The rule (`assess`): after a timeline change, a role goes on by itself when every fact it
remembers is still there (or was removed by the stream's retention since); otherwise it gets
a `Loss` per stream, naming the range, which the shells raise as `streams.FailoverLoss`. A
sighting that a role must not go past once it lost something (a reader: its consumer holds
facts the database no longer has) keeps the error (`Sighting.failed`). This module is pure;
`streams.store.failover` asks the database.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import FailoverLoss

__all__ = ["RECENT_IDS", "Loss", "Sighting", "assess"]

#: IDs remembered per stream and role: a failover that lost more than this many of the facts a
#: role saw is still found (every remembered one is missing), its range is then a lower bound.
RECENT_IDS = 4096


@dataclass(frozen=True, slots=True)
class Loss:
    """The facts of one stream a role saw and the new primary lacks."""

    stream: str
    first: int
    last: int
    missing: int
    #: Every remembered ID of the stream is missing: the loss may reach further back.
    at_least: bool

    def error(self, where: str, what: str) -> FailoverLoss:
        more = " (at least: every fact it remembered is gone)" if self.at_least else ""
        return FailoverLoss(
            where, self.stream, self.first, self.last, self.missing, f"{self.missing} {what}{more}"
        )


def assess(
    stream: str, seen: Iterable[int], present: Iterable[int], pruned_through: int
) -> Loss | None:
    """The `Loss` of ``stream`` (None: nothing lost): the IDs ``seen`` by a role that are not
    ``present`` on the new primary, ignoring those at or below ``pruned_through`` (retention
    removed them, which is no loss)."""
    remembered = sorted({i for i in seen if i > pruned_through})
    found = set(present)
    missing = [i for i in remembered if i not in found]
    if not missing:
        return None
    return Loss(stream, missing[0], missing[-1], len(missing), len(missing) == len(remembered))


@dataclass
class Sighting:
    """What one role saw on its timeline (see the module docstring). Thread-safe for a writer
    used from several threads: `note` and `snapshot` take a lock."""

    #: Whether a loss stops the role for good (a reader) or is reported once (a writer).
    sticky: bool = False
    #: The timeline of the last session the role verified (None: none yet).
    timeline: int | None = None
    #: The loss that stopped a sticky role.
    failed: FailoverLoss | None = None
    _recent: dict[str, tuple[int, deque[int]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, stream: str, key: int, ids: Iterable[int]) -> None:
        """Remember that the facts ``ids`` of ``stream`` (registry id ``key``) exist."""
        with self._lock:
            entry = self._recent.get(stream)
            if entry is None:
                entry = self._recent[stream] = (key, deque(maxlen=RECENT_IDS))
            entry[1].extend(ids)

    def forget_stream(self, stream: str) -> None:
        """A reader stopped following ``stream`` (it was dropped): nothing of it to check."""
        with self._lock:
            self._recent.pop(stream, None)

    def snapshot(self) -> Mapping[str, tuple[int, list[int]]]:
        """``{stream: (key, ids)}`` of what is remembered now."""
        with self._lock:
            return {name: (key, list(ids)) for name, (key, ids) in self._recent.items()}

    def take_loss(self) -> FailoverLoss | None:
        """A non-sticky role's loss, once: the caller raises it (a writer's next call)."""
        with self._lock:
            loss, self.failed = self.failed, None
        return loss

    def forget(self) -> None:
        """After a loss was reported: what was remembered is settled."""
        with self._lock:
            self._recent.clear()
