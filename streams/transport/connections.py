"""The Redis connections of a link: a subscriber read in bulk, and a fire-and-forget publisher.

redis-py opens every connection (TLS, AUTH, ``CLIENT SETNAME`` and every option the URL
carries); after that the subscriber's socket is read here, a ``recv`` of whatever has arrived at
a time, and parsed by `streams.core.resp` (hiredis's parser when installed): about 6 us of CPU a
message, where redis-py's ``PubSub.get_message`` cost about 22 (a readiness poll, retry
wrappers, a dict per message). `Subscriber` is the threaded one, `AsyncSubscriber` the asyncio
one; `InlinePublisher` sends ``PUBLISH`` commands on a connection switched to ``CLIENT REPLY
OFF``, so a publish is one ``send`` with no reply to wait for. What the link does with them is
in `streams.transport.link`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from .._aio import uninterrupted
from ..core import resp
from .discovery import NotMaster, check_master, open_client

__all__ = [
    "INLINE_RECONNECT_INTERVAL",
    "INLINE_SEND_TIMEOUT",
    "REDIS_ERRORS",
    "AsyncSubscriber",
    "InlinePublisher",
    "Message",
    "Subscriber",
    "client_options",
    "publish_now",
]

log = logging.getLogger("streams.redis")

#: What a Redis connection raises when it fails (redis-py's errors, and the socket's own).
REDIS_ERRORS = (redis.RedisError, OSError)


#: Seconds an inline publish may block a writer's thread in ``send`` (then it is dropped).
INLINE_SEND_TIMEOUT = 0.25


#: Least seconds between two connection attempts of the inline publisher.
INLINE_RECONNECT_INTERVAL = 1.0


#: A message read from the subscriber: ``(kind, channel, data)``, e.g. ``(b"message",
#: b"streams", b"RDATA ...")``, ``(b"subscribe", b"streams", 1)`` or ``(b"pong", b"", b"")``.
Message: TypeAlias = tuple[bytes, bytes, Any]


def client_options(socket_timeout: float | None = None, *, aio: bool = False) -> dict[str, Any]:
    # No hidden retries inside redis-py: the link owns reconnection (it must re-run the
    # connect step, which redis-py's silent resubscribe would skip). The subscriber blocks in
    # reads on purpose (the keep-alive finds a dead server); the publisher must not hang on a
    # server that stopped answering, so it gets a timeout.
    return {
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
        # Each world's own Retry: redis.asyncio converts a synchronous one, with a warning.
        "retry": (AsyncRetry if aio else Retry)(NoBackoff(), 0),
    }


def publish_now(url: str, channel: str, line: bytes) -> int | None:
    """Publish one line at once, on a connection of its own, and wait for Redis to take it:
    for a rare line that must go out before the call that makes it returns (``KEYS``, after a
    key rotation), which a link would drop while it is not subscribed yet. Returns how many
    subscribers received it, or None if Redis could not be reached (logged)."""
    try:
        # A Sentinel URL's current master, or any node of a cluster (PUBLISH reaches all).
        client = open_client(url, **client_options(socket_timeout=5))
    except REDIS_ERRORS as exc:
        log.warning("could not publish on %r: %s", channel, exc)
        return None
    try:
        received: Any = client.publish(channel, line)
        return int(received)
    except REDIS_ERRORS as exc:
        log.warning("could not publish on %r: %s", channel, exc)
        return None
    finally:
        client.close()


def _message(reply: Any) -> Message:
    """A parsed reply as a `Message`, or the error it is raised as."""
    if isinstance(reply, resp.ReplyError):
        raise redis.ResponseError(str(reply))
    if isinstance(reply, list) and len(reply) >= 2 and isinstance(reply[0], bytes):
        return reply[0], reply[1] if isinstance(reply[1], bytes) else b"", reply[-1]
    raise redis.ConnectionError(f"unexpected reply on the subscriber: {reply!r:.80}")


def subscriber_pool(pool_class: Any, url: str, client_name: str) -> Any:
    """The connection pool of a subscriber (redis-py's or redis.asyncio's ``ConnectionPool``).

    RESP2 whatever the URL says: `streams.core.resp` parses plain arrays, not RESP3 pushes. A
    ``?protocol=3`` in the URL would win over the keyword, and redis-py decides at the pool's
    creation (RESP3 turns on its maintenance notifications, which its pure-Python RESP2 parser
    refuses when hiredis is not installed), so it is taken out of the URL first.
    """
    parts = urlsplit(url)
    options = parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "protocol" for key, _ in options):
        query = urlencode([(key, value) for key, value in options if key != "protocol"])
        url = urlunsplit(parts._replace(query=query))
    aio = pool_class is redis.asyncio.ConnectionPool
    return pool_class.from_url(url, protocol=2, client_name=client_name, **client_options(aio=aio))


class Inbox:
    """What a subscriber connection has received, parsed into `Message`s (both drivers).

    Errors come out as redis-py's (``redis.ConnectionError``, ``redis.ResponseError``), so the
    listen plan treats them like any other lost link.
    """

    def __init__(self) -> None:
        self._parser = resp.new_parser()

    def next(self) -> Message | None:
        """The next complete message received, or None."""
        try:
            reply = self._parser.gets()
        except resp.ProtocolError as exc:
            raise redis.ConnectionError(f"not RESP2 from Redis: {exc}") from None
        return None if reply is resp.NOT_READY else _message(reply)

    def feed(self, data: bytes) -> None:
        if not data:
            raise redis.ConnectionError("Redis closed the connection")
        self._parser.feed(data)


class Subscriber:
    """A pub/sub connection that redis-py opens and `streams.core.resp` then reads in bulk.

    redis-py does what depends on the URL (TLS, AUTH, ``CLIENT SETNAME``, ``protocol=2`` so
    messages are plain arrays); after that the socket is read here, a ``recv`` of whatever has
    arrived at a time, parsed by `Inbox` (see `streams.core.resp` for why).
    """

    def __init__(self, url: str, client_name: str, *, expect_master: bool = False) -> None:
        conn: Any = subscriber_pool(redis.ConnectionPool, url, client_name).make_connection()
        self._conn = conn
        conn.connect()
        if expect_master:  # a Sentinel's master: check before subscribing (`topology`)
            try:
                check_master(conn)
            except BaseException:
                self.close()
                raise
        self._sock: Any = conn._sock  # redis-py's socket (plain or TLS), ours from here
        self._inbox = Inbox()

    def send(self, *args: str | bytes) -> None:
        try:
            self._sock.sendall(resp.encode(*args))
        except OSError as exc:
            raise redis.ConnectionError(f"send failed: {exc}") from None

    def receive(self, timeout: float, wake: int | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds for one (0: only if buffered),
        or None as soon as the file descriptor ``wake`` is readable (it is drained)."""
        message = self._inbox.next()
        if message is None and self._readable(timeout, wake):
            try:
                data = self._sock.recv(65536)
            except ssl.SSLWantReadError:  # a TLS record not complete yet
                return None
            except OSError as exc:
                raise redis.ConnectionError(f"receive failed: {exc}") from None
            self._inbox.feed(data)
            message = self._inbox.next()
        return message

    def _readable(self, timeout: float, wake: int | None) -> bool:
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True  # decrypted bytes wait inside the TLS layer, invisible to select
        watched: list[Any] = [self._sock] if wake is None else [self._sock, wake]
        ready, _, _ = select.select(watched, [], [], max(0.0, timeout))
        if wake is not None and wake in ready:
            with contextlib.suppress(OSError):
                os.read(wake, 4096)
        return self._sock in ready

    def fileno(self) -> Any:
        """What to ``select`` on (the socket)."""
        return self._sock

    def drain(self) -> list[Message]:
        """Every message that can be read without waiting; raises the connection's failure."""
        messages = []
        while (message := self.receive(0.0)) is not None:
            messages.append(message)
        return messages

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.disconnect()


