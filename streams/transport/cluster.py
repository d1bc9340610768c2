"""The link's connections on a Redis Cluster, as logic written once: plans and routing.

A stream's data and proof channels (`streams.core.constants.sharded_channel`) are published
with ``SPUBLISH`` and heard with ``SSUBSCRIBE`` on the master that owns the channel's slot, so
a stream's traffic stays on one shard and more shards carry more streams. Everything else (the
replication channel: ``REPLICATE``, ``KEYS``, the connect step's lines; instance channels) is
published with ``PUBLISH``, which a cluster delivers on every node, and heard on one *control*
connection to any node.

`ClusterPlans` is the subscriber's logic, with no I/O: it keeps which sharded channel is
subscribed on which master and which wait for one, and turns the link's ``SUBSCRIBE`` /
``UNSUBSCRIBE`` / receive into plans (`streams.plans`) over the subscriber's `Connections`:
`streams.transport.cluster_io` implements those on sockets (`ClusterSubscriber`, threads) and on
asyncio streams (`AsyncClusterSubscriber`), each running the plans with the kernel's driver.
A shard that fails (its connection ends, it answers ``MOVED``, or it pushes a ``sunsubscribe``:
its slot moved or it failed over) costs only its channels: the slot map is read again and
they are subscribed again, at most once per `RETRY_INTERVAL` while their owner is unreachable
(or the map has slots without a master); when they are all back the plans report a
``subscribe`` of the control channel, so the link runs its connect step again (``REPLICATE``;
writers re-announce their positions). Only the control connection failing fails the link.

The slot map is shared with the process's publisher (`route`). It is read again every
`MAP_REFRESH_INTERVAL`, at once when a ``REPLICATE`` is heard (a reader that just resubscribed
after a resharding asks for it: this process's next lines then go to the right masters), and
whenever a shard fails. Publishing is fire-and-forget, so a line published on a map that has
just gone stale is lost (as Redis may lose any line; the readers poll, and the ``POSITION``
lines every ``REPLICATE`` and heartbeat draws cover it): `StaleCounter` counts the lines sent
to a master that lost slots at the next refresh (an upper bound of those lost), the link's
``stale_map`` counter.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeAlias

from ..core.replication import LinkStats
from ..plans import Blocking, Call, Plan
from .connections import REDIS_ERRORS, Message
from .discovery import ClusterMap

__all__ = [
    "MAP_REFRESH_INTERVAL",
    "RETRY_INTERVAL",
    "ClusterPlans",
    "Connections",
    "Node",
    "StaleCounter",
    "numsub_groups",
    "route",
]

#: Least seconds between two attempts to resubscribe channels whose shard was lost.
RETRY_INTERVAL = 0.5
#: Most seconds between two reads of the slot map.
MAP_REFRESH_INTERVAL = 10.0

Node: TypeAlias = tuple[str, int]
#: What the drivers received while waiting: a message or a failure, per connection (None: the
#: control connection).
Received: TypeAlias = list[tuple[Node | None, Message | BaseException]]


class Connections(Protocol):
    """A cluster subscriber's connections, as its plans use them: each method is synchronous
    in `ClusterSubscriber` and a coroutine in `AsyncClusterSubscriber`, so one `Call` step."""

    def control_send(self, *args: str) -> Any:
        """Send a command on the control connection (a failure fails the link)."""

    def shard_send(self, node: Node, *args: str) -> Any:
        """Send a command on ``node``'s connection, opened first if there is none."""

    def drop_shard(self, node: Node) -> Any:
        """Close ``node``'s connection (there may be none)."""

    def wait_any(self, timeout: float) -> Any:
        """Wait up to ``timeout`` seconds for any connection to have data (or the link's
        wake-up); the result is everything read then (`Received`)."""


def _name(channel: str | bytes) -> str:
    return channel.decode() if isinstance(channel, bytes) else channel


