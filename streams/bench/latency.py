"""`streams bench latency`: commit-to-delivery latency and catch-up throughput, beside raw
baselines measured in the same run.

* **latency**: N writer processes (spawn context, each with its own client and Redis link)
  append single facts at a steady aggregate ``rate``, each on a fixed schedule (writer ``k`` of
  ``N`` at ``start + (k + i * N) / rate``, so a late append does not shift the ones after it). A
  writer records ``(ack.last_id, time.monotonic())`` as soon as ``append`` returns; the parent's
  reader (``start="latest"``, with Redis) records ``time.monotonic()`` when the epoch holding
  each ID is yielded. ``CLOCK_MONOTONIC`` is system-wide on Linux, so the two are comparable.
  Facts committed in the first `WARMUP_FRACTION` of the run (at most `WARMUP_MAX` seconds) are
  dropped.
* **raw Redis**: one child publishes its ``time.monotonic()`` at the same rate on a channel of
  its own with plain redis-py; the parent receives with ``pubsub.get_message``. It is the floor
  of any Redis-driven delivery, and the report gives ``p99 streams / p99 raw``.
* **catch-up**: a reader from ``"earliest"`` consuming a stream of ``catchup_facts`` facts
  (by default two streams: 200,000 facts and 10^7) against a raw psycopg loop of the same
  paged query (`common.raw_catchup`: same page size, autocommit,
  inlined integer literals, the payloads decoded a page at a time with the reader's decoder).
  The stream is filled (beyond `SERVER_SIDE_FILL` facts server-side, as `streams.bench.history`
  does), then its partition analyzed (as autovacuum would, later: without
  statistics the planner sorts the whole rest of the stream for every page of the raw loop).
  Raw and `streams` rounds alternate; the report gives medians and the ratio streams/raw.

Both streams are the run's own (`common.scratch_streams`): they are dropped, and the child
processes ended, when it ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import queue
import secrets
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import psycopg
from psycopg import sql

from ..cli_params import FiniteFloat, common_options
from ..config import Settings, redact_url
from ..core.constants import facts_partition
from ..store.reader_core import DEFAULT_PAGE_SIZE
from ..transport.discovery import open_client
from .common import (
    PAYLOAD,
    Scratch,
    end_children,
    ignore_interrupts,
    progress_report,
    raw_catchup,
    scratch_streams,
)
from .plots import plot_latency, plot_option
from .targets import (
    TARGET_CATCHUP_VS_RAW,
    CatchupResult,
    LatencyBenchResult,
    LatencyRun,
    LatencyStats,
)

if TYPE_CHECKING:
    from ..client import Client
    from ..reader import Reader
    from ..types import StreamInfo

__all__ = [
    "CatchupResult",
    "LatencyBenchResult",
    "LatencyRun",
    "LatencyStats",
    "bench_latency_command",
    "run_latency_bench",
]

#: Share of a latency run (from its start) whose facts are not measured, capped in seconds.
WARMUP_FRACTION = 0.1
WARMUP_MAX = 0.5
#: Appends each writer makes before the reader opens (connections, prepared statements).
WARMUP_APPENDS = 5
#: How long after its last scheduled append a run may take to deliver everything.
DRAIN_SECONDS = 10.0
#: Seconds a child has to start (spawn, imports, connections) before the run is abandoned.
START_TIMEOUT = 60.0
#: Facts per append when filling the catch-up stream.
CATCHUP_BATCH = 5000
CATCHUP_ROUNDS = 3
#: Streams larger than this are filled server-side (`_fill`).
SERVER_SIDE_FILL = 1_000_000
#: The sizes of the streams caught up: a fresh consumer's backfill, and a long history.
DEFAULT_CATCHUP_FACTS = (200_000, 10_000_000)


# ------------------------------------------------------------------------------ children


def _due_times(start: float, offset: float, interval: float, seconds: float) -> list[float]:
    """``start + offset + i * interval`` for every ``i`` that falls within ``seconds``."""
    count = max(0, math.ceil((seconds - offset) / interval))
    return [start + offset + i * interval for i in range(count)]


def _schedule(start: float, offset: float, interval: float, seconds: float) -> Iterator[None]:
    """Yield once per due time, sleeping until it is due (a late step does not shift the
    later ones, so the rate holds)."""
    for due in _due_times(start, offset, interval, seconds):
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield


def _wait_connected(client: Client, timeout: float = 10.0) -> None:
    link = client.link
    deadline = time.monotonic() + timeout
    while link is not None and not link.connected and time.monotonic() < deadline:
        time.sleep(0.005)


def _writer_child(
    database_url: str,
    redis_url: str,
    prefix: str,
    stream: str,
    index: int,
    writers: int,
    rate: float,
    seconds: float,
    barrier: Barrier,
    start_at: Any,
    results: Any,
) -> None:
    from ..client import connect

    ignore_interrupts()
    records: list[tuple[int, float]] = []
    try:
        with connect(database_url, redis_url=redis_url, prefix=prefix) as client:
            writer = client.writer(stream, instance=f"bench-lat-w{writers}-{index}")
            try:
                _wait_connected(client)
                for _ in range(WARMUP_APPENDS):
                    writer.append(PAYLOAD)
                barrier.wait(START_TIMEOUT)  # ready: the parent opens its reader
                barrier.wait(START_TIMEOUT)  # the reader is open and start_at is set
                for _ in _schedule(start_at.value, index / rate, writers / rate, seconds):
                    ack = writer.append(PAYLOAD)
                    records.append((ack.last_id, time.monotonic()))
                results.put((index, records, None))
            finally:
                writer.close()
    except BaseException as exc:
        results.put((index, records, f"{type(exc).__name__}: {exc}"))
        raise


def _redis_child(
    redis_url: str,
    channel: str,
    rate: float,
    seconds: float,
    barrier: Barrier,
    start_at: Any,
) -> None:
    ignore_interrupts()
    client = open_client(redis_url)
    try:
        for _ in range(WARMUP_APPENDS):
            client.publish(f"{channel}:warmup", b"0")
        barrier.wait(START_TIMEOUT)  # ready
        barrier.wait(START_TIMEOUT)  # start_at is set
        for _ in _schedule(start_at.value, 0.0, 1 / rate, seconds):
            client.publish(channel, repr(time.monotonic()).encode())
        client.publish(channel, b"done")
    finally:
        client.close()


def _stop(procs: Sequence[BaseProcess]) -> None:
    """After a run: the children are finishing, wait for them (up to 30 s, then SIGTERM)."""
    started = [proc for proc in procs if proc.pid is not None]
    for proc in started:
        proc.join(timeout=30)
    for proc in started:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


# ------------------------------------------------------------------------------ measurements


def _measure_raw_redis(
    scratch: Scratch, redis_url: str, rate: float, seconds: float
) -> LatencyStats:
    ctx = multiprocessing.get_context("spawn")
    channel = f"bench-lat-raw-{secrets.token_hex(6)}"
    barrier = ctx.Barrier(2)
    start_at = ctx.Value("d", 0.0)
    client = open_client(redis_url)
    pubsub = client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
    proc = scratch.watch(
        ctx.Process(
            target=_redis_child, args=(redis_url, channel, rate, seconds, barrier, start_at)
        )
    )
    try:
        pubsub.subscribe(channel)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # confirmed: nothing published later is lost
            message = pubsub.get_message(timeout=1.0)
            if message is not None and message.get("type") == "subscribe":
                break
        proc.start()
        barrier.wait(START_TIMEOUT)
        start = time.monotonic() + 0.01
        start_at.value = start
        barrier.wait(START_TIMEOUT)
        cutoff = start + min(WARMUP_MAX, seconds * WARMUP_FRACTION)
        expected = sum(1 for due in _due_times(start, 0.0, 1 / rate, seconds) if due >= cutoff)
        samples: list[float] = []
        deadline = start + seconds + DRAIN_SECONDS
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.05)
            if message is None or message.get("type") != "message":
                continue
            received = time.monotonic()
            data = message["data"]
            if data == b"done":
                break
            sent = float(data)
            if sent >= cutoff:
                samples.append(received - sent)
        return LatencyStats.from_seconds(samples, lost=max(0, expected - len(samples)))
    except BaseException:
        end_children([proc])  # failed or interrupted: do not wait for the child's schedule
        raise
    finally:
        barrier.abort()  # a failed parent must not leave the child waiting
        with contextlib.suppress(Exception):
            pubsub.close()
        client.close()
        _stop([proc])


def _collect(
    reader: Reader, results: Any, writers: int, deadline: float
) -> tuple[dict[int, float], dict[int, float], int]:
    """Poll until every writer reported and every fact it committed was delivered (or the
    deadline): (committed time by ID, delivered time by ID, epochs)."""
    delivered: dict[int, float] = {}
    committed: dict[int, float] = {}
    reported = 0
    pending: set[int] | None = None
    epochs = 0
    while time.monotonic() < deadline:
        epoch = reader.poll(timeout=0.05)
        if epoch is not None:
            now = time.monotonic()
            epochs += 1
            for fact in epoch.facts:
                delivered.setdefault(fact.stream_id, now)
                if pending is not None:
                    pending.discard(fact.stream_id)
        while reported < writers:
            try:
                _, records, error = results.get_nowait()
            except queue.Empty:
                break
            if error is not None:
                raise RuntimeError(f"a bench writer failed: {error}")
            committed.update(records)
            reported += 1
        if reported == writers:
            if pending is None:
                pending = committed.keys() - delivered.keys()
            if not pending:
                break
    if reported < writers:
        raise RuntimeError(f"only {reported} of {writers} bench writers reported back")
    return committed, delivered, epochs


def _measure_streams(
    scratch: Scratch,
    client: Client,
    settings: tuple[str, str, str],
    stream: str,
    writers: int,
    rate: float,
    seconds: float,
) -> tuple[LatencyStats, tuple[int, int, int]]:
    """``settings``: (database URL, Redis URL, prefix) for the writers' clients."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(writers + 1)
    start_at = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = [
        scratch.watch(
            ctx.Process(
                target=_writer_child,
                args=(*settings, stream, index, writers, rate, seconds, barrier, start_at, results),
            )
        )
        for index in range(writers)
    ]
    reader = None
    try:
        for proc in procs:
            proc.start()
        barrier.wait(START_TIMEOUT)  # every writer is registered and warmed up
        reader = client.reader(stream, start="latest")
        _wait_connected(client)
        while reader.poll(timeout=0.0) is not None:  # settle: reconcile with the link
            pass
        start = time.monotonic() + 0.01
        start_at.value = start
        barrier.wait(START_TIMEOUT)
        committed, delivered, epochs = _collect(
            reader, results, writers, start + seconds + DRAIN_SECONDS
        )
        cutoff = start + min(WARMUP_MAX, seconds * WARMUP_FRACTION)
        measured = {i: t for i, t in committed.items() if t >= cutoff}
        samples = [delivered[i] - t for i, t in measured.items() if i in delivered]
        stats = LatencyStats.from_seconds(samples, lost=len(measured) - len(samples))
        return stats, (reader.core.counters.probes, reader.core.counters.pages, epochs)
    except BaseException:
        end_children(procs)  # failed or interrupted: do not wait for the writers' schedules
        raise
    finally:
        barrier.abort()  # a failed parent must not leave the writers waiting
        if reader is not None:
            reader.close()
        _stop(procs)


