"""`streams bench history --read-url`: what reading the rows from a hot standby saves the primary.

On the long stream of `streams.bench.history`, a reader catches up from ``earliest`` through
``facts`` facts, alternately with every read on the primary and with a read URL (proofs on the
primary, rows on the standby behind the fence: `streams.core.standby_fence`), `ROUNDS` times
each, in the same run. For each, medians of:

* **primary CPU per caught-up fact**: the CPU time (user + system, from ``/proc/<pid>/stat``) of
  every process of the primary's server (the postmaster's children: the reader's backend, the
  client's, the background processes), from the reader's first read to its last, divided by the
  facts delivered. It needs the server on this host (an embedded server, a local one); for a
  remote server it is not measured (None), and the next figure still is;
* **rows the primary's scans returned per caught-up fact** (``pg_stat_database``'s
  ``tup_returned + tup_fetched`` of the database, all sessions, read after the reader's
  sessions ended, which flushes their counts): what the primary read for the reader;
* **throughput**: facts per second the reader delivered.

Before the first round the standby must have replayed the loaded facts: the run waits for it
(a reader would wait for it too, and fall back to the primary after its max wait, which would
measure the primary twice). The benchmark creates nothing of its own: it reads the history
benchmark's long stream, which that removes.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from ..client import Client
from ..config import Settings

__all__ = ["ROUNDS", "StandbyMeasure", "measure_standby_reads"]

ROUNDS = 3
#: Seconds the run waits for the standby to replay the loaded history.
REPLAY_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class StandbyMeasure:
    """Catch-up with reads on the primary beside reads on the standby (medians)."""

    facts: int
    primary_cpu_us_per_fact_primary_reads: float | None
    primary_cpu_us_per_fact_standby_reads: float | None
    primary_rows_per_fact_primary_reads: float
    primary_rows_per_fact_standby_reads: float
    catchup_per_s_primary_reads: float
    catchup_per_s_standby_reads: float
    #: Reads of the standby rounds that went to the primary after all (fallbacks): 0 expected.
    fallbacks: int

    @property
    def cpu_ratio(self) -> float | None:
        """Primary CPU per fact, standby reads / primary reads (lower is better)."""
        ours, base = (
            self.primary_cpu_us_per_fact_standby_reads,
            self.primary_cpu_us_per_fact_primary_reads,
        )
        return None if ours is None or not base else ours / base

    @property
    def throughput_ratio(self) -> float:
        """Reader throughput, standby reads / primary reads."""
        return self.catchup_per_s_standby_reads / self.catchup_per_s_primary_reads


def _ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` in clock ticks (None: gone, or not on this host)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


def _server_pids(conn: psycopg.Connection[Any]) -> list[int] | None:
    """The processes of ``conn``'s server (the postmaster's children), if it runs here."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    try:
        with open(f"/proc/{int(row[0])}/stat", encoding="ascii") as stat:
            postmaster = int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _cpu_seconds(pids: list[int] | None) -> dict[int, int]:
    if pids is None:
        return {}
    return {pid: ticks for pid in pids if (ticks := _ticks(pid)) is not None}


