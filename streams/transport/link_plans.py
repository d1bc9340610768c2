"""What both Redis links share, written once: their state, what a message means to them
(through `streams.core.replication.LinkCore`), and the plans of their connection discipline
(listen, keep alive, reconnect, refresh, publish), which `streams.transport.link`'s two classes
drive with the kernel (`streams.plans`). The discipline and why: docs/design/link.md.
"""

from __future__ import annotations

import logging
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
from ..plans import Blocking, Call, Plan, Wait
from ..redis_urls import parse_redis_url
from .connections import (
    REDIS_ERRORS,
    Message,
)
from .discovery import ClusterMap, NotMaster, master_url
from .faces import AttachedWriter, LinkListener

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


class LinkBase:
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