def _fill(client: Client, info: StreamInfo, facts: int) -> None:
    """``facts`` single-row facts: appended in batches by a writer, or, beyond
    `SERVER_SIDE_FILL`, written server-side as `streams.bench.history` does (a 10^7-fact
    stream in seconds rather than minutes; catching up reads them the same way)."""
    if facts > SERVER_SIDE_FILL:
        from .history import load_facts

        with psycopg.connect(client.settings.database_url) as conn:
            load_facts(conn, info, 1, facts, int(time.time() * 1000) - facts)
        return
    writer = client.writer(info.name, instance="bench-lat-catchup")
    try:
        payloads = [PAYLOAD] * CATCHUP_BATCH
        remaining = facts
        while remaining > 0:
            count = min(CATCHUP_BATCH, remaining)
            remaining -= writer.append_batch(payloads[:count]).count
    finally:
        writer.close()


def _catchup_streams(client: Client, stream: str, page_size: int) -> tuple[int, float]:
    reader = client.reader(stream, start="earliest", page_size=page_size)
    try:
        count = 0
        start = time.perf_counter()
        for epoch in reader.epochs():
            count += len(epoch)
        return count, time.perf_counter() - start
    finally:
        reader.close()


def _measure_catchup(
    scratch: Scratch,
    client: Client,
    database_url: str,
    facts: int,
    page_size: int,
    rounds: int,
) -> CatchupResult:
    info = scratch.create("catchup")
    stream = info.name
    _fill(client, info, facts)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(facts_partition(info.id))))
    raw: list[float] = []
    ours: list[float] = []
    for _ in range(rounds):
        count, elapsed = raw_catchup(database_url, info.id, page_size)
        if count != facts:
            raise RuntimeError(f"raw catch-up read {count} facts, expected {facts}")
        raw.append(count / elapsed)
        count, elapsed = _catchup_streams(client, stream, page_size)
        if count != facts:
            raise RuntimeError(f"streams catch-up read {count} facts, expected {facts}")
        ours.append(count / elapsed)
    return CatchupResult(
        facts=facts,
        page_size=page_size,
        raw_per_s=statistics.median(raw),
        streams_per_s=statistics.median(ours),
        raw_rounds=tuple(raw),
        streams_rounds=tuple(ours),
    )


