"""The ``redis topology`` check of `streams doctor`: what the Redis URL leads to, and what is
degraded.

* a single server: its role (a replica is named as such: PUBLISH there reaches only its own
  subscribers);
* Sentinel: the master the Sentinels name (and that it says ``ROLE`` master), how many
  Sentinels answer against the quorum, how many replicas are healthy; **degraded** when fewer
  Sentinels answer than the quorum (no failover possible), no replica is healthy (nothing to
  fail over to), or the master is down;
* Cluster: the masters and the slots they cover; **degraded** when a slot of the 16384 has no
  master (a stream hashed there has no fast path) or a node is marked failed or does not
  answer.

Returns ``(ok, detail)``; the doctor turns it into its check line.
"""

from __future__ import annotations

from typing import Any

import redis

from ..config import redact_url
from ..redis_urls import parse_redis_url
from ..transport.discovery import SLOTS, ClusterMap, master_address

__all__ = ["redis_topology"]

_ERRORS = (redis.RedisError, OSError)
_TIMEOUT = 2.0


def redis_topology(url: str) -> tuple[bool, str]:
    """``(ok, what was seen)`` for the Redis ``url`` (see the module docstring)."""
    topology = parse_redis_url(url)
    try:
        if topology.follows_master:
            return _sentinel(topology)
        if topology.sharded:
            return _cluster(topology)
        return _single(url)
    except Exception as exc:  # only the class name: a parser's message may quote the password
        return False, f"{redact_url(url)}: {type(exc).__name__}: cannot see the topology"


def _client(url: str) -> redis.Redis:
    """A client of one server (its URL carries the credentials and TLS options)."""
    return redis.Redis.from_url(url, socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT)


def _call(client: redis.Redis, *args: Any) -> Any:
    try:
        return client.execute_command(*args)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _single(url: str) -> tuple[bool, str]:
    role = _call(redis.Redis.from_url(url, socket_timeout=_TIMEOUT), "ROLE")
    kind = _text(role[0])
    if kind == "master":
        return True, f"single server (master, {len(role[2])} replica(s) attached)"
    return True, f"single server ({kind}: PUBLISH there reaches only its own subscribers)"


def _sentinel(topology: Any) -> tuple[bool, str]:
    answering, quorum, replicas, flags = 0, 0, 0, ""
    for host, port in topology.nodes:
        try:
            url = topology.sentinel_url(host, port)
            master = _call(_client(url), "SENTINEL", "MASTER", topology.service)
            found = _call(_client(url), "SENTINEL", "REPLICAS", topology.service)
        except _ERRORS:
            continue
        fields = _pairs(master)
        answering += 1
        quorum = max(quorum, int(fields.get("quorum", 0)))
        flags = _text(fields.get("flags", ""))
        healthy = [
            r for r in found if not {"s_down", "o_down", "disconnected"} & set(_flags(_pairs(r)))
        ]
        replicas = max(replicas, len(healthy))
    if not answering:
        return False, f"Sentinel: none of {len(topology.nodes)} Sentinel(s) answers"
    host, port = master_address(topology)
    problems = []
    try:
        role = _text(_call(_client(topology.node_url(host, port)), "ROLE")[0])
    except _ERRORS as exc:
        role = f"unreachable ({type(exc).__name__})"
    if role != "master":
        problems.append(f"the master is {role}")
    if "down" in flags:
        problems.append(f"the Sentinels flag the master {flags}")
    if answering < quorum:
        problems.append(f"fewer Sentinels answer than the quorum {quorum}: no failover possible")
    if replicas == 0:
        problems.append("no healthy replica: nothing to fail over to")
    detail = (
        f"Sentinel {topology.service!r}: master {host}:{port} ({role}); "
        f"{answering}/{len(topology.nodes)} Sentinel(s) answer (quorum {quorum}); "
        f"{replicas} healthy replica(s)"
    )
    if problems:
        return False, f"{detail}; degraded: {'; '.join(problems)}"
    return True, detail


def _cluster(topology: Any) -> tuple[bool, str]:
    slots = ClusterMap(topology)
    slots.refresh()
    covered = slots.covered()
    failed, silent = [], []
    for host, port in slots.masters:
        try:
            _call(_client(topology.node_url(host, port, db=0)), "PING")
        except _ERRORS:
            silent.append(f"{host}:{port}")
    host, port = slots.any_node()
    nodes = _text(_call(_client(topology.node_url(host, port, db=0)), "CLUSTER", "NODES"))
    for line in nodes.splitlines():
        words = line.split()
        if len(words) > 2 and "fail" in words[2].split(","):
            failed.append(words[1].split("@")[0])
    detail = (
        f"Cluster: {len(slots.masters)} master(s) "
        f"({', '.join(f'{h}:{p}' for h, p in slots.masters)}); {covered}/{SLOTS} slots covered"
    )
    problems = []
    if covered < SLOTS:
        problems.append(f"{SLOTS - covered} slot(s) have no master")
    if failed:
        problems.append(f"node(s) marked failed: {', '.join(failed)}")
    if silent:
        problems.append(f"node(s) not answering: {', '.join(silent)}")
    if problems:
        return False, f"{detail}; degraded: {'; '.join(problems)}"
    return True, detail


def _pairs(flat: Any) -> dict[str, Any]:
    if isinstance(flat, dict):
        return {_text(k): v for k, v in flat.items()}
    return {_text(k): v for k, v in zip(flat[::2], flat[1::2], strict=False)}


def _flags(fields: dict[str, Any]) -> list[str]:
    return _text(fields.get("flags", "")).split(",")
