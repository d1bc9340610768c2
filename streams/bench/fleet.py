"""`streams bench fleet`: N writer processes and K reader processes on S streams, beside a raw
baseline of the same shape, measured in the same run.

For each point ``NxK`` (default ``1x0,1x1,8x0,8x8,32x0,32x1,32x32``: N in 1, 8, 32 and K in 0,
1, 8, 32), with fresh processes (`streams.bench.fleet_child`):

* **fixed rate**: the N writers append ``--rate`` facts/s in total for ``--seconds``, spread
  over the S streams (writer i and reader j on stream i mod S, j mod S); the K readers follow
  live (shared proofs on, as deployed). Reported: **total CPU per fact**, summed over every
  process involved (the writer and reader processes, every PostgreSQL process and
  ``redis-server``, read from ``/proc``; servers on another machine are left out and the report
  says so); **PostgreSQL statements per fact** (every statement the processes send, counted in
  psycopg); **Redis messages delivered per append** (counted by each process's link or
  subscription); delivery p50/p99 (each fact carries its send time).
* **flat out**: the same writers append as fast as they can for ``--seconds``: appends/s, and
  its ratio to the same N with K = 0.

"Per fact" is per fact appended and delivered to every one of the K readers: what the fleet
pays to get one fact to all its readers (so cost that grows with K shows). The raw baseline of
each point: N processes that ``INSERT`` each fact (autocommit) and ``PUBLISH`` its payload, K
plain Redis subscribers of those messages; same rate, same figures.

Targets (issue 19), each checked when its points ran, gathered in ``all_targets_met``:
N = 32, K = 32 total CPU per fact <= 2x raw; writers flat out at K = 32 >= 0.5x K = 0; p99 at
K = 32 <= 5x the raw subscribers' p99; PostgreSQL statements per fact at K = 32 <= 1.5x K = 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from ..cli_params import FiniteFloat, common_options
from ..config import Settings, redact_url
from ..store import sessions
from .common import Scratch, percentiles_ms, scratch_streams
from .plots import plot_fleet, plot_option
from .targets import FLEET_TARGET_CPU_VS_RAW as TARGET_CPU_VS_RAW
from .targets import FLEET_TARGET_P99_VS_RAW as TARGET_P99_VS_RAW
from .targets import FLEET_TARGET_STATEMENTS_VS_K1 as TARGET_STATEMENTS_VS_K1
from .targets import FLEET_TARGET_WRITERS_VS_K0 as TARGET_WRITERS_VS_K0

__all__ = ["bench_fleet_command", "parse_points", "run_fleet_bench"]

DEFAULT_POINTS = "1x0,1x1,8x0,8x8,32x0,32x1,32x32"
#: Seconds the processes of a point get to elect a prover and subscribe before measuring.
SETTLE_SECONDS = 2.0


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1x0,32x32"`` -> ``[(1, 0), (32, 32)]`` (N writers >= 1, K readers >= 0, <= 256)."""
    points = []
    for part in text.split(","):
        n, sep, k = part.strip().partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise ValueError(f"{part!r} is not NxK (writers x readers), e.g. 32x8")
        if not 1 <= int(n) <= 256 or not 0 <= int(k) <= 256:
            raise ValueError(f"{part!r}: N must be 1-256 and K 0-256")
        points.append((int(n), int(k)))
    return points


