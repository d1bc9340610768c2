"""`streams bench fanout`: many reader processes on one stream, with and without shared proofs.

For each K (reader processes following one stream live, Redis on) and each mode (``shared``:
one elected prober, `streams.proofs`; ``own``: every reader probes PostgreSQL itself, as before
shared proofs), in one run:

* **flat out**: ``--writers`` writer processes append single facts as fast as they can for
  ``--seconds``: appends/s, and its ratio to K = 0 measured in the same run (target: >= 0.5
  with the most readers, shared proofs);
* **fixed rate**: the writers append ``--rate`` facts/s in total for ``--seconds``, each fact
  carrying its wall-clock send time; every reader reports the delay to delivery: p50/p99 over
  all readers (target: p99 <= 5x that of as many plain Redis subscribers, measured in the same
  run);
* **probes/s**: ``pg_locks`` probes per second over both phases (readers' own probes plus the
  prober's).

The baseline, in the same run: K plain Redis subscriber processes of messages published at the
same rate (p50/p99), and K = 0 for the writers. Processes are started fresh for every point; the
machine is noisy, so compare ratios within one run.

The processes run `streams.bench.fanout_child`. Each point has a stream of its own, dropped
after it; all are the run's own (`common.scratch_streams`): on Ctrl-C or an error, the
processes are ended and every stream left is dropped.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import click

from ..cli_params import FiniteFloat, IntList, NameList, common_options
from ..config import Settings, redact_url
from ..transport.discovery import open_client
from .common import Scratch, percentiles_ms, scratch_streams

__all__ = ["bench_fanout_command", "run_fanout_bench"]


def _spawn(scratch: Scratch, role: str, *args: str) -> subprocess.Popen[str]:
    """A `streams.bench.fanout_child` process in ``role``."""
    return scratch.watch(
        subprocess.Popen(
            [sys.executable, "-m", "streams.bench.fanout_child", role, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    )


def _ready(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "READY":
            raise click.ClickException(
                "a benchmark process failed to start (see its error above; each reader "
                "process holds 2 connections, 3 with shared proofs: max_connections?)"
            )


def _results(procs: Sequence[subprocess.Popen[str]], stop: bool) -> list[dict[str, Any]]:
    out = []
    for proc in procs:
        if stop:
            proc.terminate()
        stdout, _ = proc.communicate(timeout=60)
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _kill(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Whatever is still running (after a failure, or a point that ended normally)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def _writers(
    scratch: Scratch,
    settings: Settings,
    prefix: str,
    stream: str,
    n: int,
    seconds: float,
    rate: float,
) -> int:
    args = (settings.database_url, settings.redis_url or "", prefix, stream)
    share = str(rate / n if rate > 0 else 0)
    procs = [_spawn(scratch, "writer", *args, str(seconds), share) for _ in range(n)]
    try:
        _ready(procs)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        return sum(r["n"] for r in _results(procs, stop=False))
    finally:
        _kill(procs)


def _point(
    scratch: Scratch,
    settings: Settings,
    k: int,
    shared: bool,
    writers: int,
    seconds: float,
    rate: float,
) -> dict[str, Any]:
    prefix = f"bench-fanout-{secrets.token_hex(4)}"
    stream = scratch.create(f"k{k}-{'shared' if shared else 'own'}").name
    assert settings.redis_url is not None
    args = (settings.database_url, settings.redis_url, prefix, stream, "1" if shared else "0")
    readers = [_spawn(scratch, "reader", *args) for _ in range(k)]
    try:
        _ready(readers)
        time.sleep(1.5)  # elections, first proofs
        started = time.monotonic()
        flat = _writers(scratch, settings, prefix, stream, writers, seconds, 0)
        fixed = _writers(scratch, settings, prefix, stream, writers, seconds, rate)
        elapsed = time.monotonic() - started
        time.sleep(0.5)
        got = _results(readers, stop=True)
    finally:
        _kill(readers)
    scratch.drop(stream)  # after a failure, the scratch drops it once every process ended
    lat = [x for r in got for x in r["lat"]]
    delivered = [r["n"] for r in got]
    probes = sum(r["own"] + r["proofs"] for r in got)
    return {
        "readers": k,
        "mode": "shared" if shared else "own",
        "appends_per_s": flat / seconds,
        "fixed_rate_facts": fixed,
        "delivered_min": min(delivered, default=0),
        "delivered_expected": flat + fixed,
        "probes_per_s": probes / elapsed,
        **percentiles_ms(lat),
    }


def _redis_baseline(
    scratch: Scratch, redis_url: str, k: int, seconds: float, rate: float
) -> dict[str, Any]:
    channel = f"bench-fanout-raw-{secrets.token_hex(4)}"
    subs = [_spawn(scratch, "subscriber", redis_url, channel) for _ in range(k)]
    try:
        _ready(subs)
        time.sleep(0.3)
        r = open_client(redis_url)
        due = time.monotonic()
        end = due + seconds
        while due < end:
            r.publish(channel, repr(time.time()))
            due += 1 / rate
            time.sleep(max(0.0, due - time.monotonic()))
        r.close()
        time.sleep(0.3)
        got = _results(subs, stop=True)
    finally:
        _kill(subs)
    return {"readers": k, "mode": "redis", **percentiles_ms(x for g in got for x in g["lat"])}


def run_fanout_bench(
    settings: Settings,
    *,
    ks: Sequence[int],
    modes: Sequence[str],
    writers: int,
    seconds: float,
    rate: float,
    report: Callable[[str], None],
) -> dict[str, Any]:
    if settings.redis_url is None:
        raise click.ClickException("bench fanout measures the Redis fast path: set a Redis URL")
    with scratch_streams(settings.database_url, "fanout") as scratch:
        return _measure_all(scratch, settings, ks, modes, writers, seconds, rate, report)


def _measure_all(
    scratch: Scratch,
    settings: Settings,
    ks: Sequence[int],
    modes: Sequence[str],
    writers: int,
    seconds: float,
    rate: float,
    report: Callable[[str], None],
) -> dict[str, Any]:
    """K = 0, then for each K plain Redis subscribers and each mode."""
    assert settings.redis_url is not None
    base = _point(scratch, settings, 0, True, writers, seconds, rate)
    report(f"K=0: writers {base['appends_per_s']:.0f} appends/s (the baseline)")
    points: list[dict[str, Any]] = []
    for k in ks:
        if k == 0:
            continue
        raw = _redis_baseline(scratch, settings.redis_url, k, seconds, rate)
        report(f"K={k} plain Redis subscribers: p50 {raw['p50_ms']:.1f} ms, "
               f"p99 {raw['p99_ms']:.1f} ms")  # fmt: skip
        points.append(raw)
        for mode in modes:
            try:
                point = _point(scratch, settings, k, mode == "shared", writers, seconds, rate)
            except click.ClickException as exc:  # e.g. the server's max_connections
                report(f"K={k} {mode:6}: failed: {exc.message}")
                points.append({"readers": k, "mode": mode, "error": exc.message})
                continue
            point["vs_k0"] = point["appends_per_s"] / base["appends_per_s"]
            point["p99_vs_redis"] = point["p99_ms"] / raw["p99_ms"]
            points.append(point)
            report(
                f"K={k} {mode:6}: writers {point['appends_per_s']:.0f} appends/s "
                f"({point['vs_k0']:.2f}x K=0); at {rate:g} facts/s p50 {point['p50_ms']:.1f} ms, "
                f"p99 {point['p99_ms']:.1f} ms ({point['p99_vs_redis']:.1f}x Redis); "
                f"{point['probes_per_s']:.0f} probes/s; every reader got "
                f"{point['delivered_min']}/{point['delivered_expected']}"
            )
    targets = _targets(points, max(ks))
    if targets is not None:
        report(
            f"targets (issue 19) with {targets['readers']} readers: writers >= 0.5x K=0 "
            f"({targets['vs_k0']:.2f}x) and p99 <= 5x {targets['readers']} plain Redis "
            f"subscribers' ({targets['p99_vs_redis']:.1f}x): "
            f"{'met' if targets['met'] else 'NOT met'}"
        )
    return {"k0": base, "points": points, "targets": targets}


#: Issue 19's targets for the most readers measured, with shared proofs: the writers keep at
#: least this share of their K = 0 throughput ...
TARGET_VS_K0 = 0.5
#: ... and delivery p99 is at most this many times that of as many plain Redis subscribers.
TARGET_P99_VS_REDIS = 5.0


def _targets(points: Sequence[dict[str, Any]], k: int) -> dict[str, Any] | None:
    """Whether the shared-proof point with ``k`` readers meets the targets (None: not run)."""
    for p in points:
        if p.get("mode") == "shared" and p["readers"] == k and "error" not in p:
            met = p["vs_k0"] >= TARGET_VS_K0 and p["p99_vs_redis"] <= TARGET_P99_VS_REDIS
            return {"readers": k, "vs_k0": p["vs_k0"], "p99_vs_redis": p["p99_vs_redis"],
                    "met": met}  # fmt: skip
    return None


@click.command(name="fanout")
@click.option("--readers", "ks", type=IntList(0, 256), default="1,4,16,32", show_default=True,
              help="Comma-separated numbers of reader processes.")  # fmt: skip
@click.option("--modes", type=NameList(("shared", "own")), default="shared,own",
              show_default=True,
              help="shared (one elected prober) and/or own (every reader probes).")  # fmt: skip
@click.option("--writers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--seconds", type=FiniteFloat(0.5, 3600), default=4.0, show_default=True)
@click.option("--rate", type=FiniteFloat(1, 100_000), default=500.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
@common_options
def bench_fanout_command(
    ks: list[int],
    modes: list[str],
    writers: int,
    seconds: float,
    rate: float,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """K reader processes on one stream: writers' throughput and delivery latency, shared
    proofs vs every reader probing, beside plain Redis subscribers."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    counts, chosen = ks, modes
    click.echo(f"database {redact_url(settings.database_url)}; {writers} writer processes, "
               f"{seconds:g} s per phase, {rate:g} facts/s fixed rate")  # fmt: skip
    result = run_fanout_bench(
        settings, ks=counts, modes=chosen, writers=writers, seconds=seconds, rate=rate,
        report=click.echo,
    )  # fmt: skip
    if as_json:
        click.echo(json.dumps(result, sort_keys=True, separators=(",", ":")))
