"""A read-only look at a replication channel: who answers ``REPLICATE``, and with what.

`observe_channel` subscribes to ``<prefix>``, waits until Redis confirms the subscription,
publishes one ``REPLICATE`` (and nothing else, ever: this is safe on a Synapse deployment's
channel, whose processes simply answer with their positions) and listens until the answers stop
(`window` seconds after the last message, `cap` seconds at most). What it heard is tallied by
`ChannelTally`, which is pure (no I/O, no clocks: times are passed in) and unit-tested on its own,
and returned as a frozen `ChannelReport`, with the same foreign-deployment verdict a link would
reach (`streams.core.foreign.foreign_verdict`; the link quarantines itself on it).

Used by ``streams doctor`` (is anybody answering? is the channel another deployment's?) and
``streams positions --from-redis``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import redis

from ..core.constants import PROOF_INSTANCE_PREFIX, replication_channel
from ..core.foreign import ForeignDeployment, foreign_verdict
from ..core.protocol import (
    ForeignCommand,
    PositionCommand,
    ProtocolError,
    RdataCommand,
    ReplicateCommand,
    parse,
    serialize,
)
from ..transport.discovery import open_client
from ..transport.redis_errors import connection_error

__all__ = ["ChannelPosition", "ChannelReport", "ChannelTally", "observe_channel"]

#: Seconds to wait for Redis to confirm the subscription.
SUBSCRIBE_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class ChannelPosition:
    """The highest token heard for one (stream, instance).

    ``prev_token``/``new_token`` are those of the ``POSITION`` that set it; an ``RDATA`` with a
    higher token raises ``new_token`` and moves ``prev_token`` to the previous ``new_token``.
    ``ms``: milliseconds between the ``REPLICATE`` and the line that set it.
    """

    stream: str
    instance: str
    prev_token: int
    new_token: int
    ms: float


def _frozen(counts: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(sorted(counts.items())))


@dataclass(frozen=True, slots=True)
class ChannelReport:
    """What `observe_channel` heard.

    * ``receivers``: what ``PUBLISH REPLICATE`` returned: subscribers of the channel, this
      observer included (so ``1`` means nobody else listens);
    * ``positions``: per (stream, instance), sorted;
    * ``foreign_commands``: Synapse-only commands heard, by name; ``malformed``: malformed lines,
      by reason; ``ignored``: other lines, by command name (``REPLICATE``, including our own
      echo, ``PING``, ``ERROR``, ``SERVER``, ``NAME``, and ``RDATA`` ``batch`` rows);
    * ``foreign``: the verdict (see `streams.core.foreign.foreign_verdict`), or None;
    * ``messages``: lines heard; ``elapsed_ms``: time from ``REPLICATE`` to the end.
    """

    prefix: str
    receivers: int
    positions: tuple[ChannelPosition, ...]
    foreign_commands: Mapping[str, int]
    malformed: Mapping[str, int]
    ignored: Mapping[str, int]
    foreign: ForeignDeployment | None
    messages: int
    elapsed_ms: float

    @property
    def streams(self) -> frozenset[str]:
        """Stream names announced on the channel."""
        return frozenset(p.stream for p in self.positions)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form (for ``--json``)."""
        foreign = self.foreign
        return {
            "prefix": self.prefix,
            "receivers": self.receivers,
            "positions": [
                {
                    "stream": p.stream,
                    "instance": p.instance,
                    "prev_token": p.prev_token,
                    "new_token": p.new_token,
                    "ms": round(p.ms, 3),
                }
                for p in self.positions
            ],
            "foreign_commands": dict(self.foreign_commands),
            "malformed": dict(self.malformed),
            "ignored": dict(self.ignored),
            "foreign": None
            if foreign is None
            else {
                "reason": foreign.reason,
                "evidence": list(foreign.evidence),
                "message": foreign.describe(self.prefix),
            },
            "messages": self.messages,
            "elapsed_ms": round(self.elapsed_ms, 3),
        }


