"""`streams bench fanout`: the targets it reports are ratios of the same run."""

from __future__ import annotations

from streams.bench.fanout import _targets


def test_fanout_targets_are_ratios_of_the_same_run() -> None:
    shared = {"readers": 32, "mode": "shared", "vs_k0": 0.5, "p99_vs_redis": 5.0}
    points = [
        {"readers": 32, "mode": "redis", "p99_ms": 2.0},
        {"readers": 32, "mode": "own", "vs_k0": 0.1, "p99_vs_redis": 50.0},
        shared,
    ]
    assert _targets(points, 32) == {"readers": 32, "vs_k0": 0.5, "p99_vs_redis": 5.0,
                                    "met": True}  # fmt: skip
    shared["vs_k0"] = 0.49
    assert _targets(points, 32)["met"] is False  # type: ignore[index]
    shared["vs_k0"], shared["p99_vs_redis"] = 0.9, 5.1
    assert _targets(points, 32)["met"] is False  # type: ignore[index]
    assert _targets(points, 8) is None  # not run
    assert _targets([{"readers": 32, "mode": "shared", "error": "max_connections"}], 32) is None
