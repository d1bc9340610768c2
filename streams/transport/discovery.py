"""Where a Redis URL leads: the current master of a Sentinel set, the shards of a Cluster.

`streams.redis_urls` parses the URL (pure); this module asks the servers:

* **Sentinel**: `master_url` asks the Sentinels, in the URL's order, for the address of the
  service's master (``SENTINEL GET-MASTER-ADDR-BY-NAME``) and returns a plain ``redis://`` URL
  of it; `check_master` then checks, on the connection just opened, that the server is a master
  (``ROLE``): a Sentinel that has not noticed a failover yet, or a demoted master, is refused
  (`NotMaster`, a ``redis.ConnectionError``: the link backs off and asks again). Every
  connection the library opens goes through this at each (re)connect.
* **Cluster**: `ClusterMap` reads the slot map (``CLUSTER SHARDS``) from any node that answers,
  and says which master owns a channel's slot (``CRC16(channel) mod 16384``, redis-py's
  `key_slot`). `streams.transport.cluster` uses it.
* `open_client`: a redis-py client on the right server for one-off commands (the doctor, the
  channel observer, `publish_now`, benchmarks): a single server, the Sentinel master, or a
  cluster node that answers (ordinary ``PUBLISH``/``SUBSCRIBE`` reach every node of a cluster).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import redis
from redis.crc import key_slot

from ..redis_urls import RedisTopology, parse_redis_url

__all__ = [
    "SLOTS",
    "ClusterMap",
    "NotMaster",
    "check_master",
    "master_address",
    "master_url",
    "open_client",
    "resolve_url",
    "topology_of",
]

log = logging.getLogger("streams.redis")

#: Hash slots of a Redis Cluster.
SLOTS = 16384
#: Seconds a question to one Sentinel or cluster node may take.
QUERY_TIMEOUT = 1.0


class NotMaster(redis.ConnectionError):
    """The server reached is not the master (yet, or any more)."""


def topology_of(url: str) -> RedisTopology:
    return parse_redis_url(url)


def _node_client(topology: RedisTopology, host: str, port: int, *, sentinel: bool) -> redis.Redis:
    if sentinel:
        return redis.Redis.from_url(
            topology.sentinel_url(host, port),
            socket_timeout=QUERY_TIMEOUT,
            socket_connect_timeout=QUERY_TIMEOUT,
        )
    return redis.Redis.from_url(
        topology.node_url(host, port),
        socket_timeout=QUERY_TIMEOUT,
        socket_connect_timeout=QUERY_TIMEOUT,
    )


def master_address(topology: RedisTopology) -> tuple[str, int]:
    """The master's ``(host, port)`` as the first Sentinel that knows says; raises
    ``redis.ConnectionError`` if none answers or none knows the service."""
    assert topology.follows_master and topology.service is not None
    reasons = []
    for host, port in topology.nodes:
        client = _node_client(topology, host, port, sentinel=True)
        try:
            reply: Any = client.execute_command(  # type: ignore[no-untyped-call]
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", topology.service
            )
        except (redis.RedisError, OSError) as exc:
            reasons.append(f"{host}:{port}: {type(exc).__name__}")
            continue
        finally:
            client.close()
        if reply:
            master_host, master_port = reply
            return _text(master_host), int(master_port)
        reasons.append(f"{host}:{port}: unknown service")
    raise redis.ConnectionError(
        f"no Sentinel gave the master of {topology.service!r} ({'; '.join(reasons)})"
    )


def master_url(topology: RedisTopology) -> str:
    """A plain ``redis://`` URL of the Sentinel set's current master (`master_address`)."""
    host, port = master_address(topology)
    return topology.node_url(host, port)


def resolve_url(url: str) -> str:
    """The URL to connect to now: a Sentinel URL's current master, a cluster URL's first node
    that answers; any other URL as it is (no I/O)."""
    topology = parse_redis_url(url)
    if topology.follows_master:
        return master_url(topology)
    if topology.sharded:
        host, port = ClusterMap(topology).any_node()
        return topology.node_url(host, port)
    return url


def check_master(conn: Any) -> None:
    """On a redis-py connection just opened: raise `NotMaster` unless ``ROLE`` says master."""
    conn.send_command("ROLE", check_health=False)
    reply: Any = conn.read_response()
    role = _text(reply[0]) if isinstance(reply, list) and reply else repr(reply)
    if role != "master":
        raise NotMaster(f"the server Sentinel named is a {role}, not the master")


