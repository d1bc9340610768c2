"""`streams bench spark`'s pure parts: the phases of micro-batches, their report, the JDBC
driver jar and what the run says without it, the executors' one garbage-collector freeze."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import pytest
from streams_spark.benchmarks import spark as bench
from streams_spark.benchmarks.spark_overhead import (
    PHASES,
    batch_phases,
    overhead_lines,
    phase_medians,
)


def _progress(rows: int, total: float, **phases: float) -> dict[str, Any]:
    return {"numInputRows": rows, "durationMs": {"triggerExecution": total, **phases}}


def test_phases_count_batches_with_rows_after_the_first_ones() -> None:
    progress = [
        _progress(1, 900.0),  # workers starting: left out
        _progress(1, 800.0),
        _progress(1, 100.0, addBatch=60.0, walCommit=20.0),
        _progress(0, 5.0),  # no data: not a micro-batch of the measurement
        _progress(1, 120.0, addBatch=70.0, walCommit=30.0),
        _progress(1, 140.0, addBatch=80.0),
    ]
    batches = batch_phases(progress)
    assert [b["triggerExecution"] for b in batches] == [100.0, 120.0, 140.0]
    assert [b["latestOffset"] for b in batches] == [0.0, 0.0, 0.0]  # not timed: 0
    medians = phase_medians(batches)
    assert set(medians) == set(PHASES)
    assert medians["triggerExecution"] == 120.0
    assert medians["addBatch"] == 70.0
    assert medians["walCommit"] == 20.0  # 20, 30 and a missing (0) one
    assert all(math.isnan(v) for v in phase_medians([]).values())


def test_the_report_shows_each_phase_and_where_the_time_goes() -> None:
    def phases(total: float, add: float, wal: float, commit: float) -> dict[str, float]:
        return {
            "latestOffset": 1.0,
            "walCommit": wal,
            "queryPlanning": 4.0,
            "addBatch": add,
            "commitOffsets": commit,
            "triggerExecution": total,
        }

    figures = {
        "streams_ms": 150.0,
        "empty_python_ms": 140.0,
        "rate_micro_batch_ms": 80.0,
        "ratio": 150 / 80,
        "ratio_vs_empty_python": 150 / 140,
        "empty_python_vs_rate": 140 / 80,
        "phases_ms": {
            "streams": phases(150.0, 75.0, 35.0, 30.0),
            "empty_python": phases(140.0, 70.0, 30.0, 30.0),
            "rate_micro_batch": phases(80.0, 15.0, 28.0, 27.0),
        },
        "source_calls_ms": {"latestOffset": 0.5, "partitions": 0.1, "read": 2.5, "commit": 0.6},
    }
    text = "\n".join(overhead_lines(figures))
    assert "1.88x the built-in source" in text
    assert "1.07x the empty Python source (target <= 1.1x)" in text
    assert "  addBatch               75.0          70.0              15.0" in text
    assert "  total                 150.0         140.0              80.0" in text
    assert "checkpoint logs (walCommit + commitOffsets of rate-micro-batch): 55 ms" in text
    assert "(empty Python - rate-micro-batch): 60 ms (addBatch, the Python task: +55 ms)" in text
    assert "own work (streams - empty Python): 10 ms" in text
    assert "executor read 2.5" in text


def test_without_a_jdbc_jar_the_run_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    message = bench.jdbc_missing()
    assert "apt-get install libpostgresql-jdbc-java" in message
    assert "gives /usr/share/java/postgresql.jar" in message
    assert "--jdbc-jar" in message and "STREAMS_JDBC_JAR" in message
    monkeypatch.delenv("STREAMS_JDBC_JAR", raising=False)
    monkeypatch.setattr(bench, "JDBC_JAR", str(tmp_path / "absent.jar"))
    assert bench.find_jdbc_jar() is None
    assert bench.find_jdbc_jar(str(tmp_path / "also-absent.jar")) is None
    jar = tmp_path / "postgresql-42.jar"
    jar.write_bytes(b"PK")
    assert bench.find_jdbc_jar(str(jar)) == str(jar)
    monkeypatch.setenv("STREAMS_JDBC_JAR", str(jar))
    assert bench.find_jdbc_jar() == str(jar)


def test_executors_freeze_the_imports_once_per_worker_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark's worker collects garbage after every task: `freeze_imports` takes what the imports
    made out of that collection, once, and only in a task (never in a driver or a test)."""
    import pyspark
    from streams_spark import executor

    monkeypatch.setattr(executor, "_frozen", False)
    assert executor.freeze_imports() is False  # no task here: nothing frozen
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(pyspark.TaskContext, "get", classmethod(lambda cls: object()))
    try:
        assert executor.freeze_imports() is True
        assert gc.get_freeze_count() > 10_000  # the modules of PySpark, pyarrow, streams
        assert executor.freeze_imports() is False  # once per worker
    finally:
        gc.unfreeze()