class AsyncSubscriber:
    """The asyncio twin of `Subscriber`: redis.asyncio opens it, its stream is read here.

    A read that outlives a `receive` timeout is kept for the next call rather than cancelled,
    so no bytes can be lost between the two.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._inbox = Inbox()
        self._read: asyncio.Future[bytes] | None = None

    @classmethod
    async def open(
        cls, url: str, client_name: str, *, expect_master: bool = False
    ) -> AsyncSubscriber:
        conn: Any = subscriber_pool(
            redis.asyncio.ConnectionPool, url, client_name
        ).make_connection()
        try:
            await conn.connect()
            if expect_master:  # see `Subscriber`
                await conn.send_command("ROLE", check_health=False)
                role: Any = await conn.read_response()
                if not (isinstance(role, list) and role and role[0] == b"master"):
                    raise NotMaster(f"the server Sentinel named is not the master ({role!r:.40})")
        except BaseException:  # a cancellation mid-handshake too: leave no socket behind
            with contextlib.suppress(Exception):
                await uninterrupted(conn.disconnect())
            raise
        return cls(conn)

    async def send(self, *args: str | bytes) -> None:
        try:
            writer = self._conn._writer
            writer.write(resp.encode(*args))
            await writer.drain()
        except (OSError, AttributeError) as exc:  # AttributeError: redis.asyncio disconnected
            raise redis.ConnectionError(f"send failed: {exc}") from None

    async def receive(self, timeout: float, wake: asyncio.Event | None = None) -> Message | None:
        """`Subscriber.receive`: None as soon as ``wake`` is set, too."""
        message = self._inbox.next()
        if message is not None:
            return message
        if self._read is None:
            self._read = asyncio.ensure_future(self._conn._reader.read(65536))
        if wake is None or timeout <= 0:
            done, _ = await asyncio.wait({self._read}, timeout=max(0.0, timeout))
        else:
            woken = asyncio.ensure_future(wake.wait())
            try:
                done, _ = await asyncio.wait(
                    {self._read, woken}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                woken.cancel()
        if self._read not in done:
            return None
        read, self._read = self._read, None
        try:
            data = read.result()
        except OSError as exc:
            raise redis.ConnectionError(f"receive failed: {exc}") from None
        self._inbox.feed(data)
        return self._inbox.next()

    def reading(self) -> asyncio.Future[bytes]:
        """The read under way (started if none is): done when data arrived (`drain`)."""
        if self._read is None:
            self._read = asyncio.ensure_future(self._conn._reader.read(65536))
        return self._read

    def drain(self) -> list[Message]:
        """Every complete message received so far, without waiting (a finished `reading` is
        taken in first); raises the connection's failure."""
        if self._read is not None and self._read.done():
            read, self._read = self._read, None
            try:
                data = read.result()
            except OSError as exc:
                raise redis.ConnectionError(f"receive failed: {exc}") from None
            self._inbox.feed(data)
        messages = []
        while (message := self._inbox.next()) is not None:
            messages.append(message)
        return messages

    async def close(self) -> None:
        if self._read is not None:
            self._read.cancel()
            with contextlib.suppress(BaseException):
                await self._read
            self._read = None
        with contextlib.suppress(Exception):
            await self._conn.disconnect()