def _mark(met: bool) -> str:
    return "met" if met else "NOT MET"


def run_latency_bench(
    database_url: str,
    redis_url: str,
    *,
    writer_counts: tuple[int, ...] = (1, 4),
    rate: float = 200.0,
    seconds: float = 5.0,
    catchup_facts: int | Sequence[int] = DEFAULT_CATCHUP_FACTS,
    page_size: int | None = None,
    report: Callable[[str], None] = print,
) -> LatencyBenchResult:
    """Run the latency and catch-up benchmarks (see the module doc); report lines as it goes.
    ``catchup_facts``: the size of the stream caught up, or several (one stream each)."""
    from ..client import connect

    sizes = (catchup_facts,) if isinstance(catchup_facts, int) else tuple(catchup_facts)
    if (
        rate <= 0
        or seconds <= 0
        or not sizes
        or min(sizes) < 1
        or not writer_counts
        or min(writer_counts) < 1
    ):
        raise ValueError(
            "rate, seconds and catchup_facts must be positive, writer_counts non-empty"
        )
    pages = DEFAULT_PAGE_SIZE if page_size is None else page_size
    prefix = f"bench-lat-{secrets.token_hex(6)}"
    began = time.monotonic()
    runs: list[LatencyRun] = []
    with scratch_streams(database_url, "lat") as scratch:
        latency_stream = scratch.create().name
        with connect(database_url, redis_url=redis_url, prefix=prefix) as client:
            for writers in writer_counts:
                raw = _measure_raw_redis(scratch, redis_url, rate, seconds)
                ours, (probes, page_count, epochs) = _measure_streams(
                    scratch, client, (database_url, redis_url, prefix), latency_stream, writers,
                    rate, seconds,
                )  # fmt: skip
                result = LatencyRun(writers, rate, ours, raw, probes, page_count, epochs)
                runs.append(result)
                report(
                    f"latency x{writers} writer(s) @ {rate:g}/s: streams p50 {ours.p50_ms:.2f} ms"
                    f"  p99 {ours.p99_ms:.2f} ms  max {ours.max_ms:.2f} ms  (n={ours.count}"
                    f"{f', lost {ours.lost}' if ours.lost else ''})"
                )
                report(
                    f"{'':>25} raw Redis p50 {raw.p50_ms:.2f} ms  p99 {raw.p99_ms:.2f} ms  "
                    f"max {raw.max_ms:.2f} ms  (n={raw.count})   p99 ratio {result.p99_ratio:.1f}"
                )
                report(f"{'':>25} reader: {epochs} epochs, {probes} probes, {page_count} pages")
                report(
                    f"{'':>25} targets: "
                    + "; ".join(f"{name} {_mark(ok)}" for name, ok in result.targets().items())
                )
            catchups = []
            for size in sizes:
                catchup = _measure_catchup(
                    scratch, client, database_url, size, pages, CATCHUP_ROUNDS
                )
                catchups.append(catchup)
                report(
                    f"catch-up {catchup.facts:,} facts (page {catchup.page_size}): streams "
                    f"{catchup.streams_per_s:>10,.0f}/s   raw {catchup.raw_per_s:>10,.0f}/s   "
                    f"ratio {catchup.ratio:.2f}   target >= {TARGET_CATCHUP_VS_RAW:g}x raw "
                    f"{_mark(catchup.ratio >= TARGET_CATCHUP_VS_RAW)}"
                )
    return LatencyBenchResult(tuple(runs), tuple(catchups), seconds=time.monotonic() - began)


