"""A TCP proxy for fault tests: put it between a role and its server, then pass, freeze, delay
or cut what flows through it (imported as ``from proxy import Proxy``).

* ``pass``: bytes flow both ways as they come (the default);
* ``freeze(replies=True)``: only what the server sends is held (the client's requests reach
  it): a request that ran, whose answer never came back;
* `Proxy.freeze`: nothing flows any more, and nothing is closed: what a network partition or
  a frozen peer looks like from each side (the proxy's own kernel still acknowledges what it
  receives, as a stopped process's kernel does, so TCP keepalives do not end it either);
  `Proxy.thaw` lets what waited flow on;
* `Proxy.delay`: every chunk waits that many seconds before it is forwarded;
* `Proxy.cut`: every current connection is closed (reset) at once, as a restarted middlebox
  does; new connections go through.

Between faults it behaves as a network does when a side ends: an end of stream (FIN) is passed
on and the other direction keeps flowing; a side that fails (reset, or gone while data still
comes for it) gets its peer reset. One thread accepts, two more per connection pump bytes.
Nothing here knows the protocol.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Proxy"]


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` (see the module doc)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._flowing = threading.Event()  # client to server
        self._flowing.set()
        self._replying = threading.Event()  # server to client
        self._replying.set()
        self._delay = 0.0
        self._pairs: list[_Pair] = []
        self._closed = False
        self.connections = 0  # accepted so far
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    @classmethod
    def for_url(cls, url: str) -> Proxy:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or _default_port(parts.scheme))

    def url(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    # ---------------------------------------------------------------- faults

    def freeze(self, *, replies: bool = False) -> None:
        """Stop forwarding: both ways, or (``replies``) only from the server to the client."""
        self._replying.clear()
        if not replies:
            self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()
        self._replying.set()

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def retarget(self, host: str, port: int) -> None:
        """Send new connections to another server (a restarted one, on a new port)."""
        self.target = (host, port)

    def cut(self) -> None:
        """Reset every current connection, before returning (new ones go through)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            # Marked first: a chunk a frozen pump holds is dropped, never delivered after a
            # thaw (a reply that was lost must stay lost), and the pumps leave the sockets
            # to this method.
            pair.cut.set()
            for sock in (pair.client, pair.server):
                # A close() does not wake a thread blocked in recv() on the socket (Linux
                # keeps it open until that call returns), so nothing would be reset: stop the
                # receiving side first (it sends nothing); the pump then closes with RST.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)
        # Closed only once both pumps are out of recv() (a socket closed under a blocked
        # recv() stays open, and its pump blocked, for good), and before returning: a client
        # that looks at its idle connection right after `cut` finds it reset.
        for pair in pairs:
            for thread in pair.pumps:
                thread.join(5)
            _reset(pair.client)
            _reset(pair.server)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    def close(self) -> None:
        self._closed = True
        self.thaw()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- pumping

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, server)
            for src, dst, gate in (
                (client, server, self._flowing),
                (server, client, self._replying),
            ):
                args = (pair, src, dst, gate)
                pair.pumps.append(threading.Thread(target=self._pump, args=args, daemon=True))
            with self._lock:
                self._pairs.append(pair)
                self.connections += 1
            for thread in pair.pumps:
                thread.start()

    def _pump(
        self, pair: _Pair, src: socket.socket, dst: socket.socket, gate: threading.Event
    ) -> None:
        """Forward ``src`` to ``dst`` until one ends, then end the pair as a network would:
        an end of stream (FIN) is passed on and the other direction goes on (a half-closed
        connection), an error resets both sides."""
        cut, ended = pair.cut, False
        try:
            while _open(gate, cut):
                data = src.recv(65536)
                if not data:
                    ended = True
                    break
                if self._delay:
                    time.sleep(self._delay)
                # Frozen after reading: hold the chunk. Cut while held: it is lost, as in the
                # network.
                if not _open(gate, cut):
                    break
                dst.sendall(data)
        except OSError:
            pass
        if cut.is_set():
            return  # `cut` closes the sockets
        if ended:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            if pair.one_way_ended():  # both ways: a clean close
                for sock in (src, dst):
                    sock.close()
        else:
            # A side failed (reset, or gone while data still came for it): its peer's next
            # send would meet a reset from that side's kernel; here it meets the proxy's. A
            # client blocked sending (a COPY) must not wait forever on a socket nobody reads.
            pair.cut.set()
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)  # wakes the other pump (see `cut`)
                _reset(sock)


class _Pair:
    """One proxied connection: its two sockets, its two pump threads, whether it was cut (or
    reset after a failure), and how many of its two directions ended cleanly."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.cut = threading.Event()
        self.pumps: list[threading.Thread] = []
        self._ended = 0
        self._lock = threading.Lock()

    def one_way_ended(self) -> bool:
        """Count one direction's clean end; whether both have ended now."""
        with self._lock:
            self._ended += 1
            return self._ended == 2


def _open(gate: threading.Event, cut: threading.Event) -> bool:
    """Wait until ``gate`` is open (not frozen); ``False`` as soon as the pair is cut."""
    while not gate.wait(0.01):
        if cut.is_set():
            return False
    return not cut.is_set()


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dropped connection looks to the peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _default_port(scheme: str) -> int:
    return {"postgresql": 5432, "postgres": 5432, "redis": 6379}.get(scheme, 0)
