"""``streams bench ... --plot FILE`` (`streams.bench.plots`): which files it takes, the error
without matplotlib, and each benchmark's plot drawn from its result object in both formats.

A bench run that writes its plot from real figures is in `test_bench_cleanup` (the tiny runs of
`BENCHES`, with ``--plot``), so no benchmark runs twice for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import assert_image

from streams.bench import plots
from streams.bench.history_arrow import ArrowMeasure
from streams.bench.latency import CatchupResult, LatencyBenchResult, LatencyRun, LatencyStats
from streams.bench.write import Measurement, WriteBenchResult
from streams.command import main


def test_the_suffix_names_the_format_and_the_directory_must_exist(tmp_path: Path) -> None:
    for good in ("a.png", "a.svg", "b.PNG"):
        assert plots.check_plot_path(str(tmp_path / good)) == tmp_path / good
    (tmp_path / "dir.svg").mkdir()
    bad = ["", "a.jpg", "a", str(tmp_path / "dir.svg"), str(tmp_path / "no" / "a.png"), "a\x00.png"]
    for value in bad:
        with pytest.raises(ValueError):
            plots.check_plot_path(value)


def test_without_matplotlib_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Refused when the command line is read, before any server is touched."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what find_spec sees when absent
    for bench in ("write", "latency", "fleet", "history"):
        argv = ["bench", bench, "--plot", str(tmp_path / "x.svg")]
        out = CliRunner().invoke(main, argv)
        assert out.exit_code == 2, out.output
        assert "Error" in out.output and "pip install 'streams[plot]'" in out.output
    assert not (tmp_path / "x.svg").exists()


def test_history_plots_only_its_arrow_figures(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["bench", "history", "--plot", str(tmp_path / "h.png")])
    assert out.exit_code == 2 and "give --arrow" in out.output, out.output


def _m(per_s: float) -> Measurement:
    return Measurement(per_s=per_s, cpu_us=100.0, threads_us={"main": 90.0}, vcsw=1.0)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_each_plot_from_its_result(tmp_path: Path, suffix: str) -> None:
    """The figures of issue 31's runs (docs/performance.md), as the benchmarks return them."""
    writes = [
        WriteBenchResult(mode, n, raw, raw, {"raw": _m(raw), "redis-off": _m(raw * 1.1),
                                             "keyed": _m(raw * 0.8), "redis-on": _m(raw)})
        for mode, base in (("single", 1200.0), ("batch", 70_000.0))
        for n, raw in ((1, base), (4, base * 1.8))
    ]  # fmt: skip
    stats = LatencyStats(count=100, p50_ms=0.5, p99_ms=2.7, max_ms=4.0)
    raw = LatencyStats(count=100, p50_ms=0.2, p99_ms=0.5, max_ms=1.0)
    latency = LatencyBenchResult(
        (LatencyRun(1, 200, stats, raw), LatencyRun(4, 200, stats, raw)),
        (CatchupResult(200_000, 5000, 490_000, 270_000), CatchupResult(10**7, 5000, 4e5, 4e5)),
    )
    arrow = ArrowMeasure(10**6, 405e3, 198e3, 378e3, ((469e3, 223e3, 410e3), (387e3, 164e3, 323e3)))
    point = {"cpu_us_per_fact": 300.0, "appends_per_s": 3000.0, "p99_ms": 5.0}
    fleet = {
        "rate": 500.0,
        "points": [
            {"writers": n, "readers": k, "system": point, "raw": {**point, "appends_per_s": 0}}
            for n, k in ((32, 0), (32, 32))
        ],
    }
    drawn: dict[str, Callable[[Path], None]] = {
        "write": lambda path: plots.plot_write(writes, path),
        "latency": lambda path: plots.plot_latency(latency, path),
        "arrow": lambda path: plots.plot_arrow(arrow, path),
        "fleet": lambda path: plots.plot_fleet(fleet, path),
    }
    for name, draw in drawn.items():
        path = tmp_path / f"{name}{suffix}"
        draw(path)
        assert_image(path)
