"""``streams bench ... --plot FILE``: a benchmark's figures as a picture, PNG or SVG.

Every plot shows what the benchmark prints: each figure beside its raw baseline of the same run
(bars side by side, the baseline hatched grey), the target as a dashed red line where the
benchmark has one (over the point it applies to, when it applies to one point only), axes with
their units, and a title naming the benchmark, the date (UTC) and the machine (host name and
cores), because figures from two machines are not comparable.

* `PLOT_FILE`: the ``--plot`` option's type: a path ending in ``.png`` or ``.svg`` (the format)
  in a directory that exists; checked when the command line is read, before a benchmark runs
  for minutes, and so is the library (`require_matplotlib`).
* `plot_fleet`, `plot_write`, `plot_latency`, `plot_arrow`: one per benchmark, each taking the
  benchmark's own result object and writing the file.

matplotlib (the ``plot`` extra) is imported only here, only when a plot is drawn, and only
through its object API on the Agg canvas (never ``pyplot``: no interactive backend, no global
figure state). SVGs keep their text as text and carry no date or random ids, so a plot drawn
twice from the same figures is the same file.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import math
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..errors import UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .history_arrow import ArrowMeasure
    from .targets import LatencyBenchResult, WriteBenchResult

__all__ = [
    "FORMATS",
    "PLOT_FILE",
    "plot_arrow",
    "plot_fleet",
    "plot_latency",
    "plot_write",
    "require_matplotlib",
]

F = TypeVar("F", bound=Callable[..., Any])

#: File suffix -> the format matplotlib writes.
FORMATS = {".png": "png", ".svg": "svg"}
#: The figure (streams) and its baseline (raw), everywhere.
OURS, RAW, TARGET = "#1f77b4", "#9e9e9e", "#d62728"
#: Bar width of a pair (streams beside raw) in category units.
WIDTH = 0.38


def require_matplotlib(what: str = "--plot") -> None:
    """`UsageError` naming the extra when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"{what} needs matplotlib: pip install 'streams[plot]'")


def check_plot_path(text: str) -> Path:
    """The path of a plot to write, or `ValueError` saying why it cannot be one."""
    if not text or "\x00" in text:
        raise ValueError("give a file name ending in .png or .svg")
    path = Path(text)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"{text!r}: the format comes from the suffix: .png or .svg")
    if path.is_dir():
        raise ValueError(f"{text!r} is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{str(parent)!r} is not an existing directory")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{str(parent)!r} is not writable")
    return path


class _PlotFile(click.ParamType[Path]):
    """``--plot FILE``: `check_plot_path`, and matplotlib installed."""

    name = "FILE.png|FILE.svg"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        if isinstance(value, Path):
            return value
        try:
            path = check_plot_path(str(value))
            require_matplotlib()
        except (ValueError, UsageError) as exc:
            self.fail(str(exc), param, ctx)
        return path


PLOT_FILE = _PlotFile()


def plot_option(help_text: str) -> Callable[[F], F]:
    """The ``--plot`` option of a benchmark command (``None`` when not given)."""
    return click.option("--plot", type=PLOT_FILE, default=None, metavar="FILE", help=help_text)


# ------------------------------------------------------------------------------ drawing


