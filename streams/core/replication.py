"""What each process says and hears on the replication channel. Pure: no I/O, no clocks.

Theory of operation
===================

Redis pub/sub is the *fast path*: it tells readers within a millisecond that a stream moved, so
they need not poll. It is never the truth. A reader that hears ``RDATA`` or ``POSITION`` only
learns "stream S may have moved up to token T"; it then asks PostgreSQL what is complete
(`streams.store.probe.probe`) and reads the rows itself. So a forged, garbled, duplicated, stale or
lost message can at worst make a reader look sooner or later than it needed to, never skip or
invent a fact. Readers also poll on a timer, so a Redis outage costs latency, not correctness.

Two pieces, each a small state machine driven by `streams.transport.link`:

* `Announcer` (one per writer): turns the writer's completions and position changes into the
  Synapse commands. When its per-writer position moves from ``a`` to ``b`` it sends one
  ``RDATA`` per fact it committed in ``(a, b]`` (token = the fact's ID; the row identifies the
  fact, readers fetch it from PostgreSQL), then, if ``b`` is beyond the last such fact,
  ``POSITION <stream> <instance> <a'> <b>`` (no rows of this writer in ``(a', b]``: rollbacks,
  or an idle writer catching up with max allocated). ``announce()`` answers ``REPLICATE`` and the
  periodic announcement with ``POSITION <b> <b>``, as Synapse does.
* `LinkCore` (one per process): parses what arrives, drops malformed lines (counted, never
  fatal; each kind of malformation is logged once per link, so a hostile publisher cannot flood
  the log) and the process's own echoes, and says what to do: answer ``REPLICATE``, or *hint*
  local readers. On every (re)connect it says what to publish once the subscription is
  confirmed: ``REPLICATE`` if readers are attached (they re-run initialization), and every local
  writer's ``POSITION``; a reader attaching to a link that is already connected gets its own
  ``REPLICATE`` (`LinkCore.add_reader`). Until then every stream is "disconnected" and readers
  fall back to polling.

Foreign deployments
-------------------

A `streams` deployment must never share its channel with a Synapse deployment (the default
prefix ``streams`` is not a server name, but an operator may set the prefix to one): Synapse's
subscriber raises on a ``POSITION`` for a stream it does not know and drops its Redis
connection; on reconnect it sends ``REPLICATE``, our writers answer, it drops again, forever.
So `LinkCore` watches for another deployment on the channel:

(a) any Synapse-only command (`streams.core.protocol.SYNAPSE_ONLY_COMMANDS`: ``LOCK_RELEASED`` on
    every room message, ``USER_SYNC``, ``FEDERATION_ACK``, ...). `streams` never sends them, so
    this cannot misfire on our own traffic. ``SERVER`` and ``NAME`` are not evidence: Synapse
    sends them only over its old TCP protocol, never over Redis;
(b) with ``check_streams``, a ``POSITION``/``RDATA`` for a stream this deployment's registry
    does not know. A name heard that is not known yet becomes a *suspect*; the driver then reads
    the registry (`refresh_due` / `on_known_streams`, at most every `REFRESH_INTERVAL` seconds)
    and only a name still unknown after a read that happened *after* it was heard convicts, so a
    stream created after the last read never looks foreign. Known names are never forgotten.

A conviction starts a *quarantine* (`streams.core.foreign`, where the periods are argued): the
core says to publish nothing on the link's channels (`outgoing` drops and counts everything),
logs one error naming the prefix, the fix and how long, and the link tells local readers it is
not live (they poll PostgreSQL, which is always correct, and use no signed range). The first
lasts `streams.core.foreign.QUARANTINE_BASE` (60 s); one soon after the previous lasts twice as
long as that one, up to `streams.core.foreign.QUARANTINE_CAP` (15 min), and a whole cap without
one resets the doubling. The driver asks `lift_quarantine` on its periodic tick; once the time
is up the link is live again, publishes what `on_connected` says (a reconnect, as far as the
channel can tell), and new evidence convicts again. Before, a conviction lasted for the life of
the link, so anyone who may publish on Redis could turn a process's fast path off until it
restarted with one forged line; now that line costs 60 s, and each conviction is counted
(`LinkStats.convictions`). A real Synapse on the channel is disturbed for a few seconds at the
end of each quarantine, at most once per cap once it recurs.

Two `streams` deployments with *different* databases on one prefix also trip (b): each then
goes quiet and polls (again after each quarantine, as long as they share it), which is correct
and tells the operator to separate them.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from .constants import (
    KEYS_INSTANCE,
    PROOF_INSTANCE_PREFIX,
    data_channel,
    instance_channel,
    proof_channel,
    replication_channel,
)
from .foreign import (
    FOREIGN_REASONS,
    ForeignDeployment,
    Quarantine,
    Quarantines,
    foreign_verdict,
)
from .protocol import (
    Command,
    ErrorCommand,
    ForeignCommand,
    KeysCommand,
    PositionCommand,
    ProtocolError,
    RdataCommand,
    ReplicateCommand,
    parse,
    serialize,
)

__all__ = [
    "REFRESH_INTERVAL",
    "Announcer",
    "ForeignDeployment",
    "Hint",
    "LinkCore",
    "LinkStats",
    "Quarantine",
    "backoff_delay",
    "foreign_verdict",
    "is_keys_hint",
    "is_proof_hint",
]

log = logging.getLogger("streams.replication")

#: Least seconds between two reads of the stream registry by one link (`LinkCore.refresh_due`).
REFRESH_INTERVAL: Final = 5.0
#: Most unknown stream names remembered between two registry reads (a hostile publisher could
#: send any number of them).
MAX_SUSPECTS: Final = 64
#: Most distinct kinds of malformed line one link logs a warning for; later kinds go to debug.
MAX_WARNINGS: Final = 32
#: Seconds between two checks (``PUBSUB NUMSUB``) of whether anyone listens on the data channels
#: a link publishes writers' lines on (`LinkCore.listeners_due`).
LISTENERS_INTERVAL: Final = 1.0

_DATA_PREFIXES: Final = (b"RDATA ", b"POSITION ")

_Line = TypeVar("_Line", bytes, tuple[str, bytes])
_Item = TypeVar("_Item")


@dataclass(frozen=True, slots=True, order=True)
class _Committed:
    last_id: int  # first: the heap orders appends by the token they are announced with
    first_id: int
    count: int
    timestamp: int


class Announcer:
    """The commands one writer sends, from its completions and position (thread-safe). A local
    writer's is created and owned by the process's link, which the writer only reports to
    (`streams.transport.faces.AttachedWriter`).

    If another thread's `update` passes an append's IDs before that append's `committed` call
    arrives, the append is covered by a ``POSITION`` instead of its own ``RDATA``: tokens never
    go backwards on the wire, and readers only use either as a hint to ask PostgreSQL.
    """

    def __init__(self, stream: str, instance: str, position: int) -> None:
        self.stream = stream
        self.instance = instance
        self._announced = position
        self._committed: list[_Committed] = []
        self._lock = threading.Lock()

    @property
    def announced(self) -> int:
        return self._announced

    def committed(self, ids: tuple[int, ...], timestamp: int) -> None:
        """Facts with these IDs committed (one append, or one `Writer.fact`)."""
        if ids:
            with self._lock:
                heapq.heappush(
                    self._committed,
                    _Committed(
                        last_id=ids[-1], first_id=ids[0], count=len(ids), timestamp=timestamp
                    ),
                )

    def update(self, position: int) -> list[Command]:
        """The writer's position is now ``position``: the commands that say so (maybe none)."""
        with self._lock:
            if position <= self._announced:
                return []
            commands: list[Command] = []
            last_token = self._announced
            # A heap, not a sorted list: while a transaction of this writer stays open, its
            # later appends pile up here, and this runs after every one of them.
            while self._committed and self._committed[0].last_id <= position:
                fact = heapq.heappop(self._committed)
                if fact.last_id > self._announced:
                    commands.append(
                        RdataCommand(
                            self.stream,
                            self.instance,
                            fact.last_id,
                            {"first": fact.first_id, "count": fact.count, "ts": fact.timestamp},
                        )
                    )
                    last_token = fact.last_id
            if position > last_token:
                commands.append(PositionCommand(self.stream, self.instance, last_token, position))
            self._announced = position
            return commands

    def announce(self) -> PositionCommand:
        """``POSITION <p> <p>``: the answer to ``REPLICATE`` and the periodic announcement."""
        with self._lock:
            return PositionCommand(self.stream, self.instance, self._announced, self._announced)


