"""What `ReaderCore` does as a pattern reader (`client.reader(pattern=...)`): streams join
at the start of a step when a listing of the registry is due, and leave when they are found
dropped (`streams.core.stream_patterns` decides which; docs/design/reader.md, "A pattern
reader"). A mixin of `ReaderCore`, which holds the state it names."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from ..core.reader_state import ProofFollowing, Proven, SignedRangeInbox, StartFilters
from ..core.sightings import Sighting
from ..core.stalls import HeldStreams
from ..core.stream_patterns import RegistryCursor, Subscription
from ..types import StreamInfo
from .driver import Gen
from .membership import GroupMembership
from .probe import Probe
from .read_ahead import ReadAhead
from .subscriptions import load_listed, registry_after, registry_ids

__all__ = ["PatternFollowing"]

log = logging.getLogger("streams.reader")


class PatternFollowing:
    """The pattern reader's part of `ReaderCore` (a named reader never changes its streams:
    ``subscription`` None)."""

    subscription: Subscription | None
    names: tuple[str, ...]
    infos: dict[str, StreamInfo]
    positions: dict[str, int]
    ts_floors: dict[str, int]
    proven: Proven
    filters: StartFilters
    inbox: SignedRangeInbox
    following: ProofFollowing
    membership: GroupMembership
    sighting: Sighting
    ahead: ReadAhead
    _held: HeldStreams
    #: Streams that joined and left since the shells last took them (`take_changes`: they
    #: watch their channels), and the ones the last probe missed.
    _joined: list[str]
    _left: list[str]
    _gone: list[str]

    def _where(self) -> str:
        raise NotImplementedError

    def _resolve(self, infos: Sequence[StreamInfo], start: str) -> Gen[None]:
        raise NotImplementedError

    def poll_started(self, now: float, interval: float) -> None:
        """The shells start a poll cycle (``interval``: their poll interval): a pattern reader
        lists the registry in it, at most once per interval (`Subscription.poll_started`)."""
        if self.subscription is not None:
            self.subscription.poll_started(now, interval)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """The streams that joined and left since the last call (the shells watch and unwatch
        their channels): ``(joined, left)``."""
        joined, left = self._joined, self._left
        self._joined, self._left = [], []
        return joined, left

    def _follow_pattern(self) -> Gen[None]:
        """A pattern reader's look at the registry, when due: streams created since join, each
        from its first fact, whatever the reader's start (a group's committed position wins,
        as at open: the group takes its generation on them); a stream of a followed name under
        a new id replaces the old one. Every read happens before the reader changes, and the
        listing is undone if one fails (the next step lists again)."""
        sub = self.subscription
        assert sub is not None
        if not sub.due:
            return
        cursor = RegistryCursor(sub.cursor.top, dict(sub.cursor.holes))
        reconcile = self.proven.reconcile  # the joiners' probe re-establishes no other stream
        joining: list[str] = []
        try:
            rows = yield from registry_after(sub.cursor.low())
            followed = {name: self.infos[name].id for name in self.names}
            changes = sub.listed(rows, followed, time.monotonic())
            self._leave(changes.leaves)
            infos = yield from load_listed(changes.joins)
            joining = [info.name for info in infos]
            yield from self._resolve(infos, "earliest")
        except BaseException:
            sub.cursor, sub.due = cursor, True
            for name in joining:
                if name not in self.infos:
                    self._forget(name)
            raise
        finally:
            self.proven.reconcile = reconcile
        for info in infos:
            self.infos[info.name] = info
        self.names += tuple(joining)
        self._joined += joining
        if joining:
            log.info("%s: %d stream(s) joined: %s", self._where(), len(joining), joining[:10])

    def _probe_missed(self, probes: Mapping[str, Probe]) -> None:
        """A pattern reader's streams the probe did not find: dropped, they leave at the end
        of the step (`_leave`)."""
        if self.subscription is not None and len(probes) < len(self.names):
            self._gone = Subscription.gone(self.names, probes)

    def _leave(self, names: Sequence[str]) -> None:
        """Stop following ``names`` (dropped): everything the reader held of them goes (a
        stream created later under a name is another one, read from its first fact)."""
        if not names:
            return
        left = set(names)
        self.names = tuple(name for name in self.names if name not in left)
        for name in names:
            self._forget(name)
            self.infos.pop(name, None)
            self.membership.generations.pop(name, None)
            self.membership.committed.pop(name, None)
            self.filters.live.pop(name, None)
            self.filters.start_ms.pop(name, None)
            self.inbox.ranges.pop(name, None)
            self.following.awaited.pop(name, None)
            self.ahead.received.pop(name, None)
            self.sighting.forget_stream(name)
            self._held.forget(name)
        self._left += names
        log.info("%s: %d stream(s) left (dropped): %s", self._where(), len(names), names[:10])

    def _forget(self, name: str) -> None:
        for state in (self.positions, self.ts_floors, self.proven.targets, self.proven.allocated):
            state.pop(name, None)

    def _leave_dropped(self, failure: BaseException, infos: Sequence[StreamInfo]) -> Gen[None]:
        """A read or a commit of ``infos`` failed as one does on a stream dropped under it:
        the ones whose registry rows are gone leave; ``failure`` is raised if none is."""
        present = yield from registry_ids([info.id for info in infos])
        gone = [info.name for info in infos if info.id not in present]
        if not gone:
            raise failure
        self._leave(gone)
