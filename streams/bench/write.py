"""`streams bench write`: append throughput beside a raw psycopg baseline from the same run.

Each configuration runs one OS process per writer. Raw and `streams` rounds alternate (raw,
`streams` with Redis off, `streams` with Redis on when a Redis URL is given), and the report
gives medians and the ratio streams/raw, because this machine is noisy and only a baseline
measured in the same run is a fair comparison.

* **single**: one fact per transaction. Raw: ``nextval`` + ``INSERT`` + ``COMMIT`` per fact on
  a table of the same shape as ``streams_facts``. Streams: ``Writer.append``.
* **batch**: 1000 facts per transaction. Raw: the 1000 IDs in one ``nextval`` round trip, the
  rows by ``COPY`` (the fastest raw method), ``COMMIT``. Streams: ``Writer.append_batch``.
* **keyed** (a configuration of both, Redis off): the same appends, each fact with an
  idempotency key of its own (``key=`` / ``keys=``: `streams.store.idempotency`), beside the
  unkeyed ones: both rates, the ratio ``keyed/unkeyed`` and its target (`KEYED_TARGETS`:
  >= 0.9x for single facts, >= 0.75x for batches of 1000), also under ``keyed`` in ``--json``.

Beside each rate it prints the client CPU per append (all threads of the writer processes, from
``getrusage``) and its split by thread (``pthread_getcpuclockid`` of each live thread: ``main``,
the heartbeat, the Redis listener), and voluntary context switches per append.

It also shows that a tracker's memory does not grow with completed facts (10^6 of them).

The stream, the raw table and its sequence are the run's own (`common.scratch_streams`): they
are dropped, and the writer processes ended, when it ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import resource
import secrets
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import click
import psycopg
from psycopg import sql

from ..cli_params import DATABASE_URL, FiniteFloat, common_options
from ..config import Settings, redact_url
from ..core.fact_columns import KEY, ROW_NO, STORED_NAMES, STREAM
from ..core.positions import PositionTracker
from .common import PAYLOAD, Scratch, ignore_interrupts, progress_report, scratch_streams
from .plots import plot_option, plot_write
from .targets import KEYED_TARGETS, KINDS, Measurement, WriteBenchResult

#: (`KEYED_TARGETS`, `Measurement` and `WriteBenchResult` live in `streams.bench.targets`, with
#: what the plots draw.)
__all__ = [
    "KEYED_TARGETS",
    "Measurement",
    "WriteBenchResult",
    "bench_write_command",
    "run_write_bench",
    "tracker_memory",
]


def _setup_raw(url: str, table: str, sequence: str) -> None:
    """The raw baseline's table (the shape of ``streams_facts``) and sequence."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SEQUENCE {sequence}")
        conn.execute(
            f"CREATE TABLE {table} (stream integer NOT NULL, stream_id bigint NOT NULL, "
            "row_no integer NOT NULL DEFAULT 0, instance text NOT NULL, ts bigint NOT NULL, "
            f"payload jsonb, PRIMARY KEY ({STREAM.stored}, {', '.join(c.stored for c in KEY)}))"
        )
        conn.execute(f"CREATE INDEX ON {table} (stream, ts, stream_id)")


def _grant_raw(url: str, writer_url: str, table: str, sequence: str) -> None:
    """The raw baseline for a writer of the role model: its table and sequence, as a writer
    holds its stream's partition and sequence."""
    user = psycopg.conninfo.conninfo_to_dict(writer_url).get("user")
    if not user:
        raise click.UsageError("--writer-url must name its user")
    grantee = sql.Identifier(str(user))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("GRANT SELECT, INSERT ON {} TO {}").format(sql.Identifier(table), grantee)
        )
        conn.execute(
            sql.SQL("GRANT SELECT, USAGE ON SEQUENCE {} TO {}").format(
                sql.Identifier(sequence), grantee
            )
        )


def _raw_worker(
    url: str, mode: str, batch: int, instance: str, table: str, sequence: str
) -> Callable[[], int]:
    conn = psycopg.connect(url)
    payloads = [PAYLOAD] * batch

    def single() -> int:
        (stream_id,) = conn.execute(f"SELECT nextval('{sequence}')").fetchone()  # type: ignore[misc]
        conn.execute(
            f"INSERT INTO {table} ({', '.join(n for n in STORED_NAMES if n != ROW_NO.stored)}) "
            "VALUES (1, %s, %s, %s, %s::jsonb)",
            (stream_id, instance, int(time.time() * 1000), json.dumps(PAYLOAD)),
        )
        conn.commit()
        return 1

    def many() -> int:
        ids = conn.execute(
            f"SELECT nextval('{sequence}') FROM generate_series(1, %s)", (batch,)
        ).fetchall()
        now = int(time.time() * 1000)
        with (
            conn.cursor() as cur,
            cur.copy(f"COPY {table} ({', '.join(STORED_NAMES)}) FROM STDIN") as copy,
        ):
            for (stream_id,), payload in zip(ids, payloads, strict=True):
                copy.write_row((1, stream_id, 0, instance, now, json.dumps(payload)))
        conn.commit()
        return batch

    return single if mode == "single" else many