def _figure(
    panels: int, title: str, *, rows: int = 1, height: float = 4.6
) -> tuple[Figure, list[Axes]]:
    """A figure of ``panels`` axes on ``rows`` rows, under the title, date and machine."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = -(-panels // rows)
    fig = Figure(figsize=(5.2 * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)  # the non-interactive canvas; savefig picks the writer by format
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]
    machine = f"{socket.gethostname()}, {os.cpu_count() or '?'} cores"
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    fig.suptitle(f"{title}\n{when} · {machine}", fontsize=11)
    return fig, axes


def _save(fig: Figure, path: Path) -> None:
    import matplotlib

    fmt = FORMATS[path.suffix.lower()]
    # Text as text (small, searchable), no random ids and no date: the same figures, the same file.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "streams"}):
        metadata = {"Date": None} if fmt == "svg" else {"Software": "streams bench"}
        fig.savefig(path, format=fmt, dpi=110, metadata=metadata)


def _pairs(
    ax: Axes,
    labels: Sequence[str],
    ours: Sequence[float | None],
    raw: Sequence[float | None],
    *,
    ours_label: str,
    raw_label: str,
    ratios: bool = True,
) -> None:
    """Bars of the figure beside its baseline at each category, the ratio above the pair."""
    xs = range(len(labels))
    nan = float("nan")
    ys = [nan if y is None else y for y in ours]
    bs = [nan if b is None else b for b in raw]
    ax.bar([x - WIDTH / 2 for x in xs], ys, WIDTH, color=OURS, label=ours_label)
    ax.bar([x + WIDTH / 2 for x in xs], bs, WIDTH, color=RAW, hatch="//", label=raw_label)
    ax.set_xticks(list(xs), list(labels))
    if ratios:
        for x, y, b in zip(xs, ys, bs, strict=True):
            if not math.isnan(y) and not math.isnan(b) and b > 0:
                ax.annotate(f"{y / b:.2f}x", (x, max(y, b)), ha="center", va="bottom",
                            xytext=(0, 2), textcoords="offset points", fontsize=8)  # fmt: skip
    ax.margins(y=0.35)  # room for the legend above the bars


def _target_at(ax: Axes, x: float, y: float, label: str) -> None:
    """A target that applies to one category: a dashed segment across its pair."""
    ax.hlines(y, x - 0.45, x + 0.45, colors=TARGET, linestyles="--", linewidth=1.5, label=label)


def _target_line(ax: Axes, y: float, label: str) -> None:
    ax.axhline(y, color=TARGET, linestyle="--", linewidth=1.2, label=label)


# ------------------------------------------------------------------------------ fleet


def plot_fleet(result: dict[str, Any], path: Path) -> None:
    """`streams.bench.fleet.run_fleet_bench`'s result: per point N x K, total CPU per fact,
    delivery p99 and flat-out appends/s, each beside the raw fleet (or K = 0) of the run."""
    require_matplotlib()
    from .targets import FLEET_TARGET_CPU_VS_RAW as TARGET_CPU_VS_RAW
    from .targets import FLEET_TARGET_P99_VS_RAW as TARGET_P99_VS_RAW
    from .targets import FLEET_TARGET_WRITERS_VS_K0 as TARGET_WRITERS_VS_K0

    points = result["points"]
    labels = [f"{p['writers']}x{p['readers']}" for p in points]
    fig, (cpu, p99, flat) = _figure(3, "streams bench fleet: N writer x K reader processes")
    _pairs(cpu, labels, [p["system"]["cpu_us_per_fact"] for p in points],
           [p["raw"]["cpu_us_per_fact"] for p in points],
           ours_label="streams", raw_label="raw INSERT + PUBLISH")  # fmt: skip
    cpu.set_title("total CPU per fact (clients, PostgreSQL, Redis)", fontsize=10)
    cpu.set_ylabel("CPU per fact (µs)")
    _pairs(p99, labels, [p["system"].get("p99_ms") for p in points],
           [p["raw"].get("p99_ms") for p in points],
           ours_label="streams readers", raw_label="plain Redis subscribers")  # fmt: skip
    p99.set_title(f"delivery p99 at {result.get('rate', 0):g} facts/s (K > 0)", fontsize=10)
    p99.set_yscale("log")  # 1 x 1 and 32 x 32 differ by 10-100x, and so do their targets
    p99.set_ylabel("p99 commit to delivery (ms, log scale)")
    k0 = {p["writers"]: p["system"]["appends_per_s"] for p in points if p["readers"] == 0}
    _pairs(flat, labels, [p["system"]["appends_per_s"] for p in points],
           [k0.get(p["writers"]) for p in points],
           ours_label="with K readers", raw_label="same N, K = 0")  # fmt: skip
    flat.set_title("writers flat out", fontsize=10)
    flat.set_ylabel("appends per second")
    for i, p in enumerate(points):
        if (p["writers"], p["readers"]) != (32, 32):
            continue
        _target_at(cpu, i, TARGET_CPU_VS_RAW * p["raw"]["cpu_us_per_fact"],
                   f"target at 32x32: <= {TARGET_CPU_VS_RAW:g}x raw")  # fmt: skip
        if "p99_ms" in p["raw"]:
            _target_at(p99, i, TARGET_P99_VS_RAW * p["raw"]["p99_ms"],
                       f"target at 32x32: <= {TARGET_P99_VS_RAW:g}x raw")  # fmt: skip
        if 32 in k0:
            _target_at(flat, i, TARGET_WRITERS_VS_K0 * k0[32],
                       f"target at 32x32: >= {TARGET_WRITERS_VS_K0:g}x K = 0")  # fmt: skip
    for ax in (cpu, p99, flat):
        ax.set_xlabel("N writers x K readers (processes)")
        ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)


# ------------------------------------------------------------------------------ write


def plot_write(results: Sequence[WriteBenchResult], path: Path) -> None:
    """`streams.bench.write.run_write_bench`'s results: per mode, appends/s of each
    configuration beside raw, and their ratios to raw against the number of writers."""
    require_matplotlib()
    from .targets import KEYED_TARGETS, KINDS, TARGET_VS_RAW

    modes = list(dict.fromkeys(r.mode for r in results))
    fig, axes = _figure(
        2 * len(modes), "streams bench write: appends beside raw psycopg", rows=len(modes)
    )
    names = {"redis-off": "Redis off", "keyed": "keyed (Redis off)", "redis-on": "Redis on"}
    colours = {"raw": RAW, "redis-off": "#ff7f0e", "keyed": "#2ca02c", "redis-on": OURS}
    for m, mode in enumerate(modes):
        rates, ratios = axes[2 * m], axes[2 * m + 1]
        rows = sorted((r for r in results if r.mode == mode), key=lambda r: r.writers)
        kinds = [k for k in KINDS if all(k in r.kinds for r in rows)]
        what = "one fact per transaction" if mode == "single" else "batches of 1000"
        width = 0.8 / len(kinds)
        for j, kind in enumerate(kinds):
            xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(rows))]
            rates.bar(xs, [r.kinds[kind].per_s for r in rows], width, color=colours[kind],
                      hatch="//" if kind == "raw" else None,
                      label="raw psycopg" if kind == "raw" else names[kind])  # fmt: skip
        rates.set_xticks(range(len(rows)), [str(r.writers) for r in rows])
        rates.set_title(f"{mode}: {what}", fontsize=10)
        rates.set_ylabel("appends per second")
        rates.margins(y=0.35)
        writers = [r.writers for r in rows]
        ratios.axhline(1.0, color=RAW, linewidth=2, label="raw psycopg = 1")
        for kind in kinds[1:]:
            ratios.plot(writers, [r.ratio_of(kind) for r in rows], marker="o",
                        color=colours[kind], label=f"{names[kind]} / raw")  # fmt: skip
        ratios.plot(writers, [r.keyed_ratio for r in rows], marker="s", linestyle=":",
                    color=colours["keyed"], label="keyed / unkeyed")  # fmt: skip
        if mode in TARGET_VS_RAW:
            _target_line(ratios, TARGET_VS_RAW[mode], f"target >= {TARGET_VS_RAW[mode]:g}x raw")
        if mode in KEYED_TARGETS:
            keyed = KEYED_TARGETS[mode]
            ratios.axhline(keyed, color=TARGET, linestyle=":", linewidth=1,
                           label=f"target keyed >= {keyed:g}x unkeyed")  # fmt: skip
        ratios.set_xticks(writers)
        shown = [*(r.ratio_of(k) for r in rows for k in kinds[1:]), *(r.keyed_ratio for r in rows)]
        ratios.set_ylim(0, 1.5 * max([1.0, *(v for v in shown if not math.isnan(v))]))
        ratios.set_title(f"{mode}: ratios", fontsize=10)
        ratios.set_ylabel("ratio (appends/s over raw's)")
        for ax in (rates, ratios):
            ax.set_xlabel("writer processes")
            ax.legend(fontsize=7, loc="upper left", ncols=2)
    _save(fig, path)


# ------------------------------------------------------------------------------ latency


def _facts(n: int) -> str:
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


def plot_latency(result: LatencyBenchResult, path: Path) -> None:
    """`streams.bench.latency.run_latency_bench`'s result: latency p50/p99 per writer count
    beside raw Redis pub/sub, catch-up facts/s per stream size beside raw paging, and the
    catch-up ratio."""
    require_matplotlib()
    from .targets import TARGET_CATCHUP_VS_RAW, TARGET_P50_MS, TARGET_P99_MS, TARGET_P99_VS_RAW

    fig, (lat, rate, ratio) = _figure(3, "streams bench latency: delivery and catch-up")
    runs = result.latency
    labels = [f"{r.writers} w: p{q}" for r in runs for q in (50, 99)]
    _pairs(lat, labels, [v for r in runs for v in (r.streams.p50_ms, r.streams.p99_ms)],
           [v for r in runs for v in (r.raw_redis.p50_ms, r.raw_redis.p99_ms)],
           ours_label="streams reader", raw_label="raw Redis pub/sub")  # fmt: skip
    for i, r in enumerate(runs):  # each target over the bars it applies to, labelled once
        first = i == 0
        _target_at(
            lat, 2 * i, TARGET_P50_MS, f"target p50 <= {TARGET_P50_MS:g} ms" if first else "_"
        )
        label = f"target p99 <= {TARGET_P99_MS:g} ms" if first else "_"
        lat.hlines(TARGET_P99_MS, 2 * i + 0.55, 2 * i + 1.45, colors=TARGET, linestyles=":",
                   linewidth=1.5, label=label)  # fmt: skip
        _target_at(lat, 2 * i + 1, TARGET_P99_VS_RAW * r.raw_redis.p99_ms,
                   f"target p99 <= {TARGET_P99_VS_RAW:g}x raw" if first else "_")  # fmt: skip
    rates = {r.rate for r in runs}
    lat.set_title(f"commit to delivery at {'/'.join(f'{x:g}' for x in rates)} facts/s",
                  fontsize=10)  # fmt: skip
    lat.set_xlabel("writer processes: percentile")
    lat.set_ylabel("latency (ms)")
    sizes = [_facts(c.facts) for c in result.catchups]
    _pairs(rate, sizes, [c.streams_per_s for c in result.catchups],
           [c.raw_per_s for c in result.catchups],
           ours_label="streams reader", raw_label="raw psycopg paging")  # fmt: skip
    rate.set_title("catch-up from earliest (medians)", fontsize=10)
    rate.set_xlabel("facts in the stream")
    rate.set_ylabel("facts per second")
    ratio.bar(range(len(sizes)), [c.ratio for c in result.catchups], 0.5, color=OURS,
              label="streams / raw")  # fmt: skip
    ratio.axhline(1.0, color=RAW, linewidth=2, label="raw paging = 1")
    _target_line(ratio, TARGET_CATCHUP_VS_RAW, f"target >= {TARGET_CATCHUP_VS_RAW:g}x raw")
    ratio.set_xticks(range(len(sizes)), sizes)
    ratio.set_ylim(0, 1.5 * max([1.0, *(c.ratio for c in result.catchups)]))
    ratio.set_title("catch-up ratio", fontsize=10)
    ratio.set_xlabel("facts in the stream")
    ratio.set_ylabel("ratio (facts/s over raw's)")
    for ax in (lat, rate, ratio):
        ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)


# ------------------------------------------------------------------------------ Arrow


def plot_arrow(measure: ArrowMeasure, path: Path) -> None:
    """`streams.bench.history_arrow.measure_arrow`'s result: the three reads' medians, every
    round as a dot, and the two targets."""
    require_matplotlib()
    from .history_arrow import TARGET_VS_OBJECTS, TARGET_VS_RAW

    fig, (ax,) = _figure(1, "streams bench history --arrow", height=4.8)
    fig.set_figwidth(7.5)
    labels = ["batches()", "epochs()", "raw ADBC SELECT"]
    medians = [measure.batches_per_s, measure.epochs_per_s, measure.raw_adbc_per_s]
    ax.bar(range(3), medians, 0.6, color=[OURS, "#ff7f0e", RAW], hatch=[None, None, "//"])
    for i in range(3):
        ax.scatter([i] * len(measure.rounds), [r[i] for r in measure.rounds], color="black",
                   s=10, zorder=3, label="each round" if i == 0 else "_")  # fmt: skip
    ax.annotate(f"{measure.vs_objects:.2f}x epochs, {measure.vs_raw:.2f}x raw",
                (0, measure.batches_per_s), ha="center", va="bottom", xytext=(0, 4),
                textcoords="offset points", fontsize=8)  # fmt: skip
    _target_at(ax, 0, TARGET_VS_OBJECTS * measure.epochs_per_s,
               f"target: >= {TARGET_VS_OBJECTS:g}x epochs()")  # fmt: skip
    ax.hlines(TARGET_VS_RAW * measure.raw_adbc_per_s, -0.45, 0.45, colors=TARGET,
              linestyles=":", linewidth=1.5,
              label=f"target: >= {TARGET_VS_RAW:g}x raw ADBC")  # fmt: skip
    ax.set_xticks(range(3), labels)
    ax.set_title(f"reading {measure.facts:,} facts from earliest (medians of "
                 f"{len(measure.rounds)} rounds)", fontsize=10)  # fmt: skip
    ax.set_ylabel("facts per second")
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="upper right")
    _save(fig, path)


def plot_stream_counts(result: dict[str, Any], path: Path) -> None:
    """`streams.bench.stream_count.run_stream_count_bench`'s result (``as_dict``): each
    per-stream call's ratio to its cost at the smallest count, and each view's seconds,
    against the number of streams (log scale)."""
    require_matplotlib()
    counts = result["counts"]
    views = set(result["views"])
    fig, (calls, whole) = _figure(2, "streams bench streams: cost against the number of streams")
    for name, seconds in result["seconds"].items():
        points = [(c, s) for c, s in zip(counts, seconds, strict=True) if s is not None]
        if not points:
            continue
        xs, ys = [c for c, _ in points], [s for _, s in points]
        if name in views:
            whole.plot(xs, ys, marker="o", label=name)
        else:
            # Against the mean of the baselines measured before and after the run, if both.
            again = result.get("base_again_s", {}).get(name)
            base = ys[0] if again is None or xs[0] != counts[0] else (ys[0] + again) / 2
            calls.plot(xs, [y / base for y in ys], marker="o", label=name)
    calls.axhline(result["per_stream_target"], color="grey", linestyle="--", label="target")
    whole.axhline(result["view_target_s"], color="grey", linestyle="--", label="target")
    for axes, label in ((calls, f"x of the cost at {counts[0]} streams"), (whole, "seconds")):
        axes.set_xscale("log")
        axes.set_xlabel("streams in the database")
        axes.set_ylabel(label)
        axes.legend(fontsize=7)
    _save(fig, path)
