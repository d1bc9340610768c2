"""The reader core: facts in stream-ID order, one whole epoch at a time, with frontiers.

A reader's state per stream is a position (every fact at or below it delivered); `ReaderCore`
opens a reader (a group's position or a start), probes, reads pages of rows (reading ahead)
and plans them into whole facts, applies signed ranges from Redis when they verify, and commits
a group, all as store generators that the shells drive (`streams.reader_plans`). The stages and
why nothing from Redis can make a reader skip or invent a fact: docs/design/reader.md.
"""

from __future__ import annotations

import datetime as dt
import logging
import operator
import time
from collections.abc import Mapping, Sequence
from typing import TypeAlias

from .._gc import collection_paused
from ..config import DEFAULT_LEASE_SECONDS
from ..core.delivery import deliverable
from ..core.epochs import Epoch, Fact, Row, next_position, plan_page
from ..core.frontier import Antichain, FrontierProbe
from ..core.incarnation import Guard, Incarnation, written_elsewhere
from ..core.payloads import decode_payloads
from ..core.reader_state import (
    ProofFollowing,
    Proven,
    ReaderCounters,
    SignedRangeInbox,
    StartFilters,
)
from ..core.replication import Hint, is_keys_hint, is_proof_hint
from ..core.sightings import RECENT_IDS, Sighting
from ..core.stalls import HeldStreams
from ..core.standby_fence import StandbyRoute
from ..core.stream_patterns import RegistryCursor, Subscription, compile_pattern
from ..errors import (
    ConnectionLost,
    DatabaseChanged,
    FactsPruned,
    GroupFenced,
    GroupMoved,
    InvalidPattern,
    StoreError,
    UsageError,
)
from ..types import StreamInfo
from .driver import Gen
from .holders import retire_where_held
from .identity import verify
from .leases import persisted_writer_position
from .membership import GroupMembership
from .pattern_following import PatternFollowing
from .probe import set_up_reader_session
from .read_ahead import ReadAhead
from .reader_fast_paths import FastPaths, Planned
from .reader_groups import (
    GROUP_MOVED,
    commit_group,
    commit_group_in,
    group_position,
    take_generations,
)
from .reads import (
    Probe,
    probe,
    probe_and_read,
    pruned_positions,
    read_proven,
    receive_proven,
    send_proven,
    standby_fence,
)
from .registry import load_streams
from .rows import database_time_ms, position_before_time, ts_floor_at
from .subscriptions import DROPPED_SQLSTATES, load_listed, registry_after

__all__ = ["DEFAULT_PAGE_SIZE", "ReaderCore", "Start"]

#: Where a reader without a committed group position starts: ``"earliest"``, ``"latest"``,
#: ``"live"``, a stream ID (the first fact with an ID >= it), a `datetime` (the first fact with a
#: timestamp >= it) or a `timedelta` (that long ago, on the database's clock).
Start: TypeAlias = str | int | dt.datetime | dt.timedelta

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

log = logging.getLogger("streams.reader")

#: Rows per page when catching up.
DEFAULT_PAGE_SIZE = 5000
#: Most streams whose first pages a caught-up step reads in the probe's round trip. A reader
#: of more probes alone (3 statements, however many streams) and then reads the pages of the
#: streams the probe found news on: one round trip more when there is news, but 3 statements
#: instead of 1,004 per idle poll for 1,000 streams (188 -> 50 ms: docs/performance.md).
ROWS_WITH_PROBE_MAX = 16


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


#: A fact's stream ID (`Fact` is a named tuple: a C getter, no Python call per fact).
_STREAM_ID = operator.itemgetter(1)