class ClusterPlans:
    """The cluster subscriber's state and plans (see the module docstring).
    ``sharded``: whether a channel is a stream's."""

    def __init__(
        self,
        slots: ClusterMap,
        control_channel: str,
        sharded: Callable[[str], bool],
        connections: Connections,
    ) -> None:
        self.slots = slots
        self._io = connections
        self._control_channel = control_channel.encode()
        self._sharded = sharded
        self._where: dict[str, Node] = {}  # sharded channel -> the node it is subscribed on
        self._pending: set[str] = set()  # sharded channels to (re)subscribe
        self._lost = False  # some channel was lost since the connect step
        self._retry_at = 0.0
        self._map_due = time.monotonic() + MAP_REFRESH_INTERVAL
        self._queue: collections.deque[Message] = collections.deque()

    def send_plan(self, command: str, channels: Iterable[str | bytes]) -> Plan[None]:
        """The link's ``send(command, *channels)``: control channels on the control
        connection, sharded ones as ``SSUBSCRIBE``/``SUNSUBSCRIBE`` on their owners."""
        names = [_name(c) for c in channels]
        control = tuple(c for c in names if not self._sharded(c))
        sharded = [c for c in names if self._sharded(c)]
        if command == "PING" or control or not sharded:
            yield Call(self._io.control_send, command, *control)
        if command == "SUBSCRIBE":
            self._pending.update(sharded)
            yield from self._subscribe_pending()
        elif command == "UNSUBSCRIBE":
            for channel in sharded:
                self._pending.discard(channel)
                node = self._where.pop(channel, None)
                if node is not None:
                    yield from self._shard_send(node, "SUNSUBSCRIBE", channel)

    def receive_plan(self, timeout: float) -> Plan[Message | None]:
        """The link's ``receive(timeout)``: the next message of any connection, or None."""
        if self._queue:
            return self._queue.popleft()
        now = time.monotonic()
        incomplete = self._pending or not self.slots.complete
        if now >= self._map_due or (incomplete and now >= self._retry_at):
            yield from self._refresh()
        if incomplete:
            timeout = min(timeout, max(0.0, self._retry_at - now))
        timeout = min(timeout, max(0.0, self._map_due - now))
        received: Received = yield Call(self._io.wait_any, timeout)
        for node, item in received:
            if not isinstance(item, BaseException):
                self._take(item, node)
            elif node is None:
                raise item  # the control connection: the link reconnects
            else:
                yield from self._lose(node)
        return self._queue.popleft() if self._queue else None

    def _refresh(self) -> Plan[None]:
        now = time.monotonic()
        self._retry_at = now + RETRY_INTERVAL
        self._map_due = now + MAP_REFRESH_INTERVAL
        try:
            yield Blocking(self.slots.refresh)  # asks a node: a thread under asyncio
        except REDIS_ERRORS:  # no node answers: keep the map, retry later
            return
        # A channel whose slot moved without a ``sunsubscribe`` reaching us: move it.
        for channel, node in list(self._where.items()):
            owner = self.slots.owner(channel)
            if owner is not None and owner != node:
                del self._where[channel]
                self._pending.add(channel)
                self._lost = True
                yield from self._shard_send(node, "SUNSUBSCRIBE", channel)
        yield from self._subscribe_pending()

    def _subscribe_pending(self) -> Plan[None]:
        for channel in sorted(self._pending):
            owner = self.slots.owner(channel)
            if owner is not None and (yield from self._shard_send(owner, "SSUBSCRIBE", channel)):
                self._where[channel] = owner
                self._pending.discard(channel)

    def _shard_send(self, node: Node, *args: str) -> Plan[bool]:
        """Send on ``node``'s connection; False if it failed (its channels are lost)."""
        try:
            yield Call(self._io.shard_send, node, *args)
            return True
        except REDIS_ERRORS:
            yield from self._lose(node)
            return False

    def _lose(self, node: Node) -> Plan[None]:
        """``node``'s connection failed: its channels wait for the slot map to say where."""
        yield Call(self._io.drop_shard, node)
        for channel, where in list(self._where.items()):
            if where == node:
                del self._where[channel]
                self._pending.add(channel)
                self._lost = True
        self._retry_at = min(self._retry_at, time.monotonic() + RETRY_INTERVAL)

    def _take(self, message: Message, node: Node | None) -> None:
        kind, channel, data = message
        if kind == b"smessage":
            self._queue.append((b"message", channel, data))
        elif kind == b"sunsubscribe" and node is not None:
            name = channel.decode()
            if self._where.get(name) == node:  # not asked for: pushed by the server
                del self._where[name]
                self._pending.add(name)
                self._lost = True
                self._retry_at = time.monotonic()
        elif kind == b"ssubscribe":
            if self._lost and not self._pending:
                self._lost = False  # every channel is back: run the connect step again
                self._queue.append((b"subscribe", self._control_channel, 1))
        elif node is None:
            if kind == b"message" and isinstance(data, bytes) and data.startswith(b"REPLICATE"):
                # A reader (re)subscribed, perhaps after a resharding: check where lines go.
                self._map_due = time.monotonic()
            self._queue.append(message)


