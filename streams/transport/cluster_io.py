"""`streams.transport.cluster`'s connections, on threads and on asyncio.

`ClusterSubscriber` and `AsyncClusterSubscriber` have the faces of `Subscriber` and
`AsyncSubscriber` (``send``, ``receive``, ``close``), so the link's listen plan uses them
unchanged; each implements the `Connections` that `ClusterPlans` steps on (a control connection
and one connection per master it needs) and runs the plans with the kernel's driver
(`streams.plans.drive`, `adrive`). `ClusterPublisher` (the threaded link's, fire-and-forget
like `InlinePublisher`) and `AsyncClusterPublisher` (the asyncio link's publisher task's)
publish each line on the master `route` names and ask ``PUBSUB SHARDNUMSUB`` / ``NUMSUB`` where
`numsub_groups` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio

from ..core.replication import LinkStats
from ..plans import adrive, drive
from .cluster import (
    ClusterPlans,
    Node,
    Received,
    StaleCounter,
    numsub_groups,
    route,
    sum_counts,
)
from .connections import (
    REDIS_ERRORS,
    AsyncSubscriber,
    InlinePublisher,
    Message,
    Subscriber,
    client_options,
)
from .discovery import ClusterMap

__all__ = [
    "AsyncClusterPublisher",
    "AsyncClusterSubscriber",
    "ClusterPublisher",
    "ClusterSubscriber",
]


class ClusterSubscriber:
    """`Subscriber`'s face on a cluster (threads): `ClusterPlans` on blocking sockets."""

    def __init__(
        self,
        slots: ClusterMap,
        client_name: str,
        control_channel: str,
        sharded: Callable[[str], bool],
    ) -> None:
        self._name = client_name
        self._slots = slots
        slots.refresh()
        host, port = slots.any_node()
        self._control = Subscriber(slots.topology.node_url(host, port, db=0), client_name)
        self._shards: dict[Node, Subscriber] = {}
        self._plans = ClusterPlans(slots, control_channel, sharded, self)
        self._wake: int | None = None

    def send(self, command: str, *channels: str | bytes) -> None:
        drive(self._plans.send_plan(command, channels))

    def receive(self, timeout: float, wake: int | None = None) -> Message | None:
        self._wake = wake
        return drive(self._plans.receive_plan(timeout))

    # `Connections`, the plans' steps

    def control_send(self, *args: str) -> None:
        self._control.send(*args)

    def shard_send(self, node: Node, *args: str) -> None:
        conn = self._shards.get(node)
        if conn is None:
            url = self._slots.topology.node_url(*node, db=0)
            conn = self._shards[node] = Subscriber(url, self._name)
        conn.send(*args)

    def drop_shard(self, node: Node) -> None:
        dropped = self._shards.pop(node, None)
        if dropped is not None:
            dropped.close()

    def wait_any(self, timeout: float) -> Received:
        conns: dict[Subscriber, Node | None] = {self._control: None}
        conns.update({c: n for n, c in self._shards.items()})
        watched: list[Any] = [c.fileno() for c in conns]
        if self._wake is not None:
            watched.append(self._wake)
        ready, _, _ = select.select(watched, [], [], max(0.0, timeout))
        if self._wake is not None and self._wake in ready:
            with contextlib.suppress(OSError):
                os.read(self._wake, 4096)
        received: Received = []
        for conn, node in conns.items():
            if conn.fileno() in ready:
                try:
                    received.extend((node, message) for message in conn.drain())
                except REDIS_ERRORS as exc:
                    received.append((node, exc))
        return received

    def close(self) -> None:
        self._control.close()
        for conn in self._shards.values():
            conn.close()
        self._shards.clear()


