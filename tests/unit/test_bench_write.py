"""`streams bench write`'s keyed summary: keyed appends beside unkeyed ones, ratio and target."""

from __future__ import annotations

from streams.bench.write import KEYED_TARGETS, Measurement, WriteBenchResult


def _result(mode: str, keyed: float, plain: float) -> WriteBenchResult:
    kinds = {
        kind: Measurement(per_s=rate, cpu_us=1.0, threads_us={"main": 1.0}, vcsw=0.0)
        for kind, rate in (("raw", 2 * plain), ("redis-off", plain), ("keyed", keyed))
    }
    return WriteBenchResult(mode, 1, 2 * plain, plain, kinds)


def test_the_keyed_summary_gives_both_rates_the_ratio_and_the_mode_s_target() -> None:
    assert KEYED_TARGETS == {"single": 0.9, "batch": 0.75}
    single = _result("single", keyed=900.0, plain=1000.0).as_dict()
    assert single["keyed"] == {
        "keyed_per_s": 900.0,
        "unkeyed_per_s": 1000.0,
        "ratio": 0.9,
        "target": 0.9,
        "met": True,
    }
    assert single["keyed_vs_unkeyed"] == 0.9
    batch = _result("batch", keyed=70_000.0, plain=100_000.0).as_dict()["keyed"]
    assert (batch["ratio"], batch["target"], batch["met"]) == (0.7, 0.75, False)
