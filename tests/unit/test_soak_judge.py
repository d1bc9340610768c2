"""`soakjudge`: when a soak's sampled series is flat, and when it is growing (a leak)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from soakjudge import RULES, Rule, judge, rule_for, summary_markdown, theil_sen

RULE = Rule("MB", rel=0.10, abs=8.0)
EVERY = 60.0

counts = st.integers(6, 80)
bases = st.floats(0, 10_000, allow_nan=False)


def series(
    values: list[float], every: float = EVERY, start: float = 0.0
) -> list[tuple[float, float]]:
    return [(start + i * every, v) for i, v in enumerate(values)]


def noise(n: int, amplitude: float) -> st.SearchStrategy[list[float]]:
    return st.lists(st.floats(-amplitude, amplitude), min_size=n, max_size=n)


@given(data=st.data(), n=counts, base=bases)
def test_bounded_noise_around_a_level_is_flat(data: st.DataObject, n: int, base: float) -> None:
    """Every sample within half the absolute allowance of one level: the thirds' medians are
    within the allowance of each other, whatever the order of the noise."""
    wiggle = data.draw(noise(n, RULE.abs / 2))
    verdict = judge("rss_mb w0", series([base + w for w in wiggle]), 0.0, RULE)
    assert verdict.verdict == "flat", verdict


@given(data=st.data(), n=counts, base=bases, factor=st.floats(1.0, 100.0))
def test_a_steady_rise_is_growing(data: st.DataObject, n: int, base: float, factor: float) -> None:
    """A rise of ``R`` over the judged samples moves the thirds' medians at least ``2R/3``
    apart: a rise of three allowances (at its start) beyond the noise is caught."""
    amplitude = data.draw(st.floats(0, RULE.abs / 4))
    wiggle = data.draw(noise(n, amplitude))
    rise = factor * (3 * max(RULE.abs, RULE.rel * base) + 6 * amplitude)
    values = [base + rise * i / (n - 1) + w for i, w in enumerate(wiggle)]
    verdict = judge("rss_mb w0", series(values), 0.0, RULE)
    assert verdict.verdict == "growing", verdict


@given(data=st.data(), n=st.integers(12, 80), base=bases)
def test_spikes_in_fewer_than_half_of_each_third_do_not_decide(
    data: st.DataObject, n: int, base: float
) -> None:
    """A sample taken mid-restart (no connections) or while a reader is frozen (Redis buffers
    for it) is anything at all; the medians hold as long as most samples are steady."""
    values = [base + w for w in data.draw(noise(n, RULE.abs / 2))]
    third = n // 3
    thirds = [range(0, third), range(n - third, n)]
    for part in thirds:
        spikes = data.draw(st.lists(st.sampled_from(list(part)), max_size=(third - 1) // 2))
        for i in spikes:
            values[i] = data.draw(st.floats(0, 1e9))
    verdict = judge("rss_mb w0", series(values), 0.0, RULE)
    assert verdict.verdict == "flat", (values, verdict)


@given(data=st.data(), n=counts, base=st.floats(100, 10_000))
def test_falling_is_never_a_failure(data: st.DataObject, n: int, base: float) -> None:
    drops = data.draw(st.lists(st.floats(0, 50), min_size=n, max_size=n))
    values = [base - sum(drops[: i + 1]) for i in range(n)]
    assert judge("rss_mb w0", series(values), 0.0, RULE).verdict == "flat"


@given(
    data=st.data(),
    n=counts,
    warm=st.integers(1, 30),
    base=bases,
)
def test_the_warm_up_is_ignored(data: st.DataObject, n: int, warm: int, base: float) -> None:
    """Whatever happens before the warm-up ends (pools filling, the retained window filling)
    does not count; the verdict is the one of the samples after it."""
    before = data.draw(st.lists(st.floats(0, 1e9), min_size=warm, max_size=warm))
    after = [base + w for w in data.draw(noise(n, RULE.abs / 2))]
    warmup = warm * EVERY
    verdict = judge("rss_mb w0", series(before + after), warmup, RULE)
    assert verdict.verdict == "flat"
    assert verdict.early == judge("rss_mb w0", series(after, start=warmup), 0.0, RULE).early


@given(n=st.integers(0, 5), base=bases)
def test_too_few_samples_fail_a_judged_series_and_not_an_unjudged_one(n: int, base: float) -> None:
    samples = series([base] * n)
    assert judge("rss_mb w0", samples, 0.0, RULE).failed
    assert not judge("rss_mb w0", samples, 0.0, RULE, required=False).failed
    assert not judge("rows facts:s", samples, 0.0).failed


def test_cases() -> None:
    flat = [60.0] * 20
    # One connection more every few minutes: a leak of connections.
    steps = [10.0 + i // 3 for i in range(60)]
    assert judge("pg_connections all", series(steps), 0.0).verdict == "growing"
    # A sawtooth whose peaks do not rise (Redis memory reset by its restarts): flat.
    saw = [2.0 + (i % 5) * 0.4 for i in range(60)]
    assert judge("redis_used_mb server", series(saw), 0.0).verdict == "flat"
    # A step up by more than the allowance, then steady: growing (a pool that never shrinks).
    step = flat[:10] + [80.0] * 10
    assert judge("rss_mb w0", series(step), 0.0).verdict == "growing"
    # Within 10 %: flat; samples that could not be taken (NaN) are dropped.
    wobble = [*flat[:10], 65.0, math.nan, *([65.0] * 9)]
    verdict = judge("rss_mb w0", series(wobble), 0.0)
    assert verdict.verdict == "flat" and verdict.points == 20 and verdict.growth == 5.0
    # Samples out of order are put in order first.
    assert judge("rss_mb w0", list(reversed(series(step))), 0.0).verdict == "growing"
    # A metric without a rule is reported, not judged.
    assert judge("mystery x", series(steps), 0.0).verdict == "not judged"
    assert not rule_for("rows facts:s").judged and rule_for("rss_mb w0") == RULES["rss_mb"]


def test_theil_sen_ignores_outliers_and_caps_its_pairs() -> None:
    times = [float(i) for i in range(50)]
    values = [2.0 * t for t in times]
    values[7] = 1e9
    assert theil_sen(times, values) == 2.0
    assert theil_sen([0.0], [1.0]) == 0.0
    many = [float(i) for i in range(5_000)]
    assert theil_sen(many, [3.0 * t for t in many]) == 3.0


def test_summary_tables() -> None:
    verdicts = [
        judge("rss_mb w0", series([60.0] * 12), 0.0),
        judge("rss_mb w1", series([60.0 + 5 * i for i in range(12)]), 0.0),
        judge("rows facts:s", series([float(i) for i in range(12)]), 0.0),
    ]
    text = summary_markdown(verdicts)
    assert "| rss_mb | MB | 2 | 1 | 1 | 0 |" in text
    assert "| rss_mb w1 | MB |" in text and "**growing**" in text
    assert "| rows | - | 1 | 0 | 0 | 0 | rows, for the eye |" in text