@dataclass(frozen=True, slots=True)
class Hint:
    """Something on the channel says ``stream`` may have moved up to ``token``.

    ``proof``: for a prober's ``RDATA`` line, its row JSON as parsed (a signed range, not yet
    verified: `streams.core.signing`); None for every other line. A ``KEYS`` line becomes a
    hint of no stream (`is_keys_hint`: ``stream`` empty, ``token`` the newest key's id).
    """

    stream: str
    token: int
    instance: str
    proof: Any = None


@dataclass(slots=True)
class LinkStats:
    """Counters an operator may want (exposed by the links).

    ``foreign`` counts Synapse-only commands heard (``foreign_by_name`` per command name);
    ``convictions`` the quarantines started, by `streams.core.foreign.ForeignReason`;
    ``suppressed`` the lines not published during a quarantine; ``refresh_errors`` the failed
    reads of the stream registry (see `LinkCore.on_refresh_failed`).
    """

    received: int = 0
    malformed: int = 0
    hints: int = 0
    replicate_requests: int = 0
    published: int = 0
    reconnects: int = 0
    foreign: int = 0
    foreign_by_name: dict[str, int] = field(default_factory=dict)
    convictions: dict[str, int] = field(default_factory=lambda: {r: 0 for r in FOREIGN_REASONS})
    suppressed: int = 0
    refresh_errors: int = 0
    #: Data lines (``RDATA``/``POSITION`` of known streams) discarded unparsed: no reader here.
    skipped: int = 0
    #: Writers' lines not published: nobody listened on their data channel at the last check.
    unheard: int = 0
    #: Redis Cluster: lines published to a master that had lost slots by the next read of the
    #: slot map (an upper bound of those a resharding or failover lost; `transport.cluster`).
    stale_map: int = 0


