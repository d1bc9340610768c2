"""`streams bench streams`: what each call costs as the number of streams grows.

For each count (``--counts 10,1000,10000``) the database holds that many of the run's streams
(idle fillers, made with `streams.Client.create_streams`, beside the run's subjects: one stream
of `SUBJECT_FACTS` facts with a reader group, and `WIDE` streams of one fact each for the wide
reader). At each count it measures, as medians of a few rounds on one client (Redis on when
configured, as deployed):

* per-stream calls: ``positions(one)``, a writer's open and first append, a single append,
  a reader's open and catch-up (and a group reader's, with its commit), a reader of `WIDE`
  streams opened and caught up, ``create_stream`` (of a stream dropped after), ``prune``;
* whole-database views, as the commands read them (in-process, without the interpreter's
  start or the printing): `streams.Client.overview` as ``list`` and ``positions`` (sorted by
  lag) and ``groups list`` call it, ``doctor``'s set-based checks of every stream, and a metrics
  scrape (`streams.metrics.DatabaseCollector`, with the size of its text).

Beside each figure: its ratio to the same call at the smallest count, the target (issue 40:
a per-stream call within `PER_STREAM_TARGET`x; a view under `VIEW_TARGET_S` s), and a raw
``SELECT 1`` round trip measured in the same round, since the machine is noisy. The counts are
minutes apart, and a machine drifts as much in minutes as the target's margin: so the
per-stream calls are measured at the smallest count again at the end (the run's other streams
dropped), and the verdict compares the largest count with the mean of both baselines. Everything
the run made is dropped at the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import psycopg

from ..cli_params import common_options
from ..client import Client, connect
from ..config import Settings, redact_url
from .plots import plot_option, plot_stream_counts

__all__ = ["StreamCountResult", "bench_streams_command", "run_stream_count_bench"]

SUBJECT_FACTS = 100
#: The wide reader's streams: the first fillers, one fact each, measured from the first count
#: that holds them.
WIDE = 200
PER_STREAM_TARGET = 1.3
VIEW_TARGET_S = 1.0


@dataclass
class StreamCountResult:
    counts: list[int]
    #: figure name -> seconds per count (same order as ``counts``; None: not measured there).
    seconds: dict[str, list[float | None]] = field(default_factory=dict)
    raw_round_trip: list[float] = field(default_factory=list)
    scrape_bytes: list[int] = field(default_factory=list)
    #: Per-stream figures at the smallest count measured again at the end, after the run's
    #: other streams were dropped: the baseline brackets the run, so a drift of the machine
    #: over its minutes shows (and the ratios use the mean of both).
    base_again: dict[str, float] = field(default_factory=dict)

    def base(self, name: str) -> float | None:
        """The smallest count's figure of ``name``: the mean of both measurements."""
        first = next((s for s in self.seconds.get(name, []) if s is not None), None)
        again = self.base_again.get(name)
        if first is None or again is None:
            return first
        return (first + again) / 2

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "seconds": self.seconds,
            "raw_round_trip_s": self.raw_round_trip,
            "scrape_bytes": self.scrape_bytes,
            "base_again_s": self.base_again,
            "views": sorted(_VIEWS),
            "per_stream_target": PER_STREAM_TARGET,
            "view_target_s": VIEW_TARGET_S,
        }


