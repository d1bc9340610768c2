"""The reader core: facts in stream-ID order, one whole epoch at a time, with frontiers.

Theory of operation
===================

A reader follows one or more streams. Its state per stream is a **position** ``p``: it has
delivered every fact ``<= p``, so its frontier there is ``{p + 1}`` (`streams.core.epochs`). With
several streams, its frontier is the one-element antichain of the vector ``(p1 + 1, p2 + 1, ...)``
in the reader's stream order, compared pointwise (`streams.core.frontier`).

Stages, after Materialize's compute protocol:

1. **Creation**: attach to the process's Redis link (subscribe; `streams.transport.link`).
2. **Initialization**: resolve where to start (a reader group's committed position, else
   ``start``), and ask PostgreSQL what is complete (`streams.store.probe.probe`). The link publishes
   ``REPLICATE`` once its subscription is confirmed; writers answer with ``POSITION``.
3. **Computation**: `ReaderCore.step` delivers the next epoch. While behind the last probe it
   reads pages of rows from PostgreSQL, sending the read of the next page before it plans the
   one it has (*reading ahead*: the server reads while this process plans, and the next step
   takes the page); when caught up it probes again, and reads the first pages in the same
   round trip (every read is a plan of `streams.store.reads`, which holds the order of probe,
   rows and retention check and why it is the proof). Between steps the driver
   sleeps until a *hint* (an ``RDATA``/``POSITION`` naming a token beyond its position, from
   Redis or from a writer in the same process) or the poll interval.

Nothing from Redis is trusted: a hint only decides *when* to ask PostgreSQL, so forged, lost,
stale or duplicated commands cannot make a reader skip or invent a fact, and catching up after a
reconnect is the ordinary path, not a special one. The one thing a reader takes from Redis is a
*signed range* of a stream's prover (`streams.core.signing`, where the argument is): facts it
delivers without PostgreSQL when the signature verifies under a live key of the reader's own
database incarnation and the range fits where the reader is (`_step_on_signed_ranges`); a line
that does not verify is dropped unread (counted by reason in ``rejected_ranges``). A ``KEYS``
line (a rotation) stops all verifying until the key table is read again.
After a (re)connect every stream counts as disconnected (`Reader.live` is False, polling is
fast) until the next probe re-establishes it.

`ReaderCore` holds all of this as generators (psycopg style); `Reader` and `AsyncReader` only
drive them on a connection and wait for hints.
"""

from __future__ import annotations

import datetime as dt
import logging
import operator
import os
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypeAlias

from .._gc import collection_paused
from ..config import DEFAULT_LEASE_SECONDS
from ..core.constants import PROOF_GRACE, STALE_AFTER
from ..core.epochs import Epoch, Fact, Row, next_position, plan_page
from ..core.frontier import Antichain, FrontierProbe, FrontierSnapshot, LiveFilter, UpperAntichain
from ..core.incarnation import Guard, Incarnation, written_elsewhere
from ..core.payloads import decode_payloads
from ..core.replication import Hint, is_keys_hint, is_proof_hint
from ..core.sightings import RECENT_IDS, Sighting
from ..core.signing import KEY_REFRESH, PublicKeys, SignedRange, verify_range
from ..core.stalls import HeldStreams
from ..core.standby_fence import StandbyRoute
from ..errors import (
    ConnectionLost,
    DatabaseChanged,
    FactsPruned,
    GroupMoved,
    StoreError,
    UsageError,
)
from ..types import StreamInfo
from .driver import Gen
from .holders import retire_where_held
from .identity import verify
from .keys import live_keys
from .leases import persisted_writer_position
from .probe import set_up_reader_session
from .reader_groups import (
    GROUP_MOVED,
    Generation,
    commit_group,
    commit_group_in,
    group_position,
    take_generations,
)
from .reads import (
    PagesAhead,
    Probe,
    probe,
    probe_and_read,
    pruned_positions,
    read_proofs,
    read_proven,
    receive_proven,
    send_proven,
    standby_fence,
)
from .registry import load_streams
from .rows import database_time_ms, position_before_time, ts_floor_at

__all__ = ["DEFAULT_PAGE_SIZE", "ReaderCore", "Start"]

#: Where a reader without a committed group position starts: ``"earliest"``, ``"latest"``,
#: ``"live"``, a stream ID (the first fact with an ID >= it), a `datetime` (the first fact with a
#: timestamp >= it) or a `timedelta` (that long ago, on the database's clock).
Start: TypeAlias = str | int | dt.datetime | dt.timedelta

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

log = logging.getLogger("streams.reader")

#: Rows per page when catching up.
DEFAULT_PAGE_SIZE = 5000
#: Most verified ranges waiting for the reader to reach them, per reader and per stream (a
#: flood of replayed lines costs memory up to this, no more). A line under a key the reader
#: does not know is not kept at all (`ReaderCore._offer`).
MAX_WAITING_RANGES = 256
#: Least seconds between two reads of the key table asked for by a line naming an unknown key.
KEY_RETRY = 1.0


class _Planned(NamedTuple):
    """What one step read of one stream: its facts (before the ``live`` and time-start
    filters) and where the stream's position and timestamp floor go once they are delivered."""

    name: str
    facts: Sequence[Fact]
    position: int
    ts_floor: int


