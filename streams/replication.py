"""What each process says and hears on the replication channel. Pure: no I/O, no clocks.

Theory of operation
===================

Redis pub/sub is the *fast path*: it tells readers within a millisecond that a stream moved, so
they need not poll. It is never the truth. A reader that hears ``RDATA`` or ``POSITION`` only
learns "stream S may have moved up to token T"; it then asks PostgreSQL what is complete
(`streams.store.probe`) and reads the rows itself. So a forged, garbled, duplicated, stale or
lost message can at worst make a reader look sooner or later than it needed to, never skip or
invent a fact. Readers also poll on a timer, so a Redis outage costs latency, not correctness.

Two pieces, each a small state machine driven by `streams.redis_link`:

* `Announcer` (one per writer): turns the writer's completions and position changes into the
  Synapse commands. When its per-writer position moves from ``a`` to ``b`` it sends one
  ``RDATA`` per fact it committed in ``(a, b]`` (token = the fact's ID; the row identifies the
  fact, readers fetch it from PostgreSQL), then, if ``b`` is beyond the last such fact,
  ``POSITION <stream> <instance> <a'> <b>`` (no rows of this writer in ``(a', b]``: rollbacks,
  or an idle writer catching up with max allocated). ``announce()`` answers ``REPLICATE`` and the
  periodic announcement with ``POSITION <b> <b>``, as Synapse does.
* `LinkCore` (one per process): parses what arrives, drops malformed lines (logged, counted, never
  fatal) and the process's own echoes, and says what to do: answer ``REPLICATE``, or *hint* local
  readers. On every (re)connect it says what to publish once the subscription is confirmed:
  ``REPLICATE`` if readers are attached (they re-run initialization), and every local writer's
  ``POSITION``. Until then every stream is "disconnected" and readers fall back to polling.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .constants import instance_channel, replication_channel
from .protocol import (
    Command,
    ErrorCommand,
    PositionCommand,
    ProtocolError,
    RdataCommand,
    ReplicateCommand,
    parse,
    serialize,
)

__all__ = ["Announcer", "Hint", "LinkCore", "LinkStats", "backoff_delay"]

log = logging.getLogger("streams.replication")


@dataclass(frozen=True, slots=True, order=True)
class _Committed:
    last_id: int  # first: the heap orders appends by the token they are announced with
    first_id: int
    count: int
    timestamp: int


class Announcer:
    """The commands one writer sends, from its completions and position (thread-safe).

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
    """Something on the channel says ``stream`` may have moved up to ``token``."""

    stream: str
    token: int
    instance: str


@dataclass(slots=True)
class LinkStats:
    """Counters an operator may want (exposed by the links)."""

    received: int = 0
    malformed: int = 0
    echoes: int = 0
    hints: int = 0
    replicate_requests: int = 0
    published: int = 0
    reconnects: int = 0


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
    attached readers (only they need ``REPLICATE`` on connect).
    """

    def __init__(self, prefix: str, name: str) -> None:
        self.prefix = prefix
        self.name = name
        self.stats = LinkStats()
        self._writers: dict[tuple[str, str], Announcer] = {}
        self._readers = 0
        self._lock = threading.Lock()
        #: Test hook: a predicate that discards incoming messages (simulates loss).
        self.discard: Callable[[bytes], bool] | None = None

    # ---------------------------------------------------------------- membership

    def add_writer(self, announcer: Announcer) -> None:
        with self._lock:
            self._writers[(announcer.stream, announcer.instance)] = announcer

    def remove_writer(self, announcer: Announcer) -> None:
        with self._lock:
            key = (announcer.stream, announcer.instance)
            if self._writers.get(key) is announcer:  # not a newer writer under the same name
                del self._writers[key]

    def add_reader(self) -> None:
        with self._lock:
            self._readers += 1

    def remove_reader(self) -> None:
        with self._lock:
            self._readers = max(0, self._readers - 1)

    @property
    def channel(self) -> str:
        return replication_channel(self.prefix)

    def channels(self) -> list[str]:
        """Channels to subscribe: the replication channel and one per local instance name."""
        with self._lock:
            instances = {instance for _, instance in self._writers} | {self.name}
        return [self.channel, *(instance_channel(self.prefix, i) for i in sorted(instances))]

    # ---------------------------------------------------------------- events

    def on_connected(self) -> list[bytes]:
        """The subscription is confirmed: lines to publish now, in order."""
        with self._lock:
            announcers = list(self._writers.values())
            readers = self._readers
        lines = [serialize(a.announce()) for a in announcers]
        if readers:
            lines.append(serialize(ReplicateCommand()))
        return lines

    def on_message(self, data: bytes | str) -> tuple[list[Hint], list[bytes]]:
        """A message arrived: the hints for local readers and the lines to publish in reply."""
        self.stats.received += 1
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
        if self.discard is not None and self.discard(raw):
            return [], []
        try:
            cmd = parse(raw)
        except ProtocolError as exc:
            self.stats.malformed += 1
            log.warning("ignoring malformed replication line %s: %s", exc.line, exc)
            return [], []
        return self.on_command(cmd)

    def on_command(self, cmd: Command) -> tuple[list[Hint], list[bytes]]:
        match cmd:
            case ReplicateCommand():
                self.stats.replicate_requests += 1
                with self._lock:
                    announcers = list(self._writers.values())
                return [], [serialize(a.announce()) for a in announcers]
            case PositionCommand() | RdataCommand():
                with self._lock:
                    local = (cmd.stream_name, cmd.instance_name) in self._writers
                token = cmd.new_token if isinstance(cmd, PositionCommand) else cmd.token
                if local:
                    # Our own echo: local readers were hinted directly when it was published.
                    self.stats.echoes += 1
                    return [], []
                if token is None:  # an RDATA "batch" row: the last row of the fact follows
                    return [], []
                self.stats.hints += 1
                return [Hint(cmd.stream_name, token, cmd.instance_name)], []
            case ErrorCommand():
                log.warning("replication peer reported an error: %.200s", cmd.message)
                return [], []
            case _:  # PING, NAME, SERVER: nothing to do
                return [], []

    @staticmethod
    def hints_for(commands: list[Command]) -> list[Hint]:
        """Hints for local readers from commands a local writer is about to publish."""
        hints = []
        for cmd in commands:
            if isinstance(cmd, PositionCommand):
                hints.append(Hint(cmd.stream_name, cmd.new_token, cmd.instance_name))
            elif isinstance(cmd, RdataCommand) and cmd.token is not None:
                hints.append(Hint(cmd.stream_name, cmd.token, cmd.instance_name))
        return hints
