"""The micro-batch part of `streams bench spark`: what a micro-batch costs the ``streams`` source
beside Spark's built-in ``rate-micro-batch`` and an empty Python data source, and where it goes.

Terms: a *micro-batch* here carries one row. Spark times the *phases* of each one (its progress'
``durationMs``): ``latestOffset`` (asking the source how far to read; for a Python source a call
to its planner process), ``walCommit`` (the offset log written to the checkpoint, then the
previous batch's ``commit`` to the source), ``queryPlanning``, ``addBatch`` (the batch run:
``partitions`` from the planner process and one task, which for a Python source runs in a Python
worker), ``commitOffsets`` (the commit log written) and ``triggerExecution`` (all of it). The
*overhead* is the median ``triggerExecution``.

* **sources**, in rounds that alternate: the ``streams`` source with ``maxFactsPerTrigger=1``
  over a new stream of ``batches`` facts (``trigger(availableNow=True)``); the empty Python source
  (`streams_spark.benchmarks.bench_empty`: no I/O at all, the floor any Python source pays) with
  as many one-row batches and the same trigger; ``rate-micro-batch`` (``rowsPerBatch=1``,
  ``processingTime="0 seconds"``), stopped after as many batches. Medians over every batch with
  a row, but the first two of each query (Python workers start there).
* **the source's own calls**: ``latestOffset``, ``partitions`` and ``commit`` of the driver and an
  executor's read of one fact (its probe, rows and retention check), timed in this process over
  a stream of ``batches`` facts read one fact per batch: what of the phases above is the source's
  own work.

Targets (issue 20): overhead <= 1.5x ``rate-micro-batch``; where a Python source cannot reach that
(the empty one shows whether it can), <= 1.1x the empty Python source.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import streams
from streams.bench.common import Scratch

from ..options import parse_options
from ..source import StreamsStreamReader

__all__ = ["PHASES", "ROUNDS", "SOURCES", "batch_phases", "micro_batch_overhead", "phase_medians"]

#: Spark's phases of a micro-batch, in the order they run (see the module doc).
PHASES = ("latestOffset", "walCommit", "queryPlanning", "addBatch", "commitOffsets",
          "triggerExecution")  # fmt: skip
#: The sources measured, as named in the results.
SOURCES = ("streams", "empty_python", "rate_micro_batch")
#: Rounds of the three sources (each round: one query of each).
ROUNDS = 2
#: Batches at the start of each query left out (Python workers start, code is compiled).
SKIP = 2


def batch_phases(progress: Sequence[Mapping[str, Any]], skip: int = SKIP) -> list[dict[str, float]]:
    """The phases (ms) of every micro-batch in ``progress`` (a query's ``recentProgress``) that
    read a row, but the first ``skip`` progress reports."""
    out = []
    for report in progress[skip:]:
        durations = report.get("durationMs", {})
        if report.get("numInputRows", 0) > 0 and "triggerExecution" in durations:
            out.append({phase: float(durations.get(phase, 0.0)) for phase in PHASES})
    return out


def phase_medians(batches: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The median of each phase over ``batches`` (NaN when there are none)."""
    return {
        phase: statistics.median(b[phase] for b in batches) if batches else math.nan
        for phase in PHASES
    }


def _append(url: str, stream: str, facts: int) -> None:
    with streams.connect(url) as client, client.writer(stream, instance="bench-overhead") as w:
        w.append_batch([{"i": i} for i in range(facts)])


#: What Spark says when the Python worker of a query's source died before it said hello (seen
#: once in CI on two loaded cores, before the query's first batch): not the source's doing.
_WORKER_LOST = "Python worker failed to connect back"


def _available_now(frame: Any, checkpoint: Path, attempts: int = 3) -> list[dict[str, Any]]:
    """Run ``frame`` into the ``noop`` sink until it has read what was there; its progress.
    A query whose source's Python worker never started is started again on its checkpoint
    (it had done nothing yet), at most ``attempts`` times in all."""
    for attempt in range(1, attempts + 1):
        query = (
            frame.writeStream.format("noop")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination()
        except Exception as exc:
            if _WORKER_LOST not in str(exc) or attempt == attempts or query.recentProgress:
                raise
            continue
        return list(query.recentProgress)
    raise AssertionError("unreachable")


def _streams_query(spark: Any, url: str, stream: str, checkpoint: Path) -> list[dict[str, Any]]:
    frame = (
        spark.readStream.format("streams")
        .option("stream", stream)
        .option("databaseUrl", url)
        .option("maxFactsPerTrigger", "1")
        .load()
    )
    return _available_now(frame, checkpoint)


def _empty_query(spark: Any, batches: int, checkpoint: Path) -> list[dict[str, Any]]:
    frame = spark.readStream.format("streams_bench_empty").option("batches", str(batches)).load()
    return _available_now(frame, checkpoint)


def _rate_query(spark: Any, batches: int, checkpoint: Path) -> list[dict[str, Any]]:
    query = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", "1")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="0 seconds")
        .start()
    )
    deadline = time.monotonic() + 120
    try:
        while len(query.recentProgress) < batches and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        query.stop()
    return list(query.recentProgress)


def source_calls(url: str, stream: str) -> dict[str, float]:
    """The ``streams`` source's own calls on micro-batches of one fact, timed in this process
    over every fact of ``stream`` (median ms): ``latestOffset``, ``partitions``, ``commit`` and
    an executor's ``read`` of the batch's partition."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    options = {"stream": stream, "databaseUrl": url, "maxFactsPerTrigger": "1"}
    reader = StreamsStreamReader(parse_options(options))
    times: dict[str, list[float]] = {"latestOffset": [], "partitions": [], "read": [], "commit": []}
    try:
        start = reader.initialOffset()
        while True:
            t0 = time.perf_counter()
            end = reader.latestOffset(start, ReadMaxRows(1))
            t1 = time.perf_counter()
            if end == start:
                break
            parts = reader.partitions(start, end)
            t2 = time.perf_counter()
            for part in parts:  # what an executor runs (`streams_spark.executor`)
                for _ in reader.read(part):
                    pass
            t3 = time.perf_counter()
            reader.commit(end)
            t4 = time.perf_counter()
            for name, (a, b) in zip(times, ((t0, t1), (t1, t2), (t2, t3), (t3, t4)), strict=True):
                times[name].append((b - a) * 1000)
            start = end
    finally:
        reader.stop()
    return {name: statistics.median(values[SKIP:] or values) for name, values in times.items()}


def micro_batch_overhead(
    spark: Any,
    scratch: Scratch,
    url: str,
    batches: int,
    work: Path,
    report: Callable[[str], None],
) -> dict[str, Any]:
    """Run the rounds (see the module doc); returns the figures, also reported line by line."""
    from .bench_empty import EmptySource

    spark.dataSource.register(EmptySource)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in SOURCES}
    for n in range(ROUNDS):
        stream = scratch.create(f"overhead{n}").name
        _append(url, stream, batches)
        progress = {
            "streams": _streams_query(spark, url, stream, work / f"overhead-streams-{n}"),
            "empty_python": _empty_query(spark, batches, work / f"overhead-empty-{n}"),
            "rate_micro_batch": _rate_query(spark, batches, work / f"overhead-rate-{n}"),
        }
        for name in SOURCES:
            samples[name] += batch_phases(progress[name])
    phases = {name: phase_medians(samples[name]) for name in SOURCES}
    calls_stream = scratch.create("calls").name
    _append(url, calls_stream, batches)
    calls = source_calls(url, calls_stream)
    total = {name: phases[name]["triggerExecution"] for name in SOURCES}
    out: dict[str, Any] = {
        "streams_ms": total["streams"],
        "empty_python_ms": total["empty_python"],
        "rate_micro_batch_ms": total["rate_micro_batch"],
        "ratio": total["streams"] / total["rate_micro_batch"],
        "ratio_vs_empty_python": total["streams"] / total["empty_python"],
        "empty_python_vs_rate": total["empty_python"] / total["rate_micro_batch"],
        "batches": {name: len(samples[name]) for name in SOURCES},
        "phases_ms": phases,
        "source_calls_ms": calls,
    }
    for line in overhead_lines(out):
        report(line)
    return out


def overhead_lines(out: Mapping[str, Any]) -> list[str]:
    """The report of `micro_batch_overhead`'s figures: the overhead, then where it goes."""
    phases, calls = out["phases_ms"], out["source_calls_ms"]
    lines = [
        f"micro-batch overhead: streams {out['streams_ms']:.0f} ms, empty Python source "
        f"{out['empty_python_ms']:.0f} ms, rate-micro-batch {out['rate_micro_batch_ms']:.0f} ms: "
        f"{out['ratio']:.2f}x the built-in source (target <= 1.5x), "
        f"{out['ratio_vs_empty_python']:.2f}x the empty Python source (target <= 1.1x); "
        f"the empty one is {out['empty_python_vs_rate']:.2f}x the built-in",
        "where a micro-batch goes (median ms; Spark's phases):",
        f"  {'phase':<18}{'streams':>9}{'empty Python':>14}{'rate-micro-batch':>18}",
    ]
    for phase in PHASES:
        label = "total" if phase == "triggerExecution" else phase
        values = [phases[name][phase] for name in SOURCES]
        lines.append(f"  {label:<18}{values[0]:>9.1f}{values[1]:>14.1f}{values[2]:>18.1f}")
    rate, empty, ours = (phases[name] for name in ("rate_micro_batch", "empty_python", "streams"))
    logs = rate["walCommit"] + rate["commitOffsets"]
    lines += [
        f"  checkpoint logs (walCommit + commitOffsets of rate-micro-batch): {logs:.0f} ms; "
        f"a Python source's planner calls and task (empty Python - rate-micro-batch): "
        f"{empty['triggerExecution'] - rate['triggerExecution']:.0f} ms (addBatch, the Python "
        f"task: {empty['addBatch'] - rate['addBatch']:+.0f} ms); "
        f"the streams source's own work (streams - empty Python): "
        f"{ours['triggerExecution'] - empty['triggerExecution']:.0f} ms",
        f"  the streams source's own calls, one fact per batch (median ms, in this process): "
        f"latestOffset {calls['latestOffset']:.1f}, partitions {calls['partitions']:.1f}, "
        f"executor read {calls['read']:.1f} (probe, rows, retention: 4 statements), "
        f"commit {calls['commit']:.1f}",
    ]
    return lines