def _check_start(start: object) -> Start:
    if isinstance(start, bool):
        raise UsageError(f"invalid start {start!r}")
    if isinstance(start, str):
        if start not in ("earliest", "latest", "live"):
            raise UsageError(
                f"invalid start {start!r}: use 'earliest', 'latest', 'live', a stream ID, "
                "a datetime or a timedelta"
            )
        return start
    if isinstance(start, int):
        if start < 1:
            raise UsageError("a start stream ID must be >= 1")
        return start
    if isinstance(start, dt.datetime):
        if start.tzinfo is None:
            raise UsageError("a start datetime must be timezone-aware")
        return start
    if isinstance(start, dt.timedelta):
        if start < dt.timedelta(0):
            raise UsageError("a start timedelta must not be negative")
        return start
    raise UsageError(f"invalid start {start!r}")


class _Received(NamedTuple):
    """A page read ahead: the range it was read for, its rows, and the stream's
    ``pruned_through`` read after them."""

    after: int
    through: int
    rows: list[Row]
    pruned: int


def _take(received: _Received | None, name: str, after: int, through: int) -> list[Row] | None:
    """The rows of a page read ahead, if it was read for exactly ``(after, through]`` (a target
    that moved since, or a position that did not, asks for another range: None, read it
    anew), with its retention check (`FactsPruned`, as `read_proven` would raise)."""
    if received is None or received.after != after or received.through != through:
        return None
    if received.pruned > after:
        raise FactsPruned(name, after, received.pruned)
    return received.rows


#: A fact's stream ID (`Fact` is a named tuple: a C getter, no Python call per fact).
_STREAM_ID = operator.itemgetter(1)