@dataclass(slots=True)
class ChannelTally:
    """Accumulates lines heard on a channel (pure: times are passed in, in ms)."""

    known_streams: Collection[str] | None = None
    positions: dict[tuple[str, str], ChannelPosition] = field(default_factory=dict)
    foreign_commands: dict[str, int] = field(default_factory=dict)
    malformed: dict[str, int] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    messages: int = 0
    first_foreign_line: str = ""

    def add(self, data: bytes | str, ms: float) -> None:
        """One line, heard ``ms`` milliseconds after the ``REPLICATE``."""
        self.messages += 1
        try:
            cmd = parse(data)
        except ProtocolError as exc:
            _bump(self.malformed, exc.reason)
            return
        match cmd:
            case PositionCommand() if cmd.instance_name.startswith(PROOF_INSTANCE_PREFIX):
                _bump(self.ignored, "POSITION (shared proof)")  # a prober, not a writer
            case PositionCommand():
                self._raise(cmd.stream_name, cmd.instance_name, cmd.prev_token, cmd.new_token, ms)
            case RdataCommand(token=int(token)):
                key = (cmd.stream_name, cmd.instance_name)
                old = self.positions.get(key)
                self._raise(*key, token if old is None else old.new_token, token, ms)
            case RdataCommand():  # a batch row: its fact's last row carries the token
                _bump(self.ignored, cmd.NAME)
            case ForeignCommand():
                _bump(self.foreign_commands, cmd.name)
                if not self.first_foreign_line:
                    self.first_foreign_line = repr(serialize(cmd)[:120])
            case _:
                _bump(self.ignored, cmd.NAME)

    def _raise(self, stream: str, instance: str, prev: int, new: int, ms: float) -> None:
        old = self.positions.get((stream, instance))
        if old is None or new > old.new_token:
            self.positions[(stream, instance)] = ChannelPosition(stream, instance, prev, new, ms)

    def verdict(self) -> ForeignDeployment | None:
        """Is the channel another deployment's? Same rules as
        `streams.core.replication.LinkCore`."""
        line = self.first_foreign_line
        if not line and self.known_streams is not None:
            unknown = sorted({s for s, _ in self.positions} - set(self.known_streams))
            line = f"POSITION/RDATA for {unknown[0]!r}" if unknown else ""
        return foreign_verdict(
            commands=self.foreign_commands,
            streams={s for s, _ in self.positions},
            known_streams=self.known_streams,
            line=line,
        )

    def report(self, prefix: str, receivers: int, elapsed_ms: float) -> ChannelReport:
        return ChannelReport(
            prefix=prefix,
            receivers=receivers,
            positions=tuple(self.positions[k] for k in sorted(self.positions)),
            foreign_commands=_frozen(self.foreign_commands),
            malformed=_frozen(self.malformed),
            ignored=_frozen(self.ignored),
            foreign=self.verdict(),
            messages=self.messages,
            elapsed_ms=elapsed_ms,
        )


def _bump(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def observe_channel(
    redis_url: str,
    prefix: str,
    *,
    window: float = 0.25,
    cap: float = 2.0,
    known_streams: Collection[str] | None = None,
) -> ChannelReport:
    """Ask the channel ``<prefix>`` for positions (``REPLICATE``) and report what answers.

    Publishes nothing but one ``REPLICATE``. Listens until ``window`` seconds pass without a
    message (counted from the ``REPLICATE``), at most ``cap`` seconds. With ``known_streams``
    (the registry's names), streams announced that are not in it make the verdict foreign.
    Raises `RedisUnavailable` (what failed, where, why, what next: `streams.transport.redis_errors`)
    if Redis cannot be reached, refuses us, or does not confirm the subscription within
    `SUBSCRIBE_TIMEOUT` seconds.
    """
    failure: BaseException | None = None
    try:
        return _observe(redis_url, prefix, window=window, cap=cap, known_streams=known_streams)
    except (redis.RedisError, OSError) as exc:
        failure = exc
    # Raised outside the except block: redis-py's exception is not chained.
    raise connection_error(redis_url, failure, purpose="observing the channel")


def _observe(
    redis_url: str,
    prefix: str,
    *,
    window: float,
    cap: float,
    known_streams: Collection[str] | None,
) -> ChannelReport:
    channel = replication_channel(prefix)
    client = open_client(redis_url, socket_connect_timeout=5, socket_timeout=max(5.0, cap + 1))
    pubsub: Any = None
    try:
        pubsub = client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
        pubsub.subscribe(channel)
        deadline = time.monotonic() + SUBSCRIBE_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise redis.TimeoutError(f"Redis did not confirm the subscription to {prefix!r}")
            message = pubsub.get_message(timeout=left)
            if message is not None and message.get("type") == "subscribe":
                break
        start = time.monotonic()
        receivers = int(client.publish(channel, serialize(ReplicateCommand())))
        tally = ChannelTally(known_streams=known_streams)
        last = start
        while True:
            now = time.monotonic()
            until = min(start + cap, last + window)
            if now >= until:
                break
            message = pubsub.get_message(timeout=until - now)
            if message is not None and message.get("type") == "message":
                last = time.monotonic()
                tally.add(message["data"], (last - start) * 1000)
        return tally.report(prefix, receivers, (time.monotonic() - start) * 1000)
    finally:
        if pubsub is not None:
            pubsub.close()
        client.close()
