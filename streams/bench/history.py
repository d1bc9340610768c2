"""`streams bench history`: what a long history costs, beside raw baselines of the same run.

One stream is filled with ``facts`` facts (default 10^7) by the server itself (``INSERT ...
SELECT generate_series``, committed every `LOAD_CHUNK` facts; timestamps 1 ms apart, the
benchmarks' 197-byte payload), then:

* **bytes per fact**: the growth of the facts table's heap and of each of its two indexes
  while loading, divided by the facts loaded;
* **appends**: single-fact appends (a `streams` writer) on the long stream and on an empty one,
  alternating rounds of `APPEND_SECONDS`: the ratio long / empty (target: they keep their
  speed, >= `TARGET_APPEND_RATIO`);
* **start by time in the middle**: opening a reader at a time in the middle of the stream
  (``start=datetime``; it proves the stream's complete position, finds the position before
  the time and the running maximum timestamp there) beside opening it at an ID; median over
  `START_SAMPLES` random times (target < `TARGET_START_MS` ms);
* **positions**: ``client.positions`` (what ``streams positions`` shows per stream), median of
  `START_SAMPLES` (target < `TARGET_POSITIONS_MS` ms);
* **catch-up**: a reader from ``earliest`` reading the first ``catchup_facts`` facts beside a
  raw psycopg loop paging the same rows *with the reader's own JSON decoder*
  (`common.raw_catchup`: payloads read as text, a page decoded in one call), alternating,
  medians of `CATCHUP_ROUNDS` (target >= `TARGET_CATCHUP_RATIO` x raw);
* **retention**: `PRUNE_CYCLES` times, the stream's oldest quarter made older than its
  retention and pruned (`streams.store.retention.prune`), the table vacuumed (what autovacuum does)
  and as many facts appended again; the first prune runs while a writer appends to the same
  stream: rows/s, append latency before and during (no long locks: p99 within
  `TARGET_PRUNE_P99_RATIO` x), and the size of the heap and both indexes after each cycle (no
  bloat: the last within `TARGET_REFILL_RATIO` x of the first; B-tree pages emptied by a prune
  are reused only after a later VACUUM, so the first cycle grows the indexes once);
* **standby reads** (``--read-url``, a hot standby of the database): catch-up with the rows
  read on the standby beside reads on the primary, primary CPU per fact and throughput
  (`streams.bench.standby_reads`);
* **Arrow** (``--arrow``, instead of the rest): the load, then ``catchup_facts`` facts read as
  Arrow batches (`Reader.batches`) beside the object path (`Reader.epochs`) and a raw ADBC
  ``SELECT`` of the same rows (`streams.bench.history_arrow`).

Both streams are the run's own (`common.scratch_streams`): they are dropped when it ends, also
on Ctrl-C or an error, except the long one with ``keep`` (its name is in the first line the
run reports). Unless ``keep``, ``streams_facts`` is vacuumed afterwards, as before each
refill.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import click
import psycopg

from ..cli_params import DATABASE_URL, common_options
from ..client import Client
from ..config import Settings, redact_url
from ..core.fact_columns import STORED_NAMES
from ..store import sessions
from ..store.driver import run
from ..store.reader_core import DEFAULT_PAGE_SIZE
from ..store.rows import position_before_time
from ..types import PruneResult, StreamInfo
from .common import PAYLOAD, percentile, progress_report, raw_catchup, scratch_streams
from .history_arrow import ArrowMeasure, measure_arrow
from .history_arrow import describe as describe_arrow
from .plots import plot_arrow, plot_option
from .standby_reads import StandbyMeasure, describe, measure_standby_reads

__all__ = ["HistoryBenchResult", "bench_history_command", "run_history_bench"]

LOAD_CHUNK = 1_000_000
APPEND_SECONDS = 2.0
APPEND_ROUNDS = 3
START_SAMPLES = 7
CATCHUP_ROUNDS = 3
TARGET_APPEND_RATIO = 0.9
TARGET_START_MS = 50.0
TARGET_POSITIONS_MS = 50.0
TARGET_CATCHUP_RATIO = 1.0
#: No long locks: appends while pruning keep their p99 within this factor of before.
TARGET_PRUNE_P99_RATIO = 2.0
#: No bloat: over prune-vacuum-refill cycles the table stops growing (last / first cycle).
TARGET_REFILL_RATIO = 1.05
#: Prune-vacuum-refill cycles, a quarter of the loaded facts each.
PRUNE_CYCLES = 3
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class HistoryBenchResult:
    facts: int
    load_seconds: float
    payload_bytes: int
    heap_bytes_per_fact: float
    pkey_bytes_per_fact: float
    time_index_bytes_per_fact: float
    appends_long_per_s: float
    appends_empty_per_s: float
    position_before_time_ms: float
    start_by_time_ms: float
    start_by_id_ms: float
    positions_ms: float
    catchup_facts: int
    catchup_per_s: float
    catchup_raw_per_s: float
    prune: PruneMeasure
    #: With ``--read-url``: catch-up with reads on the primary beside reads on the standby.
    standby: StandbyMeasure | None = None

    @property
    def bytes_per_fact(self) -> float:
        return self.heap_bytes_per_fact + self.pkey_bytes_per_fact + self.time_index_bytes_per_fact

    @property
    def append_ratio(self) -> float:
        return self.appends_long_per_s / self.appends_empty_per_s

    @property
    def catchup_ratio(self) -> float:
        return self.catchup_per_s / self.catchup_raw_per_s

    def targets(self) -> dict[str, bool]:
        return {
            f"appends on the long stream >= {TARGET_APPEND_RATIO:g}x an empty one": (
                self.append_ratio >= TARGET_APPEND_RATIO
            ),
            f"start by time < {TARGET_START_MS:g} ms": self.start_by_time_ms < TARGET_START_MS,
            f"positions < {TARGET_POSITIONS_MS:g} ms": self.positions_ms < TARGET_POSITIONS_MS,
            f"catch-up >= {TARGET_CATCHUP_RATIO:g}x raw (same decoder)": (
                self.catchup_ratio >= TARGET_CATCHUP_RATIO
            ),
            f"append p99 while pruning <= {TARGET_PRUNE_P99_RATIO:g}x before": (
                self.prune.append_p99_during_ms
                <= TARGET_PRUNE_P99_RATIO * self.prune.append_p99_before_ms
            ),
            f"size after {PRUNE_CYCLES} prune-and-refill cycles <= {TARGET_REFILL_RATIO:g}x "
            "after the first": self.prune.growth_after_first_cycle <= TARGET_REFILL_RATIO,
        }

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            bytes_per_fact=round(self.bytes_per_fact, 1),
            append_ratio=round(self.append_ratio, 3),
            catchup_ratio=round(self.catchup_ratio, 3),
            targets=self.targets(),
        )
        if self.standby is not None:
            d["standby"].update(
                cpu_ratio=self.standby.cpu_ratio, throughput_ratio=self.standby.throughput_ratio
            )
        return d


def _mib(sizes: tuple[int, ...]) -> str:
    return "/".join(f"{size / 2**20:,.0f}" for size in sizes)


def _relation_sizes(conn: psycopg.Connection[Any]) -> tuple[int, int, int]:
    """Heap, primary key and time index of every stream's partition, summed."""
    row = conn.execute(
        "SELECT (SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree(%s)), "
        "(SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree(%s)), "
        "(SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree(%s))",
        ("streams_facts", "streams_facts_pkey", "streams_facts_by_time"),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def load_facts(
    conn: psycopg.Connection[Any], info: StreamInfo, first: int, last: int, base_ms: int
) -> None:
    """Fill IDs ``first..last`` server-side, as writers would have (ts 1 ms apart)."""
    payload = json.dumps(PAYLOAD)
    for low in range(first, last + 1, LOAD_CHUNK):
        high = min(last, low + LOAD_CHUNK - 1)
        conn.execute(
            f"INSERT INTO streams_facts ({', '.join(STORED_NAMES)}) "
            "SELECT %s, i, 0, 'bench-history', %s + i, %s::jsonb "
            "FROM generate_series(%s::bigint, %s::bigint) AS i",
            (info.id, base_ms, payload, low, high),
        )
        conn.commit()
    conn.execute(
        "SELECT setval(%s::regclass, GREATEST(%s, pg_sequence_last_value(%s::regclass)))",
        (info.sequence_name, last, info.sequence_name),
    )
    conn.commit()


def _append_rate(client: Client, stream: str, seconds: float, instance: str) -> float:
    with client.writer(stream, instance=instance) as writer:
        for _ in range(20):  # warm up: prepared statements, Redis link
            writer.append(PAYLOAD)
        count = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            writer.append(PAYLOAD)
            count += 1
    return count / elapsed


def _timed_ms(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return (time.perf_counter() - start) * 1e3


def _catchup_streams(client: Client, stream: str, facts: int) -> float:
    with client.reader(stream, start="earliest") as reader:
        count = 0
        start = time.perf_counter()
        for epoch in reader.epochs():
            count += len(epoch)
            if count >= facts:
                break
        return count / (time.perf_counter() - start)


def _measure_appends(
    client: Client, long_name: str, empty_name: str, seconds: float
) -> tuple[float, float]:
    long_rates, empty_rates = [], []
    for _ in range(APPEND_ROUNDS):
        empty_rates.append(_append_rate(client, empty_name, seconds, "bench-history-empty"))
        long_rates.append(_append_rate(client, long_name, seconds, "bench-history-long"))
    return statistics.median(long_rates), statistics.median(empty_rates)


def _open_close(client: Client, stream: str, start: int | dt.datetime) -> None:
    client.reader(stream, start=start).close()


def _measure_starts(
    client: Client, conn: psycopg.Connection[Any], info: StreamInfo, base_ms: int, facts: int
) -> tuple[float, float, float, float]:
    """Medians (ms) of: position_before_time, a reader opened by time, by ID, positions."""
    rng = random.Random(facts)
    lookups, by_time, by_id, positions = [], [], [], []
    for _ in range(START_SAMPLES):
        position = rng.randrange(facts // 4, 3 * facts // 4)
        ts_ms = base_ms + position
        at = _EPOCH + dt.timedelta(milliseconds=ts_ms)
        lookups.append(_timed_ms(partial(run, conn, position_before_time(info, ts_ms))))
        by_time.append(_timed_ms(partial(_open_close, client, info.name, at)))
        by_id.append(_timed_ms(partial(_open_close, client, info.name, position)))
        positions.append(_timed_ms(partial(client.positions, info.name)))
    return (
        statistics.median(lookups),
        statistics.median(by_time),
        statistics.median(by_id),
        statistics.median(positions),
    )


@dataclass(frozen=True, slots=True)
class PruneMeasure:
    """Retention on the long stream: `PRUNE_CYCLES` times, its oldest quarter pruned (the
    first time while a writer appends to it), the table vacuumed, and as many facts appended
    again: how fast, what appends feel, and whether the table stops growing."""

    rows: int
    seconds: float
    transactions: int
    #: What held the first prune where it stopped
    #: (`streams.store.retention.PruneTarget.limited_by`).
    limited_by: str
    #: Single-fact append latency (ms) on the same stream before and during the first prune.
    append_p50_before_ms: float
    append_p99_before_ms: float
    append_p50_during_ms: float
    append_p99_during_ms: float
    append_max_during_ms: float
    #: (heap, primary key, time index) in bytes before the first prune and after each cycle.
    sizes_before: tuple[int, int, int]
    sizes_after_cycles: tuple[tuple[int, int, int], ...]

    @property
    def size_before(self) -> int:
        return sum(self.sizes_before)

    @property
    def size_after_refill(self) -> int:
        return sum(self.sizes_after_cycles[-1])

    @property
    def growth_after_first_cycle(self) -> float:
        """Size after the last cycle / after the first: 1.0 once freed space is reused."""
        return self.size_after_refill / sum(self.sizes_after_cycles[0])


class _Appender(threading.Thread):
    """Appends single facts back to back, recording each latency (ms) in its current phase."""

    def __init__(self, client: Client, stream: str) -> None:
        super().__init__(name="bench-history-appender", daemon=True)
        self.writer = client.writer(stream, instance="bench-history-appender")
        self.phases: dict[str, list[float]] = {"before": [], "during": []}
        self.phase = "before"
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                start = time.perf_counter()
                self.writer.append(PAYLOAD)
                self.phases[self.phase].append((time.perf_counter() - start) * 1e3)
        finally:
            self.writer.close()


def _prune_oldest(
    client: Client, info: StreamInfo, older_than_ms: int
) -> tuple[PruneResult, float]:
    """Prune every loaded fact with a timestamp before ``older_than_ms``; the result and the
    seconds it took."""
    client.set_retention(info.name, max(1, int(time.time() * 1000) - older_than_ms))
    start = time.perf_counter()
    pruned = client.prune(info.name)
    seconds = time.perf_counter() - start
    client.set_retention(info.name, None)
    return pruned, seconds


def _measure_prune(
    client: Client,
    conn: psycopg.Connection[Any],
    info: StreamInfo,
    base_ms: int,
    facts: int,
    seconds: float,
) -> PruneMeasure:
    conn.autocommit = True
    sizes_before = _relation_sizes(conn)
    quarter = facts // 4
    appender = _Appender(client, info.name)
    appender.start()
    try:
        time.sleep(seconds)
        appender.phase = "during"
        first, first_seconds = _prune_oldest(client, info, base_ms + quarter)
    finally:
        appender.stop.set()
        appender.join()
    sizes: list[tuple[int, int, int]] = []
    for cycle in range(PRUNE_CYCLES):
        if cycle:
            _prune_oldest(client, info, base_ms + (cycle + 1) * quarter)
        # What autovacuum would do between prunes; the refill continues the timestamps.
        conn.execute("VACUUM streams_facts")
        conn.autocommit = False
        last = client.positions(info.name).max_allocated
        load_facts(conn, info, last + 1, last + quarter, base_ms + facts + cycle * quarter)
        conn.autocommit = True
        sizes.append(_relation_sizes(conn))
    before = sorted(appender.phases["before"])
    during = sorted(appender.phases["during"]) or [0.0]
    return PruneMeasure(
        rows=first.rows_deleted,
        seconds=first_seconds,
        transactions=first.transactions,
        limited_by=first.limited_by,
        append_p50_before_ms=percentile(before, 0.5),
        append_p99_before_ms=percentile(before, 0.99),
        append_p50_during_ms=percentile(during, 0.5),
        append_p99_during_ms=percentile(during, 0.99),
        append_max_during_ms=during[-1],
        sizes_before=sizes_before,
        sizes_after_cycles=tuple(sizes),
    )


def _measure_catchup(client: Client, url: str, info: StreamInfo, facts: int) -> tuple[float, float]:
    ours, raw = [], []
    for _ in range(CATCHUP_ROUNDS):
        count, seconds = raw_catchup(url, info.id, DEFAULT_PAGE_SIZE, limit=facts)
        raw.append(count / seconds)
        ours.append(_catchup_streams(client, info.name, facts))
    return statistics.median(ours), statistics.median(raw)


def _load_and_size(
    conn: psycopg.Connection[Any], info: StreamInfo, facts: int, base_ms: int
) -> tuple[float, int, tuple[float, float, float]]:
    """Load the stream; the seconds it took, the payload's jsonb size, bytes per fact of the
    heap and both indexes."""
    before = _relation_sizes(conn)
    conn.commit()
    start = time.perf_counter()
    load_facts(conn, info, 1, facts, base_ms)
    seconds = time.perf_counter() - start
    after = _relation_sizes(conn)
    conn.commit()
    conn.autocommit = True
    conn.execute("VACUUM ANALYZE streams_facts")
    row = conn.execute("SELECT pg_column_size(%s::jsonb)", (json.dumps(PAYLOAD),)).fetchone()
    heap, pkey, by_time = ((a - b) / facts for a, b in zip(after, before, strict=True))
    return seconds, int(row[0]) if row else 0, (heap, pkey, by_time)


def run_history_bench(
    settings: Settings,
    *,
    facts: int = 10_000_000,
    catchup_facts: int = 1_000_000,
    keep: bool = False,
    append_seconds: float = APPEND_SECONDS,
    report: Callable[[str], None] = print,
    read_url: str | None = None,
) -> HistoryBenchResult:
    """Run the history benchmarks (see the module doc); report lines as they go. With
    ``read_url`` (a hot standby of the database), also `streams.bench.standby_reads`."""
    if facts < 10 or catchup_facts < 1:
        raise ValueError("facts must be >= 10 and catchup_facts >= 1")
    catchup_facts = min(catchup_facts, facts)
    try:
        with scratch_streams(settings.database_url, "history") as scratch:
            info = scratch.create()
            if keep:
                scratch.keep(info.name)
            empty_name = scratch.create("empty").name
            admin = sessions.connect(
                settings.database_url, autocommit=False, connect_timeout=10, purpose="bench"
            )
            client = Client(settings)
            try:  # closed before the streams are dropped (a transaction would hold the drop)
                result = _measure_all(
                    settings, client, admin, info, empty_name, facts, catchup_facts,
                    append_seconds, report,
                )  # fmt: skip
                if read_url is None:
                    return result
                standby = measure_standby_reads(settings, read_url, info.name, catchup_facts,
                                                report)  # fmt: skip
                report(describe(standby))
                return replace(result, standby=standby)
            finally:
                client.close()
                with contextlib.suppress(psycopg.Error):
                    admin.rollback()
                admin.close()
    finally:
        if not keep:
            with (
                contextlib.suppress(psycopg.Error),
                psycopg.connect(settings.database_url, autocommit=True, connect_timeout=10) as conn,
            ):
                conn.execute("VACUUM streams_facts")


def run_arrow_bench(
    settings: Settings,
    *,
    facts: int,
    catchup_facts: int,
    report: Callable[[str], None] = print,
) -> ArrowMeasure:
    """``--arrow``: load ``facts`` facts into a scratch stream, then `measure_arrow` on the first
    ``catchup_facts`` of them; the stream is dropped after."""
    if facts < 10 or catchup_facts < 1:
        raise ValueError("facts must be >= 10 and catchup_facts >= 1")
    catchup_facts = min(catchup_facts, facts)
    with scratch_streams(settings.database_url, "arrow") as scratch:
        info = scratch.create()
        admin = sessions.connect(
            settings.database_url, autocommit=False, connect_timeout=10, purpose="bench"
        )
        client = Client(settings)
        try:
            base_ms = int(time.time() * 1000) - facts - 60_000
            report(f"loading {facts:,} facts into {info.name} ...")
            seconds, _, _ = _load_and_size(admin, info, facts, base_ms)
            report(f"loaded in {seconds:.1f} s")
            measure = measure_arrow(
                client, info.name, info.id, catchup_facts, _catchup_streams, report
            )
            for line in describe_arrow(measure):
                report(line)
            return measure
        finally:
            client.close()
            with contextlib.suppress(psycopg.Error):
                admin.rollback()
            admin.close()


def _measure_all(
    settings: Settings,
    client: Client,
    admin: psycopg.Connection[Any],
    info: StreamInfo,
    empty_name: str,
    facts: int,
    catchup_facts: int,
    append_seconds: float,
    report: Callable[[str], None],
) -> HistoryBenchResult:
    """Every measurement in turn, on the long stream ``info`` and the empty one."""
    long_name = info.name
    base_ms = int(time.time() * 1000) - facts - 60_000
    report(f"loading {facts:,} facts into {long_name} ...")
    load_seconds, payload_bytes, (heap, pkey, by_time) = _load_and_size(admin, info, facts, base_ms)
    report(
        f"loaded in {load_seconds:.1f} s; bytes per fact {heap + pkey + by_time:.0f} "
        f"(heap {heap:.0f}, primary key {pkey:.0f}, time index {by_time:.0f}; "
        f"payload {payload_bytes} bytes as jsonb)"
    )
    appends_long, appends_empty = _measure_appends(client, long_name, empty_name, append_seconds)
    report(
        f"single-fact appends: long stream {appends_long:,.0f}/s, empty stream "
        f"{appends_empty:,.0f}/s, ratio {appends_long / appends_empty:.2f}"
    )
    lookup, start_by_time, start_by_id, positions = _measure_starts(
        client, admin, info, base_ms, facts
    )
    report(
        f"start in the middle: by time {start_by_time:.1f} ms (position_before_time "
        f"{lookup:.1f} ms), by ID {start_by_id:.1f} ms; positions {positions:.1f} ms"
    )
    catchup, catchup_raw = _measure_catchup(client, settings.database_url, info, catchup_facts)
    report(
        f"catch-up from earliest, {catchup_facts:,} facts: streams {catchup:,.0f}/s, raw "
        f"paging with the same decoder {catchup_raw:,.0f}/s, ratio {catchup / catchup_raw:.2f}"
    )
    report("pruning the oldest quarter of the stream while a writer appends to it, three times ...")
    pruned = _measure_prune(client, admin, info, base_ms, facts, append_seconds)
    report(
        f"prune: {pruned.rows:,} rows in {pruned.seconds:.1f} s "
        f"({pruned.rows / max(pruned.seconds, 1e-9):,.0f} rows/s, {pruned.transactions} "
        f"transactions, held by: {pruned.limited_by}); "
        f"append p50/p99 {pruned.append_p50_before_ms:.2f}/"
        f"{pruned.append_p99_before_ms:.2f} ms before, {pruned.append_p50_during_ms:.2f}/"
        f"{pruned.append_p99_during_ms:.2f} ms (max {pruned.append_max_during_ms:.1f}) "
        f"during; heap/primary key/time index {_mib(pruned.sizes_before)} MiB before, "
        + ", ".join(
            f"{_mib(sizes)} after cycle {n}" for n, sizes in enumerate(pruned.sizes_after_cycles, 1)
        )
        + f" (last / first cycle {pruned.growth_after_first_cycle:.3f})"
    )
    result = HistoryBenchResult(
        facts=facts,
        load_seconds=load_seconds,
        payload_bytes=payload_bytes,
        heap_bytes_per_fact=heap,
        pkey_bytes_per_fact=pkey,
        time_index_bytes_per_fact=by_time,
        appends_long_per_s=appends_long,
        appends_empty_per_s=appends_empty,
        position_before_time_ms=lookup,
        start_by_time_ms=start_by_time,
        start_by_id_ms=start_by_id,
        positions_ms=positions,
        catchup_facts=catchup_facts,
        catchup_per_s=catchup,
        catchup_raw_per_s=catchup_raw,
        prune=pruned,
    )
    for target, met in result.targets().items():
        report(f"target (issue 10): {target}: {'met' if met else 'NOT met'}")
    return result


@click.command(name="history")
@click.option(
    "--facts", type=click.IntRange(10, 1_000_000_000), default=10_000_000, show_default=True
)
@click.option(
    "--catchup-facts", type=click.IntRange(1, 1_000_000_000), default=1_000_000,
    show_default=True,
)  # fmt: skip
@click.option("--keep", is_flag=True, help="Keep the long stream (dropped by default).")
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
@click.option(
    "--read-url",
    type=DATABASE_URL,
    default=None,
    help="A hot standby of the database: also catch up reading rows there (primary CPU and "
    "throughput with standby reads vs without).",
)
@click.option(
    "--arrow",
    is_flag=True,
    help="Only load the facts, then read --catchup-facts of them as Arrow batches beside "
    "epochs() and a raw ADBC SELECT (facts/s, ratios, targets). Needs the arrow extra.",
)
@plot_option("With --arrow: also draw the three reads' facts/s, every round and the targets, "
             "as FILE.png or FILE.svg (the plot extra).")  # fmt: skip
@common_options
def bench_history_command(
    facts: int,
    catchup_facts: int,
    keep: bool,
    as_json: bool,
    read_url: str | None,
    arrow: bool,
    plot: Path | None,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """A long stream: bytes per fact, appends, start by time, positions, catch-up vs raw."""
    if plot is not None and not arrow:
        raise click.UsageError("--plot draws the --arrow figures: give --arrow")
    settings = Settings.resolve(database_url, redis_url, prefix)
    redis = "off" if settings.redis_url is None else redact_url(settings.redis_url)
    click.echo(f"database {redact_url(settings.database_url)}, Redis {redis}")
    if arrow:
        if read_url or keep:
            raise click.UsageError("--arrow takes neither --read-url nor --keep")
        from ..store.arrow_reads import require_arrow

        require_arrow("streams bench history --arrow")
        measure = run_arrow_bench(
            settings, facts=facts, catchup_facts=catchup_facts, report=progress_report()
        )
        if as_json:
            click.echo(json.dumps(measure.as_dict(), sort_keys=True, separators=(",", ":")))
        if plot is not None:
            plot_arrow(measure, plot)
            click.echo(f"plot written to {plot}")
        return
    if read_url:  # before loading facts for minutes: a clear error now if it cannot be used
        with sessions.connect(
            read_url, autocommit=True, connect_timeout=min(5.0, settings.connect_timeout),
            purpose="read URL",
        ):  # fmt: skip
            pass
    result = run_history_bench(
        settings, facts=facts, catchup_facts=catchup_facts, keep=keep, report=progress_report(),
        read_url=read_url or None,
    )  # fmt: skip
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True, separators=(",", ":")))