def _streams_worker(
    url: str,
    redis_url: str | None,
    mode: str,
    batch: int,
    instance: str,
    stream: str,
    keyed: bool = False,
) -> Callable[[], int]:
    from ..client import connect

    if redis_url is None:
        os.environ.pop("STREAMS_REDIS_URL", None)  # this child process only
    client = connect(url, redis_url)
    writer = client.writer(stream, instance=instance)
    payloads = [PAYLOAD] * batch
    # Keys never seen before (each round's processes reuse the instance names).
    prefix, counter = f"{instance}-{secrets.token_hex(6)}-", itertools.count()

    def single() -> int:
        writer.append(PAYLOAD, key=f"{prefix}{next(counter)}" if keyed else None)
        return 1

    def many() -> int:
        keys = [f"{prefix}{next(counter)}" for _ in payloads] if keyed else None
        return writer.append_batch(payloads, keys=keys).count

    return single if mode == "single" else many


def _thread_name(name: str) -> str:
    if name == "MainThread":
        return "main"
    if name.startswith("streams-heartbeat"):
        return "heartbeat"
    if name.startswith("streams-redis-listen"):
        return "redis-listen"
    if name.startswith("streams-redis-publish"):
        return "redis-publish"
    if name.startswith("streams-redis-flush"):
        return "redis-flush"
    return "other"


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of every live thread of this process, by ident (name, seconds)."""
    out = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            out[thread.ident] = (_thread_name(thread.name), time.clock_gettime(clock))
        except (OSError, ProcessLookupError):
            continue
    return out


def _child(
    kind: str,
    url: str,
    redis_url: str | None,
    mode: str,
    batch: int,
    instance: str,
    stream: str,
    raw: tuple[str, str],
    seconds: float,
    barrier: Barrier,
    results: Any,
) -> None:
    """One writer process: ``raw`` is the raw baseline's (table, sequence)."""
    ignore_interrupts()
    step = (
        _raw_worker(url, mode, batch, instance, *raw)
        if kind == "raw"
        else _streams_worker(
            url,
            redis_url if kind == "redis-on" else None,
            mode,
            batch,
            instance,
            stream,
            keyed=kind == "keyed",
        )
    )
    for _ in range(3):  # warm up: connections, prepared statements, caches
        step()
    barrier.wait()
    count = 0
    threads_before = _thread_cpu()
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    deadline = start + seconds
    while (now := time.perf_counter()) < deadline:
        count += step()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    threads: dict[str, float] = {}
    for ident, (name, cpu) in _thread_cpu().items():
        before = threads_before.get(ident, (name, 0.0))[1]
        threads[name] = threads.get(name, 0.0) + cpu - before
    results.put(
        {
            "rate": count / (now - start),
            "count": count,
            "cpu": usage.ru_utime + usage.ru_stime - usage_before.ru_utime - usage_before.ru_stime,
            "vcsw": usage.ru_nvcsw - usage_before.ru_nvcsw,
            "threads": threads,
        }
    )