@click.command(name="latency")
@click.option(
    "--seconds", type=FiniteFloat(0.1, 3600), default=5.0, show_default=True,
    help="Per writer count.",
)  # fmt: skip
@click.option(
    "--rate", type=FiniteFloat(1, 100_000), default=200.0, show_default=True,
    help="Facts/s in total.",
)  # fmt: skip
@click.option(
    "--writers", "writer_counts", multiple=True, type=click.IntRange(1, 64), default=(1, 4),
    show_default=True,
)  # fmt: skip
@click.option(
    "--catchup-facts", type=click.IntRange(1, 1_000_000_000), multiple=True,
    default=DEFAULT_CATCHUP_FACTS, show_default=True,
    help="Facts in the stream caught up; repeat for several sizes (a stream each).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
@plot_option("Also draw latency p50/p99 per writer count and catch-up per stream size beside "
             "their raw baselines, as FILE.png or FILE.svg (the plot extra).")  # fmt: skip
@common_options
def bench_latency_command(
    seconds: float,
    rate: float,
    writer_counts: tuple[int, ...],
    catchup_facts: tuple[int, ...],
    as_json: bool,
    plot: Path | None,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Commit-to-delivery p50/p99 vs raw Redis pub/sub; catch-up facts/s vs raw paging."""
    settings = Settings.resolve(database_url, redis_url, prefix, require_redis=True)
    assert settings.redis_url is not None
    click.echo(
        f"database {redact_url(settings.database_url)}, Redis {redact_url(settings.redis_url)}"
    )
    result = run_latency_bench(
        settings.database_url,
        settings.redis_url,
        writer_counts=writer_counts,
        rate=rate,
        seconds=seconds,
        catchup_facts=catchup_facts,
        report=progress_report(),
    )
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True, separators=(",", ":")))
    if plot is not None:
        plot_latency(result, plot)
        click.echo(f"plot written to {plot}")
