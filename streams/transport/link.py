"""The Redis I/O of one process: `RedisLink` (threads) and `AsyncRedisLink` (asyncio tasks).

Each link keeps a subscriber (the replication channel, the data channels of the streams its
readers follow, its instance channels) and a publisher. What a message means is decided by
`streams.core.replication.LinkCore`; the connection discipline is written once, as plans in
`streams.transport.link_plans`, which these two classes drive with the kernel
(`streams.plans`). How they subscribe, publish, keep alive, reconnect and quarantine, and why:
docs/design/link.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Collection, Sequence

import redis
import redis.asyncio

from ..core.protocol import Command
from ..core.replication import (
    Announcer,
    LinkCore,
)
from ..plans import Call, Plan, adrive, drive
from .cluster_io import (
    AsyncClusterPublisher,
    AsyncClusterSubscriber,
    ClusterPublisher,
    ClusterSubscriber,
)
from .connections import (
    REDIS_ERRORS,
    AsyncSubscriber,
    InlinePublisher,
    Subscriber,
    client_options,
)
from .faces import LinkListener
from .link_plans import (
    IDLE_READ_INTERVAL,
    KEEPALIVE,
    PUBLISH_BATCH,
    PUBLISH_QUEUE_LIMIT,
    PUBLISH_TIMEOUT,
    PUBLISH_WINDOW,
    KnownStreams,
    LinkBase,
    _Out,
    _text,
)

__all__ = ["KEEPALIVE", "AsyncRedisLink", "KnownStreams", "LinkListener", "RedisLink"]

log = logging.getLogger("streams.redis")


class RedisLink(LinkBase):
    """The threaded link of a synchronous `streams.Client`.

    ``known_streams``: see the module docstring (foreign-deployment detection, rule (b)).
    ``idle_read_interval``: with no reader attached, read the subscription in bursts this many
    seconds apart (0: every message as it arrives; see the module docstring).
    Publishing is inline and fire-and-forget (`InlinePublisher`). ``publish_window``: a line
    published less than this many seconds after the previous send waits up to that long and
    goes out with the lines after it in one ``send`` (a flusher thread sends it if nothing
    follows; it only runs while lines come faster than the window). 0 sends every line at once.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        name: str,
        *,
        known_streams: KnownStreams | None = None,
        idle_read_interval: float = IDLE_READ_INTERVAL,
        publish_window: float = PUBLISH_WINDOW,
    ) -> None:
        super().__init__(url, prefix, name, known_streams, idle_read_interval)
        self._publisher: InlinePublisher | ClusterPublisher
        if self._slots is not None:
            self._publisher = ClusterPublisher(
                self._slots, self.client_name("pub"), self._sharded, self.core.stats
            )
        else:
            self._publisher = InlinePublisher(self._target, self.client_name("pub"))
        self._publish_window = publish_window
        self._pending: list[_Out] = []
        self._pending_lock = threading.Lock()
        self._last_send = 0.0
        self._flush_armed = False
        self._flush_wake = threading.Event()
        self._stopped = threading.Event()
        self._resubscribe = threading.Event()
        # Written to wake the listener from its wait for a message (`_request_resubscribe`).
        self._wake, self._wake_w = os.pipe()
        os.set_blocking(self._wake, False)
        os.set_blocking(self._wake_w, False)
        self._listen_thread = threading.Thread(
            target=self._listen_loop, name="streams-redis-listen", daemon=True
        )
        self._listen_thread.start()
        self._flush_thread: threading.Thread | None = None
        if publish_window > 0:
            self._flush_thread = threading.Thread(
                target=self._flush_loop, name="streams-redis-flush", daemon=True
            )
            self._flush_thread.start()

    def publish(self, commands: Sequence[Command]) -> None:
        """Publish commands of local writers (best effort); local readers hear them at once."""
        if not commands:
            return
        if self._listeners:
            self._dispatch(LinkCore.hints_for(list(commands)))
        due = self.core.listeners_due(time.monotonic())
        if due:  # at most once a LISTENERS_INTERVAL: who listens on our data channels?
            counts = self._publisher.numsub(due, self._subscribed)
            if counts is not None:
                self.core.on_listeners(counts)
        lines = self._outgoing(commands)
        if lines:
            self._enqueue(lines)

    def subscribers(self, channels: Sequence[str]) -> dict[str, int] | None:
        """``PUBSUB NUMSUB``: how many clients subscribe to each channel (None if Redis could
        not say)."""
        return self._publisher.numsub(channels, self._subscribed)

    def add_writer(self, announcer: Announcer) -> None:
        super().add_writer(announcer)
        self._request_resubscribe()  # its instance channel

    def _request_resubscribe(self) -> None:
        super()._request_resubscribe()
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"x")

    def _enqueue(self, lines: Sequence[_Out]) -> None:
        """Send now from the calling thread, or within `publish_window` if the previous send
        was more recent than that (the name is the base class's)."""
        batch = self.core.outgoing(list(lines))
        if not batch or self._stopped.is_set():
            return
        with self._pending_lock:
            self._pending.extend(batch)
            now = time.monotonic()
            if now - self._last_send >= self._publish_window or len(self._pending) >= PUBLISH_BATCH:
                self._send_pending_locked(now)
            elif not self._flush_armed:
                self._flush_armed = True
                self._flush_wake.set()

    def _send_pending_locked(self, now: float) -> None:
        batch, self._pending = self._pending, []
        self._last_send = now
        sent = self._publisher.send(batch, self._subscribed)
        if sent:
            self.core.stats.published += sent
        else:
            self.dropped += len(batch)

    def _flush_loop(self) -> None:
        """Send what waits in the window; runs only while appends outpace the window."""
        while not self._stopped.is_set():
            self._flush_wake.wait()
            self._flush_wake.clear()
            while not self._stopped.wait(self._publish_window):
                with self._pending_lock:
                    if not self._pending:
                        self._flush_armed = False
                        break
                    now = time.monotonic()
                    if now - self._last_send >= self._publish_window:
                        self._send_pending_locked(now)

    def _set_connected(self, subscribed: bool) -> None:
        if not subscribed:
            # Without replies a write into a dead connection can look fine: start afresh.
            self._publisher.reset()
        super()._set_connected(subscribed)

    def _listen_loop(self) -> None:
        drive(self._listen_plan())

    def _open_subscriber(self, target: str) -> Subscriber | ClusterSubscriber:
        """The listen plan's (re)connect: a subscriber on ``target`` (the URL, or the master
        the Sentinels named); on a cluster, the cluster's subscriber."""
        if self._slots is not None:
            return ClusterSubscriber(
                self._slots, self.client_name("sub"), self.core.channel, self._sharded
            )
        subscriber = Subscriber(
            target, self.client_name("sub"), expect_master=self._topology.follows_master
        )
        self._target = target
        self._publisher.retarget(target)
        return subscriber

    def close(self) -> None:
        if self._stopped.is_set():
            return
        with self._pending_lock:
            if self._pending:
                self._send_pending_locked(time.monotonic())
        self._stopped.set()
        self._flush_wake.set()
        if self._flush_thread is not None:
            self._flush_thread.join(timeout=5)
        self._request_resubscribe()  # wakes the listener: it sees the link stopped
        self._listen_thread.join(timeout=5)
        self._publisher.close()
        for fd in (self._wake, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class AsyncRedisLink(LinkBase):
    """The asyncio link of a `streams.AsyncClient` (tasks on the loop that started it).

    ``known_streams`` is a *blocking* function, run with `asyncio.to_thread`.
    """

    def __init__(
        self, url: str, prefix: str, name: str, *, known_streams: KnownStreams | None = None
    ) -> None:
        super().__init__(url, prefix, name, known_streams)
        self._queue: asyncio.Queue[_Out | None] = asyncio.Queue(PUBLISH_QUEUE_LIMIT)
        self._stopped = asyncio.Event()
        self._resubscribe = asyncio.Event()
        self._wake = self._resubscribe
        self._closing: asyncio.Future[None] | None = None
        self._listen_task = asyncio.create_task(self._listen_loop(), name="streams-redis-listen")
        self._publish_task = asyncio.create_task(self._publish_loop(), name="streams-redis-publish")

    def _ensure_running(self) -> None:
        """Restart a task of the link that ended while the link is open.

        Only a cancellation from outside ends one (a service's shutdown code cancelling every
        task, say; Redis errors are retried inside): each closes its connection on the way
        out, so a restarted one starts clean, with the connect step, like a reconnect.
        Checked whenever the link is used, not from a callback, so a loop that is shutting
        down is left alone.
        """
        if self._stopped.is_set():
            return
        if self._listen_task.done():
            log.warning("Redis link %s: its listener had stopped; restarting it", self)
            self._listen_task = asyncio.create_task(
                self._listen_loop(), name="streams-redis-listen"
            )
        if self._publish_task.done():
            log.warning("Redis link %s: its publisher had stopped; restarting it", self)
            self._publish_task = asyncio.create_task(
                self._publish_loop(), name="streams-redis-publish"
            )

    def publish(self, commands: Sequence[Command]) -> None:
        if not commands:
            return
        self._ensure_running()
        self._dispatch(LinkCore.hints_for(list(commands)))
        self._enqueue(self._outgoing(commands))

    def add_listener(
        self, listener: LinkListener, streams: Collection[str] = (), *, writers: bool = True
    ) -> None:
        self._ensure_running()
        super().add_listener(listener, streams, writers=writers)

    def add_writer(self, announcer: Announcer) -> None:
        self._ensure_running()
        super().add_writer(announcer)
        self._request_resubscribe()

    def _enqueue(self, lines: Sequence[_Out]) -> None:
        for line in self.core.outgoing(list(lines)):
            try:
                self._queue.put_nowait(line)
            except asyncio.QueueFull:
                self.dropped += 1

    async def _listen_loop(self) -> None:
        await adrive(self._listen_plan())

    async def _open_subscriber(self, target: str) -> AsyncSubscriber | AsyncClusterSubscriber:
        """`RedisLink._open_subscriber` on asyncio (the publisher task follows ``_target``)."""
        if self._slots is not None:
            return await AsyncClusterSubscriber.open(
                self._slots, self.client_name("sub"), self.core.channel, self._sharded
            )
        subscriber = await AsyncSubscriber.open(
            target, self.client_name("sub"), expect_master=self._topology.follows_master
        )
        self._target = target
        return subscriber

    async def _publish_loop(self) -> None:
        # No socket timeout inside redis-py: it would bound each send with asyncio.wait_for,
        # which on Python 3.11 can swallow a cancellation (`streams._aio`); `_send` bounds the
        # whole publish with asyncio.timeout instead.
        client: redis.asyncio.Redis | None = None
        client_url: str | None = None
        cluster = None
        if self._slots is not None:
            cluster = AsyncClusterPublisher(
                self._slots, self.client_name("pub"), self._sharded, self.core.stats
            )
        try:
            while True:
                line = await self._queue.get()
                if line is None:
                    return
                batch = [line]
                stop = False
                while len(batch) < PUBLISH_BATCH and not stop and not self._queue.empty():
                    more = self._queue.get_nowait()
                    stop = more is None
                    if more is not None:
                        batch.append(more)
                if cluster is None and self._target != client_url:  # a Sentinel's new master
                    if client is not None:
                        await client.aclose()
                    client, client_url = None, self._target
                    if client_url is not None:
                        client = redis.asyncio.Redis.from_url(
                            client_url,
                            client_name=self.client_name("pub"),
                            **client_options(aio=True),
                        )
                target = cluster or client
                if target is None:  # the master is not known yet: best effort, dropped
                    self.dropped += len(batch)
                    if stop:
                        return
                    continue
                due = self.core.listeners_due(time.monotonic())
                if due:  # see `RedisLink._enqueue`
                    with contextlib.suppress(*REDIS_ERRORS):
                        async with asyncio.timeout(PUBLISH_TIMEOUT):
                            counts = await self._numsub(target, due)
                        if counts is not None:
                            self.core.on_listeners(counts)
                batch = self.core.drop_unheard(batch)
                if batch:
                    await self._send(target, batch)
                if stop:
                    return
        finally:
            if client is not None:
                await client.aclose()
            if cluster is not None:
                await cluster.aclose()

    @staticmethod
    async def _numsub(
        target: redis.asyncio.Redis | AsyncClusterPublisher, channels: list[str]
    ) -> dict[str, int] | None:
        if isinstance(target, AsyncClusterPublisher):
            return await target.numsub(channels)
        reply = await target.pubsub_numsub(*channels)
        return {_text(k): int(n) for k, n in reply}

    async def _send(
        self, target: redis.asyncio.Redis | AsyncClusterPublisher, batch: list[_Out]
    ) -> None:
        await adrive(self._send_plan(target, batch))

    def _send_plan(
        self, target: redis.asyncio.Redis | AsyncClusterPublisher, batch: list[_Out]
    ) -> Plan[None]:
        # Lines queued before the channel was found foreign are dropped here, at the last step.
        batch = self.core.outgoing(batch)
        if not batch:
            return
        for attempt in range(2):  # one retry (redis-py reconnects), then drop: best effort
            try:
                yield Call(self._publish_batch, target, batch)
                self.core.stats.published += len(batch)
                return
            except REDIS_ERRORS as exc:
                if attempt:
                    self.dropped += len(batch)
                    log.debug("dropped %d replication messages: %s", len(batch), exc)

    @staticmethod
    async def _publish_batch(
        target: redis.asyncio.Redis | AsyncClusterPublisher, batch: list[_Out]
    ) -> None:
        async with asyncio.timeout(PUBLISH_TIMEOUT):  # TimeoutError is an OSError
            if isinstance(target, AsyncClusterPublisher):
                await target.publish(batch)
            elif len(batch) == 1:
                await target.publish(*batch[0])
            else:
                pipe = target.pipeline(transaction=False)
                for channel, line in batch:
                    pipe.publish(channel, line)
                await pipe.execute()

    async def aclose(self) -> None:
        """Stop both tasks and close both connections.

        Closing runs in a task of its own: cancelling ``aclose()`` stops the wait, not the
        close, and awaiting ``aclose()`` again waits for the same close to finish.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)
        for task in (self._listen_task, self._publish_task):
            # Each task closes its connection in a `finally`: give it 5 s to finish on its
            # own (the publisher sends what is queued), then cancel it and wait for that.
            await asyncio.wait({task}, timeout=5)
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                log.debug("Redis link task ended with %r", task.exception())
