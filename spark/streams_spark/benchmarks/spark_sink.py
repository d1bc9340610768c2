"""The sink part of `streams bench spark`: rows/s written through the Spark sink beside
``append_batch`` from plain Python processes, the same rows with the same parallelism.

* **sink**: ``spark.range(rows)`` in ``partitions`` partitions, its columns ``kind`` and
  ``text`` forming each row's payload (`streams.bench.common.PAYLOAD`, the JSON object every
  benchmark appends), written with ``df.write.format("streams")`` into a new stream; timed from
  ``save()`` to its return (Spark's scheduling, each task's writer registration, the Arrow to
  JSON conversion and its one transaction, the driver's commit). Also with the payload given as
  JSON text (``payloadColumn`` of ``to_json(...)``: the sink stores it without encoding).
* **baseline**: ``partitions`` Python processes, each with a connected writer, append their
  share of the rows with ``append_batch`` in batches of `streams_spark.sink.ROWS_PER_CHUNK`
  (the sink's chunk) after a common start; timed from that start to the last one's end.

Rounds alternate, each into fresh streams; medians reported. Target (issue 20): sink >= 0.8x
the baseline. Every stream is the run's own (`streams.bench.common.scratch_streams`), and so are
the sink's commit records (they go with their stream).
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from typing import Any

from streams.bench.common import PAYLOAD, Scratch, ignore_interrupts

from ..sink import ROWS_PER_CHUNK

__all__ = ["sink_throughput"]


def _baseline_child(url: str, stream: str, instance: str, rows: int, chunk: int,
                    barrier: Barrier, results: Any) -> None:  # fmt: skip
    """One baseline process: a writer appending ``rows`` rows in batches of ``chunk``."""
    ignore_interrupts()
    import streams

    with streams.connect(url) as client, client.writer(stream, instance=instance) as writer:
        barrier.wait()
        start = time.time()
        for offset in range(0, rows, chunk):
            writer.append_batch([PAYLOAD] * min(chunk, rows - offset))
        results.put((start, time.time()))


def _baseline(scratch: Scratch, url: str, rows: int, partitions: int, chunk: int) -> float:
    stream = scratch.create("python").name
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(partitions)
    results = ctx.Queue()
    shares = [rows // partitions + (1 if n < rows % partitions else 0) for n in range(partitions)]
    procs = [
        scratch.watch(
            ctx.Process(
                target=_baseline_child,
                args=(url, stream, f"bench-python-{n}", share, chunk, barrier, results),
            )
        )
        for n, share in enumerate(shares)
    ]
    for proc in procs:
        proc.start()
    spans = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return float(max(end for _, end in spans) - min(start for start, _ in spans))


def _sink(spark: Any, scratch: Scratch, url: str, rows: int, partitions: int, text: bool) -> float:
    stream = scratch.create("sink").name
    df = spark.range(rows, numPartitions=partitions).selectExpr(
        f"'{PAYLOAD['kind']}' AS kind", f"repeat('x', {len(PAYLOAD['text'])}) AS text"
    )
    if text:
        df = df.selectExpr("to_json(named_struct('kind', kind, 'text', text)) AS payload")
    writer = df.write.format("streams").mode("append").option("stream", stream)
    writer = writer.option("databaseUrl", url).option("instancePrefix", "bench-sink")
    if text:
        writer = writer.option("payloadColumn", "payload")
    t0 = time.perf_counter()
    writer.save()
    return time.perf_counter() - t0


def sink_throughput(
    spark: Any,
    scratch: Scratch,
    url: str,
    rows: int,
    partitions: int,
    rounds: int,
    report: Callable[[str], None],
) -> dict[str, Any]:
    """Run the rounds; returns the figures (also reported line by line)."""
    _sink(spark, scratch, url, min(rows, 10_000), partitions, False)  # warm the Python workers
    times: dict[str, list[float]] = {"sink": [], "sink_json_text": [], "append_batch": []}
    for _ in range(rounds):
        times["append_batch"].append(_baseline(scratch, url, rows, partitions, ROWS_PER_CHUNK))
        times["sink"].append(_sink(spark, scratch, url, rows, partitions, False))
        times["sink_json_text"].append(_sink(spark, scratch, url, rows, partitions, True))
    out: dict[str, Any] = {"rows": rows, "partitions": partitions}
    for name, values in times.items():
        out[f"{name}_rows_per_s"] = rows / statistics.median(values)
        runs = ", ".join(f"{v:.2f}s" for v in values)
        rate = out[f"{name}_rows_per_s"] / 1e3
        report(f"sink throughput {name}: {rate:.0f}k rows/s (median of {len(values)}: {runs})")
    out["ratio_vs_append_batch"] = out["sink_rows_per_s"] / out["append_batch_rows_per_s"]
    out["json_text_ratio_vs_append_batch"] = (
        out["sink_json_text_rows_per_s"] / out["append_batch_rows_per_s"]
    )
    report(
        f"sink / append_batch ({partitions} processes): {out['ratio_vs_append_batch']:.2f}x "
        f"(target >= 0.8x); JSON text payloads: {out['json_text_ratio_vs_append_batch']:.2f}x"
    )
    return out
