"""Smoke test of `streams bench latency` with tiny parameters: structure, not timings."""

from __future__ import annotations

import json
import math

import psycopg

from streams.bench.latency import LatencyStats, run_latency_bench


def test_latency_bench_smoke(streams_url: str, redis_url: str) -> None:
    lines: list[str] = []
    result = run_latency_bench(
        streams_url,
        redis_url,
        writer_counts=(1,),
        rate=50,
        seconds=1,
        catchup_facts=(2000, 3000),
        page_size=500,
        report=lines.append,
    )

    (run,) = result.latency
    assert run.writers == 1
    for stats in (run.streams, run.raw_redis):
        assert stats.count > 0
        assert stats.lost == 0
        assert stats.p50_ms <= stats.p99_ms <= stats.max_ms
    assert run.p99_ratio > 0
    assert run.probes > 0 and run.pages > 0 and run.epochs > 0

    catchup = result.catchup
    assert catchup.facts == 2000 and catchup.page_size == 500
    assert len(catchup.raw_rounds) == len(catchup.streams_rounds) == 3
    assert catchup.raw_per_s > 0 and catchup.streams_per_s > 0 and catchup.ratio > 0

    data = json.loads(json.dumps(result.as_dict()))
    assert data["latency"][0]["streams"]["count"] == run.streams.count
    assert set(data["catchup"]["targets"]) == {"catch-up >= 1x raw"}
    assert [c["facts"] for c in data["catchups"]] == [2000, 3000]
    assert any(line.startswith("latency x1") for line in lines)
    assert any(line.startswith("catch-up 2,000 facts") for line in lines)
    assert any(line.startswith("catch-up 3,000 facts") for line in lines)

    # The bench streams are dropped afterwards.
    with psycopg.connect(streams_url) as conn:
        rows = conn.execute(
            "SELECT name FROM streams_registry WHERE name LIKE 'bench-lat-%'"
        ).fetchall()
    assert rows == []


def test_latency_stats_percentiles() -> None:
    stats = LatencyStats.from_seconds([0.004, 0.001, 0.002, 0.003, 0.005])
    assert stats.count == 5
    assert math.isclose(stats.p50_ms, 3.0)
    assert math.isclose(stats.p99_ms, 4.96)
    assert math.isclose(stats.max_ms, 5.0)
    empty = LatencyStats.from_seconds([])
    assert empty.count == 0 and math.isnan(empty.p50_ms)
