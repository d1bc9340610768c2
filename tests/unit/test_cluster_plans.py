"""`streams.transport.cluster`: the cluster subscriber's plans and the publisher's routing, with
no server (a fake slot map, ops recorded and answered here)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from streams.core.replication import LinkStats
from streams.plans import Plan, drive
from streams.redis_urls import parse_redis_url
from streams.transport import cluster as c
from streams.transport.discovery import ClusterMap

A, B = ("10.0.0.1", 7000), ("10.0.0.2", 7000)
CONTROL = "p"


def _shards(*owners: tuple[tuple[str, int], int, int]) -> list[dict[str, Any]]:
    return [
        {"slots": [lo, hi], "nodes": [{"ip": h, "port": p, "role": "master", "health": "online"}]}
        for (h, p), lo, hi in owners
    ]


def _map(split: int = 8192) -> ClusterMap:
    slots = ClusterMap(parse_redis_url("redis+cluster://10.0.0.1:7000"))
    slots._apply(_shards((A, 0, split - 1), (B, split, 16383)), "10.0.0.1")
    return slots


def _channel(slots: ClusterMap, node: tuple[str, int]) -> str:
    return next(f"p:data:s{i}" for i in range(1000) if slots.owner(f"p:data:s{i}") == node)


class Driver:
    """The plans' `Connections`, faked: records each step, answers ``wait_any`` with
    ``received``, fails ``failing``; plans run on it with the kernel's own `drive`."""

    def __init__(self, slots: ClusterMap) -> None:
        self.slots = slots
        self.ops: list[Any] = []
        self.received: list[Any] = []
        self.failing: set[tuple[str, int]] = set()
        self.next_map: list[dict[str, Any]] | None = None
        slots.refresh = self.refresh  # type: ignore[method-assign]

    def run(self, plan: Plan[Any]) -> Any:
        return drive(plan)

    def control_send(self, *args: str) -> None:
        self.ops.append(_control_send(args))

    def shard_send(self, node: tuple[str, int], *args: str) -> None:
        self.ops.append(_shard_send(node, args))
        if node in self.failing:
            raise redis.ConnectionError("refused")

    def drop_shard(self, node: tuple[str, int]) -> None:
        self.ops.append(_drop_shard(node))

    def refresh(self) -> None:
        self.ops.append(_REFRESH_MAP)
        if self.next_map is not None:
            self.slots._apply(self.next_map, "10.0.0.1")

    def wait_any(self, timeout: float) -> Any:
        self.ops.append(_wait(timeout))
        received, self.received = self.received, []
        return received


def _control_send(args: tuple[str, ...]) -> tuple[Any, ...]:
    return ("control_send", args)


def _shard_send(node: tuple[str, int], args: tuple[str, ...]) -> tuple[Any, ...]:
    return ("shard_send", node, args)


def _drop_shard(node: tuple[str, int]) -> tuple[Any, ...]:
    return ("drop_shard", node)


def _wait(timeout: float) -> tuple[Any, ...]:
    return ("wait_any", timeout)


_REFRESH_MAP = ("refresh_map",)


def _sharded(channel: str) -> bool:
    return channel.startswith("p:data:")


def test_subscribe_routes_control_and_sharded_channels() -> None:
    slots = _map()
    a, b = _channel(slots, A), _channel(slots, B)
    driver = Driver(slots)
    plans = c.ClusterPlans(slots, CONTROL, _sharded, driver)
    driver.run(plans.send_plan("SUBSCRIBE", [CONTROL, a, b]))
    assert set(driver.ops) == {
        _control_send(("SUBSCRIBE", CONTROL)),
        _shard_send(A, ("SSUBSCRIBE", a)),
        _shard_send(B, ("SSUBSCRIBE", b)),
    }
    driver.ops.clear()
    driver.received = [(A, (b"smessage", a.encode(), b"RDATA x")), (None, (b"pong", b"", b""))]
    assert driver.run(plans.receive_plan(0.5)) == (b"message", a.encode(), b"RDATA x")
    assert driver.run(plans.receive_plan(0.5)) == (b"pong", b"", b"")
    driver.run(plans.send_plan("UNSUBSCRIBE", [b]))
    assert _shard_send(B, ("SUNSUBSCRIBE", b)) in driver.ops