class _Points(click.ParamType):  # type: ignore[type-arg]
    name = "NxK,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> list[tuple[int, int]]:
        if isinstance(value, list):
            return value
        try:
            return parse_points(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# ----------------------------------------------------------------------- processes


class _Children:
    """The processes of one point, spoken to through their stdin/stdout."""

    def __init__(self, scratch: Scratch) -> None:
        self.scratch = scratch
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        proc = self.scratch.watch(
            subprocess.Popen(
                [sys.executable, "-m", "streams.bench.fleet_child", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def ready(procs: Sequence[subprocess.Popen[str]]) -> None:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "READY":
                raise click.ClickException(
                    "a benchmark process failed to start (see its error above; with many "
                    "processes: the server's max_connections?)"
                )

    @staticmethod
    def ask(procs: Sequence[subprocess.Popen[str]], command: str) -> list[dict[str, Any]]:
        """Send ``command`` to every process, then read every answer."""
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        answers = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise click.ClickException("a benchmark process ended early (see above)")
            answers.append(json.loads(line))
        return answers

    def end(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# ----------------------------------------------------------------------- servers' CPU


def _local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("", "localhost", "127.0.0.1", "::1") or host.startswith("/")


def _server_cpu(names: tuple[str, ...]) -> float:
    """User + system seconds of every process whose name starts with one of ``names``, and of
    its children that ended (from /proc): a PostgreSQL backend that exits during a phase
    moves its CPU into the postmaster's, so the sum only grows."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm.startswith(names):
            fields = stat[stat.rindex(")") + 2 :].split()
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


class _ServerMeter:
    """CPU of the local PostgreSQL and Redis servers between `start` and `stop`."""

    def __init__(self, settings: Settings) -> None:
        self.pg = _local(settings.database_url) and os.path.isdir("/proc")
        self.redis = settings.redis_url is not None and _local(settings.redis_url)
        self.pg_cpu = self.redis_cpu = 0.0

    def start(self) -> None:
        self._pg0 = _server_cpu(("postgres", "postmaster")) if self.pg else 0.0
        self._redis0 = _server_cpu(("redis-server",)) if self.redis else 0.0

    def stop(self) -> None:
        if self.pg:
            self.pg_cpu = _server_cpu(("postgres", "postmaster")) - self._pg0
        if self.redis:
            self.redis_cpu = _server_cpu(("redis-server",)) - self._redis0


# ----------------------------------------------------------------------- one point


def _fixed_phase(
    settings: Settings,
    writers: list[subprocess.Popen[str]],
    readers: list[subprocess.Popen[str]],
    seconds: float,
    rate: float,
) -> dict[str, Any]:
    meter = _ServerMeter(settings)
    if readers:
        _Children.ask(readers, "mark")
    meter.start()
    wrote = _Children.ask(writers, f"run {seconds} {rate / len(writers)}")
    time.sleep(0.5)  # the last facts reach the readers
    got = _Children.ask(readers, "report") if readers else []
    meter.stop()
    n = sum(w["n"] for w in wrote)
    clients = sum(x["cpu"] for x in (*wrote, *got))
    total = clients + meter.pg_cpu + meter.redis_cpu
    per = max(n, 1)
    lat = percentiles_ms(x for g in got for x in g["lat"])
    return {
        "facts": n,
        "delivered": sum(g["n"] for g in got),
        "cpu_us_per_fact": total / per * 1e6,
        "client_cpu_us_per_fact": clients / per * 1e6,
        "postgres_cpu_us_per_fact": meter.pg_cpu / per * 1e6 if meter.pg else None,
        "redis_cpu_us_per_fact": meter.redis_cpu / per * 1e6 if meter.redis else None,
        "statements_per_fact": sum(x["stmts"] for x in (*wrote, *got)) / per,
        "redis_messages_per_append": sum(x["recv"] for x in (*wrote, *got)) / per,
        **({"p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"]} if got else {}),
    }


def _system_point(
    scratch: Scratch,
    settings: Settings,
    n: int,
    k: int,
    streams: int,
    seconds: float,
    rate: float,
) -> dict[str, Any]:
    assert settings.redis_url is not None
    names = [scratch.create(f"{n}x{k}-{i}").name for i in range(min(streams, max(n, k)))]
    prefix = f"bench-fleet-{secrets.token_hex(4)}"
    children = _Children(scratch)
    try:
        url, redis_url = settings.database_url, settings.redis_url
        readers = [children.spawn("reader", url, redis_url, prefix, names[j % len(names)])
                   for j in range(k)]  # fmt: skip
        _Children.ready(readers)
        writers = [children.spawn("writer", url, redis_url, prefix, names[i % len(names)])
                   for i in range(n)]  # fmt: skip
        _Children.ready(writers)
        time.sleep(SETTLE_SECONDS)
        point = _fixed_phase(settings, writers, readers, seconds, rate)
        flat = _Children.ask(writers, f"run {seconds} 0")
        point["appends_per_s"] = sum(w["n"] for w in flat) / seconds
        return point
    finally:
        children.end()
        for name in names:
            scratch.drop(name)


def _raw_point(
    scratch: Scratch,
    settings: Settings,
    n: int,
    k: int,
    streams: int,
    seconds: float,
    rate: float,
) -> dict[str, Any]:
    assert settings.redis_url is not None
    table = scratch.table("fleet")
    with contextlib.closing(
        sessions.connect(settings.database_url, autocommit=True, purpose="bench")
    ) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, payload jsonb)".encode())
    channels = [f"bench-fleet-raw-{secrets.token_hex(4)}" for _ in range(min(streams, max(n, k)))]
    children = _Children(scratch)
    try:
        url, redis_url = settings.database_url, settings.redis_url
        readers = [children.spawn("raw_reader", redis_url, channels[j % len(channels)])
                   for j in range(k)]  # fmt: skip
        _Children.ready(readers)
        writers = [children.spawn("raw_writer", url, redis_url, channels[i % len(channels)],
                                  table) for i in range(n)]  # fmt: skip
        _Children.ready(writers)
        time.sleep(0.5)
        return _fixed_phase(settings, writers, readers, seconds, rate)
    finally:
        children.end()


# ----------------------------------------------------------------------- the run


def _target(value: float, op: str, bound: float) -> dict[str, Any]:
    met = value <= bound if op == "<=" else value >= bound
    return {"value": value, "target": f"{op} {bound:g}", "met": met}


def _targets(points: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    """Each target of issue 19 whose points ran: its figures and whether it is met."""
    out: dict[str, Any] = {}
    big = points.get((32, 32))
    if big is not None:
        ratio = big["system"]["cpu_us_per_fact"] / big["raw"]["cpu_us_per_fact"]
        out["cpu_32x32_vs_raw"] = _target(ratio, "<=", TARGET_CPU_VS_RAW)
        p99 = big["system"].get("p99_ms", 0.0) / max(big["raw"].get("p99_ms", 0.0), 1e-9)
        out["p99_32x32_vs_raw"] = _target(p99, "<=", TARGET_P99_VS_RAW)
        base = points.get((32, 0))
        if base is not None:
            vs = big["system"]["appends_per_s"] / base["system"]["appends_per_s"]
            out["writers_k32_vs_k0"] = _target(vs, ">=", TARGET_WRITERS_VS_K0)
        one = points.get((32, 1))
        if one is not None:
            st = big["system"]["statements_per_fact"] / one["system"]["statements_per_fact"]
            out["statements_k32_vs_k1"] = _target(st, "<=", TARGET_STATEMENTS_VS_K1)
    return out


def run_fleet_bench(
    settings: Settings,
    *,
    points: Sequence[tuple[int, int]],
    streams: int,
    seconds: float,
    rate: float,
    report: Any,
) -> dict[str, Any]:
    if settings.redis_url is None:
        raise click.ClickException("bench fleet measures the deployed path: set a Redis URL")
    results: dict[tuple[int, int], dict[str, Any]] = {}
    with scratch_streams(settings.database_url, "fleet") as scratch:
        for n, k in points:
            system = _system_point(scratch, settings, n, k, streams, seconds, rate)
            raw = _raw_point(scratch, settings, n, k, streams, seconds, rate)
            results[(n, k)] = {"writers": n, "readers": k, "system": system, "raw": raw}
            base = results.get((n, 0))
            if base is not None:
                system["vs_k0"] = system["appends_per_s"] / base["system"]["appends_per_s"]
            report(_line(n, k, system, raw))
    targets = _targets(results)
    for name, t in targets.items():
        report(f"target {name}: {t['value']:.2f} ({t['target']}): "
               f"{'met' if t['met'] else 'NOT met'}")  # fmt: skip
    met = bool(targets) and len(targets) == 4 and all(t["met"] for t in targets.values())
    report(f"all targets met: {met}" + ("" if len(targets) == 4 else " (some points not run)"))
    return {
        "points": list(results.values()),
        "targets": targets,
        "all_targets_met": met,
        "rate": rate,
        "seconds": seconds,
        "servers_measured": {
            "postgres": _ServerMeter(settings).pg,
            "redis": _ServerMeter(settings).redis,
        },
    }


def _line(n: int, k: int, system: dict[str, Any], raw: dict[str, Any]) -> str:
    def lat(p: dict[str, Any]) -> str:
        return f"p50 {p['p50_ms']:.1f} / p99 {p['p99_ms']:.1f} ms" if "p99_ms" in p else "-"

    vs = f" ({system['vs_k0']:.2f}x K=0)" if "vs_k0" in system else ""
    cpu, raw_cpu = system["cpu_us_per_fact"], raw["cpu_us_per_fact"]
    stmts, raw_stmts = system["statements_per_fact"], raw["statements_per_fact"]
    return (
        f"N={n} K={k}: CPU {cpu:.0f} us/fact (raw {raw_cpu:.0f}, {cpu / raw_cpu:.2f}x); "
        f"{stmts:.2f} statements/fact (raw {raw_stmts:.2f}); "
        f"{system['redis_messages_per_append']:.1f} Redis messages/append "
        f"(raw {raw['redis_messages_per_append']:.1f}); delivery {lat(system)} (raw {lat(raw)}); "
        f"flat out {system['appends_per_s']:.0f} appends/s{vs}"
    )


@click.command(name="fleet")
@click.option("--points", type=_Points(), default=DEFAULT_POINTS, show_default=True,
              help="Comma-separated NxK: N writer processes, K reader processes.")  # fmt: skip
@click.option("--streams", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Streams the writers and readers are spread over.")  # fmt: skip
@click.option("--seconds", type=FiniteFloat(0.5, 3600), default=4.0, show_default=True)
@click.option("--rate", type=FiniteFloat(1, 100_000), default=500.0, show_default=True,
              help="Total facts/s of the fixed-rate phase.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
@plot_option("Also draw CPU per fact, p99 and flat-out appends per point beside the raw "
             "fleet, as FILE.png or FILE.svg (the plot extra).")  # fmt: skip
@common_options
def bench_fleet_command(
    points: list[tuple[int, int]],
    streams: int,
    seconds: float,
    rate: float,
    as_json: bool,
    plot: Path | None,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """N writer and K reader processes on S streams: CPU, PostgreSQL statements and Redis
    messages per fact, delivery latency and flat-out appends, beside a raw INSERT + PUBLISH
    baseline of the same shape."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    click.echo(f"database {redact_url(settings.database_url)}; {streams} stream(s), "
               f"{seconds:g} s per phase, {rate:g} facts/s fixed rate")  # fmt: skip
    result = run_fleet_bench(
        settings, points=points, streams=streams, seconds=seconds, rate=rate, report=click.echo
    )
    if as_json:
        click.echo(json.dumps(result, sort_keys=True, separators=(",", ":")))
    if plot is not None:
        plot_fleet(result, plot)
        click.echo(f"plot written to {plot}")
