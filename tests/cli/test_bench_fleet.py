"""`streams bench fleet`: its points, its figures and its targets (CliRunner, real servers)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from streams.bench.fleet import _targets, bench_fleet_command, parse_points


def test_points_parse_and_refuse() -> None:
    assert parse_points("1x0, 32x32") == [(1, 0), (32, 32)]
    for bad in ("1", "0x1", "x1", "1x", "1x-1", "1y2", "300x1"):
        with pytest.raises(ValueError):
            parse_points(bad)


def _point(cpu: float, stmts: float, p99: float, flat: float) -> dict[str, float]:
    return {"cpu_us_per_fact": cpu, "statements_per_fact": stmts, "p99_ms": p99,
            "appends_per_s": flat}  # fmt: skip


def test_targets_are_ratios_of_the_same_run() -> None:
    points = {
        (32, 0): {"system": _point(100, 1.0, 0, 1000)},
        (32, 1): {"system": _point(100, 2.0, 2, 900)},
        (32, 32): {"system": _point(300, 2.9, 9, 500), "raw": _point(150, 1.0, 2, 0)},
    }
    targets = _targets(points)
    assert {k: round(v["value"], 2) for k, v in targets.items()} == {
        "cpu_32x32_vs_raw": 2.0, "p99_32x32_vs_raw": 4.5,
        "writers_k32_vs_k0": 0.5, "statements_k32_vs_k1": 1.45,
    }  # fmt: skip
    assert all(t["met"] for t in targets.values())
    points[(32, 32)]["system"]["cpu_us_per_fact"] = 301
    assert not _targets(points)["cpu_32x32_vs_raw"]["met"]
    assert _targets({}) == {}


def test_a_small_fleet_delivers_every_fact_to_every_reader(
    streams_url: str, redis_url: str
) -> None:
    args = ["--database-url", streams_url, "--redis-url", redis_url, "--seconds", "0.5"]
    out = CliRunner().invoke(
        bench_fleet_command, [*args, "--points", "2x0,2x2", "--rate", "100", "--json"]
    )
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert result["all_targets_met"] is False  # the 32-process points did not run
    by_shape = {(p["writers"], p["readers"]): p for p in result["points"]}
    assert set(by_shape) == {(2, 0), (2, 2)}
    for side in ("system", "raw"):
        point = by_shape[(2, 2)][side]
        assert point["facts"] > 0 and point["delivered"] == 2 * point["facts"]
        assert point["statements_per_fact"] >= 1 and point["p99_ms"] > 0
    assert by_shape[(2, 2)]["raw"]["statements_per_fact"] == 1.0  # one INSERT per fact
    assert by_shape[(2, 2)]["system"]["appends_per_s"] > 0
    assert "vs_k0" in by_shape[(2, 2)]["system"]
    bad = CliRunner().invoke(bench_fleet_command, [*args, "--points", "2y2"])
    assert bad.exit_code == 2 and "--points" in bad.output