def _measure(
    scratch: Scratch,
    kind: str,
    url: str,
    redis_url: str | None,
    mode: str,
    writers: int,
    batch: int,
    stream: str,
    raw: tuple[str, str],
    seconds: float,
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(writers)
    results = ctx.Queue()
    procs = [
        scratch.watch(
            ctx.Process(
                target=_child,
                args=(
                    kind,
                    url,
                    redis_url,
                    mode,
                    batch,
                    f"bench-{kind}-{n}",
                    stream,
                    raw,
                    seconds,
                    barrier,
                    results,
                ),
            )
        )
        for n in range(writers)
    ]
    for proc in procs:
        proc.start()
    parts = [results.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join()
    count = sum(p["count"] for p in parts) or 1
    threads: dict[str, float] = {}
    for part in parts:
        for name, cpu in part["threads"].items():
            threads[name] = threads.get(name, 0.0) + cpu
    return {
        "per_s": float(sum(p["rate"] for p in parts)),
        "cpu_us": sum(p["cpu"] for p in parts) / count * 1e6,
        "threads_us": {name: cpu / count * 1e6 for name, cpu in threads.items()},
        "vcsw": sum(p["vcsw"] for p in parts) / count,
    }


def _median(runs: list[dict[str, Any]]) -> Measurement:
    names = sorted({name for run in runs for name in run["threads_us"]})
    return Measurement(
        per_s=statistics.median(r["per_s"] for r in runs),
        cpu_us=statistics.median(r["cpu_us"] for r in runs),
        threads_us={n: statistics.median(r["threads_us"].get(n, 0.0) for r in runs) for n in names},
        vcsw=statistics.median(r["vcsw"] for r in runs),
    )


def _cpu_text(m: Measurement) -> str:
    split = ", ".join(f"{n} {v:.0f}" for n, v in sorted(m.threads_us.items()) if v >= 0.5)
    return f"{m.cpu_us:.0f} us ({split}; {m.vcsw:.1f} vcsw)"


def run_write_bench(
    url: str,
    *,
    redis_url: str | None = None,
    writer_counts: tuple[int, ...] = (1, 4),
    modes: tuple[str, ...] = ("single", "batch"),
    batch: int = 1000,
    seconds: float = 3.0,
    rounds: int = 3,
    report: Callable[[str], None] = print,
    writer_url: str | None = None,
) -> list[WriteBenchResult]:
    """Medians of `rounds` rounds of raw, Redis off and (with `redis_url`) Redis on.
    ``writer_url``: the writers (raw and `streams`) log in as this user, a writer of the role
    model (`url` sets up: creates the stream and the raw table, then grants the raw table to
    that user)."""
    kinds = KINDS if redis_url is not None else KINDS[:3]
    results = []
    with scratch_streams(url, "write") as scratch:
        stream = scratch.create().name
        raw = (scratch.table("raw"), scratch.sequence("raw"))
        _setup_raw(url, *raw)
        if writer_url is not None:
            _grant_raw(url, writer_url, *raw)
            url = writer_url
        for mode in modes:
            for writers in writer_counts:
                runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
                for _ in range(rounds):
                    for kind in kinds:
                        args = (kind, url, redis_url, mode, writers, batch, stream, raw, seconds)
                        runs[kind].append(_measure(scratch, *args))
                measured = {k: _median(v) for k, v in runs.items()}
                headline = measured["redis-on" if "redis-on" in measured else "redis-off"]
                result = WriteBenchResult(
                    mode, writers, measured["raw"].per_s, headline.per_s, measured
                )
                results.append(result)
                parts = [f"raw {measured['raw'].per_s:>9,.0f}/s"]
                for kind in kinds[1:]:
                    rate, ratio = measured[kind].per_s, result.ratio_of(kind)
                    parts.append(f"{kind} {rate:>9,.0f}/s ratio {ratio:.2f}")
                report(f"{mode:>6} x{writers} writer(s): " + " | ".join(parts))
                target = result.keyed_target
                report(
                    f"{'':>8}keyed {measured['keyed'].per_s:,.0f}/s vs unkeyed "
                    f"{measured['redis-off'].per_s:,.0f}/s (Redis off): "
                    f"{result.keyed_ratio:.2f}x (target >= {target:.2f}x: "
                    f"{'met' if result.keyed_ratio >= target else 'not met'})"
                )
                for kind in kinds:
                    report(f"{'':>8}client CPU per append, {kind:>9}: {_cpu_text(measured[kind])}")
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


@click.command(name="write")
@click.option(
    "--seconds", type=FiniteFloat(0.1, 3600), default=3.0, show_default=True,
    help="Per measurement.",
)  # fmt: skip
@click.option("--rounds", type=click.IntRange(1, 100), default=3, show_default=True)
@click.option(
    "--writers", "writer_counts", multiple=True, type=click.IntRange(1, 64), default=(1, 4),
    show_default=True,
)  # fmt: skip
@click.option(
    "--memory-facts", type=click.IntRange(0, 100_000_000), default=1_000_000, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
@plot_option("Also draw appends/s beside raw and the ratios against writers, as FILE.png or "
             "FILE.svg (the plot extra).")  # fmt: skip
@click.option(
    "--writer-url", metavar="URL", type=DATABASE_URL,
    help="Append (raw and streams) as this user, a member of streams_writer of a database set "
    "up with `streams roles create`: appends as deployed under the role model (row security, "
    "partition grants); --database-url sets up and removes.",
)  # fmt: skip
@common_options
def bench_write_command(
    seconds: float,
    rounds: int,
    writer_counts: tuple[int, ...],
    memory_facts: int,
    as_json: bool,
    plot: Path | None,
    writer_url: str | None,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Appends/s (single and 1000-per-transaction) for 1 and 4 writer processes vs raw,
    with Redis off, keyed (each fact with an idempotency key, Redis off) and (when a Redis URL
    is configured) Redis on, and client CPU per append."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    redis_text = redact_url(settings.redis_url) if settings.redis_url else "none (Redis off only)"
    click.echo(
        f"database {redact_url(settings.database_url)}; Redis {redis_text}; "
        f"medians of {rounds} rounds"
        + (f"; writers log in as {redact_url(writer_url)}" if writer_url else "")
    )
    report = progress_report()
    results = run_write_bench(
        settings.database_url,
        redis_url=settings.redis_url,
        writer_counts=writer_counts,
        seconds=seconds,
        rounds=rounds,
        report=report,
        writer_url=writer_url,
    )
    if memory_facts:
        tracker_memory(memory_facts, report=report)
    if as_json:
        data = [r.as_dict() for r in results]
        click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
    if plot is not None:
        plot_write(results, plot)
        click.echo(f"plot written to {plot}")