def _short(line: bytes) -> str:
    return repr(line[:120]) + ("..." if len(line) > 120 else "")


def backoff_delay(
    attempt: int, *, base: float = 0.05, cap: float = 5.0, jitter: float = 0.0
) -> float:
    """Capped exponential back-off before reconnect attempt ``attempt`` (0-based).

    ``jitter`` in [0, 1) is supplied by the caller (random), keeping this function pure.
    """
    delay: float = min(cap, base * (2 ** min(attempt, 30)))
    return delay * (0.5 + jitter / 2) if jitter else delay


class LinkCore:
    """The decisions of one process's Redis link (see the module docstring).

    ``writers`` maps (stream, instance) to that local writer's `Announcer`; ``readers`` counts
    attached readers (they need ``REPLICATE`` on connect, and when they attach; with
    ``skip_data_without_readers``, a process without them does not parse data lines). With
    ``check_streams`` the driver reads the stream registry when `refresh_due` says so and hands
    the names to `on_known_streams`: rule (b) of foreign-deployment detection. A conviction
    quarantines the link (`streams.core.foreign.Quarantines`: ``quarantine_base`` and
    ``quarantine_cap`` seconds, by default the module's constants); the driver ends it with
    `lift_quarantine`, which it calls on its periodic tick.
    """

    def __init__(
        self,
        prefix: str,
        name: str,
        *,
        check_streams: bool = False,
        skip_data_without_readers: bool = False,
        quarantine_base: float | None = None,
        quarantine_cap: float | None = None,
    ) -> None:
        self.prefix = prefix
        self.name = name
        self._data_prefix = data_channel(prefix, "")
        self.check_streams = check_streams
        #: With no reader attached, discard ``RDATA``/``POSITION`` lines of known streams after
        #: reading two words (counted in ``stats.skipped``): nobody would use their hints.
        self.skip_data_without_readers = skip_data_without_readers
        self.stats = LinkStats()
        self._writers: dict[tuple[str, str], Announcer] = {}
        self._readers = 0
        self._watched: dict[str, int] = {}  # stream -> local readers following it
        self._watched_writers: dict[str, int] = {}  # stream -> local users of writers' hints
        # Data channels this link published writers' lines on, and whether anyone listened at
        # the last check (absent: not checked yet, so published).
        self._listened: dict[str, bool] = {}
        self._listened_at: float | None = None
        self._replicated = False  # a REPLICATE came: publish everything for an interval
        self._connected = False
        self._quarantines = Quarantines(quarantine_base, quarantine_cap)
        self._known: set[str] = set()
        self._suspects: dict[str, str] = {}  # unknown stream name -> a line that named it
        self._refreshed_at: float | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        #: Test hook: a predicate that discards incoming messages (simulates loss).
        self.discard: Callable[[bytes], bool] | None = None

    # ---------------------------------------------------------------- membership

    def add_writer(self, announcer: Announcer) -> None:
        with self._lock:
            self._writers[(announcer.stream, announcer.instance)] = announcer
            self._known.add(announcer.stream)  # a writer's stream is in the registry

    def remove_writer(self, announcer: Announcer) -> None:
        with self._lock:
            key = (announcer.stream, announcer.instance)
            if self._writers.get(key) is announcer:  # not a newer writer under the same name
                del self._writers[key]

    def add_reader(self) -> list[bytes]:
        """A reader attached: lines to publish now (``REPLICATE`` if the link is live)."""
        with self._lock:
            self._readers += 1
            live = self._connected and self._quarantines.current is None
        # The same lock as `on_connected`: a reader attaching while the subscription is being
        # confirmed is covered by exactly one of the two REPLICATEs.
        return [serialize(ReplicateCommand())] if live else []

    def remove_reader(self) -> None:
        with self._lock:
            self._readers = max(0, self._readers - 1)

    def watch(self, streams: Iterable[str], *, writers: bool = False) -> bool:
        """Local readers follow ``streams``: hear their proof channels (with ``writers``, their
        data channels too: writers' hints). True if a channel is new (the driver subscribes)."""
        counts = self._watched_writers if writers else self._watched
        added = False
        with self._lock:
            for stream in streams:
                count = counts.get(stream, 0)
                added = added or count == 0
                counts[stream] = count + 1
        return added

    def replicate_if_live(self) -> list[bytes]:
        """``REPLICATE`` if the link is live: what a process publishes when it starts to
        listen to writers' hints of a stream (writers answer, and resume publishing on a data
        channel they had found unheard, `listeners_due`)."""
        with self._lock:
            live = self._connected and self._quarantines.current is None
        return [serialize(ReplicateCommand())] if live else []

    def unwatch(self, streams: Iterable[str], *, writers: bool = False) -> bool:
        """Undo one `watch` of the same kind: True if a channel is no longer needed."""
        counts = self._watched_writers if writers else self._watched
        removed = False
        with self._lock:
            for stream in streams:
                left = counts.get(stream, 0) - 1
                if left > 0:
                    counts[stream] = left
                elif stream in counts:
                    del counts[stream]
                    removed = True
        return removed

    def route(self, cmd: Command) -> str:
        """The channel a command is published on: a prover's ``RDATA``/``POSITION`` on the
        stream's proof channel, a writer's on its data channel, everything else on the
        replication channel (`streams.core.constants`)."""
        if isinstance(cmd, PositionCommand | RdataCommand):
            if cmd.instance_name.startswith(PROOF_INSTANCE_PREFIX):
                return proof_channel(self.prefix, cmd.stream_name)
            return data_channel(self.prefix, cmd.stream_name)
        return self.channel

    # ---------------------------------------------------------------- unheard data channels

    def listeners_due(self, now: float) -> list[str]:
        """The data channels to ask Redis about now (``PUBSUB NUMSUB``; none if not due).

        Writers' lines go on a stream's data channel, which only its prover and readers that
        probe for themselves subscribe to. Where nobody listens (no reader of the stream
        anywhere), a link stops publishing them (`drop_unheard`) and asks again every
        `LISTENERS_INTERVAL`: appends then cost Redis nothing. A process that starts
        listening misses at most that long of hints, which its poll covers anyway.
        """
        with self._lock:
            if self._replicated:
                # Someone (re)started listening: publish to every channel for an interval
                # before asking again (its subscription may not be in place yet).
                self._replicated = False
                self._listened = dict.fromkeys(self._listened, True)
                self._listened_at = now
                return []
            if self._listened_at is not None and now - self._listened_at < LISTENERS_INTERVAL:
                return []
            if not self._listened:
                return []
            self._listened_at = now
            return sorted(self._listened)

    def on_listeners(self, counts: Mapping[str, int]) -> None:
        """What ``PUBSUB NUMSUB`` said about the channels `listeners_due` named."""
        with self._lock:
            for channel, count in counts.items():
                if channel in self._listened:
                    self._listened[channel] = count > 0

    def drop_unheard(self, lines: list[tuple[str, _Item]]) -> list[tuple[str, _Item]]:
        """The lines (or commands, before they are serialized) still worth publishing: a
        writer's line on a data channel nobody listened to at the last check is dropped
        (counted in ``stats.unheard``)."""
        kept = []
        with self._lock:
            if self._replicated:
                return list(lines)
            for item in lines:
                channel = item[0]
                if channel.startswith(self._data_prefix):
                    listened = self._listened.setdefault(channel, True)
                    if not listened:
                        self.stats.unheard += 1
                        continue
                kept.append(item)
        return kept

    @property
    def readers(self) -> int:
        """How many readers are attached (0: a writer-only process)."""
        return self._readers

    @property
    def channel(self) -> str:
        return replication_channel(self.prefix)

    def channels(self) -> list[str]:
        """Channels to subscribe: the replication channel, the proof channel of every stream a
        local reader follows, the data channel of every stream whose writers' hints a local
        reader or prover uses, and one per local instance name."""
        with self._lock:
            instances = {instance for _, instance in self._writers} | {self.name}
            watched = sorted(self._watched)
            hinted = sorted(self._watched_writers)
        return [
            self.channel,
            *(proof_channel(self.prefix, s) for s in watched),
            *(data_channel(self.prefix, s) for s in hinted),
            *(instance_channel(self.prefix, i) for i in sorted(instances)),
        ]

    @property
    def foreign(self) -> ForeignDeployment | None:
        """Why the link is quarantined (another deployment shares the channel), or None if it
        is not (see the module doc)."""
        current = self._quarantines.current
        return None if current is None else current.verdict

    @property
    def quarantine(self) -> Quarantine | None:
        """The quarantine in force (why, and when it ends: monotonic seconds), or None."""
        return self._quarantines.current

    # ---------------------------------------------------------------- events

    def on_connected(self) -> list[bytes]:
        """The subscription is confirmed: lines to publish now, in order."""
        with self._lock:
            self._connected = True
            announcers, readers = list(self._writers.values()), self._readers
        return self.outgoing(_initial_lines(announcers, readers))

    def lift_quarantine(self, now: float) -> list[bytes] | None:
        """The driver's periodic tick (monotonic seconds ``now``): if the quarantine in force
        is over, end it and return the lines to publish now, those of a reconnect (`on_connected`;
        none while disconnected: the next `on_connected` sends them). None if nothing ended (the
        link's liveness did not change)."""
        with self._lock:
            ended = self._quarantines.end(now)
            if ended is None:
                return None
            self._suspects.clear()  # heard before or during it: evidence must come anew
            connected = self._connected
            # Under the lock, as in `on_connected`: a reader attaching meanwhile gets exactly
            # one REPLICATE, this one or its own (`add_reader`).
            announcers, readers = list(self._writers.values()), self._readers
        log.info(
            "replication channel %r: quarantine over after %.0f s; publishing and using signed "
            "ranges again",
            self.prefix,
            ended.seconds,
        )
        return self.outgoing(_initial_lines(announcers, readers)) if connected else []

    def on_disconnected(self) -> None:
        """The subscription is lost (until the next `on_connected`)."""
        with self._lock:
            self._connected = False

    def outgoing(self, lines: list[_Line]) -> list[_Line]:
        """The lines (or (channel, line) pairs) that may be published: none during a quarantine
        (counted)."""
        if self._quarantines.current is None:
            return lines
        self.stats.suppressed += len(lines)
        return []

    def on_message(self, data: bytes | str, now: float) -> tuple[list[Hint], list[bytes]]:
        """A message arrived at ``now`` (monotonic seconds: a quarantine it starts starts then):
        the hints for local readers and the lines to publish in reply."""
        self.stats.received += 1
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
        if self.discard is not None and self.discard(raw):
            return [], []
        if self.skip_data_without_readers and not self._readers and raw.startswith(_DATA_PREFIXES):
            # Nobody here to hint: a data line of a stream this deployment knows needs no parse
            # (an unknown name still goes through, for rule (b) of the foreign check).
            words = raw.split(b" ", 2)
            if len(words) == 3 and (
                not self.check_streams or words[1].decode("utf-8", "replace") in self._known
            ):
                self.stats.skipped += 1
                return [], []
        try:
            cmd = parse(raw)
        except ProtocolError as exc:
            self.stats.malformed += 1
            self._warn_once(exc.reason, "ignoring malformed replication line %s: %s", exc.line, exc)
            return [], []
        return self.on_command(cmd, now)

    def on_command(self, cmd: Command, now: float) -> tuple[list[Hint], list[bytes]]:
        match cmd:
            case ReplicateCommand():
                self.stats.replicate_requests += 1
                with self._lock:
                    announcers = list(self._writers.values())
                    # A reader or prover starts listening: writers' lines go out again.
                    self._replicated = True
                return [], self.outgoing([serialize(a.announce()) for a in announcers])
            case PositionCommand() | RdataCommand():
                with self._lock:
                    local = (cmd.stream_name, cmd.instance_name) in self._writers
                    if (
                        not local
                        and self.check_streams
                        and self._quarantines.current is None
                        and cmd.stream_name not in self._known
                        and len(self._suspects) < MAX_SUSPECTS
                    ):
                        self._suspects.setdefault(cmd.stream_name, _short(serialize(cmd)))
                token = cmd.new_token if isinstance(cmd, PositionCommand) else cmd.token
                if local:
                    # Our own echo: local readers were hinted directly when it was published.
                    return [], []
                if token is None:  # an RDATA "batch" row: the last row of the fact follows
                    return [], []
                self.stats.hints += 1
                return [_hint_of(cmd, token)], []
            case KeysCommand():
                self.stats.hints += 1
                return [_keys_hint(cmd)], []
            case ForeignCommand():
                self.stats.foreign += 1
                by_name = self.stats.foreign_by_name
                by_name[cmd.name] = by_name.get(cmd.name, 0) + 1
                log.debug("ignoring Synapse command %s on channel %r", cmd.name, self.prefix)
                verdict = foreign_verdict(commands=[cmd.name], line=_short(serialize(cmd)))
                self._convict(verdict, now)
                return [], []
            case ErrorCommand():
                self._warn_once("ERROR", "replication peer reported an error: %.200s", cmd.message)
                return [], []
            case _:  # PING, NAME, SERVER: nothing to do
                return [], []

    # ---------------------------------------------------------------- rule (b): the registry

    def refresh_due(self, now: float) -> bool:
        """Should the driver read the stream registry now (monotonic seconds ``now``)?

        Only when an unknown stream name was heard, and at most every `REFRESH_INTERVAL`.
        """
        with self._lock:
            return (
                self.check_streams
                and self._quarantines.current is None
                and bool(self._suspects)
                and (self._refreshed_at is None or now - self._refreshed_at >= REFRESH_INTERVAL)
            )

    def on_known_streams(self, names: Collection[str], now: float) -> ForeignDeployment | None:
        """The registry, read at ``now`` after every suspect was heard: convict or clear them.

        Returns the reason of the link's quarantine (`foreign`) afterwards.
        """
        with self._lock:
            self._refreshed_at = now
            self._known.update(names)
            suspects, self._suspects = self._suspects, {}
            known = frozenset(self._known)
        if suspects:
            line = next(iter(suspects.values()))
            verdict = foreign_verdict(streams=suspects, known_streams=known, line=line)
            self._convict(verdict, now)
        return self.foreign

    def on_refresh_failed(self, now: float, error: BaseException) -> None:
        """Reading the registry failed: decide nothing, try again after `REFRESH_INTERVAL`."""
        with self._lock:
            self._refreshed_at = now
            self.stats.refresh_errors += 1
        self._warn_once(
            "registry",
            "cannot read the stream registry to check the replication channel (%s); retrying",
            type(error).__name__,
        )

    # ---------------------------------------------------------------- helpers

    def _convict(self, verdict: ForeignDeployment | None, now: float) -> None:
        if verdict is None:
            return
        with self._lock:
            started = self._quarantines.begin(verdict, now)
            if started is None:  # quarantined already: counted where heard, nothing more
                return
            self._suspects.clear()
            self.stats.convictions[verdict.reason] += 1
        log.error("%s", verdict.describe(self.prefix, started.seconds))

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        """Log a warning the first time ``key`` comes up on this link, then debug only."""
        with self._lock:
            first = key not in self._warned and len(self._warned) < MAX_WARNINGS
            if first:
                self._warned.add(key)
        if first:
            log.warning(message + " (further ones like it are logged at debug level)", *args)
        else:
            log.debug(message, *args)

    @staticmethod
    def hints_for(commands: list[Command]) -> list[Hint]:
        """Hints for local readers from commands a local writer is about to publish."""
        hints = []
        for cmd in commands:
            if isinstance(cmd, PositionCommand):
                hints.append(Hint(cmd.stream_name, cmd.new_token, cmd.instance_name))
            elif isinstance(cmd, RdataCommand) and cmd.token is not None:
                hints.append(_hint_of(cmd, cmd.token))
            elif isinstance(cmd, KeysCommand):
                hints.append(_keys_hint(cmd))
        return hints


