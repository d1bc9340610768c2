"""The parts of a reader's state that need no database: what it counted, what probes proved,
what start filters still drop, the signed ranges Redis brought, and the shared proofs it
follows (`streams.store.reader_core` drives them; each part owns the flags it reads).

Several are written from two threads: the Redis link's thread verifies signed ranges and
notes writers' tokens, the reader's thread takes them. Every such write is one dict or deque
operation (atomic under the GIL), as the comments at each say.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import DatabaseChanged
from .constants import PROOF_GRACE
from .epochs import Fact
from .frontier import Antichain, FrontierSnapshot, LiveFilter, UpperAntichain
from .replication import Hint
from .signing import KEY_REFRESH, PublicKeys, SignedRange, verify_range

__all__ = [
    "KEY_RETRY",
    "MAX_WAITING_RANGES",
    "ProofFollowing",
    "Proven",
    "ReaderCounters",
    "SignedRangeInbox",
    "StartFilters",
]

#: Most verified ranges waiting for the reader to reach them, per reader and per stream (a
#: flood of replayed lines costs memory up to this, no more). A line under a key the reader
#: does not know is not kept at all (`SignedRangeInbox.offer`).
MAX_WAITING_RANGES = 256
#: Least seconds between two reads of the key table asked for by a line naming an unknown key.
KEY_RETRY = 1.0


@dataclass(slots=True)
class ReaderCounters:
    """What a reader did, for metrics (`streams.metrics`); every count only grows.

    Probes run, shared proofs read, pages of rows read and of those the pages read ahead
    while the previous one was planned; signed ranges delivered from Redis, lines that
    verified, and lines rejected by reason (what `verify_range` returned, ``no-keys`` and
    the inbox's own reasons); shared proofs refused (above their stream's max allocated ID);
    rows read from PostgreSQL (catch-up and live) and, of them, from a standby."""

    probes: int = 0
    proof_reads: int = 0
    pages: int = 0
    pages_ahead: int = 0
    signed_ranges: int = 0
    verified_ranges: int = 0
    # Written by the link's thread (one dict store); `streams.metrics` reads a copy.
    rejected_ranges: dict[str, int] = field(default_factory=dict)
    refused_proofs: int = 0
    rows: int = 0
    standby_rows: int = 0

    def page(self, rows: int) -> None:
        """A page of ``rows`` rows was read."""
        self.pages += 1
        self.rows += rows

    def reject(self, reason: str) -> int:
        """A signed line was rejected for ``reason``: how many were, so far."""
        count = self.rejected_ranges[reason] = self.rejected_ranges.get(reason, 0) + 1
        return count


@dataclass(slots=True)
class Proven:
    """What probes and proofs proved, by stream, and whether that still stands.

    ``targets``: the complete position to catch up to; ``allocated``: the highest max
    allocated ID a probe saw (a sequence never goes back within one history); ``proof_lsn``:
    the highest LSN of a proof ("the standby fence" in `streams.store.probe`: a standby
    replayed past it shows every fact up to the targets, as replay passes the lower ones
    first). ``reconcile``: the Redis link went up or down since the last probe, which must
    re-establish the positions before the reader counts as `live`."""

    targets: dict[str, int] = field(default_factory=dict)
    allocated: dict[str, int] = field(default_factory=dict)
    proof_lsn: int = 0
    link_up: bool = False
    reconcile: bool = True

    def note(self, name: str, complete: int, max_allocated: int | None, position: int = 0) -> None:
        """A probe proved ``name`` complete through ``complete`` (``max_allocated`` None: a
        shared proof, which says nothing of what is allocated). A sequence below what an
        earlier probe saw went back in time (a physical restore in place, a failover to a
        standby that lagged: the incarnation may not show it), and its IDs are handed out
        again: `DatabaseChanged`, as the reader (at ``position``) would skip those facts."""
        if max_allocated is not None:
            seen = self.allocated.get(name, 0)
            if max_allocated < seen:
                through = max(seen, position)
                raise DatabaseChanged(
                    f"reader of {name!r}",
                    f"stream {name!r}: its sequence went back from {seen} to "
                    f"{max_allocated}, so this history restarted at or below "
                    f"{max_allocated}: the facts this reader saw with IDs up to {through} "
                    "may differ from the ones the database now has",
                )
            self.allocated[name] = max_allocated
        self.raise_target(name, complete)

    def raise_target(self, name: str, position: int) -> None:
        self.targets[name] = max(self.targets.get(name, 0), position)

    def note_lsn(self, lsn: int) -> None:
        self.proof_lsn = max(self.proof_lsn, lsn)

    def set_link_state(self, connected: bool) -> None:
        """The Redis link went up or down: disconnected until the next probe."""
        self.link_up = connected
        self.reconcile = True

    @property
    def live(self) -> bool:
        """The Redis link is up and a probe has re-established the positions since."""
        return self.link_up and not self.reconcile

    def target(self, name: str) -> int:
        return self.targets.get(name, 0)

    def behind(self, names: Sequence[str], positions: Mapping[str, int]) -> bool:
        """Is one of the streams ``names`` at ``positions`` below its target?"""
        return any(positions[n] < self.targets.get(n, 0) for n in names)


@dataclass(slots=True)
class StartFilters:
    """What a ``live`` or time start still drops, by stream, until it is done.

    ``live``: Strymon's late subscriber (`LiveFilter`: epochs active at join may be partly
    gone, so all of them are dropped); ``start_ms``: a start by time, which drops facts whose
    running-maximum timestamp is earlier until the first one at or after it (so a fact that
    was pending at the start cannot sneak in late)."""

    live: dict[str, LiveFilter[int]] = field(default_factory=dict)
    start_ms: dict[str, int] = field(default_factory=dict)

    def join_live(self, name: str, position: int, max_allocated: int) -> None:
        """A ``live`` start at ``position`` with IDs up to ``max_allocated`` handed out."""
        if max_allocated > position:
            snapshot = FrontierSnapshot(Antichain([position + 1]), UpperAntichain([max_allocated]))
            self.live[name] = LiveFilter(snapshot)

    def admit(self, name: str, position: int, facts: list[Fact]) -> list[Fact]:
        """The ``facts`` of ``name`` these filters keep, the stream now at ``position``."""
        live = self.live.get(name)
        if live is not None:
            facts = [f for f in facts if live.admit(f.stream_id)]
            live.advance_lower(Antichain([position + 1]))
            if not live.active:
                del self.live[name]
        start_ms = self.start_ms.get(name)
        if start_ms is not None:
            facts = [f for f in facts if f.timestamp >= start_ms]
            if facts:
                del self.start_ms[name]
        return facts

    def admit_columns(
        self, name: str, position: int, ids: Sequence[int], timestamps: Sequence[int]
    ) -> list[bool] | None:
        """`admit` for a page as columns: which rows are kept, None when all are (the usual
        case: no per-row work then)."""
        keep: list[bool] | None = None
        live = self.live.get(name)
        if live is not None:
            keep = [live.admit(int(i)) for i in ids]
            live.advance_lower(Antichain([position + 1]))
            if not live.active:
                del self.live[name]
        start_ms = self.start_ms.get(name)
        if start_ms is not None:
            late = [int(t) >= start_ms for t in timestamps]
            keep = late if keep is None else [a and b for a, b in zip(keep, late, strict=True)]
            if any(keep):
                del self.start_ms[name]
        return keep


@dataclass(slots=True)
class SignedRangeInbox:
    """Signed ranges from Redis (`streams.core.signing`) on their way to delivery: verified on
    the link's thread (`offer`: deque appends and pops are atomic), then taken by the reader
    (`accept`) and kept by stream and ``after`` until it reaches them (`take`); and the keys
    they verify under. Rejections are counted in ``counters``.

    ``keys_wanted``: a line asked for a read of the keys (at most every `KEY_RETRY`);
    ``keys_stale``: a ``KEYS`` line said the keys changed, so nothing verifies or is taken
    until they are read again."""

    counters: ReaderCounters
    verified: deque[SignedRange] = field(default_factory=lambda: deque(maxlen=MAX_WAITING_RANGES))
    ranges: dict[str, dict[int, SignedRange]] = field(default_factory=dict)
    keys: dict[int, PublicKeys] = field(default_factory=dict)
    keys_at: float = -KEY_REFRESH
    keys_wanted: bool = False
    keys_stale: bool = False

    @property
    def pending(self) -> bool:
        """Something may be delivered, or the keys are to be read first."""
        return bool(self.verified or self.keys_wanted or any(self.ranges.values()))

    def keys_due(self, now: float) -> bool:
        """Time to read the keys again (`KEY_REFRESH`: retired keys are dropped then)."""
        return now - self.keys_at >= KEY_REFRESH

    def keys_retry_due(self, now: float) -> bool:
        """A line asked for the keys, and `KEY_RETRY` has passed since the last read."""
        return self.keys_wanted and now - self.keys_at >= KEY_RETRY

    def reading_keys(self, now: float) -> None:
        """A read of the keys starts: a ``KEYS`` line heard from here on asks for another."""
        self.keys_at = now
        self.keys_wanted = False
        self.keys_stale = False

    def keys_read(self, keys: dict[int, PublicKeys]) -> None:
        self.keys = keys

    def keys_unreadable(self) -> int:
        """The reader may not read the keys: it takes nothing from Redis. How many times."""
        self.keys = {}
        return self.counters.reject("no-keys")

    def keys_changed(self, now: float) -> bool:
        """A ``KEYS`` line (a rotation, a retirement): verify nothing more with the keys held
        now. Whether to wake the reader to read them (at most every `KEY_RETRY`)."""
        self.keys_stale = True
        self.keys_wanted = True
        return now - self.keys_at >= KEY_RETRY

    def offer(self, hint: Hint, incarnation: str | None, now: float) -> bool:
        """A signed range arrived (on the link's thread): verify it now, so that a line that
        does not verify costs no wake-up (and no PostgreSQL read) at all. Whether to wake.

        A line under a key this reader does not know is dropped, and asks for a read of the
        keys (at most every `KEY_RETRY`: a flood of lines under unknown keys costs that, no
        more); so is every line after a ``KEYS`` line, until the keys are read again. Keeping
        such a line until then would keep what anyone with Redis may send: parsed, a 1 MiB line
        of ``[],`` is 350k lists, 20 times its size, and 52 of them took a reader to 1.2 GB.
        Dropping it costs only after a rotation, until this reader has read the new key (a
        line it did not take is read from PostgreSQL, as for a line Redis lost)."""
        if self.keys_stale:
            self.counters.reject("keys-changed")
            self.keys_wanted = True
            return now - self.keys_at >= KEY_RETRY
        found = verify_range(
            hint.stream, hint.instance, hint.token, hint.proof, self.keys, incarnation
        )
        if isinstance(found, SignedRange):
            self.counters.verified_ranges += 1
            self.verified.append(found)
            return True
        self.counters.reject(found)
        if found == "unknown-key":
            self.keys_wanted = True
            return now - self.keys_at >= KEY_RETRY
        return False

    def accept(self, incarnation: str | None) -> None:
        """Take the verified ranges in, each under its stream (at most `MAX_WAITING_RANGES`
        each: the lowest go first); drop those whose key was retired since, or whose key is
        of another incarnation than the reader's (verified just before a failover moved it
        to another timeline: not proven in the history it reads now)."""
        keys = self.keys
        while self.verified:
            found = self.verified.popleft()
            if found.key not in keys:  # verified before the key table said it was retired
                self.counters.reject("retired-key")
                continue
            if keys[found.key].incarnation != incarnation:
                self.counters.reject("other-history")
                continue
            waiting = self.ranges.setdefault(found.stream, {})
            known = waiting.get(found.after)
            if known is None or known.through < found.through:
                if len(waiting) >= MAX_WAITING_RANGES:
                    waiting.pop(min(waiting))
                waiting[found.after] = found

    def take(self, name: str, position: int) -> SignedRange | None:
        """The range of ``name`` that goes furthest from ``position`` (``after <= position <
        through``), taken out; ranges already passed or under a retired key are dropped."""
        ranges = self.ranges.get(name)
        if not ranges:
            return None
        keys = self.keys
        fits = [r for r in ranges.values() if r.after <= position < r.through and r.key in keys]
        for stale in [a for a, r in ranges.items() if r.through <= position or r.key not in keys]:
            del ranges[stale]
        if not fits:
            return None
        signed = max(fits, key=lambda r: r.through)
        ranges.pop(signed.after, None)
        return signed

    def on_incarnation(self, previous: str | None, token: str) -> None:
        """The reader's session is in incarnation ``token`` (after ``previous``, None at
        first). A failover: what was verified in the old history (maybe while this process
        was frozen) may describe facts the new primary lacks. Drop it; read the keys again."""
        if previous is None or token == previous:
            return
        self.verified.clear()
        self.ranges.clear()
        self.keys_stale = self.keys_wanted = True


@dataclass(slots=True)
class ProofFollowing:
    """Following the elected prober's proofs (`streams.proofs`) instead of probing each time.

    ``fresh``: the last proofs read were all fresh (a stale or refused one: probe instead).
    ``awaited``: writers' tokens heard while following, not yet covered by a proof, since
    ``awaited_since`` (the link's thread writes, the reader's thread reads: single dict
    operations under the GIL); a proof is due `PROOF_GRACE` after the first.
    ``deadline_moved``: that deadline appeared, so the driver's wait must end sooner."""

    shared_proofs: bool = False
    fresh: bool = False
    awaited: dict[str, int] = field(default_factory=dict)
    awaited_since: float | None = None
    deadline_moved: bool = False

    def following(self, live: bool) -> bool:
        """Following fresh shared proofs over a live link: writers' hints say nothing then."""
        return self.shared_proofs and self.fresh and live

    def await_token(self, stream: str, token: int, now: float) -> None:
        """A writer committed ``token``: the prober should announce it within PROOF_GRACE."""
        if token > self.awaited.get(stream, 0):
            self.awaited[stream] = token
        if self.awaited_since is None:
            self.awaited_since = now
            self.deadline_moved = True

    def deadline(self) -> float | None:
        since = self.awaited_since
        return None if since is None else since + PROOF_GRACE

    def clear(self) -> None:
        self.awaited.clear()
        self.awaited_since = None

    def read(self, fresh: bool) -> bool:
        """The proofs were read: are they all fresh? (If not, nothing is awaited of them.)"""
        self.fresh = fresh
        if not fresh:
            self.clear()
        return fresh

    def late(self, proven: Mapping[str, int], now: float) -> bool:
        """Fresh proofs ``proven``: is a token awaited beyond them past its grace (the prober
        is late: probe for ourselves this once)? Awaiting ends when they cover every token,
        or when it is late."""
        since = self.awaited_since
        if since is None:
            return False
        behind = any(self.awaited.get(n, 0) > proven[n] for n in proven)
        overdue = now >= since + PROOF_GRACE
        if not behind or overdue:
            self.clear()
        return behind and overdue

    def covered(self, positions: Mapping[str, int]) -> None:
        """Signed ranges moved the reader to ``positions``: awaiting ends if they cover all."""
        if self.awaited_since is not None and all(
            self.awaited[n] <= positions[n] for n in self.awaited
        ):
            self.clear()
