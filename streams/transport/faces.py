"""What the shells need of a process's Redis link, and the handle a writer announces through.

`Link` is what writers and readers (`streams.writer`, `streams.reader`) use of a link;
`RedisLink` and `AsyncRedisLink` both satisfy it (mypy checks it structurally wherever a client
hands one to a shell). `ProverLink` adds what the prover (`streams.proofs`) uses of a
`RedisLink`. `LinkListener` is what a link tells a reader (or the prover) in return.

Who owns a writer's `Announcer`
-------------------------------
The link. `Link.attach_writer` creates the announcer of one local writer (at the writer's
position), registers it with the link's `LinkCore`, which answers ``REPLICATE`` and every
reconnect with its ``POSITION``, and hands the writer an `AttachedWriter`. The writer only
*reports* to that handle (what completed, and each heartbeat) and detaches it when it closes;
it never sees the announcer, and nothing else feeds it. (`RedisLink.add_writer` still registers
an announcer that its caller makes and feeds: the tests stand in for writers so.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from ..core.protocol import Command
from ..core.replication import Announcer, Hint

__all__ = ["AttachedWriter", "Link", "LinkListener", "ProverLink"]


class LinkListener(Protocol):
    """What a link tells a reader. Called on the link's thread (or event loop): be quick."""

    def on_hint(self, hint: Hint) -> None: ...
    def on_link_state(self, connected: bool) -> None: ...


class AttachedWriter:
    """A local writer's place on the link (see the module docstring): its reports become its
    `Announcer`'s Synapse commands, published best effort, without waiting for Redis.

    Thread-safe. A lock is held from computing commands to queueing them, so that threads of one
    writer can never queue them out of order (``RDATA 5`` after ``POSITION 5 6``); an asyncio
    writer never awaits in between, so it never waits for it.
    """

    __slots__ = ("_announcer", "_detach", "_lock", "_position", "_publish")

    def __init__(
        self,
        announcer: Announcer,
        position: Callable[[], int],
        publish: Callable[[Sequence[Command]], None],
        detach: Callable[[Announcer], None],
    ) -> None:
        self._announcer = announcer
        self._position = position  # the writer's per-writer position, read under the lock
        self._publish = publish
        self._detach = detach
        self._lock = threading.Lock()

    def completed(self, ids: tuple[int, ...] = (), timestamp: int = 0) -> None:
        """IDs completed: ``ids`` committed (one append or fact; ``timestamp``: the last one's),
        or none (gaps, a failure): publish what the position moved by."""
        announcer = self._announcer
        with self._lock:
            if ids:
                announcer.committed(ids, timestamp)
            self._publish(announcer.update(self._position()))

    def beat(self) -> None:
        """A scheduled heartbeat: publish what moved, or else ``POSITION p p`` (the courtesy
        answer to readers that joined in between)."""
        announcer = self._announcer
        with self._lock:
            self._publish(announcer.update(self._position()) or [announcer.announce()])

    def detach(self) -> None:
        """The writer closed: the link forgets its announcer."""
        self._detach(self._announcer)


class Link(Protocol):
    """What writers and readers need of the process's Redis link."""

    @property
    def connected(self) -> bool:
        """Live: subscribed, and the channel is not another deployment's."""
        ...

    def add_listener(
        self, listener: LinkListener, streams: Collection[str] = (), *, writers: bool = True
    ) -> None: ...

    def remove_listener(
        self, listener: LinkListener, streams: Collection[str] = (), *, writers: bool = True
    ) -> None: ...

    def watch(self, streams: Collection[str], *, writers: bool) -> None: ...

    def unwatch(self, streams: Collection[str], *, writers: bool) -> None: ...

    def attach_writer(
        self, stream: str, instance: str, position: Callable[[], int]
    ) -> AttachedWriter: ...


class ProverLink(Link, Protocol):
    """What the prover (`streams.proofs.ProofService`) needs of a (threaded) link besides."""

    @property
    def prefix(self) -> str: ...

    def publish(self, commands: Sequence[Command]) -> None: ...

    def subscribers(self, channels: Sequence[str]) -> dict[str, int] | None: ...
