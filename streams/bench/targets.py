"""The benchmarks' targets and results: what `streams.bench.plots` draws and the benches
report (both import them from here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .common import percentile

__all__ = [
    "FLEET_TARGET_CPU_VS_RAW",
    "FLEET_TARGET_P99_VS_RAW",
    "FLEET_TARGET_STATEMENTS_VS_K1",
    "FLEET_TARGET_WRITERS_VS_K0",
    "KEYED_TARGETS",
    "KINDS",
    "TARGET_CATCHUP_VS_RAW",
    "TARGET_P50_MS",
    "TARGET_P99_MS",
    "TARGET_P99_VS_RAW",
    "TARGET_VS_RAW",
    "CatchupResult",
    "LatencyBenchResult",
    "LatencyRun",
    "LatencyStats",
    "Measurement",
    "WriteBenchResult",
]

# ------------------------------------------------------------------------------ fleet

#: The targets of issue 19 (see the module doc).
FLEET_TARGET_CPU_VS_RAW = 2.0
FLEET_TARGET_P99_VS_RAW = 5.0
FLEET_TARGET_WRITERS_VS_K0 = 0.5
FLEET_TARGET_STATEMENTS_VS_K1 = 1.5


# ------------------------------------------------------------------------------ write

#: The configurations of one round, in the order they run: raw first, then `streams` (keyed
#: appends with Redis off, beside ``redis-off``).
KINDS = ("raw", "redis-off", "keyed", "redis-on")
#: Targets of the ratio to raw, per mode (docs/performance.md); the plots draw them.
TARGET_VS_RAW = {"single": 1.0, "batch": 0.9}

#: The targets of keyed appends (each fact with an idempotency key of its own) over unkeyed
#: ones of the same run, Redis off, by mode (issue 31).
KEYED_TARGETS = {"single": 0.9, "batch": 0.75}


@dataclass(frozen=True, slots=True)
class Measurement:
    """One configuration of one (mode, writers), medians over the rounds.

    ``cpu_us``: client CPU per append over all threads; ``threads_us``: per thread name
    (``main``, ``heartbeat``, ``redis-listen``, ``other``); ``vcsw``: voluntary context switches
    per append.
    """

    per_s: float
    cpu_us: float
    threads_us: dict[str, float]
    vcsw: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "per_s": round(self.per_s, 1),
            "cpu_us": round(self.cpu_us, 1),
            "threads_us": {k: round(v, 1) for k, v in sorted(self.threads_us.items())},
            "vcsw": round(self.vcsw, 2),
        }


@dataclass(frozen=True, slots=True)
class WriteBenchResult:
    mode: str
    writers: int
    raw_per_s: float
    streams_per_s: float
    #: Per configuration (`KINDS`): what was measured.
    kinds: dict[str, Measurement] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.streams_per_s / self.raw_per_s if self.raw_per_s else float("nan")

    def ratio_of(self, kind: str) -> float:
        m = self.kinds.get(kind)
        return m.per_s / self.raw_per_s if m is not None and self.raw_per_s else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "writers": self.writers,
            "kinds": {k: m.as_dict() for k, m in self.kinds.items()},
            "ratios": {k: round(self.ratio_of(k), 3) for k in self.kinds if k != "raw"},
            "keyed_vs_unkeyed": round(self.keyed_ratio, 3),
            "keyed": self.keyed_summary(),
        }

    @property
    def keyed_target(self) -> float:
        """The target of `keyed_ratio` for this mode."""
        return KEYED_TARGETS[self.mode]

    def keyed_summary(self) -> dict[str, Any]:
        """Keyed appends beside their baseline (unkeyed, Redis off): rates, ratio, target."""
        keyed, plain = self.kinds.get("keyed"), self.kinds.get("redis-off")
        return {
            "keyed_per_s": round(keyed.per_s, 1) if keyed else None,
            "unkeyed_per_s": round(plain.per_s, 1) if plain else None,
            "ratio": round(self.keyed_ratio, 3),
            "target": self.keyed_target,
            "met": self.keyed_ratio >= self.keyed_target,
        }

    @property
    def keyed_ratio(self) -> float:
        """Keyed appends per second over unkeyed ones (both with Redis off)."""
        keyed, plain = self.kinds.get("keyed"), self.kinds.get("redis-off")
        return keyed.per_s / plain.per_s if keyed and plain and plain.per_s else float("nan")


# ------------------------------------------------------------------------------ latency

#: Targets the report marks as met or not.
TARGET_P50_MS = 2.0
TARGET_P99_MS = 10.0
TARGET_P99_VS_RAW = 5.0
TARGET_CATCHUP_VS_RAW = 1.0


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Latency figures of one measurement, in milliseconds."""

    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    #: Measured messages or facts that were never received (within the drain time).
    lost: int = 0

    @classmethod
    def from_seconds(cls, samples: Sequence[float], lost: int = 0) -> LatencyStats:
        ordered = sorted(s * 1000 for s in samples)
        return cls(
            count=len(ordered),
            p50_ms=percentile(ordered, 0.50),
            p99_ms=percentile(ordered, 0.99),
            max_ms=ordered[-1] if ordered else float("nan"),
            lost=lost,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "max_ms": self.max_ms,
            "lost": self.lost,
        }


