"""The report of a soak (`tests/soak.py`), in its folder:

* ``samples.json``: the settings and totals (``meta``), every verdict, every sample (``t`` in
  seconds since the soak began, ``values`` by series, the PID and age of each process sampled,
  the errors met taking it);
* ``samples.csv``: one row per sample, one column per series (empty: not taken);
* ``soak.svg``: the judged series over time, in six panels, the end of the warm-up dotted;
* ``summary.md``: the settings, the problems, and `soakjudge.summary_markdown`.

matplotlib through its object API on the Agg canvas, as ``streams.bench.plots`` does.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from soakjudge import Verdict, split_series, summary_markdown

__all__ = ["plot", "write_report"]

#: The panels of the plot: title, metrics drawn, log scale.
PANELS: list[tuple[str, tuple[str, ...], bool]] = [
    ("RSS per process (MB)", ("rss_mb",), False),
    ("descriptors (solid), threads (dashed)", ("fds", "threads"), False),
    ("connections: PostgreSQL sessions, Redis clients", ("pg_connections", "redis_clients"), False),
    ("Redis used memory (MB)", ("redis_used_mb",), False),
    ("bounded tables (kB)", ("table_kb",), True),
    ("tables keeping every fact: bytes per row", ("bytes_per_row",), False),
]


def _series(samples: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for sample in samples:
        for name, value in sample["values"].items():
            out[name].append((float(sample["t"]), float(value)))
    return dict(out)


def write_report(
    directory: Path,
    meta: dict[str, Any],
    samples: Sequence[dict[str, Any]],
    verdicts: Sequence[Verdict],
) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": directory / "samples.json",
        "csv": directory / "samples.csv",
        "plot": directory / "soak.svg",
        "summary": directory / "summary.md",
    }

    def finite(value: Any) -> Any:  # JSON has no NaN
        return None if isinstance(value, float) and not math.isfinite(value) else value

    document = {
        "meta": meta,
        "verdicts": [{k: finite(v) for k, v in dataclasses.asdict(v).items()} for v in verdicts],
        "samples": list(samples),
    }
    paths["json"].write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    names = sorted({name for sample in samples for name in sample["values"]})
    with open(paths["csv"], "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["t", *names])
        for sample in samples:
            values = sample["values"]
            writer.writerow([sample["t"], *(_cell(values.get(name)) for name in names)])
    plot(paths["plot"], meta, _series(samples))
    paths["summary"].write_text(summary(meta, verdicts))
    return paths


def _cell(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.6g}"


def summary(meta: dict[str, Any], verdicts: Sequence[Verdict]) -> str:
    failed = [v for v in verdicts if v.failed]
    problems = meta.get("problems", [])
    verdict = "FLAT" if not failed and not problems else "NOT FLAT"
    lines = [
        f"# Soak: chaos {meta['label']}, {verdict}",
        "",
        f"- started {meta['started']} on {meta['machine']}; seed {meta['seed']}",
        f"- faults for {meta['seconds']:g} s; a sample every {meta['every']:g} s "
        f"({meta.get('samples', 0)} samples, {meta.get('sample_errors', 0)} server reads "
        "failed under the faults)",
        f"- judged after a warm-up of {meta['warmup']:g} s; the soak's stream keeps "
        f"{meta['retention']:g} s; keys and retired writers pruned past {meta['window']:g} s",
        f"- upkeep: {meta.get('upkeep', {})}",
        f"- bystanders: lives {meta.get('bystander_lives', {})}, "
        f"counts {meta.get('bystander_counts', {})}",
    ]
    lines += [f"- note: {note}" for note in meta.get("notes", [])]
    lines += [f"- **problem**: {problem}" for problem in problems]
    lines += [
        "",
        f"{len(failed)} of {sum(1 for v in verdicts if v.verdict != 'not judged')} judged "
        "series failed. Growth is the median of the last third after the warm-up minus that "
        "of the first third; allowed is the larger of the rule's absolute and relative "
        "allowances (`tests/soakjudge.py`).",
        "",
        summary_markdown(verdicts),
    ]
    return "\n".join(lines)


def _label(metric: str, subject: str) -> str:
    if metric.endswith("threads"):
        return "_nolegend_"  # the descriptors' line of the same colour names it
    return {"pg_connections": f"PostgreSQL {subject}", "redis_clients": "Redis"}.get(
        metric, subject
    )


def plot(path: Path, meta: dict[str, Any], series: dict[str, list[tuple[float, float]]]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(
        f"soak: chaos {meta['label']}, faults for {meta['seconds']:g} s, a sample every "
        f"{meta['every']:g} s\n{meta['started']} · {meta['machine']}",
        fontsize=11,
    )
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"]
    palette = [tab20(i) for i in range(tab20.N)]
    subjects = sorted({split_series(name)[1] for name in series})
    color = {s: palette[i % len(palette)] for i, s in enumerate(subjects)}
    for i, (title, metrics, log) in enumerate(PANELS):
        ax = fig.add_subplot(2, 3, i + 1)
        for name in sorted(series):
            metric, subject = split_series(name)
            if metric not in metrics:
                continue
            points = sorted(series[name])
            ax.plot(
                [t / 60 for t, _ in points],
                [v for _, v in points],
                "--" if metric.endswith("threads") else "-",
                color=color[subject],
                linewidth=2.0 if subject.startswith("soak-") or subject == "all" else 1.0,
                label=_label(metric, subject),
            )
        ax.axvline(meta["warmup"] / 60, color="#888888", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("minutes", fontsize=8)
        ax.tick_params(labelsize=7)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines[1:]:
            ax.legend(fontsize=6, ncol=2, loc="best")
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "streams"}):
        fig.savefig(path, format=path.suffix.lstrip(".") or "svg", metadata={"Date": None})
