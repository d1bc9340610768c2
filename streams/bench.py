"""`streams bench write`: append throughput beside a raw psycopg baseline from the same run.

Each configuration runs one OS process per writer. Raw and `streams` rounds alternate, and
the report gives medians and the ratio streams/raw, because this machine is noisy and only a
baseline measured in the same run is a fair comparison.

* **single**: one fact per transaction. Raw: ``nextval`` + ``INSERT`` + ``COMMIT`` per fact on
  a table of the same shape as ``streams_facts``. Streams: ``Writer.append``.
* **batch**: 1000 facts per transaction. Raw: the 1000 IDs in one ``nextval`` round trip, the
  rows by ``COPY`` (the fastest raw method), ``COMMIT``. Streams: ``Writer.append_batch``.

It also shows that a tracker's memory does not grow with completed facts (10^6 of them).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from typing import Any

import psycopg

from .positions import PositionTracker

__all__ = ["WriteBenchResult", "run_write_bench", "tracker_memory"]

PAYLOAD = {"kind": "bench", "text": "x" * 160}
RAW_TABLE = "streams_bench_raw"
RAW_SEQUENCE = "streams_bench_raw_seq"


@dataclass(frozen=True, slots=True)
class WriteBenchResult:
    mode: str
    writers: int
    raw_per_s: float
    streams_per_s: float

    @property
    def ratio(self) -> float:
        return self.streams_per_s / self.raw_per_s if self.raw_per_s else float("nan")


def _setup_raw(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {RAW_TABLE}")
        conn.execute(f"DROP SEQUENCE IF EXISTS {RAW_SEQUENCE}")
        conn.execute(f"CREATE SEQUENCE {RAW_SEQUENCE}")
        conn.execute(
            f"CREATE TABLE {RAW_TABLE} (stream integer NOT NULL, stream_id bigint NOT NULL, "
            "row_no integer NOT NULL DEFAULT 0, instance text NOT NULL, ts bigint NOT NULL, "
            "payload jsonb, PRIMARY KEY (stream, stream_id, row_no))"
        )
        conn.execute(f"CREATE INDEX ON {RAW_TABLE} (stream, ts, stream_id)")


def _drop_raw(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {RAW_TABLE}")
        conn.execute(f"DROP SEQUENCE IF EXISTS {RAW_SEQUENCE}")


def _raw_worker(url: str, mode: str, batch: int, instance: str) -> Callable[[], int]:
    conn = psycopg.connect(url)
    payloads = [PAYLOAD] * batch

    def single() -> int:
        (stream_id,) = conn.execute(f"SELECT nextval('{RAW_SEQUENCE}')").fetchone()  # type: ignore[misc]
        conn.execute(
            f"INSERT INTO {RAW_TABLE} (stream, stream_id, instance, ts, payload) "
            "VALUES (1, %s, %s, %s, %s::jsonb)",
            (stream_id, instance, int(time.time() * 1000), json.dumps(PAYLOAD)),
        )
        conn.commit()
        return 1

    def many() -> int:
        ids = conn.execute(
            f"SELECT nextval('{RAW_SEQUENCE}') FROM generate_series(1, %s)", (batch,)
        ).fetchall()
        now = int(time.time() * 1000)
        with (
            conn.cursor() as cur,
            cur.copy(
                f"COPY {RAW_TABLE} (stream, stream_id, row_no, instance, ts, payload) FROM STDIN"
            ) as copy,
        ):
            for (stream_id,), payload in zip(ids, payloads, strict=True):
                copy.write_row((1, stream_id, 0, instance, now, json.dumps(payload)))
        conn.commit()
        return batch

    return single if mode == "single" else many


def _streams_worker(
    url: str, mode: str, batch: int, instance: str, stream: str
) -> Callable[[], int]:
    from .client import connect

    client = connect(url)
    writer = client.writer(stream, instance=instance)
    payloads = [PAYLOAD] * batch

    def single() -> int:
        writer.append(PAYLOAD)
        return 1

    def many() -> int:
        return writer.append_batch(payloads).count

    return single if mode == "single" else many


def _child(
    kind: str,
    url: str,
    mode: str,
    batch: int,
    instance: str,
    stream: str,
    seconds: float,
    barrier: Barrier,
    results: Any,
) -> None:
    step = (
        _raw_worker(url, mode, batch, instance)
        if kind == "raw"
        else _streams_worker(url, mode, batch, instance, stream)
    )
    for _ in range(3):  # warm up: connections, prepared statements, caches
        step()
    barrier.wait()
    count = 0
    start = time.perf_counter()
    deadline = start + seconds
    while (now := time.perf_counter()) < deadline:
        count += step()
    results.put(count / (now - start))


def _measure(
    kind: str, url: str, mode: str, writers: int, batch: int, stream: str, seconds: float
) -> float:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(writers)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(kind, url, mode, batch, f"bench-{kind}-{n}", stream, seconds, barrier, results),
        )
        for n in range(writers)
    ]
    for proc in procs:
        proc.start()
    rates = [results.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join()
    return float(sum(rates))


def run_write_bench(
    url: str,
    *,
    writer_counts: tuple[int, ...] = (1, 4),
    modes: tuple[str, ...] = ("single", "batch"),
    batch: int = 1000,
    seconds: float = 3.0,
    rounds: int = 3,
    report: Callable[[str], None] = print,
) -> list[WriteBenchResult]:
    from .client import connect

    stream = f"bench-{int(time.time())}"
    with connect(url) as client:
        client.create_stream(stream)
    _setup_raw(url)
    results = []
    try:
        for mode in modes:
            for writers in writer_counts:
                raw, ours = [], []
                for _ in range(rounds):
                    raw.append(_measure("raw", url, mode, writers, batch, stream, seconds))
                    ours.append(_measure("streams", url, mode, writers, batch, stream, seconds))
                result = WriteBenchResult(
                    mode, writers, statistics.median(raw), statistics.median(ours)
                )
                results.append(result)
                report(
                    f"{mode:>6} x{writers} writer(s): streams {result.streams_per_s:>10,.0f}/s"
                    f"   raw {result.raw_per_s:>10,.0f}/s   ratio {result.ratio:.2f}"
                )
    finally:
        _drop_raw(url)
    return results


def tracker_memory(facts: int = 1_000_000, report: Callable[[str], None] = print) -> list[int]:
    """Traced bytes held by a tracker after 0, 10%, ..., 100% of `facts` reserve/complete."""
    tracker = PositionTracker(local_instance="bench")
    tracemalloc.start()
    sizes = []
    checkpoints = {facts * k // 10 for k in range(11)}
    base = tracemalloc.get_traced_memory()[0]
    for stream_id in range(1, facts + 1):
        token = tracker.begin_reservation()
        tracker.reserved(token, (stream_id,))
        tracker.complete((stream_id,))
        if stream_id in checkpoints:
            sizes.append(tracemalloc.get_traced_memory()[0] - base)
    tracemalloc.stop()
    report(
        f"tracker memory over {facts:,} completed facts: "
        f"{min(sizes):,} .. {max(sizes):,} bytes (position {tracker.local_position:,})"
    )
    return sizes