def test_a_pushed_sunsubscribe_resubscribes_and_reports_the_connect_step() -> None:
    slots = _map()
    a = _channel(slots, A)
    driver = Driver(slots)
    plans = c.ClusterPlans(slots, CONTROL, _sharded, driver)
    driver.run(plans.send_plan("SUBSCRIBE", [a]))
    driver.received = [(A, (b"sunsubscribe", a.encode(), 0))]  # its slot moved to B
    driver.next_map = _shards((B, 0, 16383))
    assert driver.run(plans.receive_plan(0.5)) is None
    driver.ops.clear()
    assert driver.run(plans.receive_plan(0.5)) is None  # retried at once: read the map, B
    assert driver.ops[:2] == [_REFRESH_MAP, _shard_send(B, ("SSUBSCRIBE", a))]
    driver.received = [(B, (b"ssubscribe", a.encode(), 1))]
    assert driver.run(plans.receive_plan(0.5)) == (b"subscribe", CONTROL.encode(), 1)


def test_a_failed_shard_costs_only_its_channels_and_the_control_one_fails_the_link() -> None:
    slots = _map()
    a, b = _channel(slots, A), _channel(slots, B)
    driver = Driver(slots)
    plans = c.ClusterPlans(slots, CONTROL, _sharded, driver)
    driver.failing = {A}
    driver.run(plans.send_plan("SUBSCRIBE", [a, b]))
    assert _drop_shard(A) in driver.ops and _shard_send(B, ("SSUBSCRIBE", b)) in driver.ops
    driver.failing.clear()
    driver.ops.clear()
    driver.run(plans.receive_plan(0.5))
    assert _shard_send(A, ("SSUBSCRIBE", a)) in driver.ops
    driver.received = [(B, redis.ConnectionError("gone"))]
    driver.ops.clear()
    driver.run(plans.receive_plan(0.5))
    assert driver.ops[-1] == _drop_shard(B)
    driver.received = [(None, redis.ConnectionError("gone"))]
    with pytest.raises(redis.ConnectionError):
        driver.run(plans.receive_plan(0.5))


def test_replicate_and_a_moved_slot_read_the_map_and_move_the_channel() -> None:
    slots = _map()
    a = _channel(slots, A)
    driver = Driver(slots)
    plans = c.ClusterPlans(slots, CONTROL, _sharded, driver)
    driver.run(plans.send_plan("SUBSCRIBE", [a]))
    driver.received = [(None, (b"message", CONTROL.encode(), b"REPLICATE"))]
    assert driver.run(plans.receive_plan(0.5)) == (b"message", CONTROL.encode(), b"REPLICATE")
    driver.next_map = _shards((B, 0, 16383))  # moved, no sunsubscribe seen
    driver.ops.clear()
    driver.run(plans.receive_plan(0.5))
    assert driver.ops[:4] == [
        _REFRESH_MAP,
        _shard_send(A, ("SUNSUBSCRIBE", a)),
        _shard_send(B, ("SSUBSCRIBE", a)),
        _wait(0.5),
    ]


def test_routing_listener_counts_and_stale_lines() -> None:
    slots = _map()
    a, b = _channel(slots, A), _channel(slots, B)
    groups = c.route(slots, _sharded, [(a, b"1"), (CONTROL, b"2"), (b, b"3"), (a, b"4")])
    assert groups == {
        (A, "SPUBLISH"): [(a, b"1"), (a, b"4")],
        (A, "PUBLISH"): [(CONTROL, b"2")],
        (B, "SPUBLISH"): [(b, b"3")],
    }
    asked = c.numsub_groups(slots, _sharded, [a, CONTROL])
    assert asked == {(A, "SHARDNUMSUB"): [a], (A, "NUMSUB"): [CONTROL], (B, "NUMSUB"): [CONTROL]}
    assert c.sum_counts([{a: 1, CONTROL: 2}, {CONTROL: 3}]) == {a: 1, CONTROL: 5}
    assert c.sum_counts([]) is None
    stats = LinkStats()
    stale = c.StaleCounter(slots, stats)
    stale.sent(A, "SPUBLISH", 5)
    stale.sent(B, "SPUBLISH", 2)
    stale.sent(A, "PUBLISH", 9)  # control lines: every node relays them
    slots._apply(_shards((A, 0, 99), (B, 100, 16383)), "10.0.0.1")  # A lost slots
    assert slots.moved_from == {A}
    stale.sent(B, "SPUBLISH", 1)
    assert stats.stale_map == 5