def open_client(url: str, **options: Any) -> redis.Redis:
    """A redis-py client on the server to use now (see the module docstring); a Sentinel
    master is checked with ``ROLE`` first."""
    target = resolve_url(url)
    client = redis.Redis.from_url(target, **options)
    if parse_redis_url(url).follows_master:
        try:
            role: Any = client.execute_command(  # type: ignore[no-untyped-call]
                "ROLE"
            )
            if _text(role[0]) != "master":
                raise NotMaster(f"the server Sentinel named is a {_text(role[0])}, not the master")
        except BaseException:
            client.close()
            raise
    return client


class ClusterMap:
    """The slot map of a Redis Cluster: which master owns which slot (thread-safe).

    Read with ``CLUSTER SHARDS`` (Redis 7) from the seed nodes or any node seen since;
    `refresh` again after a ``MOVED``, a ``sunsubscribe`` pushed by a server (its slot moved or
    it failed over) or a lost node.
    """

    def __init__(self, topology: RedisTopology) -> None:
        assert topology.sharded
        self.topology = topology
        self._lock = threading.Lock()
        self._owners: list[tuple[str, int] | None] = [None] * SLOTS
        self._known: list[tuple[str, int]] = list(topology.nodes)
        self.masters: list[tuple[str, int]] = []
        #: Bumped by every `refresh`.
        self.version = 0
        #: Masters that owned a slot before the last `refresh` and no longer own it (a
        #: resharding, a failover): lines published there on the previous map may be lost.
        self.moved_from: frozenset[tuple[str, int]] = frozenset()
        #: Whether every slot had an online master at the last `refresh` (a node that just
        #: came back may still be marked failed by the one asked: the map is read again soon).
        self.complete = False

    def any_node(self) -> tuple[str, int]:
        """A node that answers ``PING`` (the seeds first)."""
        for host, port in self._candidates():
            client = _node_client(self.topology, host, port, sentinel=False)
            try:
                client.ping()
                return host, port
            except (redis.RedisError, OSError):
                continue
            finally:
                client.close()
        raise redis.ConnectionError("no node of the cluster answers")

    def _candidates(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(dict.fromkeys([*self.masters, *self._known]))

    def refresh(self) -> None:
        """Read the slot map again; raises ``redis.ConnectionError`` if no node answers."""
        reasons = []
        for host, port in self._candidates():
            client = _node_client(self.topology, host, port, sentinel=False)
            try:
                shards: Any = client.execute_command(  # type: ignore[no-untyped-call]
                    "CLUSTER", "SHARDS"
                )
            except (redis.RedisError, OSError) as exc:
                reasons.append(f"{host}:{port}: {type(exc).__name__}")
                continue
            finally:
                client.close()
            self._apply(shards, host)
            return
        raise redis.ConnectionError(f"cannot read the cluster's slot map ({'; '.join(reasons)})")

    def _apply(self, shards: Iterable[Any], asked: str) -> None:
        owners: list[tuple[str, int] | None] = [None] * SLOTS
        masters = []
        for shard in shards:
            info = _pairs(shard)
            master = None
            for node in info.get("nodes", []):
                fields = _pairs(node)
                if (
                    _text(fields.get("role", b"")) == "master"
                    and _text(fields.get("health", b"online")) == "online"
                ):
                    ip = _text(fields.get("ip") or fields.get("endpoint") or asked)
                    # Over TLS a node listens on its ``tls-port`` (``port`` may be absent).
                    port = fields.get("tls-port") if self.topology.tls else None
                    port = port or fields["port"]
                    master = (ip if ip not in ("", "?") else asked, int(port))
            if master is None:
                continue
            masters.append(master)
            ranges = list(info.get("slots", []))
            for start, end in zip(ranges[::2], ranges[1::2], strict=True):
                for slot in range(int(start), int(end) + 1):
                    owners[slot] = master
        with self._lock:
            old = self._owners
            self.moved_from = frozenset(
                was for was, now in zip(old, owners, strict=True) if was is not None and was != now
            )
            self._owners = owners
            self.complete = None not in owners
            self.masters = masters
            self._known = list(dict.fromkeys([*self._known, *masters]))
            self.version += 1

    def owner(self, channel: str) -> tuple[str, int] | None:
        """The master that owns ``channel``'s slot (None: uncovered, or not read yet)."""
        return self._owners[key_slot(channel.encode())]

    def covered(self) -> int:
        """How many slots a master owns."""
        return sum(1 for owner in self._owners if owner is not None)


def _pairs(flat: Any) -> dict[str, Any]:
    """``[k1, v1, k2, v2, ...]`` (RESP2 maps) as a dict with text keys."""
    if isinstance(flat, dict):
        return {_text(k): v for k, v in flat.items()}
    return {_text(k): v for k, v in zip(flat[::2], flat[1::2], strict=False)}


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
