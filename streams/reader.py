"""Readers: facts in stream-ID order, one whole epoch at a time, with frontiers and probes.

Theory of operation
===================

A reader follows one or more streams. Its state per stream is a **position** ``p``: it has
delivered every fact ``<= p``, so its frontier there is ``{p + 1}`` (`streams.epochs`). With
several streams, its frontier is the one-element antichain of the vector ``(p1 + 1, p2 + 1, ...)``
in the reader's stream order, compared pointwise (`streams.frontier`).

Stages, after Materialize's compute protocol:

1. **Creation**: attach to the process's Redis link (subscribe; `streams.redis_link`).
2. **Initialization**: resolve where to start (a reader group's committed position, else
   ``start``), and ask PostgreSQL what is complete (`streams.store.probe`). The link publishes
   ``REPLICATE`` once its subscription is confirmed; writers answer with ``POSITION``.
3. **Computation**: `ReaderCore.step` delivers the next epoch. While behind the last probe it
   reads pages of rows from PostgreSQL; when caught up it probes again. Between steps the driver
   sleeps until a *hint* (an ``RDATA``/``POSITION`` naming a token beyond its position, from
   Redis or from a writer in the same process) or the poll interval.

Nothing from Redis is trusted: a hint only decides *when* to ask PostgreSQL, so forged, lost,
stale or duplicated commands cannot make a reader skip or invent a fact, and catching up after a
reconnect is the ordinary path, not a special one. After a (re)connect every stream counts as
disconnected (`Reader.live` is False, polling is fast) until the next probe re-establishes it.

`ReaderCore` holds all of this as generators (psycopg style); `Reader` and `AsyncReader` only
drive them on a connection and wait for hints.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

import orjson
import psycopg
from psycopg.types.json import set_json_loads

from . import dbconnect
from ._ops import Gen, Pipeline, arun, run
from .epochs import Epoch, Fact, Row, plan_page
from .errors import FactsPruned, StoreError, UsageError, WaitTimeout
from .frontier import Antichain, FrontierProbe, FrontierSnapshot, LiveFilter, UpperAntichain
from .proofs import PROOF_GRACE, STALE_AFTER, is_proof_hint
from .replication import Hint
from .store import (
    PROBE_STATEMENTS,
    READER_SESSION_SETUP,
    Probe,
    StreamInfo,
    check_retained,
    commit_group,
    database_time_ms,
    fetch_rows,
    fetch_rows_after_probe,
    fetch_rows_after_proof,
    group_position,
    load_streams,
    persisted_writer_position,
    position_before_time,
    probe,
    probe_queries,
    probes_from_rows,
    pruned_positions,
    retention_query,
    ts_floor_at,
)

__all__ = ["AsyncReader", "Reader", "ReaderCore", "Start"]

#: Where a reader without a committed group position starts: ``"earliest"``, ``"latest"``,
#: ``"live"``, a stream ID (the first fact with an ID >= it), a `datetime` (the first fact with a
#: timestamp >= it) or a `timedelta` (that long ago, on the database's clock).
Start: TypeAlias = str | int | dt.datetime | dt.timedelta

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

#: Rows per page when catching up.
DEFAULT_PAGE_SIZE = 5000
#: Seconds between probes while the Redis fast path is up (a safety net for lost messages).
LIVE_POLL_INTERVAL = 1.0
#: Seconds between probes without Redis, or while it is reconnecting.
FALLBACK_POLL_INTERVAL = 0.1
#: Least time between two probes of a caught-up reader (bounds the load a flood of forged or
#: stale messages can cause: a probe costs about as much anyway).
MIN_HINT_GAP = 0.0005


class _Flag(Protocol):
    """What the plans need of the wake-up event (threading's and asyncio's both have it)."""

    def is_set(self) -> bool: ...
    def clear(self) -> None: ...
    def set(self) -> None: ...


class _WaitWake(NamedTuple):
    """Wait up to ``seconds`` for a hint; the driver sends back whether one came."""

    seconds: float


class _Pause(NamedTuple):
    seconds: float


T = TypeVar("T")
_Plan: TypeAlias = Generator["_WaitWake | _Pause | Gen[Any]", Any, T]


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


class ReaderCore:
    """The logic of one reader, shared by `Reader` and `AsyncReader` (see the module doc)."""

    def __init__(
        self,
        streams: Sequence[str],
        *,
        start: Start = "earliest",
        group: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
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
        self._targets: dict[str, int] = {}
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
        self.probes = 0
        self.proof_reads = 0
        self.pages = 0
        #: Rows read from PostgreSQL (catch-up and live), for metrics.
        self.rows = 0

    # ---------------------------------------------------------------- initialization

    def open(self) -> Gen[None]:
        """Load the streams and resolve every starting position."""
        infos = yield from load_streams(list(self.names))
        self.infos = {info.name: info for info in infos}
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
            if committed is not None:
                self.positions[info.name], self.ts_floors[info.name] = committed
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

    # ---------------------------------------------------------------- computation

    def _note_probe(self, probes: Mapping[str, Probe]) -> None:
        self.probes += 1
        for name, found in probes.items():
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
    def live(self) -> bool:
        """The Redis link is up and a probe has re-established the position since."""
        return self._link_up and not self._reconcile

    def wants(self, hint: Hint) -> bool:
        """Could this hint mean something new for this reader? Following fresh shared proofs,
        only a prober's line can: a writer's commit is not readable before it is proven."""
        position = self.positions.get(hint.stream)
        if position is None or hint.token <= position:
            return False
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

    def step(self) -> Gen[Epoch | None]:
        """The next epoch, or None if PostgreSQL has nothing complete beyond the positions.

        Caught up (or reconciling), it probes and reads the first page of every stream in one
        pipelined round trip; behind the last probe, it reads pages only.
        """
        lower = dict(self.positions)
        facts: list[Fact] = []
        shared = None
        # Proofs only while the Redis link is live: without it nobody hears writers' commits
        # in time to prove them, and this reader polls PostgreSQL itself.
        if self.shared_proofs and self._link_up and (not self.behind() or self._reconcile):
            shared = yield from self._step_on_proofs(lower)
        if shared is not None:
            facts = shared
        elif not self.behind() or self._reconcile:
            infos = [self.infos[n] for n in self.names]
            queries = probe_queries(infos)
            queries += [fetch_rows_after_probe(i, lower[i.name], self.page_size) for i in infos]
            queries.append(retention_query(infos))  # after the rows: see "retention" (store)
            results = yield Pipeline(queries)
            check_retained(results[-1], lower)
            probes = probes_from_rows(results[PROBE_STATEMENTS - 1])
            self._note_probe(probes)
            for info, raw in zip(infos, results[PROBE_STATEMENTS:-1], strict=True):
                # The rows were read up to this probe's position, whatever earlier ones said.
                through = probes[info.name].complete
                if through > lower[info.name]:
                    facts.extend((yield from self._plan(info.name, list(raw), through)))
        else:
            for name in self.names:
                target = self._targets.get(name, 0)
                if self.positions[name] < target:
                    page = yield from fetch_rows(
                        self.infos[name], self.positions[name], target, self.page_size
                    )
                    facts.extend((yield from self._plan(name, page, target)))
        if self.positions == lower:
            return None
        return Epoch(lower, dict(self.positions), tuple(facts))

    def _step_on_proofs(self, lower: Mapping[str, int]) -> Gen[list[Fact] | None]:
        """`step` as a follower: every stream's shared proof and its first page, one statement
        each, one round trip; None (nothing delivered) when a proof is missing or stale, and
        the caller probes itself."""
        infos = [self.infos[n] for n in self.names]
        *results, pruned = yield Pipeline(
            [
                *(fetch_rows_after_proof(i, lower[i.name], self.page_size) for i in infos),
                retention_query(infos),  # after the rows: see "retention" (store)
            ]
        )
        check_retained(pruned, lower)
        self._proof_fresh = all(rows and int(rows[0][1]) <= STALE_AFTER for rows in results)
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
        self._note_probe({n: Probe(n, c, c) for n, c in proven.items()})
        facts: list[Fact] = []
        for info, rows in zip(infos, results, strict=True):
            if proven[info.name] > lower[info.name]:
                page = [tuple(r[2:]) for r in rows if r[2] is not None]
                facts.extend((yield from self._plan(info.name, page, proven[info.name])))
        return facts

    def _plan(self, name: str, rows: list[Row], target: int) -> Gen[list[Fact]]:
        """Deliver what a page of rows allows; advance the position."""
        info = self.infos[name]
        after = self.positions[name]
        self.pages += 1
        self.rows += len(rows)
        plan = plan_page(
            name, rows, after=after, through=target, limit=self.page_size,
            ts_floor=self.ts_floors[name], decode=decode_payloads,
        )  # fmt: skip
        if plan.refetch is not None:
            # One fact has more rows than a page: read it alone, whole.
            rows = yield from fetch_rows(info, plan.refetch - 1, plan.refetch, 2**31 - 1)
            plan = plan_page(
                name, rows, after=after, through=plan.refetch, limit=len(rows) + 1,
                ts_floor=self.ts_floors[name], decode=decode_payloads,
            )  # fmt: skip
        self.positions[name] = plan.position
        self.ts_floors[name] = plan.ts_floor
        facts = list(plan.facts)
        live = self._filters.get(name)
        if live is not None:
            facts = [f for f in facts if live.admit(f.id)]
            live.advance_lower(Antichain([plan.position + 1]))
            if not live.active:
                del self._filters[name]
        start_ms = self._start_ts.get(name)
        if start_ms is not None:
            facts = [f for f in facts if f.timestamp >= start_ms]
            if facts:
                del self._start_ts[name]
        return facts

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
        """
        if self.group is None:
            raise UsageError("this reader has no group: pass group= to commit positions")
        if through is not None:
            info = self._info(through.stream)
            if through.id > self.positions[through.stream]:
                raise UsageError(f"fact {through.id} of {through.stream!r} was not delivered yet")
            position = yield from commit_group(info, self.group, through.id, through.timestamp)
            return {through.stream: position}
        committed = {}
        for name in self.names:
            committed[name] = yield from commit_group(
                self.infos[name], self.group, self.positions[name], self.ts_floors[name]
            )
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