def route(
    slots: ClusterMap, sharded: Callable[[str], bool], lines: Sequence[tuple[str, bytes]]
) -> dict[tuple[Node, str], list[tuple[str, bytes]]]:
    """Lines grouped by the master and verb to publish them with: ``SPUBLISH`` on the owner of
    a stream's channel, ``PUBLISH`` on the first master for the rest (a cluster relays it to
    every node). Lines with no owner known are left out (dropped: best effort)."""
    groups: dict[tuple[Node, str], list[tuple[str, bytes]]] = {}
    masters = slots.masters
    for channel, line in lines:
        if sharded(channel):
            owner = slots.owner(channel)
            if owner is None:
                continue
            key = (owner, "SPUBLISH")
        elif masters:
            key = (masters[0], "PUBLISH")
        else:
            continue
        groups.setdefault(key, []).append((channel, line))
    return groups


def numsub_groups(
    slots: ClusterMap, sharded: Callable[[str], bool], channels: Sequence[str]
) -> dict[tuple[Node, str], list[str]]:
    """Where to ask how many subscribe to ``channels``: ``PUBSUB SHARDNUMSUB`` on the owner of
    a stream's channel, ``PUBSUB NUMSUB`` on every master for the rest (each counts only its
    own clients: the answers are summed, `sum_counts`)."""
    groups: dict[tuple[Node, str], list[str]] = {}
    for channel in channels:
        if sharded(channel):
            owner = slots.owner(channel)
            if owner is not None:
                groups.setdefault((owner, "SHARDNUMSUB"), []).append(channel)
        else:
            for master in slots.masters:
                groups.setdefault((master, "NUMSUB"), []).append(channel)
    return groups


def sum_counts(answers: Iterable[dict[str, int]]) -> dict[str, int] | None:
    """The answers of `numsub_groups`' questions as one count per channel (None: none came)."""
    total: dict[str, int] | None = None
    for answer in answers:
        total = {} if total is None else total
        for channel, count in answer.items():
            total[channel] = total.get(channel, 0) + count
    return total


class StaleCounter:
    """Counts lines published on a slot map that then proved stale (``stats.stale_map``).

    `sent` is called with each group published; when the map's version changed since, the
    lines sent to a master that lost slots (`ClusterMap.moved_from`) are counted: an upper
    bound of the lines a resharding or failover lost (those on its other slots arrived).
    """

    def __init__(self, slots: ClusterMap, stats: LinkStats) -> None:
        self._slots = slots
        self._stats = stats
        self._version = slots.version
        self._sent: dict[Node, int] = {}

    def sent(self, node: Node, verb: str, count: int) -> None:
        slots = self._slots
        if slots.version != self._version:
            self._version = slots.version
            moved = slots.moved_from
            self._stats.stale_map += sum(n for where, n in self._sent.items() if where in moved)
            self._sent.clear()
        if verb == "SPUBLISH":
            self._sent[node] = self._sent.get(node, 0) + count