def _rows_scanned(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT tup_returned + tup_fetched FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _wait_replayed(primary: psycopg.Connection[Any], read_url: str) -> None:
    row = primary.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    deadline = time.monotonic() + REPLAY_TIMEOUT
    with psycopg.connect(read_url, autocommit=True, connect_timeout=10) as standby:
        while True:
            done = standby.execute(
                "SELECT NOT pg_is_in_recovery() OR pg_last_wal_replay_lsn() >= %s::pg_lsn",
                (row[0],),
            ).fetchone()
            if done and done[0]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the standby did not replay the history in {REPLAY_TIMEOUT}s")
            time.sleep(0.1)


def _catch_up(
    settings: Settings, stream: str, facts: int, primary: psycopg.Connection[Any]
) -> tuple[float | None, float, float, int]:
    """One catch-up: primary CPU (us) per fact, primary rows per fact, facts/s, fallbacks."""
    rows_before = _rows_scanned(primary)
    client = Client(settings)
    try:
        with client.reader(stream, start="earliest") as reader:
            pids = _server_pids(primary)  # now: the reader's backend is one of them
            cpu_before = _cpu_seconds(pids)
            count = 0
            start = time.perf_counter()
            for epoch in reader.epochs():
                count += len(epoch)
                if count >= facts:
                    break
            seconds = time.perf_counter() - start
            cpu_after = _cpu_seconds(pids)
            route = reader.core.route
            fallbacks = 0 if route is None else sum(
                n for outcome, n in route.outcomes.items() if outcome != "standby"
            )  # fmt: skip
    finally:
        client.close()
    time.sleep(0.1)  # the reader's backends flushed their statistics as they exited
    rows = _rows_scanned(primary) - rows_before
    cpu: float | None = None
    if pids is not None:
        ticks = sum(cpu_after[p] - cpu_before[p] for p in cpu_after if p in cpu_before)
        cpu = ticks / os.sysconf("SC_CLK_TCK") * 1e6 / count
    return cpu, rows / count, count / seconds, fallbacks


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def measure_standby_reads(
    settings: Settings,
    read_url: str,
    stream: str,
    facts: int,
    report: Callable[[str], None],
    rounds: int = ROUNDS,
) -> StandbyMeasure:
    """Catch up ``facts`` facts of ``stream`` with and without the read URL (module doc)."""
    on_primary = replace(settings, read_database_url=None)
    on_standby = replace(settings, read_database_url=read_url)
    with psycopg.connect(settings.database_url, autocommit=True, connect_timeout=10) as primary:
        report("waiting for the standby to replay the history ...")
        _wait_replayed(primary, read_url)
        measured: dict[bool, list[tuple[float | None, float, float, int]]] = {True: [], False: []}
        for _ in range(rounds):
            measured[False].append(_catch_up(on_primary, stream, facts, primary))
            measured[True].append(_catch_up(on_standby, stream, facts, primary))
    return StandbyMeasure(
        facts=facts,
        primary_cpu_us_per_fact_primary_reads=_median([m[0] for m in measured[False]]),
        primary_cpu_us_per_fact_standby_reads=_median([m[0] for m in measured[True]]),
        primary_rows_per_fact_primary_reads=statistics.median(m[1] for m in measured[False]),
        primary_rows_per_fact_standby_reads=statistics.median(m[1] for m in measured[True]),
        catchup_per_s_primary_reads=statistics.median(m[2] for m in measured[False]),
        catchup_per_s_standby_reads=statistics.median(m[2] for m in measured[True]),
        fallbacks=sum(m[3] for m in measured[True]),
    )


def describe(found: StandbyMeasure) -> str:
    """The report line of a `StandbyMeasure`."""

    def cpu(value: float | None) -> str:
        return "n/a (server not on this host)" if value is None else f"{value:.3f} us"

    ratio = found.cpu_ratio
    return (
        f"catch-up of {found.facts:,} facts, reads on the primary vs on the standby: primary "
        f"CPU per fact {cpu(found.primary_cpu_us_per_fact_primary_reads)} vs "
        f"{cpu(found.primary_cpu_us_per_fact_standby_reads)}"
        + ("" if ratio is None else f" (ratio {ratio:.3f})")
        + f"; primary rows scanned per fact {found.primary_rows_per_fact_primary_reads:.3f} vs "
        f"{found.primary_rows_per_fact_standby_reads:.3f}; reader "
        f"{found.catchup_per_s_primary_reads:,.0f}/s vs {found.catchup_per_s_standby_reads:,.0f}/s "
        f"(ratio {found.throughput_ratio:.2f}); fallbacks to the primary {found.fallbacks}"
    )
