"""`streams bench history --arrow`: Arrow batches beside the object path and a raw ADBC read.

On the long stream of `streams.bench.history` (single-row facts of the benchmarks' 197-byte
payload, the partition ``ANALYZE``d), ``facts`` facts from ``earliest`` are read three ways,
alternating, `ROUNDS` times each, in the same run; each figure is the median of facts/s:

* **batches**: `Reader.batches` (`streams.arrow`: proofs on the reader's session, pages of
  `streams.arrow.DEFAULT_MAX_ROWS` rows over ADBC, each with its retention check, cut to whole
  facts, converted to the Spark source's columns), from opening the reader's ADBC session (in
  its first read) to the batch that reaches ``facts``;
* **epochs**: the object path, `Reader.epochs` (one `Fact` per fact), as the history
  benchmark's catch-up measures it;
* **raw ADBC**: what a user would write by hand for the same rows: one ADBC connection (opened
  in the timing), one ``SELECT`` of every row of the range (the text of the batches' own rows
  statement, `streams.store.rows.range_rows_sql` with ``jsonb``, without its page limit), its
  record batches iterated as ADBC hands them over, nothing checked or converted.

Targets (issue 31): batches >= `TARGET_VS_OBJECTS` x epochs, and >= `TARGET_VS_RAW` x raw ADBC.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..client import Client
from ..store.rows import range_rows_sql
from ..store.sessions import with_client_tcp_settings

__all__ = ["ROUNDS", "TARGET_VS_OBJECTS", "TARGET_VS_RAW", "ArrowMeasure", "measure_arrow"]

ROUNDS = 5
TARGET_VS_OBJECTS = 3.0
TARGET_VS_RAW = 0.9


@dataclass(frozen=True, slots=True)
class ArrowMeasure:
    """Medians of facts/s over `ROUNDS` alternating rounds (see the module doc)."""

    facts: int
    batches_per_s: float
    epochs_per_s: float
    raw_adbc_per_s: float
    #: Every round's figures, in order (noisy machines: look at the spread).
    rounds: tuple[tuple[float, float, float], ...]

    @property
    def vs_objects(self) -> float:
        return self.batches_per_s / self.epochs_per_s

    @property
    def vs_raw(self) -> float:
        return self.batches_per_s / self.raw_adbc_per_s

    def targets(self) -> dict[str, bool]:
        return {
            f"batches() >= {TARGET_VS_OBJECTS:g}x epochs()": self.vs_objects >= TARGET_VS_OBJECTS,
            f"batches() >= {TARGET_VS_RAW:g}x raw ADBC": self.vs_raw >= TARGET_VS_RAW,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts": self.facts,
            "batches_per_s": round(self.batches_per_s),
            "epochs_per_s": round(self.epochs_per_s),
            "raw_adbc_per_s": round(self.raw_adbc_per_s),
            "vs_objects": round(self.vs_objects, 3),
            "vs_raw": round(self.vs_raw, 3),
            "rounds": [[round(x) for x in r] for r in self.rounds],
            "targets": self.targets(),
        }


def _batches(client: Client, stream: str, facts: int) -> float:
    with client.reader(stream, start="earliest") as reader:
        count = 0
        start = time.perf_counter()
        for batch in reader.batches():
            count += batch.num_rows
            if count >= facts:
                break
        return count / (time.perf_counter() - start)


def _raw_adbc(url: str, stream_key: int, facts: int) -> float:
    import adbc_driver_postgresql.dbapi as adbc

    start = time.perf_counter()
    with adbc.connect(with_client_tcp_settings(url), autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(range_rows_sql(stream_key, 0, facts, jsonb=True))
        count: int = sum(batch.num_rows for batch in cur.fetch_record_batch())
    return count / (time.perf_counter() - start)


def measure_arrow(
    client: Client,
    stream: str,
    stream_key: int,
    facts: int,
    objects: Callable[[Client, str, int], float],
    report: Callable[[str], None],
) -> ArrowMeasure:
    """The three reads of ``facts`` facts of ``stream`` (see the module doc); ``objects`` is
    the history benchmark's catch-up through `Reader.epochs` (facts/s)."""
    from ..store.arrow_reads import require_arrow

    require_arrow("streams bench history --arrow")
    url = client.settings.database_url
    _raw_adbc(url, stream_key, min(facts, 10_000))  # warm up: the driver's first load
    rounds = []
    for n in range(ROUNDS):
        raw = _raw_adbc(url, stream_key, facts)
        ours = _batches(client, stream, facts)
        epochs = objects(client, stream, facts)
        rounds.append((ours, epochs, raw))
        report(
            f"round {n + 1}: batches() {ours:,.0f}/s, epochs() {epochs:,.0f}/s, "
            f"raw ADBC {raw:,.0f}/s"
        )
    return ArrowMeasure(
        facts=facts,
        batches_per_s=statistics.median(r[0] for r in rounds),
        epochs_per_s=statistics.median(r[1] for r in rounds),
        raw_adbc_per_s=statistics.median(r[2] for r in rounds),
        rounds=tuple(rounds),
    )


def describe(measure: ArrowMeasure) -> list[str]:
    """The report lines: figures, ratios, targets."""
    lines = [
        f"Arrow, {measure.facts:,} facts (medians of {ROUNDS}): batches() "
        f"{measure.batches_per_s:,.0f}/s, epochs() {measure.epochs_per_s:,.0f}/s, raw ADBC "
        f"{measure.raw_adbc_per_s:,.0f}/s; batches/epochs {measure.vs_objects:.2f}x, "
        f"batches/raw ADBC {measure.vs_raw:.2f}x"
    ]
    lines += [
        f"target (issue 31): {target}: {'met' if met else 'NOT met'}"
        for target, met in measure.targets().items()
    ]
    return lines