class ReaderCore:
    """The logic of one reader, shared by `Reader` and `AsyncReader` (see the module doc)."""

    #: The timeline of the reader's session (0: none yet; `verify_incarnation`).
    timeline: int = 0

    def __init__(
        self,
        streams: Sequence[str],
        *,
        start: Start = "earliest",
        group: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        names = list(streams)
        if not names:
            raise UsageError("a reader needs at least one stream")
        if len(set(names)) != len(names):
            raise UsageError("a reader cannot follow the same stream twice")
        if group is not None and (not isinstance(group, str) or not 0 < len(group) <= 200):
            raise UsageError("a group name is a non-empty string of at most 200 characters")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise UsageError("page_size must be a positive int")
        self.names: tuple[str, ...] = tuple(names)
        self.start = _check_start(start)
        self.group = group
        self.page_size = page_size
        self.infos: dict[str, StreamInfo] = {}
        self.positions: dict[str, int] = {}
        self.ts_floors: dict[str, int] = {}
        #: The group's position on each stream as this reader last knew it (when it opened the
        #: group, or its last commit; None: no row): where `commit_in` expects to find it.
        self.committed: dict[str, int | None] = {}
        #: The generation of the group this reader took on each stream when it opened it
        #: (`streams.store.reader_groups.take_generations`): its commits are fenced by it.
        self.generations: dict[str, Generation] = {}
        #: Who this reader is, in the group's generation rows (``streams positions`` shows it).
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        #: The database incarnation written into the group's rows at each commit (None: not
        #: known; set by the shells).
        self.incarnation: str | None = None
        self._targets: dict[str, int] = {}
        #: The highest max allocated ID a probe of this reader saw, by stream: a sequence never
        #: goes back within one history (`_note_probe`).
        self._allocated: dict[str, int] = {}
        self._filters: dict[str, LiveFilter[int]] = {}
        self._start_ts: dict[str, int] = {}
        self._link_up = False
        self._reconcile = True
        #: Follow the elected prober's proofs (`streams.proofs`) instead of probing each time.
        self.shared_proofs = False
        self._proof_fresh = False
        # Writers' tokens heard while following proofs, not yet covered by one (link thread
        # writes, the reader's thread reads; single dict operations under the GIL).
        self._awaited: dict[str, int] = {}
        self._awaited_since: float | None = None
        self.deadline_moved = False
        #: When a stream held back is checked, and who has held it too long (`retire_where_held`,
        #: with ``lease_seconds`` as this reader's own lease: docs/design/liveness.md).
        self._held = HeldStreams(lease=lease_seconds)
        #: Probes run, shared proofs read, pages of rows read, and of those the pages read
        #: ahead while the previous one was planned (`_read_pages`), for metrics.
        self.probes = self.proof_reads = self.pages = self.pages_ahead = 0
        # Signed ranges from Redis (`streams.core.signing`): verified by the link thread
        # (deque appends and pops are atomic), then by `after`, and the keys.
        self._verified: deque[SignedRange] = deque(maxlen=MAX_WAITING_RANGES)
        self._ranges: dict[str, dict[int, SignedRange]] = {}
        self._keys: dict[int, PublicKeys] = {}
        self._keys_at = -KEY_REFRESH
        self._keys_wanted = False
        # A ``KEYS`` line said the keys changed: no line verifies until they are read again.
        self._keys_stale = False
        #: Signed ranges delivered from Redis, lines that verified, and lines rejected by
        #: reason (what `verify_range` returned, and ``no-keys``), for metrics.
        self.signed_ranges = 0
        self.verified_ranges = 0
        self.rejected_ranges: dict[str, int] = {}
        #: Shared proofs refused (above their stream's max allocated ID), for metrics.
        self.refused_proofs = 0
        #: Rows read from PostgreSQL (catch-up and live), for metrics; of them, from a standby.
        self.rows = self.standby_rows = 0
        #: Read rows on a hot standby (a read URL; set by the shells), and how long to wait
        #: for it: the shells then `step` without rows on the primary (it only proves) and
        #: read the rows by `standby_step` behind the fence (`streams.core.standby_fence`).
        self.route: StandbyRoute | None = None
        #: The highest LSN of a proof this reader noted ("the standby fence" in
        #: `streams.store.probe`): a standby replayed past it shows every fact up to the
        #: targets (taking the highest is safe: replay passes the lower ones first).
        self.proof_lsn = 0
        #: The database history this reader's positions belong to: the first session records
        #: it (or the client's, which shares its guard), every reconnect checks it.
        self.guard = Guard()
        #: The facts delivered lately, checked after a failover (`streams.core.sightings`);
        #: a loss stops the reader (its consumer holds facts the database no longer has).
        self.sighting = Sighting(sticky=True)
        # Reading ahead (`_read_pages`): the pages sent on the session, not yet received;
        # then, received, by stream, for the next step.
        self._ahead: PagesAhead | None = None
        self._received: dict[str, _Received] = {}

    def verify_incarnation(self) -> Gen[Incarnation]:
        """On a new session, before anything else: is it the database history this reader
        started on (`streams.store.identity`)? `DatabaseChanged` otherwise."""
        found = yield from verify(self.guard, self._where(), self.sighting, "facts delivered")
        if self.incarnation is not None and found.token != self.incarnation:
            # A failover: what was verified in the old history (signed ranges heard, maybe
            # while this process was frozen) may describe facts the new primary lacks, and
            # they were not part of the check just made. Drop it; read the keys again.
            self._verified.clear()
            self._ranges.clear()
            self._keys_stale = self._keys_wanted = True
        self.incarnation, self.timeline = found.token, found.timeline
        return found

    def _where(self) -> str:
        what = "group " + repr(self.group) if self.group is not None else "reader"
        return f"{what} of {', '.join(self.names)}"

    def opening(self, *, first: bool = False) -> Gen[None]:
        """What a new reader session runs before anything else: the readers' settings, then
        `verify_incarnation`; on the reader's first session, `open` too. Run afresh when the
        session is lost under it (`streams.store.sessions`, "Opening checks"): each step reads,
        or takes a group generation, which taking again only moves further ahead."""
        yield from set_up_reader_session()
        yield from self.verify_incarnation()
        if first:
            yield from self.open()

    # ---------------------------------------------------------------- initialization

    def open(self) -> Gen[None]:
        """Load the streams and resolve every starting position. With a group, first take the
        group's next generation on every stream (committed before its positions are read:
        the fencing of groups, docs/design/fencing.md): a consumer
        that opened the group before this one is fenced from now on."""
        infos = yield from load_streams(list(self.names))
        self.infos = {info.name: info for info in infos}
        if self.group is not None:
            self.generations = yield from take_generations(self.group, infos, self.owner)
        probes = yield from probe(infos)
        self._note_probe(probes)
        pruned = yield from pruned_positions(infos)
        start = self.start
        start_ms: int | None = None
        if isinstance(start, dt.timedelta):
            now_ms = yield from database_time_ms()
            start_ms = now_ms - start // dt.timedelta(milliseconds=1)
        elif isinstance(start, dt.datetime):
            # Exact ceiling in integers: a fact at 12.000 s is before a start at 12.0005 s.
            start_ms = -((_EPOCH - start) // dt.timedelta(milliseconds=1))
        for info in infos:
            found = probes[info.name]
            committed = None
            if self.group is not None:
                committed = yield from group_position(info, self.group)
                self.committed[info.name] = None if committed is None else committed.position
            if committed is not None:
                self._check_group_incarnation(info.name, committed.incarnation, committed.position)
                if committed.position > found.max_allocated:
                    # Commits refuse such a position (`InvalidPosition`): the stream went back
                    # under the group (a restore in place), or the row was written by hand.
                    raise DatabaseChanged(
                        f"group {self.group!r}",
                        f"stream {info.name!r}: the group committed {committed.position}, "
                        f"beyond the stream's max allocated ID {found.max_allocated}: the facts "
                        f"it consumed with IDs above {found.max_allocated} are not in this "
                        "history, and facts written here under those IDs would be skipped",
                    )
                self.positions[info.name] = committed.position
                self.ts_floors[info.name] = committed.ts_floor
                continue
            if start == "earliest":
                position = pruned[info.name]  # the oldest fact retention kept is next
            elif start in ("latest", "live"):
                position = found.complete
            elif isinstance(start, int):
                position = start - 1
                if position < pruned[info.name]:
                    raise FactsPruned(info.name, position, pruned[info.name])
            else:
                assert start_ms is not None
                before = yield from position_before_time(info, start_ms)
                # Capped at what is complete: a pending fact below the first committed match
                # may still commit with a timestamp >= start (the filter drops earlier ones).
                position = found.complete if before is None else min(before, found.complete)
                self._start_ts[info.name] = start_ms
            if start == "live" and found.max_allocated > position:
                # Strymon's late subscriber: epochs active at join (IDs up to max allocated) may
                # be partly gone for a subscriber without backfill; drop them all.
                snapshot = FrontierSnapshot(
                    Antichain([position + 1]), UpperAntichain([found.max_allocated])
                )
                self._filters[info.name] = LiveFilter(snapshot)
            self.positions[info.name] = position
            self.ts_floors[info.name] = yield from ts_floor_at(info, position)
        yield from self.read_keys()

    def _check_group_incarnation(self, stream: str, token: str | None, position: int) -> None:
        """A group row committed in another database history (a restore: its position may name
        facts this one lacks, or pass facts written here since under the same IDs) stops the
        reader until an operator binds it to this one (`streams incarnation accept`). Rows
        committed before incarnations existed (None) are taken as they are, and so are rows of
        an earlier timeline of this history (a failover): the new primary holds the row and
        every fact committed before it, so it resumes from there (`streams.core.sightings`)."""
        current = self.guard.expected
        changed = (
            None if current is None else written_elsewhere(token, current, across_failover=True)
        )
        if changed is None:
            return
        raise DatabaseChanged(
            f"group {self.group!r} on stream {stream!r}",
            f"its position {position} was committed in another incarnation: {changed}",
        )

    # ---------------------------------------------------------------- computation

    def _note_probe(self, probes: Mapping[str, Probe], *, shared: bool = False) -> None:
        """Record what a probe proved. A stream whose sequence is now below what an earlier
        probe of this reader saw allocated went back in time under it (a physical restore in
        place, a failover to a standby that lagged: the database's incarnation may not show
        it): the IDs above are handed out again, and this reader would skip the facts written
        under them as delivered. Nothing is delivered: `DatabaseChanged` names the stream and
        the range that may differ. ``shared``: proofs of the prober, which say what is
        complete, not what is allocated."""
        self.probes += 1
        for name, found in probes.items():
            self.proof_lsn = max(self.proof_lsn, found.wal_lsn)
            if found.flushed_lsn and self.timeline:
                # On disk: what a rewind would take back (`Guard`, "A rewind").
                self.guard.observed(self.timeline, found.flushed_lsn)
            if shared:
                self._targets[name] = max(self._targets.get(name, 0), found.complete)
                continue
            seen = self._allocated.get(name, 0)
            if found.max_allocated < seen:
                through = max(seen, self.positions.get(name, 0))
                raise DatabaseChanged(
                    f"reader of {name!r}",
                    f"stream {name!r}: its sequence went back from {seen} to "
                    f"{found.max_allocated}, so this history restarted at or below "
                    f"{found.max_allocated}: the facts this reader saw with IDs up to {through} "
                    "may differ from the ones the database now has",
                )
            self._allocated[name] = found.max_allocated
            self._targets[name] = max(self._targets.get(name, 0), found.complete)
        self._reconcile = False

    def start_times(self) -> dict[str, int]:
        """For a start by time: the start (ms), by stream, still filtering what comes next
        (facts whose running-maximum timestamp is earlier are dropped until the first one at
        or after it, so a fact that was pending at the start cannot sneak in late)."""
        return dict(self._start_ts)

    def set_link_state(self, connected: bool) -> None:
        """The Redis link went up or down: disconnected until the next probe re-establishes."""
        self._link_up = connected
        self._reconcile = True

    @property
    def needs_writer_hints(self) -> bool:
        """Does this reader need writers' hints? Not while it follows fresh shared proofs over
        a live link: the prover's lines then say all there is to say, and `step` looks at
        the proof record at least every `streams.reader.FOLLOWER_CHECK_INTERVAL`."""
        return not (self.shared_proofs and self._proof_fresh and self.live)

    @property
    def live(self) -> bool:
        """The Redis link is up and a probe has re-established the position since."""
        return self._link_up and not self._reconcile

    def wants(self, hint: Hint) -> bool:
        """Could this hint mean something new for this reader? Following fresh shared proofs,
        only a prober's line can: a writer's commit is not readable before it is proven."""
        if is_keys_hint(hint):
            # The keys changed (a rotation, a retirement): verify nothing more with the keys
            # held now; the next step reads them again (at most every KEY_RETRY).
            self._keys_stale = True
            self._keys_wanted = True
            return time.monotonic() - self._keys_at >= KEY_RETRY
        position = self.positions.get(hint.stream)
        if position is None or hint.token <= position:
            return False
        if hint.proof is not None:
            return self._offer(hint)
        if self.shared_proofs and self._proof_fresh and self.live:
            if is_proof_hint(hint):
                return True
            # A writer committed: the prober should announce it within PROOF_GRACE.
            if hint.token > self._awaited.get(hint.stream, 0):
                self._awaited[hint.stream] = hint.token
            if self._awaited_since is None:
                self._awaited_since = time.monotonic()
                self.deadline_moved = True  # the driver's wait must end sooner now
            return False
        return True

    def _offer(self, hint: Hint) -> bool:
        """A signed range arrived (on the link's thread): verify it now, so that a line that
        does not verify costs no wake-up (and no PostgreSQL read) at all.

        A line under a key this reader does not know is dropped, and asks for a read of the
        keys (at most every `KEY_RETRY`: a flood of lines under unknown keys costs that, no
        more); so is every line after a ``KEYS`` line, until the keys are read again. Keeping
        such a line until then would keep what anyone with Redis may send: parsed, a 1 MiB line
        of ``[],`` is 350k lists, 20 times its size, and 52 of them took a reader to 1.2 GB.
        Dropping it costs only after a rotation, until this reader has read the new key (a
        line it did not take is read from PostgreSQL, as for a line Redis lost)."""
        if self._keys_stale:
            self.rejected_ranges["keys-changed"] = self.rejected_ranges.get("keys-changed", 0) + 1
            self._keys_wanted = True
            return time.monotonic() - self._keys_at >= KEY_RETRY
        found = verify_range(
            hint.stream, hint.instance, hint.token, hint.proof, self._keys, self.incarnation
        )
        if isinstance(found, SignedRange):
            self.verified_ranges += 1
            self._verified.append(found)
            return True
        self.rejected_ranges[found] = self.rejected_ranges.get(found, 0) + 1
        if found == "unknown-key":
            self._keys_wanted = True
            return time.monotonic() - self._keys_at >= KEY_RETRY
        return False

    def proof_deadline(self) -> float | None:
        """When (monotonic) to look even without a proof line: `PROOF_GRACE` after the first
        writer's hint no proof has covered yet (None: no such hint)."""
        since = self._awaited_since
        return None if since is None else since + PROOF_GRACE

    def target(self, stream: str) -> int:
        """The complete position the last probe proved for ``stream`` (what catching up aims
        at; progress bars use it)."""
        return self._targets.get(stream, 0)

    def behind(self) -> bool:
        return any(self.positions[n] < self._targets.get(n, 0) for n in self.names)

    @property
    def caught_up(self) -> bool:
        """Everything the last probe proved complete is delivered (and no reconnect since)."""
        return not self._reconcile and not self.behind()

    def step(self, with_rows: bool = True) -> Gen[Epoch | None]:
        """The next epoch, or None if PostgreSQL has nothing complete beyond the positions.

        Caught up (or reconciling), it probes and reads the first page of every stream in one
        pipelined round trip; behind the last probe, it reads pages only.

        ``with_rows`` False (a reader with a read URL, on the primary): it proves only, reading no
        rows (none behind a probe or a shared proof, no pages when behind); `standby_step`
        reads them from the standby. Signed ranges from Redis are delivered as always.

        All or nothing: every read happens before any position moves (`_advance`), so an
        error or a cancellation at any of its steps leaves the reader where it was, and the
        next step reads the same facts again; none is skipped.
        """
        lower = dict(self.positions)
        if self._ahead is not None:
            yield from self.receive_ahead()
        if self.keys_due():
            yield from self.read_keys()
        if (
            self._link_up
            and not self._reconcile
            and (self._verified or self._keys_wanted or any(self._ranges.values()))
        ):
            planned = yield from self._step_on_signed_ranges()
            if planned:
                facts = self._advance(planned)
                return Epoch(lower, dict(self.positions), tuple(facts))
        planned = []
        shared = None
        # Proofs only while the Redis link is live: without it nobody hears writers' commits
        # in time to prove them, and this reader polls PostgreSQL itself.
        if self.shared_proofs and self._link_up and (not self.behind() or self._reconcile):
            shared = yield from self._step_on_proofs(lower, with_rows)
        if shared is not None:
            planned = shared
        elif not with_rows:
            if not self.behind() or self._reconcile:  # prove only: the rows are the standby's
                infos = [self.infos[n] for n in self.names]
                probes = yield from probe(infos)
                self._note_probe(probes)
                yield from retire_where_held(
                    self.infos,
                    self._held,
                    time.monotonic(),
                    ((name, p.complete, p.max_allocated) for name, p in probes.items()),
                )
        elif not self.behind() or self._reconcile:
            # Probe, rows and retention in one round trip (`streams.store.reads`).
            infos = [self.infos[n] for n in self.names]
            probes, pages, _ = yield from probe_and_read(infos, lower, self.page_size)
            self._note_probe(probes)
            # A stream held back for a while: end an expired writer's sessions ("the liveness
            # argument" in streams.store.leases). Not a read: no position moves here.
            yield from retire_where_held(
                self.infos,
                self._held,
                time.monotonic(),
                ((name, p.complete, p.max_allocated) for name, p in probes.items()),
            )
            for info, raw in zip(infos, pages, strict=True):
                # The rows were read up to this probe's position, whatever earlier ones said.
                through = probes[info.name].complete
                if through > lower[info.name]:
                    planned.append((yield from self._plan(info.name, list(raw), through)))
        else:
            planned = yield from self._read_pages(lower)
        facts = self._advance(planned)  # nothing may be yielded from here on
        if self.positions == lower:
            return None
        return Epoch(lower, dict(self.positions), tuple(facts))

    def _read_pages(self, lower: Mapping[str, int], *, ahead: bool = True) -> Gen[list[_Planned]]:
        """A page of each stream behind its target, up to what the last proof proved.

        With ``ahead``, the pages that follow are *sent* before these are planned ("reading
        ahead": `streams.store.reads.send_proven`), so the server reads them while this
        process plans; the next step takes them (`receive_ahead`) if it reads the same
        ranges, and reads them anew otherwise. Sending reads nothing into the reader's state
        and moves no position, so a step that ends early, fails or is never followed loses
        nothing (the pages are read again)."""
        if self._ahead is not None:
            yield from self.receive_ahead()
        received, self._received = self._received, {}
        pages: list[tuple[str, list[Row], int]] = []
        for name in self.names:
            target = self._targets.get(name, 0)
            if lower[name] < target:
                page = _take(received.get(name), name, lower[name], target)
                if page is not None:
                    self.pages_ahead += 1
                else:
                    info = self.infos[name]
                    page = yield from read_proven(info, lower[name], target, self.page_size)
                pages.append((name, page, target))
        if ahead:
            following: list[tuple[StreamInfo, int, int]] = []
            for name, page, target in pages:
                position = next_position(page, through=target, limit=self.page_size)
                if position is None:  # a fact larger than a page: planning reads it alone
                    following = []
                    break
                if position < target:
                    following.append((self.infos[name], position, target))
            if following:
                self._ahead = yield from send_proven(following, self.page_size)
        planned: list[_Planned] = []
        for name, page, target in pages:
            planned.append((yield from self._plan(name, page, target)))
        return planned

    @property
    def reading_ahead(self) -> bool:
        """Pages were sent ahead and not received yet: the session is busy with them, and
        `receive_ahead` must run on it before anything else."""
        return self._ahead is not None

    def receive_ahead(self) -> Gen[None]:
        """Take in the pages `_read_pages` sent ahead (kept for the next step); the shells run
        it before any other plan on the session."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        received = yield from receive_proven(ahead)
        if received is None:
            return
        pages, pruned = received
        for (name, after, through), rows in zip(ahead.ranges, pages, strict=True):
            self._received[name] = _Received(after, through, rows, pruned.get(name, 0))

    def forget_ahead(self) -> None:
        """The session closed: pages sent ahead on it are gone, and pages received on it are
        dropped too (the shells, on reconnect: the next session may be on a new primary, whose
        history the sighting check compares first)."""
        self._ahead = None
        self._received = {}

    def standby_step(self) -> Gen[Epoch | None]:
        """`step`'s pages, on a hot standby's session (a read URL): the fence first (one
        statement: `StandbyBehind`, nothing read, while the standby has not replayed past the
        last proof's LSN: `streams.store.reads.standby_fence`), then a page of each stream
        behind its target, each with its retention check, on the standby (why that check may
        run there: `streams.store.standby`). None when no stream is behind. All or nothing, as
        `step`."""
        lower = dict(self.positions)
        if not self.behind():
            return None
        yield from standby_fence(self.proof_lsn, f"reader of {', '.join(self.names)}")
        rows_before = self.rows
        planned = yield from self._read_pages(lower, ahead=False)  # not on the standby's session
        facts = self._advance(planned)  # nothing may be yielded from here on
        self.standby_rows += self.rows - rows_before
        if self.positions == lower:
            return None
        return Epoch(lower, dict(self.positions), tuple(facts))

    def _step_on_proofs(
        self, lower: Mapping[str, int], with_rows: bool = True
    ) -> Gen[list[_Planned] | None]:
        """`step` as a follower: every stream's shared proof and its first page, one statement
        each, one round trip; None (nothing delivered) when a proof is missing or stale, and
        the caller probes itself. ``with_rows`` False: the proofs only (nothing planned)."""
        infos = [self.infos[n] for n in self.names]
        results, lsn = yield from read_proofs(
            infos, lower, self.page_size if with_rows else 0, self.incarnation
        )
        refused = {
            i.name: int(rows[0][0])
            for i, rows in zip(infos, results, strict=True)
            if rows and not rows[0][2]
        }
        if refused:
            self._refuse_proofs(refused)
        self._proof_fresh = not refused and all(
            rows and int(rows[0][1]) <= STALE_AFTER for rows in results
        )
        if not self._proof_fresh:
            self._awaited.clear()
            self._awaited_since = None
            return None
        self.proof_reads += 1
        proven = {i.name: int(rows[0][0]) for i, rows in zip(infos, results, strict=True)}
        since = self._awaited_since
        if since is not None:
            behind = any(self._awaited.get(n, 0) > proven[n] for n in proven)
            overdue = time.monotonic() >= since + PROOF_GRACE
            if not behind or overdue:
                self._awaited.clear()
                self._awaited_since = None
            if behind and overdue:
                return None  # the prober is late: probe for ourselves this once
        self._note_probe({n: Probe(n, c, c, lsn) for n, c in proven.items()}, shared=True)
        planned: list[_Planned] = []
        if not with_rows:
            return planned
        for info, found in zip(infos, results, strict=True):
            if proven[info.name] > lower[info.name]:
                page = [tuple(r[3:]) for r in found if r[3] is not None]
                planned.append((yield from self._plan(info.name, page, proven[info.name])))
        return planned

    def _refuse_proofs(self, refused: Mapping[str, int]) -> None:
        """Shared proofs above their stream's max allocated ID (``stream -> complete``, as
        `read_after_proof` finds them): no prober wrote them, so this reader probes for
        itself. Counted, and logged the first time."""
        first = not self.refused_proofs
        self.refused_proofs += len(refused)
        if first:
            log.warning(
                "refused the shared proof of %s: beyond the stream's max allocated ID, so no "
                "prober wrote it (a role that may write streams_proofs did); probing PostgreSQL "
                "instead (further refusals are counted, not logged)",
                ", ".join(f"{name!r} (complete {c})" for name, c in refused.items()),
            )

    def _step_on_signed_ranges(self) -> Gen[list[_Planned]]:
        """`step` from the signed ranges Redis brought (`streams.core.signing`): every stream
        a verified range fits (``after <= position < through``) moves, without PostgreSQL
        (except to read the key table now and then). Nothing moves here (`_advance` does)."""
        now = time.monotonic()
        if self._keys_wanted and now - self._keys_at >= KEY_RETRY:
            yield from self.read_keys()
        if self._keys_stale:  # told the keys changed, not read since: apply nothing
            return []
        keys = self._keys
        while self._verified:
            found = self._verified.popleft()
            if found.key not in keys:  # verified before the key table said it was retired
                self.rejected_ranges["retired-key"] = self.rejected_ranges.get("retired-key", 0) + 1
                continue
            if keys[found.key].incarnation != self.incarnation:
                # Verified (on the link's thread) just before a failover moved this reader to
                # another timeline: not proven in the history it reads now.
                self.rejected_ranges["other-history"] = (
                    self.rejected_ranges.get("other-history", 0) + 1
                )
                continue
            waiting = self._ranges.setdefault(found.stream, {})
            known = waiting.get(found.after)
            if known is None or known.through < found.through:
                if len(waiting) >= MAX_WAITING_RANGES:
                    waiting.pop(min(waiting))
                waiting[found.after] = found
        planned: list[_Planned] = []
        for name in self.names:
            ranges = self._ranges.get(name)
            if not ranges:
                continue
            start = self.positions[name]
            position, floor = start, self.ts_floors[name]
            facts: list[Fact] = []
            while True:
                fits = [
                    r for r in ranges.values() if r.after <= position < r.through and r.key in keys
                ]
                for stale in [
                    a for a, r in ranges.items() if r.through <= position or r.key not in keys
                ]:
                    del ranges[stale]
                if not fits:
                    break
                signed = max(fits, key=lambda r: r.through)
                ranges.pop(signed.after, None)
                rows = [row for row in signed.rows if row[0] > position]
                plan = plan_page(
                    name, rows, after=position, through=signed.through, limit=len(rows) + 1,
                    ts_floor=floor, decode=decode_payloads,
                )  # fmt: skip
                facts += plan.facts
                position, floor = plan.position, plan.ts_floor
                self.signed_ranges += 1
            if position > start:
                self._targets[name] = max(self._targets.get(name, 0), position)
                planned.append(_Planned(name, tuple(facts), position, floor))
        if planned and self._awaited_since is not None:
            moved = {p.name: p.position for p in planned}
            if all(self._awaited[n] <= moved.get(n, self.positions[n]) for n in self._awaited):
                self._awaited.clear()
                self._awaited_since = None
        return planned

    def keys_due(self) -> bool:
        """Time to read the keys again (`KEY_REFRESH`: retired keys are dropped then)."""
        return time.monotonic() - self._keys_at >= KEY_REFRESH

    def read_keys(self) -> Gen[None]:
        """Read the live keys; a reader that may not read them takes nothing from Redis."""
        self._keys_at = time.monotonic()
        self._keys_wanted = False
        self._keys_stale = False  # a KEYS line heard from here on asks for another read
        try:
            self._keys = yield from live_keys()
        except ConnectionLost:
            raise
        except StoreError as exc:
            self._keys = {}
            self.rejected_ranges["no-keys"] = self.rejected_ranges.get("no-keys", 0) + 1
            if self.rejected_ranges["no-keys"] == 1:
                log.warning("cannot read the replication keys (%s): reading PostgreSQL only", exc)

    def _plan(self, name: str, rows: list[Row], target: int) -> Gen[_Planned]:
        """What a page of rows allows to deliver on ``name`` (reads more only for a fact with
        more rows than a page); changes no position (`_advance` does)."""
        info = self.infos[name]
        after = self.positions[name]
        self.pages += 1
        self.rows += len(rows)
        with collection_paused():  # streams._gc: a page's objects all live, no cycles
            plan = plan_page(
                name, rows, after=after, through=target, limit=self.page_size,
                ts_floor=self.ts_floors[name], decode=decode_payloads,
            )  # fmt: skip
        if plan.refetch is not None:
            # One fact has more rows than a page: read it alone, whole.
            rows = yield from read_proven(info, plan.refetch - 1, plan.refetch, 2**31 - 1)
            plan = plan_page(
                name, rows, after=after, through=plan.refetch, limit=len(rows) + 1,
                ts_floor=self.ts_floors[name], decode=decode_payloads,
            )  # fmt: skip
        return _Planned(name, plan.facts, plan.position, plan.ts_floor)

    def _advance(self, planned: Sequence[_Planned]) -> list[Fact]:
        """Move the positions to what `step` read, and filter what a ``live`` or time start
        drops: the only place a step changes them, after its last read."""
        delivered: list[Fact] = []
        for name, planned_facts, position, ts_floor in planned:
            self.positions[name] = position
            self.ts_floors[name] = ts_floor
            facts = list(planned_facts)
            live = self._filters.get(name)
            if live is not None:
                facts = [f for f in facts if live.admit(f.stream_id)]
                live.advance_lower(Antichain([position + 1]))
                if not live.active:
                    del self._filters[name]
            start_ms = self._start_ts.get(name)
            if start_ms is not None:
                facts = [f for f in facts if f.timestamp >= start_ms]
                if facts:
                    del self._start_ts[name]
            if facts:
                recent = map(_STREAM_ID, facts[-RECENT_IDS:])
                self.sighting.note(name, self.infos[name].id, recent)
            delivered.extend(facts)
        return delivered

    def advance_columns(
        self,
        name: str,
        position: int,
        ts_floor: int,
        ids: Sequence[int],
        timestamps: Sequence[int],
    ) -> list[bool] | None:
        """`_advance` for one stream's page read as columns (`streams.arrow`, where every read
        of the page happened before this call): move ``name`` to ``position`` (its running
        maximum timestamp there ``ts_floor``), and say which of the page's rows (their stream
        IDs ``ids`` and running-maximum ``timestamps``) the ``live`` and time-start filters
        keep: None when they keep all (the usual case: no per-row work then)."""
        self.positions[name] = position
        self.ts_floors[name] = ts_floor
        keep: list[bool] | None = None
        live = self._filters.get(name)
        if live is not None:
            keep = [live.admit(int(i)) for i in ids]
            live.advance_lower(Antichain([position + 1]))
            if not live.active:
                del self._filters[name]
        start_ms = self._start_ts.get(name)
        if start_ms is not None:
            late = [int(t) >= start_ms for t in timestamps]
            keep = late if keep is None else [a and b for a, b in zip(keep, late, strict=True)]
            if any(keep):
                del self._start_ts[name]
        tail = (
            ids[-RECENT_IDS:] if keep is None else [i for i, k in zip(ids, keep, strict=True) if k]
        )
        if len(tail):
            recent = dict.fromkeys(int(i) for i in tail[-RECENT_IDS:])
            self.sighting.note(name, self.infos[name].id, recent)
        return keep

    # ---------------------------------------------------------------- queries

    def reached(self, stream: str, token: int, instance: str | None) -> Gen[bool]:
        """Has PostgreSQL proven ``stream`` complete through ``token`` (for ``instance``'s
        facts only, if given: its persisted position counts too)?"""
        info = self._info(stream)
        probes = yield from probe([info])
        self._note_probe(probes)
        if probes[stream].complete >= token:
            return True
        if instance is not None:
            persisted = yield from persisted_writer_position(info, instance)
            return persisted is not None and persisted >= token
        return False

    def commit(self, through: Fact | None = None) -> Gen[dict[str, int]]:
        """Commit the group's positions (forward-only); returns what is committed now.

        With ``through``, a fact this reader delivered, commit its stream only, up to that fact:
        for a consumer that stopped in the middle of an epoch (the rest of the epoch is
        delivered again after a restart of the group; nothing is skipped).

        `GroupFenced` (nothing committed, on any stream) once another reader opened the group
        since this one did: it is the group's consumer now, this one must stop.
        `InvalidPosition` (the same) for a position beyond its stream's max allocated ID.
        """
        commits = self._commits(through)
        assert self.group is not None
        committed = yield from commit_group(
            self.group, commits, self.generations, incarnation=self.incarnation
        )
        self.committed.update(committed)
        return committed

    def _commits(self, through: Fact | None) -> list[tuple[StreamInfo, int, int]]:
        """``(info, position, ts_floor)`` of each stream a commit writes."""
        if self.group is None:
            raise UsageError("this reader has no group: pass group= to commit positions")
        if through is not None:
            info = self._info(through.stream)
            if through.stream_id > self.positions[through.stream]:
                raise UsageError(
                    f"fact {through.stream_id} of {through.stream!r} was not delivered yet"
                )
            return [(info, through.stream_id, through.timestamp)]
        return [(self.infos[n], self.positions[n], self.ts_floors[n]) for n in self.names]

    def commit_in(self, through: Fact | None = None) -> Gen[dict[str, int]]:
        """`commit` in the caller's open transaction, from exactly where this reader left the
        group (`streams.store.reader_groups.commit_group_in`; docs/design/fencing.md):
        `GroupMoved` (and the caller's transaction failed) if the group moved meanwhile,
        `GroupFenced` (the same) if another reader opened it since this one did.

        The reader takes the new positions as the group's at once; if the caller's transaction
        then rolls back, the next `commit_in` finds the group where it was and raises
        `GroupMoved`: reopen the reader to deliver those facts again.
        """
        commits = self._commits(through)
        assert self.group is not None
        group = self.group
        for info, position, _ in commits:
            base = self.committed.get(info.name)
            if base is not None and position < base:
                raise UsageError(
                    f"group {group!r} is at {base} on {info.name!r}: a commit "
                    f"through {position} would move it back"
                )
        try:
            committed = yield from commit_group_in(
                group,
                [(i, p, f, self.committed.get(i.name)) for i, p, f in commits],
                self.generations,
                incarnation=self.incarnation,
            )
        except StoreError as exc:
            if GROUP_MOVED not in str(exc):
                raise
            moved = next(
                (i.name for i, _, _ in commits if f"{GROUP_MOVED} {i.id} " in str(exc)),
                commits[0][0].name,
            )
            raise GroupMoved(group, moved, self.committed.get(moved)) from None
        self.committed.update(committed)
        return committed

    def _info(self, stream: str) -> StreamInfo:
        try:
            return self.infos[stream]
        except KeyError:
            raise UsageError(f"this reader does not follow stream {stream!r}") from None

    def position(self, stream: str | None = None) -> int:
        if stream is None:
            if len(self.names) != 1:
                raise UsageError("this reader follows several streams: name one")
            stream = self.names[0]
        self._info(stream)
        return self.positions[stream]

    @property
    def frontier(self) -> Antichain[tuple[int, ...]]:
        return Antichain([tuple(self.positions[n] + 1 for n in self.names)])

    def probe(self, stream: str | None = None) -> FrontierProbe[int]:
        """A probe of one stream's frontier ``{position + 1}`` (the only stream by default)."""
        return FrontierProbe(Antichain([self.position(stream) + 1]))

    def vector_probe(self) -> FrontierProbe[tuple[int, ...]]:
        """A probe of the merged frontier over all streams (vectors in the reader's order)."""
        return FrontierProbe(self.frontier)