class AsyncClusterSubscriber:
    """`AsyncSubscriber`'s face on a cluster: the same `ClusterPlans` on asyncio streams."""

    def __init__(
        self,
        slots: ClusterMap,
        client_name: str,
        control: AsyncSubscriber,
        control_channel: str,
        sharded: Callable[[str], bool],
    ) -> None:
        self._slots = slots
        self._name = client_name
        self._control = control
        self._shards: dict[Node, AsyncSubscriber] = {}
        self._plans = ClusterPlans(slots, control_channel, sharded, self)
        self._wake: asyncio.Event | None = None

    @classmethod
    async def open(
        cls,
        slots: ClusterMap,
        client_name: str,
        control_channel: str,
        sharded: Callable[[str], bool],
    ) -> AsyncClusterSubscriber:
        await asyncio.to_thread(slots.refresh)
        host, port = await asyncio.to_thread(slots.any_node)
        control = await AsyncSubscriber.open(slots.topology.node_url(host, port, db=0), client_name)
        return cls(slots, client_name, control, control_channel, sharded)

    async def send(self, command: str, *channels: str | bytes) -> None:
        await adrive(self._plans.send_plan(command, channels))

    async def receive(self, timeout: float, wake: asyncio.Event | None = None) -> Message | None:
        self._wake = wake
        return await adrive(self._plans.receive_plan(timeout))

    # `Connections`, the plans' steps

    async def control_send(self, *args: str) -> None:
        await self._control.send(*args)

    async def shard_send(self, node: Node, *args: str) -> None:
        conn = self._shards.get(node)
        if conn is None:
            url = self._slots.topology.node_url(*node, db=0)
            conn = self._shards[node] = await AsyncSubscriber.open(url, self._name)
        await conn.send(*args)

    async def drop_shard(self, node: Node) -> None:
        dropped = self._shards.pop(node, None)
        if dropped is not None:
            await dropped.close()

    def _collect(self) -> Received:
        received: Received = []
        for node, conn in [(None, self._control), *self._shards.items()]:
            try:
                received.extend((node, message) for message in conn.drain())
            except REDIS_ERRORS as exc:
                received.append((node, exc))
        return received

    async def wait_any(self, timeout: float) -> Received:
        received = self._collect()
        if received or timeout <= 0:
            return received
        waits: set[asyncio.Future[Any]] = {self._control.reading()}
        waits.update(conn.reading() for conn in self._shards.values())
        woken = None
        if self._wake is not None:
            woken = asyncio.ensure_future(self._wake.wait())
            waits.add(woken)
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if woken is not None:
                woken.cancel()
        return self._collect()

    async def close(self) -> None:
        await self._control.close()
        for conn in self._shards.values():
            await conn.close()
        self._shards.clear()


class ClusterPublisher:
    """`InlinePublisher`'s face on a cluster: a fire-and-forget connection per master, lines
    grouped by `route`; ``numsub`` asks where `numsub_groups` says."""

    def __init__(
        self, slots: ClusterMap, client_name: str, sharded: Callable[[str], bool], stats: LinkStats
    ) -> None:
        self._slots = slots
        self._name = client_name
        self._sharded = sharded
        self._stale = StaleCounter(slots, stats)
        self._nodes: dict[Node, InlinePublisher] = {}

    def _on(self, node: Node) -> InlinePublisher:
        publisher = self._nodes.get(node)
        if publisher is None:
            url = self._slots.topology.node_url(*node, db=0)
            publisher = self._nodes[node] = InlinePublisher(url, self._name)
        return publisher

    def send(self, lines: Sequence[tuple[str, bytes]], may_connect: bool) -> int:
        sent = 0
        for (node, verb), batch in route(self._slots, self._sharded, lines).items():
            count = self._on(node).send(batch, may_connect, verb=verb)
            self._stale.sent(node, verb, count)
            sent += count
        return sent

    def numsub(self, channels: Sequence[str], may_connect: bool) -> dict[str, int] | None:
        answers = []
        for (node, subcommand), asked in numsub_groups(
            self._slots, self._sharded, channels
        ).items():
            answer = self._on(node).numsub(asked, may_connect, subcommand=subcommand)
            if answer is not None:
                answers.append(answer)
        return sum_counts(answers)

    def retarget(self, url: str) -> None:
        pass

    def reset(self) -> None:
        for publisher in self._nodes.values():
            publisher.reset()

    def close(self) -> None:
        for publisher in self._nodes.values():
            publisher.close()
        self._nodes.clear()


class AsyncClusterPublisher:
    """The asyncio link's publisher on a cluster: a redis.asyncio client per master."""

    def __init__(
        self, slots: ClusterMap, client_name: str, sharded: Callable[[str], bool], stats: LinkStats
    ) -> None:
        self._slots = slots
        self._name = client_name
        self._sharded = sharded
        self._stale = StaleCounter(slots, stats)
        self._nodes: dict[Node, redis.asyncio.Redis] = {}

    def _on(self, node: Node) -> redis.asyncio.Redis:
        client = self._nodes.get(node)
        if client is None:
            url = self._slots.topology.node_url(*node, db=0)
            client = self._nodes[node] = redis.asyncio.Redis.from_url(
                url, client_name=self._name, **client_options(aio=True)
            )
        return client

    async def publish(self, lines: Sequence[tuple[str, bytes]]) -> None:
        """Publish every line (raises the first Redis error; the send plan retries once)."""
        for (node, verb), batch in route(self._slots, self._sharded, lines).items():
            pipe = self._on(node).pipeline(transaction=False)
            for channel, line in batch:
                pipe.execute_command(verb, channel, line)
            await pipe.execute()
            self._stale.sent(node, verb, len(batch))

    async def numsub(self, channels: Sequence[str]) -> dict[str, int] | None:
        answers = []
        for (node, subcommand), asked in numsub_groups(
            self._slots, self._sharded, channels
        ).items():
            with contextlib.suppress(*REDIS_ERRORS):
                client = self._on(node)
                reply: Any = await client.execute_command(  # type: ignore[no-untyped-call]
                    "PUBSUB", subcommand, *asked
                )
                answers.append(
                    {_text(k): int(n) for k, n in zip(reply[::2], reply[1::2], strict=True)}
                )
        return sum_counts(answers)

    async def aclose(self) -> None:
        for client in self._nodes.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._nodes.clear()


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