@dataclass(frozen=True, slots=True)
class LatencyRun:
    """Commit-to-delivery latency with N writers, and the raw Redis baseline beside it."""

    writers: int
    rate: float
    streams: LatencyStats
    raw_redis: LatencyStats
    #: Reader work over the whole run (warm-up included): probes and pages of rows.
    probes: int = 0
    pages: int = 0
    epochs: int = 0

    @property
    def p99_ratio(self) -> float:
        """p99 streams / p99 raw Redis."""
        raw = self.raw_redis.p99_ms
        return self.streams.p99_ms / raw if raw > 0 else float("nan")

    def targets(self) -> dict[str, bool]:
        return {
            f"p50 <= {TARGET_P50_MS:g} ms": self.streams.p50_ms <= TARGET_P50_MS,
            f"p99 <= {TARGET_P99_MS:g} ms": self.streams.p99_ms <= TARGET_P99_MS,
            f"p99 <= {TARGET_P99_VS_RAW:g}x raw Redis p99": self.p99_ratio <= TARGET_P99_VS_RAW,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "writers": self.writers,
            "rate": self.rate,
            "streams": self.streams.as_dict(),
            "raw_redis": self.raw_redis.as_dict(),
            "p99_ratio": self.p99_ratio,
            "reader": {"probes": self.probes, "pages": self.pages, "epochs": self.epochs},
            "targets": self.targets(),
        }


@dataclass(frozen=True, slots=True)
class CatchupResult:
    """Catch-up throughput in facts/s: medians over alternating rounds."""

    facts: int
    page_size: int
    raw_per_s: float
    streams_per_s: float
    raw_rounds: tuple[float, ...] = ()
    streams_rounds: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        """streams / raw."""
        return self.streams_per_s / self.raw_per_s if self.raw_per_s else float("nan")

    def targets(self) -> dict[str, bool]:
        return {f"catch-up >= {TARGET_CATCHUP_VS_RAW:g}x raw": self.ratio >= TARGET_CATCHUP_VS_RAW}

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts": self.facts,
            "page_size": self.page_size,
            "raw_per_s": self.raw_per_s,
            "streams_per_s": self.streams_per_s,
            "ratio": self.ratio,
            "raw_rounds": list(self.raw_rounds),
            "streams_rounds": list(self.streams_rounds),
            "targets": self.targets(),
        }


@dataclass(frozen=True, slots=True)
class LatencyBenchResult:
    latency: tuple[LatencyRun, ...]
    #: One per stream size, in the order measured.
    catchups: tuple[CatchupResult, ...]
    seconds: float = 0.0

    @property
    def catchup(self) -> CatchupResult:
        """The first size's catch-up (the JSON's ``catchup``, as before several sizes)."""
        return self.catchups[0]

    @property
    def all_met(self) -> bool:
        checks = [ok for catchup in self.catchups for ok in catchup.targets().values()]
        for run_ in self.latency:
            checks.extend(run_.targets().values())
        return all(checks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "latency": [r.as_dict() for r in self.latency],
            "catchup": self.catchup.as_dict(),
            "catchups": [catchup.as_dict() for catchup in self.catchups],
            "all_targets_met": self.all_met,
        }
