"""The judgement of a soak (`tests/soak.py`): is a sampled series flat, or growing? Pure: no
I/O, no clock; unit-tested in ``tests/unit/test_soak_judge.py``.

A *series* is named ``"<metric> <subject>"`` (``"rss_mb w0"``, ``"pg_connections all"``,
``"table_kb streams_writers"``) and holds ``(t, value)`` samples, ``t`` in seconds since the
soak began. Its metric's `Rule` says whether it is judged and how much growth it is allowed.

The rule (`judge`): samples before the warm-up are ignored (servers and processes filling
their caches and pools, the retained window filling up). The rest, in time order, is cut in
thirds; the series is *growing* when the median of the last third exceeds the median of the
first third by more than ``max(rule.abs, rule.rel * |median of the first third|)``, else
*flat*. Medians, because a soak under faults is spiky: a sample taken just after PostgreSQL
restarted finds clients still reconnecting, one taken while a reader is frozen sees Redis
buffering for it; fewer than half of a third's samples can be anything without moving its
median past the others. A leak shows as the late median above the early one: a series that
rises by ``R`` at a steady rate moves its thirds' medians at least ``2R/3`` apart, so a steady
rise above 1.5 times the allowance is caught (noise aside). Falling is never a failure. Fewer
than `MIN_POINTS` samples after the warm-up cannot be judged, and fail a judged series unless
the caller says it may be short: a soak that sampled nothing proves nothing. The Theil-Sen
slope (the median of the pairwise slopes) is reported beside the verdict, per hour, for the
reader's eye; it does not decide.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "MIN_POINTS",
    "RULES",
    "Rule",
    "Verdict",
    "judge",
    "rule_for",
    "split_series",
    "summary_markdown",
    "theil_sen",
]

#: Samples after the warm-up below which a series cannot be judged (two per third).
MIN_POINTS = 6


@dataclass(frozen=True, slots=True)
class Rule:
    """How a metric is judged: growth allowed is ``max(abs, rel * early median)``, in
    ``unit``; ``judged=False`` series are reported, never failed, for the ``why`` given."""

    unit: str
    rel: float = 0.0
    abs: float = 0.0
    judged: bool = True
    why: str = ""


#: By metric (the first word of a series' name). The allowances are wider than the noise seen
#: between samples of a steady run on a busy 2-core machine, and narrow enough that a leak of
#: one connection, file or thread per few minutes, or of a few MB an hour per process, fails.
RULES: dict[str, Rule] = {
    # Each service process: a library child of the chaos run (restarted as a supervisor would)
    # or a bystander of the soak (never killed).
    "rss_mb": Rule("MB", rel=0.10, abs=8.0),
    "fds": Rule("", abs=4.0),
    "threads": Rule("", abs=2.0),
    # A sample right after a restart of PostgreSQL finds clients still reconnecting: noisy.
    "pg_connections": Rule("", rel=0.25, abs=6.0),
    "redis_clients": Rule("", rel=0.20, abs=4.0),
    "redis_used_mb": Rule("MB", rel=0.25, abs=2.0),
    "redis_keys": Rule("", rel=0.50, abs=16.0),
    # Tables of bounded content: registry rows, writers (pruned), keys (their window), groups,
    # proofs, the retained stream; MVCC leaves dead rows until autovacuum, hence the slack.
    "table_kb": Rule("kB", rel=0.50, abs=512.0),
    # Tables that keep every fact of the chaos streams (the final check needs them all): their
    # size grows with the facts by design, their bytes per row must not.
    "bytes_per_row": Rule("B", rel=0.25, abs=32.0),
    "data_kb": Rule("kB", judged=False, why="keeps every fact (no retention): see bytes_per_row"),
    "rows": Rule("", judged=False, why="rows, for the eye"),
    "facts_per_tick": Rule("", judged=False, why="a bystander's throughput, for the eye"),
    # The test's own process keeps every line its children printed, for the final check.
    "harness_rss_mb": Rule("MB", judged=False, why="the test keeps every child's output"),
    "harness_fds": Rule("", judged=False, why="the pipes of every child, dead ones too; the proxy"),
    "harness_threads": Rule("", judged=False, why="children's pumps, the proxy's per session"),
}


def rule_for(series: str) -> Rule:
    """The rule of ``series`` by its metric; an unknown metric is reported, not judged."""
    metric = series.split(" ", 1)[0]
    return RULES.get(metric, Rule("", judged=False, why="no rule"))


def split_series(series: str) -> tuple[str, str]:
    """``"rss_mb w0"`` -> ``("rss_mb", "w0")``."""
    metric, _, subject = series.partition(" ")
    return metric, subject


@dataclass(frozen=True, slots=True)
class Verdict:
    series: str
    #: ``flat``, ``growing``, ``too few samples`` or ``not judged``.
    verdict: str
    unit: str
    points: int
    first: float
    median: float
    last: float
    maximum: float
    #: Medians of the first and last thirds after the warm-up, their difference, the allowance.
    early: float | None = None
    late: float | None = None
    growth: float | None = None
    allowed: float | None = None
    slope_per_hour: float | None = None
    why: str = ""
    #: Whether too few samples fail it (see `judge`).
    required: bool = True

    @property
    def failed(self) -> bool:
        return self.verdict == "growing" or (self.verdict == "too few samples" and self.required)


def theil_sen(times: Sequence[float], values: Sequence[float], most: int = 200) -> float:
    """The median of the slopes between every two samples at different times (0 for fewer);
    of ``most`` samples evenly spread, when there are more (the pairs grow as the square)."""
    if len(times) > most:
        picks = [round(i * (len(times) - 1) / (most - 1)) for i in range(most)]
        times, values = [times[i] for i in picks], [values[i] for i in picks]
    slopes = [
        (values[j] - values[i]) / (times[j] - times[i])
        for i in range(len(times))
        for j in range(i + 1, len(times))
        if times[j] != times[i]
    ]
    return statistics.median(slopes) if slopes else 0.0


def judge(
    series: str,
    samples: Iterable[tuple[float, float]],
    warmup: float,
    rule: Rule | None = None,
    *,
    min_points: int = MIN_POINTS,
    required: bool = True,
) -> Verdict:
    """Flat or growing (see the module's docstring); ``samples`` are ``(t, value)``, in any
    order; non-finite values are dropped (a sample that could not be taken). ``required=False``:
    too few samples is no failure (a slot whose children rarely live long enough to be
    sampled)."""
    rule = rule or rule_for(series)
    points = sorted((t, v) for t, v in samples if math.isfinite(v) and math.isfinite(t))
    unjudged = "too few samples" if rule.judged else "not judged"
    if not points:
        nan = math.nan
        return Verdict(
            series, unjudged, rule.unit, 0, nan, nan, nan, nan, why=rule.why, required=required
        )
    values = [v for _, v in points]
    whole = (rule.unit, len(points), values[0], statistics.median(values), values[-1],
             max(values))  # fmt: skip
    kept = [(t, v) for t, v in points if t >= warmup]
    if len(kept) < min_points:
        return Verdict(series, unjudged, *whole, why=rule.why, required=required)
    third = len(kept) // 3
    early = statistics.median(v for _, v in kept[:third])
    late = statistics.median(v for _, v in kept[-third:])
    growth = late - early
    allowed = max(rule.abs, rule.rel * abs(early))
    verdict = "not judged" if not rule.judged else "growing" if growth > allowed else "flat"
    slope = theil_sen([t for t, _ in kept], [v for _, v in kept]) * 3600
    return Verdict(series, verdict, *whole, early, late, growth, allowed, slope, rule.why, required)


def _num(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:,.2f}"


def summary_markdown(verdicts: Sequence[Verdict]) -> str:
    """Two markdown tables: per metric, how many series are flat and the largest growth
    against its allowance; then every series (first, median, last, max over the whole soak;
    early and late medians after the warm-up, the allowance, the verdict)."""
    by_metric: dict[str, list[Verdict]] = {}
    for v in verdicts:
        by_metric.setdefault(split_series(v.series)[0], []).append(v)
    lines = [
        "| metric | unit | series | flat | growing | too few | worst growth / allowed |",
        "|---|---|---|---|---|---|---|",
    ]
    for metric, group in by_metric.items():
        count = {k: sum(1 for v in group if v.verdict == k) for k in
                 ("flat", "growing", "too few samples")}  # fmt: skip
        ratios = [
            (v.growth / v.allowed, v) for v in group
            if v.growth is not None and v.allowed and v.verdict != "not judged"
        ]  # fmt: skip
        if ratios:
            ratio, worst = max(ratios, key=lambda r: r[0])
            worst_text = f"{ratio:+.2f} ({split_series(worst.series)[1]})"
        else:
            worst_text = rule_for(metric + " x").why or "-"
        lines.append(
            f"| {metric} | {group[0].unit or '-'} | {len(group)} | {count['flat']} | "
            f"{count['growing']} | {count['too few samples']} | {worst_text} |"
        )
    lines += [
        "",
        "| series | unit | first | median | last | max | early | late | allowed | slope/h | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        lines.append(
            f"| {v.series} | {v.unit or '-'} | {_num(v.first)} | {_num(v.median)} | "
            f"{_num(v.last)} | {_num(v.maximum)} | {_num(v.early)} | {_num(v.late)} | "
            f"{_num(v.allowed)} | {_num(v.slope_per_hour)} | "
            f"{'**' + v.verdict + '**' if v.failed else v.verdict} |"
        )
    return "\n".join(lines) + "\n"