class ReaderCore(FastPaths, PatternFollowing):
    """The logic of one reader, shared by `Reader` and `AsyncReader` (see the module doc)."""

    #: The timeline of the reader's session (0: none yet; `verify_incarnation`).
    timeline: int = 0

    def __init__(
        self,
        streams: Sequence[str] = (),
        *,
        pattern: str | None = None,
        start: Start = "earliest",
        group: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        names = list(streams)
        #: A pattern reader's subscription (`streams.core.stream_patterns`; None: named streams).
        self.subscription: Subscription | None = None
        if pattern is not None:
            if names:
                raise InvalidPattern("a reader follows named streams or a pattern, not both")
            self.subscription = Subscription(compile_pattern(pattern))
        elif not names:
            raise UsageError("a reader needs at least one stream (or a pattern)")
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
        self.membership = GroupMembership()  # the group, as this reader holds it
        #: The database incarnation the reader reads (None: not known; set by the shells);
        #: written into the group's rows at each commit.
        self.incarnation: str | None = None
        #: The database history this reader's positions belong to: the first session records
        #: it (or the client's, which shares its guard), every reconnect checks it.
        self.guard = Guard()
        #: The facts delivered lately, checked after a failover (`streams.core.sightings`);
        #: a loss stops the reader (its consumer holds facts the database no longer has).
        self.sighting = Sighting(sticky=True)
        self.proven = Proven()  # what probes and proofs proved, and whether it still stands
        self.filters = StartFilters()  # what a ``live`` or time start still drops
        self.following = ProofFollowing()  # the elected prober's proofs (`streams.proofs`)
        self.counters = ReaderCounters()  # for metrics
        self.inbox = SignedRangeInbox(self.counters)  # signed ranges from Redis, and the keys
        #: When a stream held back is checked, and who has held it too long (`retire_where_held`,
        #: with ``lease_seconds`` as this reader's own lease: docs/design/liveness.md).
        self._held = HeldStreams(lease=lease_seconds)
        #: Read rows on a hot standby (a read URL; set by the shells), and how long to wait
        #: for it: the shells then `step` without rows on the primary (it only proves) and
        #: read the rows by `standby_step` behind the fence (`streams.core.standby_fence`).
        self.route: StandbyRoute | None = None
        self.ahead = ReadAhead()  # the pages `_read_pages` read ahead
        #: A pattern reader's streams that joined and left since the shells last took them
        #: (`take_changes`: they watch their channels), and the ones the last probe missed.
        self._joined: list[str] = []
        self._left: list[str] = []
        self._gone: list[str] = []
        self._suspect: StoreError | None = None  # a failure a dropped stream may explain

    def verify_incarnation(self) -> Gen[Incarnation]:
        """On a new session, before anything else: is it the database history this reader
        started on (`streams.store.identity`)? `DatabaseChanged` otherwise."""
        found = yield from verify(self.guard, self._where(), self.sighting, "facts delivered")
        self.inbox.on_incarnation(self.incarnation, found.token)
        self.incarnation, self.timeline = found.token, found.timeline
        return found

    def _where(self) -> str:
        what = "group " + repr(self.group) if self.group is not None else "reader"
        return f"{what} of {self.described}"

    @property
    def described(self) -> str:
        """The streams, as messages name them: the names, or a pattern reader's pattern."""
        if self.subscription is not None:
            return f"streams matching {self.subscription.pattern.pattern!r}"
        return ", ".join(self.names)

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
        if self.subscription is None:
            infos = yield from load_streams(list(self.names))
        else:
            sub = self.subscription
            sub.cursor = RegistryCursor()  # from scratch: this runs again if the session broke
            rows = yield from registry_after(sub.cursor.low())
            infos = yield from load_listed(sub.listed(rows, {}, time.monotonic()).joins)
            self.names = tuple(info.name for info in infos)
        self.infos = {info.name: info for info in infos}
        yield from self._resolve(infos, self.start)
        yield from self.read_keys()

    def _resolve(self, infos: Sequence[StreamInfo], start: Start) -> Gen[None]:
        """The starting position of each of ``infos`` (a group's, else ``start``'s), with a
        group first taking its generation on them (see `open`)."""
        if not infos:
            return
        if self.group is not None:
            taken = yield from take_generations(self.group, infos, self.membership.owner)
            self.membership.generations.update(taken)
        probes = yield from probe(infos)
        self._note_probe(probes)
        pruned = yield from pruned_positions(infos)
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
                self.membership.took({info.name: None if committed is None else committed.position})
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
                self.filters.start_ms[info.name] = start_ms
            if start == "live":
                self.filters.join_live(info.name, position, found.max_allocated)
            self.positions[info.name] = position
            self.ts_floors[info.name] = yield from ts_floor_at(info, position)

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
        """Record what a probe proved (`Proven.note`: `DatabaseChanged`, nothing delivered,
        for a sequence that went back under this reader). ``shared``: proofs of the prober,
        which say what is complete, not what is allocated."""
        self.counters.probes += 1
        for name, found in probes.items():
            self.proven.note_lsn(found.wal_lsn)
            if found.flushed_lsn and self.timeline:
                # On disk: what a rewind would take back (`Guard`, "A rewind").
                self.guard.observed(self.timeline, found.flushed_lsn)
            max_allocated = None if shared else found.max_allocated
            self.proven.note(name, found.complete, max_allocated, self.positions.get(name, 0))
        self.proven.reconcile = False

    def start_times(self) -> dict[str, int]:
        """For a start by time: the start (ms), by stream, still filtering what comes next
        (facts whose running-maximum timestamp is earlier are dropped until the first one at
        or after it, so a fact that was pending at the start cannot sneak in late)."""
        return dict(self.filters.start_ms)

    def set_link_state(self, connected: bool) -> None:
        """The Redis link went up or down: disconnected until the next probe re-establishes."""
        self.proven.set_link_state(connected)

    @property
    def needs_writer_hints(self) -> bool:
        """Does this reader need writers' hints? Not while it follows fresh shared proofs over
        a live link: the prover's lines then say all there is to say, and `step` looks at
        the proof record at least every `streams.reader.FOLLOWER_CHECK_INTERVAL`."""
        return not self.following.following(self.live)

    @property
    def live(self) -> bool:
        """The Redis link is up and a probe has re-established the position since."""
        return self.proven.live

    def wants(self, hint: Hint) -> bool:
        """Could this hint mean something new for this reader? Following fresh shared proofs,
        only a prober's line can: a writer's commit is not readable before it is proven."""
        if is_keys_hint(hint):
            # The keys changed (a rotation, a retirement): the next step reads them again.
            return self.inbox.keys_changed(time.monotonic())
        position = self.positions.get(hint.stream)
        if position is None or hint.token <= position:
            return False
        if hint.proof is not None:
            return self.inbox.offer(hint, self.incarnation, time.monotonic())
        if self.following.following(self.live):
            if is_proof_hint(hint):
                return True
            self.following.await_token(hint.stream, hint.token, time.monotonic())
            return False
        return True

    def proof_deadline(self) -> float | None:
        """When (monotonic) to look even without a proof line: `PROOF_GRACE` after the first
        writer's hint no proof has covered yet (None: no such hint)."""
        return self.following.deadline()

    def target(self, stream: str) -> int:
        """The complete position the last probe proved for ``stream`` (what catching up aims
        at; progress bars use it)."""
        return self.proven.target(stream)

    def behind(self) -> bool:
        return self.proven.behind(self.names, self.positions)

    @property
    def caught_up(self) -> bool:
        """Everything the last probe proved complete is delivered (and no reconnect since)."""
        return not self.proven.reconcile and not self.behind()

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

        A pattern reader first looks for new streams when due (`_follow_pattern`). A step of
        it that fails on a table or setting gone (a stream dropped under it) delivers nothing;
        the next one (on a new session: the driver closes a session a pipeline failed on)
        looks which streams are gone, and they leave; if none is, it raises that failure (so
        each such step either loses a stream or raises).
        """
        if self.subscription is None:
            return (yield from self._step(with_rows))
        suspect, self._suspect = self._suspect, None
        if suspect is not None:
            yield from self._leave_dropped(suspect, [self.infos[n] for n in self.names])
        yield from self._follow_pattern()
        if not self.names:  # a pattern that matches nothing yet: nothing to probe
            self.proven.reconcile = False
            return None
        try:
            return (yield from self._step(with_rows))
        except StoreError as exc:
            if exc.sqlstate not in DROPPED_SQLSTATES:
                raise
            self._suspect = exc
            return None

    def _step(self, with_rows: bool) -> Gen[Epoch | None]:
        if self.ahead.sent is not None:
            yield from self.receive_ahead()
        lower = dict(self.positions)
        if self.keys_due():
            yield from self.read_keys()
        if self.proven.live and self.inbox.pending:
            planned = yield from self._step_on_signed_ranges()
            if planned:
                facts = self._advance(planned)
                return Epoch(lower, dict(self.positions), tuple(facts))
        planned = []
        shared = None
        # Proofs only while the Redis link is live: without it nobody hears writers' commits
        # in time to prove them, and this reader polls PostgreSQL itself.
        proven = self.proven
        if (
            self.following.shared_proofs
            and proven.link_up
            and (not self.behind() or proven.reconcile)
        ):
            shared = yield from self._step_on_proofs(lower, with_rows)
        if shared is not None:
            planned = shared
        elif not with_rows:
            if not self.behind() or proven.reconcile:  # prove only: the rows are the standby's
                infos = [self.infos[n] for n in self.names]
                probes = yield from probe(infos)
                self._note_probe(probes)
                self._probe_missed(probes)
                yield from retire_where_held(
                    self.infos,
                    self._held,
                    time.monotonic(),
                    ((name, p.complete, p.max_allocated) for name, p in probes.items()),
                )
        elif not self.behind() or proven.reconcile:
            # Probe, rows and retention in one round trip (`streams.store.reads`); for many
            # streams, the probe alone and then the pages of the streams it found news on.
            infos = [self.infos[n] for n in self.names]
            pages: Sequence[Sequence[Row]] | None = None
            if len(infos) > ROWS_WITH_PROBE_MAX:
                probes = yield from probe(infos)
            else:
                probes, pages, _ = yield from probe_and_read(infos, lower, self.page_size)
            self._note_probe(probes)
            self._probe_missed(probes)
            # A stream held back for a while: end an expired writer's sessions ("the liveness
            # argument" in streams.store.leases). Not a read: no position moves here.
            yield from retire_where_held(
                self.infos,
                self._held,
                time.monotonic(),
                ((name, p.complete, p.max_allocated) for name, p in probes.items()),
            )
            # The rows were read up to this probe's position, whatever earlier ones said.
            ends = deliverable(lower, {name: p.complete for name, p in probes.items()})
            if pages is None:
                planned = yield from self._pages_behind_probe(lower, ends)
            else:
                for info, raw in zip(infos, pages, strict=True):
                    if ends[info.name] > lower[info.name]:
                        planned.append(
                            (yield from self._plan(info.name, list(raw), ends[info.name]))
                        )
        else:
            planned = yield from self._read_pages(lower)
        facts = self._advance(planned)  # nothing may be yielded from here on
        changed = self.positions != lower
        epoch = Epoch(lower, dict(self.positions), tuple(facts)) if changed else None
        if self._gone:
            self._leave(self._gone)
            self._gone = []
        return epoch

    def _pages_behind_probe(
        self, lower: Mapping[str, int], ends: Mapping[str, int]
    ) -> Gen[list[Planned]]:
        """A page of each stream the probe just run found news on (up to ``ends``), all in one
        round trip (steps 3-4 behind that probe: `send_proven` then `receive_proven`)."""
        news = [(self.infos[n], lower[n], ends[n]) for n in self.names if ends[n] > lower[n]]
        if not news:
            return []
        received = yield from receive_proven((yield from send_proven(news, self.page_size)))
        if received is None:  # nothing in flight: the session was reopened under the read
            raise ConnectionLost("the session closed under a read")
        pages, pruned = received
        planned: list[Planned] = []
        for (info, after, end), page in zip(news, pages, strict=True):
            if pruned.get(info.name, 0) > after:
                raise FactsPruned(info.name, after, pruned[info.name])
            planned.append((yield from self._plan(info.name, page, end)))
        return planned

    def _read_pages(self, lower: Mapping[str, int], *, ahead: bool = True) -> Gen[list[Planned]]:
        """A page of each stream behind its target, up to what the last proof proved.

        With ``ahead``, the pages that follow are *sent* before these are planned ("reading
        ahead": `streams.store.reads.send_proven`), so the server reads them while this
        process plans; the next step takes them (`receive_ahead`) if it reads the same
        ranges, and reads them anew otherwise. Sending reads nothing into the reader's state
        and moves no position, so a step that ends early, fails or is never followed loses
        nothing (the pages are read again)."""
        if self.ahead.sent is not None:
            yield from self.receive_ahead()
        received = self.ahead.take_received()
        pages: list[tuple[str, list[Row], int]] = []
        ends = deliverable(lower, self.proven.targets)
        for name in self.names:
            target = ends[name]
            if lower[name] < target:
                found = received.get(name)
                page = None if found is None else found.rows_for(name, lower[name], target)
                if page is not None:
                    self.counters.pages_ahead += 1
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
                self.ahead.sent = yield from send_proven(following, self.page_size)
        planned: list[Planned] = []
        for name, page, target in pages:
            planned.append((yield from self._plan(name, page, target)))
        return planned

    @property
    def reading_ahead(self) -> bool:
        """Pages were sent ahead and not received yet: the session is busy with them, and
        `receive_ahead` must run on it before anything else."""
        return self.ahead.sent is not None

    def receive_ahead(self) -> Gen[None]:
        """Take in the pages `_read_pages` sent ahead (kept for the next step); the shells run
        it before any other plan on the session."""
        ahead, self.ahead.sent = self.ahead.sent, None
        if ahead is None:
            return
        received = yield from receive_proven(ahead)
        if received is not None:
            self.ahead.took_in(ahead, *received)

    def forget_ahead(self) -> None:
        """The session closed: pages sent ahead on it are gone, and pages received on it are
        dropped too (the shells, on reconnect: the next session may be on a new primary, whose
        history the sighting check compares first)."""
        self.ahead.forget()

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
        yield from standby_fence(self.proven.proof_lsn, f"reader of {self.described}")
        rows_before = self.counters.rows
        try:
            planned = yield from self._read_pages(lower, ahead=False)  # not on the standby's
        except StoreError as exc:
            # A pattern reader's stream dropped (and replayed so): the next `step` looks.
            if self.subscription is None or exc.sqlstate not in DROPPED_SQLSTATES:
                raise
            self._suspect = exc
            return None
        facts = self._advance(planned)  # nothing may be yielded from here on
        self.counters.standby_rows += self.counters.rows - rows_before
        if self.positions == lower:
            return None
        return Epoch(lower, dict(self.positions), tuple(facts))

    def _plan(self, name: str, rows: list[Row], target: int) -> Gen[Planned]:
        """What a page of rows allows to deliver on ``name`` (reads more only for a fact with
        more rows than a page); changes no position (`_advance` does)."""
        info = self.infos[name]
        after = self.positions[name]
        self.counters.page(len(rows))
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
        return Planned(name, plan.facts, plan.position, plan.ts_floor)

    def _advance(self, planned: Sequence[Planned]) -> list[Fact]:
        """Move the positions to what `step` read, and filter what a ``live`` or time start
        drops: the only place a step changes them, after its last read."""
        delivered: list[Fact] = []
        for name, planned_facts, position, ts_floor in planned:
            self.positions[name] = position
            self.ts_floors[name] = ts_floor
            facts = self.filters.admit(name, position, list(planned_facts))
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
        keep = self.filters.admit_columns(name, position, ids, timestamps)
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
        if not commits:  # a pattern reader that follows no stream yet
            return {}
        try:
            committed = yield from commit_group(
                self.group, commits, self.membership.generations, incarnation=self.incarnation
            )
        except GroupFenced as exc:
            # A pattern reader's stream dropped since its last step (its group row went with
            # it): it leaves, and the others are committed. Any other fence stands.
            if self.subscription is None or exc.current is not None:
                raise
            yield from self._leave_dropped(exc, [info for info, _, _ in commits])
            if through is not None and through.stream not in self.infos:
                return {}  # its stream is gone: nothing to commit
            return (yield from self.commit(through))
        self.membership.took(committed)
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
        if not commits:
            return {}
        group = self.group
        membership = self.membership
        membership.check_forward(group, [(info.name, position) for info, position, _ in commits])
        try:
            committed = yield from commit_group_in(
                group,
                [(i, p, f, membership.committed.get(i.name)) for i, p, f in commits],
                membership.generations,
                incarnation=self.incarnation,
            )
        except StoreError as exc:
            if GROUP_MOVED not in str(exc):
                raise
            moved = next(
                (i.name for i, _, _ in commits if f"{GROUP_MOVED} {i.id} " in str(exc)),
                commits[0][0].name,
            )
            raise GroupMoved(group, moved, membership.committed.get(moved)) from None
        membership.took(committed)
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