def _median(rounds: int, action: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Run:
    """One run's streams (names carry the run's tag) and its client."""

    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.tag = f"bench_streams_{int(time.time())}"
        self.subject = f"{self.tag}_subject"
        self.fillers: list[str] = []
        self.made: list[str] = []
        self.serial = 0

    @property
    def wide(self) -> list[str]:
        return self.fillers[:WIDE]

    def setup(self) -> None:
        self.client.create_stream(self.subject)
        self.made.append(self.subject)
        with self.client.writer(self.subject) as writer:
            writer.append_batch([{"n": n} for n in range(SUBJECT_FACTS)])

    def grow_to(self, count: int) -> None:
        first = len(self.fillers)
        names = [f"{self.tag}_f{n:05d}" for n in range(first, first + count - len(self.made))]
        if names:
            self.client.create_streams(names)
            self.fillers += names
            self.made += names
        for name in self.fillers[first:WIDE]:
            with self.client.writer(name) as writer:
                writer.append({"w": name})

    def shrink_to(self, count: int) -> None:
        """Drop the run's streams but the subject and its first ``count - 1`` fillers: the
        database holds what it held at the smallest count again."""
        keep = {self.subject, *self.fillers[: max(0, count - 1)]}
        self.client.drop_streams([name for name in self.made if name not in keep])
        self.fillers = [name for name in self.fillers if name in keep]
        self.made = [name for name in self.made if name in keep]

    def remove(self) -> None:
        self.client.drop_streams(self.made)

    # -------------------------------------------------------------------- the calls

    def positions(self) -> None:
        self.client.positions(self.subject)

    def writer_open(self) -> None:
        with self.client.writer(self.subject) as writer:
            writer.append({"open": True})

    def reader_catch_up(self, group: str | None = None) -> None:
        with self.client.reader(self.subject, group=group) as reader:
            seen = sum(1 for _ in reader.facts())
            if group is not None:
                reader.commit()
        if group is None and seen < SUBJECT_FACTS:
            raise AssertionError(f"the reader saw {seen} facts of {SUBJECT_FACTS}")

    def wide_catch_up(self) -> None:
        with self.client.reader(self.wide) as reader:
            seen = sum(1 for _ in reader.facts())
        if seen != WIDE:
            raise AssertionError(f"the wide reader saw {seen} facts of {WIDE}")

    def create_one(self) -> None:
        self.serial += 1
        name = f"{self.tag}_c{self.serial:04d}"
        self.made.append(name)
        self.client.create_stream(name)

    def doctor_checks(self) -> None:
        """What ``streams doctor`` reads of every stream (`streams.store.overview.stream_health`
        and one look at who holds streams back), without the checks of its few chosen streams."""
        from ..store import sessions
        from ..store.driver import run
        from ..store.overview import stream_health
        from ..store.probe import held_streams
        from ..store.registry import list_streams

        with sessions.connect(
            self.settings.database_url, autocommit=False, purpose="bench"
        ) as conn:
            run(conn, stream_health(run(conn, list_streams())))
            run(conn, held_streams())

    def metrics_scrape(self) -> int:
        from prometheus_client import CollectorRegistry, generate_latest

        from ..metrics import DatabaseCollector

        registry = CollectorRegistry()
        registry.register(DatabaseCollector(self.settings))
        return len(generate_latest(registry))


def run_stream_count_bench(
    settings: Settings,
    counts: Sequence[int],
    rounds: int = 5,
    report: Callable[[str], None] = click.echo,
) -> StreamCountResult:
    result = StreamCountResult(sorted(counts))
    with connect(settings.database_url, redis_url=settings.redis_url) as client:
        run = _Run(client, settings)
        try:
            run.setup()
            with (
                client.writer(run.subject, instance="bench-steady") as writer,
                psycopg.connect(settings.database_url, autocommit=True) as raw,
            ):

                def per_stream() -> dict[str, float | None]:
                    return {
                        "positions(one)": _median(rounds * 2, run.positions),
                        "writer open + append": _median(rounds, run.writer_open),
                        "append": _median(rounds * 4, lambda: writer.append({"x": 1})),
                        "reader open + catch-up": _median(rounds, run.reader_catch_up),
                        "group open + catch-up + commit": _median(
                            rounds, lambda: run.reader_catch_up(group=f"{run.tag}_g")
                        ),
                        f"reader of {WIDE} streams": _median(max(2, rounds // 2), run.wide_catch_up)
                        if len(run.wide) == WIDE
                        else None,
                        "create_stream": _median(rounds, run.create_one),
                        "prune(one)": _median(rounds, lambda: client.prune(run.subject)),
                    }

                for count in result.counts:
                    started = time.perf_counter()
                    run.grow_to(count)
                    report(f"{count} streams (made in {time.perf_counter() - started:.1f} s)")
                    figures = per_stream()
                    figures.update(
                        {
                            "list (overview)": _median(3, client.overview),
                            "positions --json (overview)": _median(
                                3, lambda: client.overview(sort="lag")
                            ),
                            "groups list (overview)": _median(
                                3, lambda: client.overview(grouped=True)
                            ),
                            "doctor's checks": _median(3, run.doctor_checks),
                        }
                    )
                    size = 0

                    def scrape() -> None:
                        nonlocal size
                        size = run.metrics_scrape()

                    figures["metrics scrape"] = _median(3, scrape)
                    result.scrape_bytes.append(size)
                    result.raw_round_trip.append(
                        _median(rounds * 4, lambda: raw.execute("SELECT 1").fetchall())
                    )
                    for name, seconds in figures.items():
                        result.seconds.setdefault(name, []).append(seconds)
                    report(_lines(result, len(result.raw_round_trip) - 1))
                if len(result.counts) > 1:
                    started = time.perf_counter()
                    run.shrink_to(result.counts[0])
                    report(
                        f"{result.counts[0]} streams again, the baseline after the run (dropped "
                        f"the others in {time.perf_counter() - started:.1f} s)"
                    )
                    again = per_stream()
                    result.base_again = {k: v for k, v in again.items() if v is not None}
                    report(_bracketed(result))
        finally:
            report(f"removing the run's {len(run.made)} streams")
            run.remove()
    return result


_VIEWS = {
    "list (overview)",
    "positions --json (overview)",
    "groups list (overview)",
    "doctor's checks",
    "metrics scrape",
}


def _lines(result: StreamCountResult, i: int) -> str:
    count = result.counts[i]
    lines = [f"  raw SELECT 1 round trip {result.raw_round_trip[i] * 1e3:.2f} ms"]
    for name, seconds in result.seconds.items():
        measured = [s for s in seconds[: i + 1] if s is not None]
        if seconds[i] is None or not measured:
            continue
        here, base = measured[-1], measured[0]
        if name in _VIEWS:
            verdict = "ok" if here < VIEW_TARGET_S else "over"
            lines.append(
                f"  {name:<32} {here * 1e3:9.1f} ms  (x{here / base:.2f} of the first; "
                f"target < {VIEW_TARGET_S:g} s: {verdict})"
            )
        else:
            ratio = here / base
            verdict = "ok" if ratio <= PER_STREAM_TARGET or i == 0 else "over"
            lines.append(
                f"  {name:<32} {here * 1e3:9.2f} ms  x{ratio:.2f} of the first "
                f"(target <= {PER_STREAM_TARGET:g}x: {verdict})"
            )
    if result.scrape_bytes:
        lines.append(f"  metrics text {result.scrape_bytes[i] / 1024:.0f} KiB at {count} streams")
    return "\n".join(lines)


def _bracketed(result: StreamCountResult) -> str:
    """Each per-stream figure at the largest count against the baseline measured before and
    after the run, and the verdict against their mean."""
    last = len(result.counts) - 1
    lines = [f"  at {result.counts[last]} streams, against the baseline before / after / mean:"]
    for name, again in result.base_again.items():
        first, here = result.seconds[name][0], result.seconds[name][last]
        base = result.base(name)
        if first is None or here is None or base is None:
            continue
        verdict = "ok" if here / base <= PER_STREAM_TARGET else "over"
        lines.append(
            f"  {name:<32} {here * 1e3:9.2f} ms  x{here / first:.2f} / x{here / again:.2f} / "
            f"x{here / base:.2f} (baseline {first * 1e3:.2f} then {again * 1e3:.2f} ms; "
            f"target <= {PER_STREAM_TARGET:g}x: {verdict})"
        )
    return "\n".join(lines)


def _parse_counts(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter("a comma-separated list of numbers, e.g. 10,1000,10000") from None
    if not counts or counts[0] < 1 or counts[-1] > 100_000:
        raise click.BadParameter("counts between 1 and 100,000")
    return counts


@click.command(name="streams")
@click.option(
    "--counts", default="10,1000,10000", show_default=True, callback=_parse_counts,
    help="Numbers of streams in the database (the run's own, beside what it holds).",
)  # fmt: skip
@click.option("--rounds", type=click.IntRange(1, 100), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
@plot_option("Also draw each figure against the number of streams, as FILE.png or FILE.svg.")
@common_options
def bench_streams_command(
    counts: list[int],
    rounds: int,
    as_json: bool,
    plot: Path | None,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Per-stream calls and whole-database views at 10, 1,000, 10,000 streams."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    click.echo(f"database {redact_url(settings.database_url)}")
    result = run_stream_count_bench(settings, counts, rounds)
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True, separators=(",", ":")))
    if plot is not None:
        plot_stream_counts(result.as_dict(), plot)
        click.echo(f"plot written to {plot}")
