"""Smoke test of `streams bench history` with tiny parameters: structure and bookkeeping, not
timings (the figures are the benchmark's job)."""

from __future__ import annotations

import json

import psycopg

import streams
from streams.bench.history import run_history_bench


def test_history_bench_smoke(streams_url: str, redis_url: str, redis_prefix: str) -> None:
    settings = streams.Settings.resolve(streams_url, redis_url, redis_prefix)
    lines: list[str] = []
    result = run_history_bench(
        settings, facts=4000, catchup_facts=1500, append_seconds=0.2, report=lines.append
    )
    assert result.facts == 4000 and result.catchup_facts == 1500
    assert result.payload_bytes > 150 and result.bytes_per_fact > result.payload_bytes
    assert result.appends_long_per_s > 0 and result.appends_empty_per_s > 0
    assert 0 < result.position_before_time_ms < result.start_by_time_ms
    assert result.catchup_per_s > 0 and result.catchup_raw_per_s > 0
    prune = result.prune
    # The loaded facts are 1 ms apart: the half before the middle (give or take the time the
    # bench took before pruning) is older than the retention it sets.
    assert 900 < prune.rows <= 1100 and prune.transactions >= 1, lines
    assert len(prune.sizes_after_cycles) == 3
    assert prune.append_p50_before_ms > 0 and prune.size_before > 0
    data = json.loads(json.dumps(result.as_dict()))
    assert set(data["targets"]) == set(result.targets())
    assert any(line.startswith("prune:") for line in lines)
    # Both streams are gone afterwards.
    with psycopg.connect(streams_url) as conn:
        left = conn.execute(
            "SELECT count(*) FROM streams_registry WHERE name LIKE 'bench-history-%'"
        ).fetchone()
    assert left == (0,)
