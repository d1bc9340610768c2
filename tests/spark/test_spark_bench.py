"""`streams bench spark`'s micro-batch measurement against real Spark and PostgreSQL: the empty
Python source (the floor any Python source pays) and the overhead figures with their breakdown."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_empty_python_source_gives_one_row_per_micro_batch(spark: Any, tmp_path: Path) -> None:
    from streams_spark.benchmarks.bench_empty import EmptySource

    spark.dataSource.register(EmptySource)
    seen: list[tuple[int, list[int]]] = []

    def handle(batch: Any, batch_id: int) -> None:
        seen.append((batch_id, sorted(r.value for r in batch.collect())))

    query = (
        spark.readStream.format("streams_bench_empty")
        .option("batches", "4")
        .load()
        .writeStream.foreachBatch(handle)
        .option("checkpointLocation", str(tmp_path / "empty"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert seen == [(0, [0]), (1, [1]), (2, [2]), (3, [3])]
    # Trigger.Once asks for everything (ReadAllAvailable): all rows in one micro-batch.
    again = (
        spark.readStream.format("streams_bench_empty")
        .option("batches", "3")
        .load()
        .writeStream.foreachBatch(handle)
        .option("checkpointLocation", str(tmp_path / "empty-all"))
        .trigger(once=True)
        .start()
    )
    again.awaitTermination()
    assert seen[-1][1] == [0, 1, 2]


def test_overhead_is_measured_beside_both_baselines_with_its_breakdown(
    spark: Any, streams_url: str, tmp_path: Path
) -> None:
    from streams_spark.benchmarks.spark_overhead import (
        PHASES,
        ROUNDS,
        SKIP,
        SOURCES,
        micro_batch_overhead,
    )

    from streams.bench.common import scratch_streams

    lines: list[str] = []
    batches = 5
    with scratch_streams(streams_url, "spark-test") as scratch:
        out = micro_batch_overhead(spark, scratch, streams_url, batches, tmp_path, lines.append)
    # Every one-fact micro-batch of each query but the first SKIP, in every round.
    assert out["batches"]["streams"] == ROUNDS * (batches - SKIP)
    assert out["batches"]["empty_python"] == ROUNDS * (batches - SKIP)
    assert out["batches"]["rate_micro_batch"] >= ROUNDS * (batches - SKIP)
    for name in SOURCES:
        assert set(out["phases_ms"][name]) == set(PHASES)
        assert out["phases_ms"][name]["triggerExecution"] > 0
    assert out["streams_ms"] == out["phases_ms"]["streams"]["triggerExecution"]
    assert out["ratio"] == out["streams_ms"] / out["rate_micro_batch_ms"]
    assert out["ratio_vs_empty_python"] == out["streams_ms"] / out["empty_python_ms"]
    calls = out["source_calls_ms"]
    assert set(calls) == {"latestOffset", "partitions", "read", "commit"}
    assert all(math.isfinite(v) and v >= 0 for v in calls.values())
    assert lines[0].startswith("micro-batch overhead: streams ")
    assert any("where a micro-batch goes" in line for line in lines)
