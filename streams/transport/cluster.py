"""The link's connections on a Redis Cluster: sharded pub/sub for streams, broadcast for control.

A stream's data and proof channels (`streams.core.constants.sharded_channel`) are published
with ``SPUBLISH`` and heard with ``SSUBSCRIBE`` on the master that owns the channel's slot, so
a stream's traffic stays on one shard and more shards carry more streams. Everything else (the
replication channel: ``REPLICATE``, ``KEYS``, the connect step's lines; instance channels) is
published with ``PUBLISH``, which a cluster delivers on every node, and heard on one *control*
connection to any node.

`ClusterSubscriber` has the face of `streams.transport.connections.Subscriber` (``send``,
``receive``, ``close``), so the link's listen plan drives it unchanged: it keeps the control
connection and one connection per shard it needs, and routes ``SUBSCRIBE``/``UNSUBSCRIBE`` of
sharded channels to ``SSUBSCRIBE``/``SUNSUBSCRIBE`` on their owners. A shard that fails (its
connection ends, it answers ``MOVED``, or it pushes a ``sunsubscribe``: its slot moved or it
failed over) costs only its channels: the slot map is read again and they are subscribed
again, at most once per `RETRY_INTERVAL` while their owner is unreachable; when they are back
the subscriber reports a ``subscribe`` of the control channel, so the link runs its connect
step again (``REPLICATE``; writers re-announce their positions). Only the control connection
failing fails the link (which reconnects everything). `ClusterPublisher` publishes each line
on the right node, fire-and-forget like `InlinePublisher` (``MOVED`` replies are not read: a
line published on a stale map is lost, as Redis may lose any line; the readers poll).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

from .connections import REDIS_ERRORS, InlinePublisher, Message, Subscriber
from .topology import ClusterMap

__all__ = ["RETRY_INTERVAL", "ClusterPublisher", "ClusterSubscriber"]

#: Least seconds between two attempts to resubscribe channels whose shard was lost.
RETRY_INTERVAL = 0.5

Node = tuple[str, int]


class ClusterSubscriber:
    """See the module docstring. ``sharded``: whether a channel is a stream's."""

    def __init__(
        self,
        slots: ClusterMap,
        client_name: str,
        control_channel: str,
        sharded: Callable[[str], bool],
    ) -> None:
        self._slots = slots
        self._name = client_name
        self._control_channel = control_channel.encode()
        self._sharded = sharded
        slots.refresh()
        host, port = slots.any_node()
        self._control = Subscriber(slots.topology.node_url(host, port, db=0), client_name)
        self._shards: dict[Node, Subscriber] = {}
        self._where: dict[str, Node] = {}  # sharded channel -> the node it is subscribed on
        self._pending: set[str] = set()  # sharded channels to (re)subscribe
        self._lost = False  # some channel was lost since the connect step
        self._retry_at = 0.0
        self._queue: collections.deque[Message] = collections.deque()

    def send(self, command: str, *channels: str | bytes) -> None:
        names = [c.decode() if isinstance(c, bytes) else c for c in channels]
        control = [c for c in names if not self._sharded(c)]
        sharded = [c for c in names if self._sharded(c)]
        if command == "PING" or control or not sharded:
            self._control.send(command, *control)
        if command == "SUBSCRIBE":
            self._pending.update(sharded)
            self._subscribe_pending()
        elif command == "UNSUBSCRIBE":
            for channel in sharded:
                self._pending.discard(channel)
                node = self._where.pop(channel, None)
                if node is not None and node in self._shards:
                    self._shard_call(node, "SUNSUBSCRIBE", channel)

    def _subscribe_pending(self) -> None:
        for channel in sorted(self._pending):
            owner = self._slots.owner(channel)
            if owner is None:
                continue
            if self._shard_call(owner, "SSUBSCRIBE", channel):
                self._where[channel] = owner
                self._pending.discard(channel)

    def _shard_call(self, node: Node, *args: str) -> bool:
        """Send on ``node``'s connection (opened if needed); False if it failed (lost)."""
        try:
            conn = self._shards.get(node)
            if conn is None:
                conn = Subscriber(self._slots.topology.node_url(*node, db=0), self._name)
                self._shards[node] = conn
            conn.send(*args)
            return True
        except REDIS_ERRORS:
            self._lose(node)
            return False

    def _lose(self, node: Node) -> None:
        """``node``'s connection failed: its channels wait for the slot map to say where."""
        conn = self._shards.pop(node, None)
        if conn is not None:
            conn.close()
        for channel, where in list(self._where.items()):
            if where == node:
                del self._where[channel]
                self._pending.add(channel)
                self._lost = True
        self._retry_at = min(self._retry_at, time.monotonic() + RETRY_INTERVAL)

    def receive(self, timeout: float, wake: int | None = None) -> Message | None:
        """`Subscriber.receive` over every connection (see the module docstring)."""
        if self._queue:
            return self._queue.popleft()
        now = time.monotonic()
        if self._pending and now >= self._retry_at:
            self._retry_at = now + RETRY_INTERVAL
            with contextlib.suppress(*REDIS_ERRORS):
                self._slots.refresh()
            self._subscribe_pending()
        if self._pending:
            timeout = min(timeout, max(0.0, self._retry_at - now))
        conns = {self._control: None, **{c: n for n, c in self._shards.items()}}
        watched: list[Any] = [c._sock for c in conns]
        if wake is not None:
            watched.append(wake)
        ready, _, _ = select.select(watched, [], [], max(0.0, timeout))
        if wake is not None and wake in ready:
            with contextlib.suppress(OSError):
                os.read(wake, 4096)
        for conn, node in conns.items():
            if conn._sock not in ready:
                continue
            try:
                while (message := conn.receive(0.0)) is not None:
                    self._take(message, node)
            except REDIS_ERRORS:
                if node is None:
                    raise  # the control connection: the link reconnects
                self._lose(node)
        return self._queue.popleft() if self._queue else None

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
            self._queue.append(message)

    def close(self) -> None:
        self._control.close()
        for conn in self._shards.values():
            conn.close()
        self._shards.clear()