def _initial_lines(announcers: list[Announcer], readers: int) -> list[bytes]:
    """What a link publishes on (re)connect: every local writer's ``POSITION``, then
    ``REPLICATE`` if readers are attached (they re-run initialization)."""
    lines = [serialize(a.announce()) for a in announcers]
    if readers:
        lines.append(serialize(ReplicateCommand()))
    return lines


def _hint_of(cmd: PositionCommand | RdataCommand, token: int) -> Hint:
    if isinstance(cmd, RdataCommand) and cmd.instance_name.startswith(PROOF_INSTANCE_PREFIX):
        return Hint(cmd.stream_name, token, cmd.instance_name, cmd.row)
    return Hint(cmd.stream_name, token, cmd.instance_name)


def _keys_hint(cmd: KeysCommand) -> Hint:
    return Hint("", cmd.key_id, KEYS_INSTANCE)


def is_keys_hint(hint: Hint) -> bool:
    """Is this hint a ``KEYS`` line (the replication keys changed: read them again), not a
    stream's? Its ``token`` is the newest key's id, its ``stream`` empty."""
    return hint.instance == KEYS_INSTANCE


def is_proof_hint(hint: Hint) -> bool:
    """Is this hint a prober's announcement (not a writer's)?"""
    return hint.instance.startswith(PROOF_INSTANCE_PREFIX)
