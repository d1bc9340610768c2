"""The Redis I/O of one process: `RedisLink` (threads) and `AsyncRedisLink` (asyncio tasks).

Each link keeps two Redis connections: a subscriber (the replication channel, the data channels
of the streams its readers follow, and its instance channels), read by a thread (asyncio: a
task), and a publisher. A writer's or prober's lines about a stream go on that stream's data
channel (`streams.core.constants`), so they reach only the processes that read it. `RedisLink`
publishes from the thread that has something to say (a writer's appending thread, the listener
answering ``REPLICATE``), fire-and-forget: the publisher connection is switched to ``CLIENT
REPLY OFF``, so a ``PUBLISH`` is one ``send`` with no reply to wait for, no thread handoff and
no wakeup. While lines come faster than ``publish_window`` (2 ms), a line waits up to that long
and goes out with the next ones in one ``send`` (a loopback ``send`` costs ~35 us of CPU here; a
flusher thread sends the tail, and sleeps while the link is quiet), so a busy writer pays one
``send`` per window, not one per append; a line after a quiet spell goes out at once.
`AsyncRedisLink` still feeds a publisher task through a bounded queue. Both read their
subscription themselves, in bulk (`streams.transport.connections`: redis-py opens the
connection, `streams.core.resp` parses what arrives). What a message means and what to publish
on connect is decided by `streams.core.replication.LinkCore`; the connection discipline below is
written once, as generator "plans" in `_LinkBase`, and the two classes only drive them on
redis-py or redis.asyncio.

A process with no reader attached (a writer-only process) subscribes to no data channel, so it
hears none of the other processes' appends. It still listens to the replication channel (it
must answer ``REPLICATE`` and notice a foreign deployment there), in bursts: after a message it
drains what has arrived and then sleeps ``idle_read_interval`` seconds (messages wait in Redis
meanwhile), and `LinkCore` discards ``RDATA``/``POSITION`` lines of known streams after reading
their first two words. ``idle_read_interval=0`` reads every message at once.

Connection discipline, as the issue of record asks and Synapse does:

* subscribe, wait until Redis confirms every channel, *then* publish ``REPLICATE`` and the local
  writers' positions (a reply published before we listen would be lost);
* a ``PING`` every `KEEPALIVE` seconds; no reply within two intervals counts as a dead link;
* on any error: mark disconnected (readers fall back to polling PostgreSQL), back off
  exponentially up to 5 s, reconnect, and run the connect step again;
* a reader attaching to a connected link publishes ``REPLICATE`` (writers answer ``POSITION``).

Foreign deployments (see `streams.core.replication`): when the core decides the channel belongs to
another deployment (Synapse), the link is quarantined (`streams.core.foreign`): it publishes
nothing, and reports itself not connected (`connected` is False, listeners get
``on_link_state(False)``), so readers poll PostgreSQL and use no signed range. The listen loop
ticks at least every half second (its wait for a message is bounded) and asks the core whether
the quarantine is over (`LinkCore.lift_quarantine`); then it publishes what a reconnect
publishes and tells listeners ``on_link_state(True)``.

With ``known_streams`` (a blocking function returning the stream names of this deployment's
registry) the link also checks announced stream names against it; it is called from the
listener thread (asyncio: `asyncio.to_thread`), only when an unknown name was heard, at most
every `streams.core.replication.REFRESH_INTERVAL` seconds. It should be quick (a short database
timeout): the subscriber is not read while it runs.

Publishing is best effort: Redis delivers at most once anyway, so when the queue is full or Redis
is down, messages are dropped (and counted in `dropped`) rather than blocking writers. The
inline publisher never waits to connect on a writer's thread while the subscriber is down: it
only (re)connects while the subscription is up (which proves Redis reachable), at most once a
second; a send that fails or times out (`INLINE_SEND_TIMEOUT`) drops the connection, and a lost
subscription drops it too (a write into a dead socket can succeed unnoticed without replies).
What is lost is covered by the ``POSITION`` lines every (re)connect and every heartbeat send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeAlias

import redis
import redis.asyncio

from ..config import redact_url
from ..core.constants import sharded_channel
from ..core.protocol import Command, serialize
from ..core.replication import (
    Announcer,
    ForeignDeployment,
    Hint,
    LinkCore,
    LinkStats,
    Quarantine,
    backoff_delay,
)
from ..plans import Blocking, Call, Plan, Wait, adrive, drive
from ..redis_urls import parse_redis_url
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
    Message,
    Subscriber,
    client_options,
)
from .discovery import ClusterMap, NotMaster, master_url
from .faces import AttachedWriter, LinkListener

__all__ = ["KEEPALIVE", "AsyncRedisLink", "KnownStreams", "LinkListener", "RedisLink"]

log = logging.getLogger("streams.redis")

#: Seconds between keep-alive PINGs on the subscriber connection.
KEEPALIVE = 5.0
#: Most seconds the listener waits for a message before its periodic work (the registry
#: refresh, a quarantine's end, the keep-alive).
RECEIVE_WAIT = 0.5
#: Most messages waiting to be published; beyond that new ones are dropped.
PUBLISH_QUEUE_LIMIT = 100_000
#: Seconds a publish may wait on Redis before the batch is given up.
PUBLISH_TIMEOUT = 5.0
#: Most messages sent in one pipeline.
PUBLISH_BATCH = 256
#: Default `RedisLink` ``publish_window``: a line published within this many seconds of the
#: previous send waits (at most this long) to go out with the next ones, in one ``send``.
PUBLISH_WINDOW = 0.002
#: Default `RedisLink` ``idle_read_interval``: with no reader attached, read the subscription
#: in bursts this many seconds apart.
IDLE_READ_INTERVAL = 0.05

#: What Redis refuses in a client name (spaces, newlines, quotes), replaced by ``_``.
_CLIENT_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._:@/-]")

#: A blocking function returning the stream names of this deployment's registry.
KnownStreams: TypeAlias = Callable[[], Collection[str]]
#: A line to publish and its channel.
_Out: TypeAlias = tuple[str, bytes]


class _LinkBase:
    def __init__(
        self,
        url: str,
        prefix: str,
        name: str,
        known_streams: KnownStreams | None = None,
        idle_read_interval: float = 0.0,
    ) -> None:
        self.core = LinkCore(
            prefix,
            name,
            check_streams=known_streams is not None,
            skip_data_without_readers=idle_read_interval > 0,
        )
        self._idle_read_interval = idle_read_interval
        self._url = url
        self._topology = parse_redis_url(url)
        #: The server the subscriber reached last (a Sentinel set's master, `_resolve`); the
        #: publisher follows it. None until the first connect for a Sentinel URL.
        self._target: str | None = self._topology.fixed_url
        #: A cluster's slot map, shared by the subscriber and the publisher (`cluster`).
        self._slots = ClusterMap(self._topology) if self._topology.sharded else None
        self._known_streams = known_streams
        self._listeners: list[LinkListener] = []
        self._listeners_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._subscribed = False  # Redis confirmed the subscription (whatever `foreign` says)
        self.connected = False  # live: subscribed and not quarantined
        self.dropped = 0

    @property
    def foreign(self) -> ForeignDeployment | None:
        """Why the link is quarantined (another deployment shares the channel), or None."""
        return self.core.foreign

    @property
    def quarantine(self) -> Quarantine | None:
        """The quarantine in force (``.end``: when it ends, `time.monotonic` seconds), or None."""
        return self.core.quarantine

    @property
    def stats(self) -> LinkStats:
        return self.core.stats

    @property
    def prefix(self) -> str:
        return self.core.prefix

    def client_name(self, role: str) -> str:
        """The Redis ``CLIENT SETNAME`` of this link's ``role`` connection (``sub``/``pub``),
        so ``CLIENT LIST`` tells operators which process holds which connection."""
        return f"streams-{role}:" + _CLIENT_NAME_UNSAFE.sub("_", self.core.name)[:100]

    def __repr__(self) -> str:
        state = "connected" if self.connected else "disconnected"
        return (
            f"<{type(self).__name__} {redact_url(self._url)} prefix={self.core.prefix!r} {state}>"
        )

    def add_listener(
        self, listener: LinkListener, streams: Collection[str] = (), *, writers: bool = True
    ) -> None:
        """Hints go to ``listener`` from now on; ``streams``: those it follows (the link
        subscribes to their proof channels, and with ``writers`` to their data channels; undo
        with the same arguments in `remove_listener`)."""
        with self._listeners_lock:
            self._listeners.append(listener)
        # Its REPLICATE (below) also tells writers to resume publishing to the new channels.
        if self.core.watch(streams) | (writers and self.core.watch(streams, writers=True)):
            self._request_resubscribe()
        # If the link is already connected, the core says to publish REPLICATE now: the
        # connect step's REPLICATE went out before this reader was there.
        self._enqueue_control(self.core.add_reader())

    def remove_listener(
        self, listener: LinkListener, streams: Collection[str] = (), *, writers: bool = True
    ) -> None:
        with self._listeners_lock:
            if listener not in self._listeners:
                return
            self._listeners.remove(listener)
            self.core.remove_reader()
        self.unwatch(streams, writers=False)
        if writers:
            self.unwatch(streams, writers=True)

    def watch(self, streams: Collection[str], *, writers: bool) -> None:
        """Subscribe to the proof channels of ``streams`` (``writers``: their data channels,
        where writers' hints are), counted: each call is undone by one `unwatch`."""
        if self.core.watch(streams, writers=writers):
            self._request_resubscribe()
            if writers:  # writers that stopped publishing for want of listeners resume
                self._enqueue_control(self.core.replicate_if_live())

    def unwatch(self, streams: Collection[str], *, writers: bool) -> None:
        if self.core.unwatch(streams, writers=writers):
            self._request_resubscribe()

    def attach_writer(
        self, stream: str, instance: str, position: Callable[[], int]
    ) -> AttachedWriter:
        """Attach a local writer of ``stream`` (``position``: reads its per-writer position).
        The link creates its `Announcer` and owns it: see `streams.transport.faces`."""
        announcer = Announcer(stream, instance, position())
        self.add_writer(announcer)
        return AttachedWriter(announcer, position, self.publish, self.remove_writer)

    def add_writer(self, announcer: Announcer) -> None:
        """Answer ``REPLICATE`` (and every reconnect) for ``announcer`` from now on."""
        self.core.add_writer(announcer)

    def remove_writer(self, announcer: Announcer) -> None:
        self.core.remove_writer(announcer)

    def publish(self, commands: Sequence[Command]) -> None:
        raise NotImplementedError

    def _dispatch(self, hints: Sequence[Hint]) -> None:
        if not hints:
            return
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            for hint in hints:
                listener.on_hint(hint)

    def _set_connected(self, subscribed: bool) -> None:
        """Redis subscription up or down; listeners hear when the link's liveness changes."""
        with self._state_lock:
            self._subscribed = subscribed
            live = subscribed and self.core.foreign is None
            if live == self.connected:
                return
            self.connected = live
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_link_state(live)

    def _update_liveness(self) -> None:
        """After anything that may have started or ended a quarantine: tell the readers."""
        if self.connected != (self._subscribed and self.core.foreign is None):
            self._set_connected(self._subscribed)

    def _tick(self, now: float) -> None:
        """The listen loop's periodic step: end a quarantine that is over (`lift_quarantine`),
        publish what a reconnect would, and tell the readers the link is live again."""
        lines = self.core.lift_quarantine(now)
        if lines is not None:
            self._enqueue_control(lines)
            self._update_liveness()

    def _handle(self, message: Message, now: float) -> list[bytes]:
        """One message from the subscriber connection: dispatch it, return lines to publish."""
        kind, channel, data = message
        if kind == b"message":
            hints, replies = self.core.on_message(data, now)
            self._dispatch(hints)
            self._update_liveness()
            return replies
        if kind == b"subscribe" and _text(channel) == self.core.channel:
            # Confirmed (also after a reconnect): the connect step.
            lines = self.core.on_connected()
            self._set_connected(True)
            return lines
        return []

    # The connection discipline, written once as plans (`streams.plans`): each class
    # implements the steps under the same names (``_open_subscriber``; the subscriber's
    # ``send``, ``receive``, ``close``), synchronous in `RedisLink` and coroutines in
    # `AsyncRedisLink`, and runs the plan with `drive` or `adrive`.
    _stopped: Any  # threading.Event or asyncio.Event
    _resubscribe: Any
    #: What interrupts the subscriber's wait for a message (`_request_resubscribe`): a pipe's
    #: read end (threads) or the ``_resubscribe`` event (asyncio).
    _wake: Any

    def _listen_plan(self) -> Plan[None]:
        attempt = 0
        subscriber: Any = None  # a `Subscriber`, `AsyncSubscriber` or their cluster faces
        try:
            while not self._stopped.is_set():
                try:
                    if subscriber is not None:  # the connection of the previous attempt
                        subscriber, previous = None, subscriber
                        yield Call(previous.close)
                    target = self._url
                    if self._topology.follows_master:
                        target = yield Blocking(self._resolve)
                    subscriber = yield Call(self._open_subscriber, target)
                    channels = self.core.channels()
                    yield Call(subscriber.send, "SUBSCRIBE", *channels)
                    last_pong = last_ping = time.monotonic()
                    draining = False
                    while not self._stopped.is_set():
                        if self._resubscribe.is_set():
                            channels = yield from self._resubscribe_plan(subscriber, channels)
                        timeout = 0.0 if draining else RECEIVE_WAIT
                        message = yield Call(subscriber.receive, timeout, self._wake)
                        now = time.monotonic()
                        if message is not None:
                            attempt = 0
                            if message[0] == b"pong":
                                last_pong = now
                            self._enqueue_control(self._handle(message, now))
                            # No reader here: drain what has arrived, then let more pile up.
                            draining = self._idle_read_interval > 0 and not self.core.readers
                        elif draining:
                            draining = False
                            yield Wait(self._stopped, self._idle_read_interval)
                        yield from self._periodic_plan(now)
                        if now - last_ping >= KEEPALIVE:
                            if now - last_pong > 2 * KEEPALIVE + 1:
                                raise redis.ConnectionError("no reply to keep-alive PING")
                            yield from self._keepalive_plan(subscriber)
                            last_ping = now
                except REDIS_ERRORS as exc:
                    if self._stopped.is_set():
                        break
                    delay = self._lost(exc, attempt)
                    attempt += 1
                    yield Wait(self._stopped, delay)
            self.core.on_disconnected()
            self._set_connected(False)
        finally:
            # However the plan ends: the link closed, the task cancelled, an error it does not
            # handle (it propagates once the connection is closed).
            if subscriber is not None:
                yield Call(subscriber.close)

    def _open_subscriber(self, target: str) -> Any:
        """Open the subscriber on ``target`` (each class's, in its world)."""
        raise NotImplementedError

    def _resubscribe_plan(self, subscriber: Any, channels: list[str]) -> Plan[list[str]]:
        """The channels to hear changed (`_request_resubscribe`): subscribe to the new ones,
        unsubscribe from the others; return the channels now subscribed."""
        self._resubscribe.clear()
        wanted = self.core.channels()
        new = [c for c in wanted if c not in channels]
        gone = [c for c in channels if c not in wanted]
        if new:
            yield Call(subscriber.send, "SUBSCRIBE", *new)
        if gone:
            yield Call(subscriber.send, "UNSUBSCRIBE", *gone)
        return wanted

    def _keepalive_plan(self, subscriber: Any) -> Plan[None]:
        yield Call(subscriber.send, "PING")
        if self._topology.follows_master:
            # Still the master? (A demoted one still relays the new one's lines.)
            yield Blocking(self._verify)

    def _lost(self, exc: BaseException, attempt: int) -> float:
        """The subscription failed: tell the readers; the seconds to wait before reconnecting."""
        self.core.on_disconnected()
        self._set_connected(False)
        self.core.stats.reconnects += 1
        delay = backoff_delay(attempt, cap=self._topology.reconnect_cap, jitter=random.random())
        log.warning(
            "Redis link %s lost (%s); reconnecting in %.2fs",
            redact_url(self._url),
            type(exc).__name__,
            delay,
        )
        return delay

    def _sharded(self, channel: str) -> bool:
        return sharded_channel(self.core.prefix, channel)

    def _resolve(self) -> str:
        """The URL to open the subscriber on (blocking: asks the Sentinels, if any)."""
        if self._topology.follows_master:
            return master_url(self._topology)
        return self._url

    def _verify(self) -> None:
        """Raise `NotMaster` if the Sentinels now name another master than the one the link
        is on (it was demoted, or a failover happened while it stayed reachable); if no
        Sentinel answers, stay on the current one."""
        try:
            now = self._resolve()
        except REDIS_ERRORS:
            return
        if self._target is not None and now != self._target:
            raise NotMaster("the Sentinels name a new master")

    def _periodic_plan(self, now: float) -> Plan[None]:
        """After each wait for a message (at most half a second): read the registry if the
        core asks (rule (b)), and end a quarantine that is over."""
        if self._known_streams is not None and self.core.refresh_due(now):
            yield from self._refresh_plan()
        self._tick(now)

    def _refresh_plan(self) -> Plan[None]:
        # Read after every suspect name was heard: the listen plan is the only consumer of
        # messages, and it waits here.
        assert self._known_streams is not None
        try:
            names = frozenset((yield Blocking(self._known_streams)))
        except Exception as exc:  # the client's function: a database error, most likely
            self.core.on_refresh_failed(time.monotonic(), exc)
        else:
            self.core.on_known_streams(names, time.monotonic())
            self._update_liveness()

    def _enqueue_control(self, lines: Sequence[bytes]) -> None:
        """Publish lines the core decided on, all on the replication channel."""
        if lines:
            channel = self.core.channel
            self._enqueue([(channel, line) for line in lines])

    def _outgoing(self, commands: Sequence[Command]) -> list[_Out]:
        """Each command of a local writer or prover, on the channel the core routes it to;
        none on a data channel nobody listens to (dropped before it costs a serialization)."""
        route = self.core.route
        routed = self.core.drop_unheard([(route(cmd), cmd) for cmd in commands])
        return [(channel, serialize(cmd)) for channel, cmd in routed]

    def _enqueue(self, lines: Sequence[_Out]) -> None:
        raise NotImplementedError

    def _request_resubscribe(self) -> None:
        """The channels to hear changed: the listener subscribes at once (it is woken if it
        waits for a message), so a new reader hears its streams within a round trip."""
        self._resubscribe.set()


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class RedisLink(_LinkBase):
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


class AsyncRedisLink(_LinkBase):
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