class ClusterPublisher:
    """`InlinePublisher`'s face on a cluster: a fire-and-forget connection per node;
    ``SPUBLISH`` on the owner of a stream's channel, ``PUBLISH`` on any node for control."""

    def __init__(self, slots: ClusterMap, client_name: str, sharded: Callable[[str], bool]) -> None:
        self._slots = slots
        self._name = client_name
        self._sharded = sharded
        self._nodes: dict[Node, InlinePublisher] = {}

    def _on(self, node: Node) -> InlinePublisher:
        publisher = self._nodes.get(node)
        if publisher is None:
            url = self._slots.topology.node_url(*node, db=0)
            publisher = self._nodes[node] = InlinePublisher(url, self._name)
        return publisher

    def send(self, lines: Sequence[tuple[str, bytes]], may_connect: bool) -> int:
        groups: dict[tuple[Node, str], list[tuple[str, bytes]]] = {}
        masters = self._slots.masters
        for channel, line in lines:
            if self._sharded(channel):
                owner = self._slots.owner(channel)
                if owner is None:
                    continue
                key = (owner, "SPUBLISH")
            elif masters:
                key = (masters[0], "PUBLISH")
            else:
                continue
            groups.setdefault(key, []).append((channel, line))
        return sum(
            self._on(node).send(batch, may_connect, verb=verb)
            for (node, verb), batch in groups.items()
        )

    def numsub(self, channels: Sequence[str], may_connect: bool) -> dict[str, int] | None:
        """Not asked on a cluster (``PUBSUB SHARDNUMSUB`` is per shard): None, so every
        stream's lines are published."""
        return None

    def retarget(self, url: str) -> None:
        pass

    def reset(self) -> None:
        for publisher in self._nodes.values():
            publisher.reset()

    def close(self) -> None:
        for publisher in self._nodes.values():
            publisher.close()
        self._nodes.clear()