class InlinePublisher:
    """A fire-and-forget ``PUBLISH`` connection (``CLIENT REPLY OFF``), used under a lock.

    `send` returns how many lines went out; it never raises for Redis or socket errors, and it
    connects only when `may_connect` says so (see the module docstring).
    """

    def __init__(self, url: str | None, client_name: str) -> None:
        # ``url`` None: not known yet (a Sentinel's master, until the link asks; `retarget`).
        self._client_name = client_name
        self._url = url
        self._pool = self._new_pool(url)
        self._lock = threading.Lock()
        self._conn: Any = None
        self._next_attempt = 0.0

    def _new_pool(self, url: str | None) -> Any:
        if url is None:
            return None
        return redis.ConnectionPool.from_url(
            url,
            socket_connect_timeout=1,
            socket_timeout=INLINE_SEND_TIMEOUT,
            client_name=self._client_name,
        )

    def retarget(self, url: str) -> None:
        """Publish to the server at ``url`` from now on (a Sentinel set's new master: the
        link's subscriber found it); nothing happens if it is the current one."""
        if url == self._url:
            return
        with self._lock:
            self._reset_locked()
            old, self._pool, self._url = self._pool, self._new_pool(url), url
            self._next_attempt = 0.0
        with contextlib.suppress(Exception):
            if old is not None:
                old.disconnect()

    def _connected_locked(self, may_connect: bool) -> Any:
        conn: Any = self._conn
        if conn is None:
            now = time.monotonic()
            if not may_connect or now < self._next_attempt or self._pool is None:
                return None
            self._next_attempt = now + INLINE_RECONNECT_INTERVAL
            try:
                conn = self._pool.make_connection()
                conn.connect()
                # From here on the server sends no replies on this connection at all.
                conn.send_command("CLIENT", "REPLY", "OFF", check_health=False)
            except REDIS_ERRORS as exc:
                log.debug("inline publisher cannot connect: %s", exc)
                with contextlib.suppress(Exception):
                    conn.disconnect()
                return None
            self._conn = conn
        return conn

    def numsub(
        self, channels: Sequence[str], may_connect: bool, *, subcommand: str = "NUMSUB"
    ) -> dict[str, int] | None:
        """``PUBSUB NUMSUB``: subscribers of each channel (None if Redis could not say;
        ``subcommand``: ``SHARDNUMSUB`` for a stream's channel on a cluster).

        The connection's replies are switched on for this one question and off again."""
        with self._lock:
            conn = self._connected_locked(may_connect)
            if conn is None:
                return None
            try:
                conn.send_command("CLIENT", "REPLY", "ON", check_health=False)
                conn.read_response()
                conn.send_command("PUBSUB", subcommand, *channels, check_health=False)
                reply = conn.read_response()
                conn.send_command("CLIENT", "REPLY", "OFF", check_health=False)
            except REDIS_ERRORS as exc:
                log.debug("inline publisher could not ask for subscribers: %s", exc)
                self._reset_locked()
                return None
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): int(n)
            for k, n in zip(reply[::2], reply[1::2], strict=True)
        }

    def send(
        self, lines: Sequence[tuple[str, bytes]], may_connect: bool, *, verb: str = "PUBLISH"
    ) -> int:
        """Publish each ``(channel, line)``, in order, in one ``send`` (``verb``: ``SPUBLISH``
        for a stream's channel on a cluster)."""
        with self._lock:
            conn = self._connected_locked(may_connect)
            if conn is None:
                return 0
            try:
                if len(lines) == 1:
                    packed = conn.pack_command(verb, *lines[0])
                else:
                    packed = conn.pack_commands([(verb, *item) for item in lines])
                conn.send_packed_command(packed, check_health=False)
            except REDIS_ERRORS as exc:
                log.debug("inline publish failed: %s", exc)
                self._reset_locked()
                return 0
            return len(lines)

    def reset(self) -> None:
        """Drop the connection (the next send reconnects, when allowed)."""
        with self._lock:
            self._reset_locked()

    def _reset_locked(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.disconnect()
            self._conn = None

    def close(self) -> None:
        self.reset()
        with contextlib.suppress(Exception):
            if self._pool is not None:
                self._pool.disconnect()