def decode_jsonb(data: bytes | str) -> Any:
    """JSONB payloads -> Python: orjson (a quarter faster end to end when catching up,
    measured), falling back to the standard library for what orjson refuses (integers beyond
    64 bits, numbers beyond float range) so every stored payload still reads."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def decode_payloads(texts: list[Any]) -> list[Any]:
    """A page's payload column, read as JSON text, -> Python values: one ``map`` over orjson
    (a fifth faster end to end when catching up than psycopg's loader per value, measured);
    value by value with `decode_jsonb` (and NULL as None) if orjson refuses any of them."""
    try:
        return list(map(orjson.loads, texts))
    except (orjson.JSONDecodeError, TypeError):
        return [None if text is None else decode_jsonb(text) for text in texts]


def _connect(url: str) -> psycopg.Connection[Any]:
    try:
        conn = dbconnect.connect(url, autocommit=True, connect_timeout=10, purpose="reader")
        for statement in READER_SESSION_SETUP:
            conn.execute(statement)
        set_json_loads(decode_jsonb, conn)
        return conn
    except psycopg.Error as exc:
        raise StoreError(f"cannot connect to PostgreSQL: {type(exc).__name__}") from None


class _ReaderBase:
    _core: ReaderCore

    @property
    def core(self) -> ReaderCore:
        return self._core

    @property
    def streams(self) -> tuple[str, ...]:
        return self._core.names

    @property
    def group(self) -> str | None:
        return self._core.group

    @property
    def live(self) -> bool:
        """Is the Redis fast path up and re-established (else the reader polls)?"""
        return self._core.live

    @property
    def frontier(self) -> Antichain[tuple[int, ...]]:
        """The merged frontier: ``{(p1 + 1, p2 + 1, ...)}`` in `streams` order."""
        return self._core.frontier

    def position(self, stream: str | None = None) -> int:
        """Everything ``<=`` this has been delivered (on ``stream``, or the only stream)."""
        return self._core.position(stream)

    def probe(self, stream: str | None = None) -> FrontierProbe[int]:
        return self._core.probe(stream)

    def vector_probe(self) -> FrontierProbe[tuple[int, ...]]:
        return self._core.vector_probe()

    def _poll_interval(self, configured: float | None) -> float:
        if configured is not None:
            return configured
        return LIVE_POLL_INTERVAL if self._core.live else FALLBACK_POLL_INTERVAL

    # LinkListener
    def on_link_state(self, connected: bool) -> None:
        self._core.set_link_state(connected)
        self._wakeup()

    def on_hint(self, hint: Hint) -> None:
        if self._core.wants(hint):
            self._hinted = True
            self._wakeup()
        elif self._core.deadline_moved:
            self._wakeup()  # not a hint: the wait only recomputes its deadline

    def _wakeup(self) -> None:
        raise NotImplementedError

    # The waiting logic of `poll` and `wait_for_position`, written once as generators (like
    # `ReaderCore`'s): they yield `_WaitWake` (wait for a hint, up to some seconds; the driver
    # sends back whether one came), `_Pause` (sleep), or a `ReaderCore` generator to run on the
    # connection (the driver sends back its result). `Reader` and `AsyncReader` only drive them.
    _wake: _Flag
    _hinted = False  # a hint (not a moved deadline) set `_wake`
    _closed: bool
    _poll: float | None
    _last_probe: float

    def _poll_plan(self, timeout: float | None) -> _Plan[Epoch | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise UsageError("reader is closed")
            if timeout != 0 and self._core.caught_up and not self._wake.is_set():
                due = self._last_probe + self._poll_interval(self._poll)
                proof_due = self._core.proof_deadline()
                if proof_due is not None:
                    due = min(due, proof_due)
                until = due if deadline is None else min(due, deadline)
                hinted = yield _WaitWake(max(0.0, until - time.monotonic()))
                if hinted and self._core.deadline_moved and not self._hinted:
                    self._core.deadline_moved = False
                    self._wake.clear()
                    continue  # a writer's hint started the proof grace: wait up to it
                if not hinted and time.monotonic() < due:
                    return None  # the deadline came first
            if self._core.caught_up:  # this step probes: at most one probe per MIN_HINT_GAP
                gap = self._last_probe + MIN_HINT_GAP - time.monotonic()
                if gap > 0:
                    yield _Pause(gap)
            self._wake.clear()
            self._hinted = False
            self._core.deadline_moved = False
            self._last_probe = time.monotonic()
            epoch: Epoch | None = yield self._core.step()
            if epoch is not None:
                return epoch
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _wait_plan(
        self, stream: str, token: int, instance: str | None, timeout: float
    ) -> _Plan[None]:
        deadline = time.monotonic() + timeout
        while True:
            self._wake.clear()
            if (yield self._core.reached(stream, token, instance)):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"stream {stream!r} did not reach {token} within {timeout}s")
            yield _WaitWake(min(remaining, self._poll_interval(self._poll)))


class Reader(_ReaderBase):
    """A synchronous reader. Iterate it for epochs; see `ReaderCore` for the model."""

    _wake: threading.Event

    def __init__(
        self,
        database_url: str,
        core: ReaderCore,
        link: Any = None,
        *,
        poll_interval: float | None = None,
        proofs: Any = None,
    ) -> None:
        self._core = core
        self._conn = _connect(database_url)
        self._wake = threading.Event()
        self._closed = False
        self._poll = poll_interval
        self._last_probe = 0.0
        try:
            run(self._conn, core.open())
        except BaseException:
            self._conn.close()
            raise
        self._link = link
        if link is not None:
            core.set_link_state(link.connected)
            link.add_listener(self)
        # ``proofs``: the process's `streams.proofs.ProofService` (None: probe every time).
        self._proofs = proofs
        if proofs is not None:
            core.shared_proofs = True
            proofs.follow(core.names)

    def __repr__(self) -> str:
        return f"<Reader streams={list(self.streams)!r} group={self.group!r}>"

    def _wakeup(self) -> None:
        self._wake.set()

    def poll(self, timeout: float | None = 0.0) -> Epoch | None:
        """The next epoch, waiting up to ``timeout`` seconds (None: forever) for one.

        ``timeout=0`` asks PostgreSQL once, now. Otherwise a caught-up reader asks again only
        when a hint arrives (a command naming a token beyond its position) or the poll interval
        has passed since its last probe, so a quiet stream costs one probe per interval, not
        one per call.
        """
        return self._drive(self._poll_plan(timeout))

    def _drive(self, plan: _Plan[T]) -> T:
        result: Any = None
        while True:
            try:
                op = plan.send(result)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(op, _WaitWake):
                result = self._wake.wait(op.seconds)
            elif isinstance(op, _Pause):
                time.sleep(op.seconds)
                result = None
            else:
                result = run(self._conn, op)

    def __iter__(self) -> Iterator[Epoch]:
        """Epochs forever (blocking); stop by breaking out or closing the reader."""
        while not self._closed:
            epoch = self.poll(timeout=None)
            if epoch is not None:
                yield epoch

    def epochs(self, *, idle_timeout: float = 0.0) -> Iterator[Epoch]:
        """Epochs until none arrives within ``idle_timeout`` seconds (0: until caught up)."""
        while True:
            epoch = self.poll(timeout=idle_timeout)
            if epoch is None:
                return
            yield epoch

    def facts(self, *, idle_timeout: float = 0.0) -> Iterator[Fact]:
        """The facts of `epochs`, one by one."""
        for epoch in self.epochs(idle_timeout=idle_timeout):
            yield from epoch.facts

    def wait_for_position(
        self, stream: str, token: int, instance: str | None = None, *, timeout: float = 10.0
    ) -> None:
        """Wait until PostgreSQL has every fact of ``stream`` up to ``token`` complete (only
        ``instance``'s facts, if given), so a query now sees them; raises `WaitTimeout`.

        This is about what is *visible*, not what this reader has delivered yet: compare
        `position` for that.
        """
        self._drive(self._wait_plan(stream, token, instance, timeout))

    def commit(self, through: Fact | None = None) -> dict[str, int]:
        """Commit this reader's positions for its group; a restart of the group resumes here.
        ``through``: only up to that delivered fact (see `ReaderCore.commit`)."""
        return run(self._conn, self._core.commit(through))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.remove_listener(self)
        if self._proofs is not None:
            self._proofs.unfollow(self._core.names)
        self._wake.set()
        self._conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncReader(_ReaderBase):
    """The asyncio twin of `Reader`: ``async for epoch in reader``."""

    _wake: asyncio.Event

    def __init__(
        self, core: ReaderCore, conn: psycopg.AsyncConnection[Any], link: Any, poll: float | None
    ) -> None:
        self._core = core
        self._conn = conn
        self._link = link
        self._poll = poll
        self._wake = asyncio.Event()
        self._closed = False
        self._last_probe = 0.0

    @classmethod
    async def open(
        cls,
        database_url: str,
        core: ReaderCore,
        link: Any = None,
        *,
        poll_interval: float | None = None,
    ) -> AsyncReader:
        try:
            conn = await dbconnect.aconnect(
                database_url, autocommit=True, connect_timeout=10, purpose="reader"
            )
            for statement in READER_SESSION_SETUP:
                await conn.execute(statement)
            set_json_loads(decode_jsonb, conn)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {type(exc).__name__}") from None
        try:
            await arun(conn, core.open())
        except BaseException:
            await conn.close()
            raise
        self = cls(core, conn, link, poll_interval)
        if link is not None:
            core.set_link_state(link.connected)
            link.add_listener(self)
        return self

    def __repr__(self) -> str:
        return f"<AsyncReader streams={list(self.streams)!r} group={self.group!r}>"

    def _wakeup(self) -> None:
        self._wake.set()

    async def _wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def poll(self, timeout: float | None = 0.0) -> Epoch | None:
        """The asyncio twin of `Reader.poll`."""
        return await self._drive(self._poll_plan(timeout))

    async def _drive(self, plan: _Plan[T]) -> T:
        result: Any = None
        while True:
            try:
                op = plan.send(result)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(op, _WaitWake):
                result = await self._wait(op.seconds)
            elif isinstance(op, _Pause):
                await asyncio.sleep(op.seconds)
                result = None
            else:
                result = await arun(self._conn, op)

    def __aiter__(self) -> AsyncIterator[Epoch]:
        return self._forever()

    async def _forever(self) -> AsyncIterator[Epoch]:
        while not self._closed:
            epoch = await self.poll(timeout=None)
            if epoch is not None:
                yield epoch

    async def epochs(self, *, idle_timeout: float = 0.0) -> AsyncIterator[Epoch]:
        while True:
            epoch = await self.poll(timeout=idle_timeout)
            if epoch is None:
                return
            yield epoch

    async def facts(self, *, idle_timeout: float = 0.0) -> AsyncIterator[Fact]:
        async for epoch in self.epochs(idle_timeout=idle_timeout):
            for fact in epoch.facts:
                yield fact

    async def wait_for_position(
        self, stream: str, token: int, instance: str | None = None, *, timeout: float = 10.0
    ) -> None:
        await self._drive(self._wait_plan(stream, token, instance, timeout))

    async def commit(self, through: Fact | None = None) -> dict[str, int]:
        return await arun(self._conn, self._core.commit(through))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.remove_listener(self)
        self._wake.set()
        await self._conn.close()

    async def __aenter__(self) -> AsyncReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
