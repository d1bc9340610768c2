"""`streams demo`: the main job end to end, checking itself.

Several writer *processes* append at a steady rate (single facts, batches, and a multi-row fact
written with ``writer.fact(conn)`` that also puts a row in a user table, ``demo_lines``); a
Python reader in a group and a Spark Structured Streaming query consume the stream as epochs
while a live view shows positions, writers, groups and lag. At the end the writers stop, both
readers drain to the final linear position, and a summary checks that each delivered every
committed fact exactly once, whole (every row), in stream-ID order; any mismatch is a non-zero
exit.

Every run's stream shares ``demo_lines``: its ``stream`` column says whose a row is, and each
stream declares only its own rows (``demo_lines.stream_id WHERE stream = 'demo-...'``), so
sequence repair starts each new stream at ID 1, not past the rows of earlier runs.

The Spark query writes each micro-batch into ``demo_spark_sink`` (an idempotent upsert keyed by
stream ID and row), which is what a real pipeline would do; the check compares that table and
the batches' order with ``streams_facts``. It is the connector's (`streams_spark.demo_query`),
found through an entry point (`streams.plugins`), so that the library never imports it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg

from ..client import Client, connect
from ..config import Settings
from ..core.epochs import Fact
from ..plugins import DEMO, load_plugin
from .render import Table, age, positions_tables, print_tables, rich_renderable

__all__ = ["DemoResult", "run_demo"]

USER_TABLE = "demo_lines"
SINK_TABLE = "demo_spark_sink"


@dataclass
class DemoResult:
    stream: str
    committed_facts: int = 0
    committed_rows: int = 0
    python_facts: int = 0
    spark_facts: int = 0
    spark_batches: int = 0
    epochs: int = 0
    problems: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C: what was committed until then was checked
    seconds: float = 0.0
    spark_log: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "committed_facts": self.committed_facts,
            "committed_rows": self.committed_rows,
            "python_facts": self.python_facts,
            "spark_facts": self.spark_facts,
            "spark_batches": self.spark_batches,
            "epochs": self.epochs,
            "ok": self.ok,
            "problems": self.problems,
            "interrupted": self.interrupted,
            "seconds": round(self.seconds, 1),
            "spark_log": self.spark_log,
        }


# ------------------------------------------------------------------------------- writers


def _writer_process(
    url: str, redis_url: str | None, prefix: str, stream: str, k: int, rate: float, stop: Any
) -> None:
    """One writer process: ``rate`` facts/s, cycling single facts, batches and user facts."""
    with (
        connect(url, redis_url, prefix) as client,
        client.writer(stream, instance=f"demo-writer-{k}") as writer,
        psycopg.connect(url) as conn,
    ):
        n = step = 0
        started = time.monotonic()
        while not stop.is_set():
            kind = step % 10
            step += 1
            if kind < 6:
                writer.append({"writer": k, "n": n})
                n += 1
            elif kind < 9:
                size = 5 + (n % 7)
                writer.append_batch([{"writer": k, "n": n + i} for i in range(size)])
                n += size
            else:
                with writer.fact(conn) as fact:
                    conn.execute(
                        f"INSERT INTO {USER_TABLE} (stream, stream_id, item) VALUES (%s, %s, %s)",
                        (stream, fact.stream_id, f"line of writer {k}"),
                    )
                    fact.add({"writer": k, "n": n, "row": 0}, {"writer": k, "n": n, "row": 1})
                n += 1
            # Steady rate: sleep until the n-th fact is due.
            delay = started + n / rate - time.monotonic()
            if delay > 0:
                stop.wait(delay)


# ------------------------------------------------------------------------------- readers


class _PythonReader:
    def __init__(self, client: Client, stream: str) -> None:
        self.reader = client.reader(stream, group="demo-python")
        self.facts: list[Fact] = []
        self.epochs = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="demo-reader", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                epoch = self.reader.poll(timeout=0.2)
                if epoch is not None:
                    self.facts.extend(epoch.facts)
                    self.epochs += 1
                    self.reader.commit()
        except BaseException as exc:  # reported in the summary
            self.error = exc

    def drain(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is None:
            for epoch in self.reader.epochs():
                self.facts.extend(epoch.facts)
                self.epochs += 1
            self.reader.commit()
        self.reader.close()


class _SparkStep(Protocol):
    """The demo's Spark query, from the connector (`streams_spark.demo_query.SparkQuery`, the
    entry point ``spark`` of ``streams.demo``): it runs the streams source into `SINK_TABLE`
    from its start, counting its micro-batches, until `drain` has it deliver what is complete
    and stop."""

    batches: int

    def drain(self) -> None: ...


def _spark_query(settings: Settings, stream: str, checkpoint: str, log: str) -> _SparkStep:
    """Start the Spark step (the library never imports the connector: `streams.plugins`); the
    JVM's own output goes to ``log``, not to the terminal."""
    step = load_plugin(DEMO, "spark")
    query: _SparkStep = step(settings, stream, checkpoint, SINK_TABLE, log=log)
    return query


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Processes started in this block ignore Ctrl-C (Python keeps SIGINT ignored when it
    starts so): the terminal sends it to the whole process group, and the writers must stop
    by the demo's event, not by a traceback each."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ------------------------------------------------------------------------------- the run


def _setup(settings: Settings, client: Client, spark: bool) -> str:
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        # One table for every run's stream: ``stream`` says whose a row is, and each stream
        # declares only its own rows (below), so sequence repair does not start a new stream
        # past the IDs of earlier runs. The index answers repair's max(stream_id) per stream.
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {USER_TABLE} "
            "(stream text NOT NULL, stream_id bigint NOT NULL, item text NOT NULL)"
        )
        # A table of a demo from before the column existed: its rows are nobody's now.
        conn.execute(f"ALTER TABLE {USER_TABLE} ADD COLUMN IF NOT EXISTS stream text")
        conn.execute(
            f"CREATE INDEX IF NOT EXISTS {USER_TABLE}_stream_id ON {USER_TABLE} (stream, stream_id)"
        )
        if spark:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {SINK_TABLE} (stream text, stream_id bigint, "
                "row_no int, batch_id bigint, epoch_upper bigint, "
                "PRIMARY KEY (stream, stream_id, row_no))"
            )
    name = f"demo-{int(time.time())}"
    client.create_stream(name, fact_tables=[f"{USER_TABLE}.stream_id WHERE stream = '{name}'"])
    return name


def _view(
    client: Client, stream: str, reader: _PythonReader, query: _SparkStep | None
) -> list[Table]:
    p = client.positions(stream)
    streams_table = Table(
        f"stream {stream}",
        ["LINEAR", "MAX_ALLOCATED", "SCRATCHPAD", "OLDEST_PENDING_MS", "EPOCHS", "SPARK_BATCHES"],
        numeric=frozenset({"LINEAR", "MAX_ALLOCATED", "SCRATCHPAD", "EPOCHS", "SPARK_BATCHES"}),
    )
    streams_table.rows.append(
        [
            str(p.linear),
            str(p.max_allocated),
            str(p.scratchpad),
            age(p.oldest_pending_ms),
            str(reader.epochs),
            str(query.batches) if query else "-",
        ]
    )
    # Writers and readers as `streams positions` shows them.
    return [streams_table, *positions_tables([p], show_all=False)[1:]]


@contextlib.contextmanager
def _live(terminal: bool, out: Callable[[str], None]) -> Iterator[Callable[[list[Table]], None]]:
    if terminal:
        from rich.live import Live

        with Live(auto_refresh=False) as live:
            yield lambda tables: live.update(rich_renderable(tables), refresh=True)
    else:

        def show(tables: list[Table]) -> None:
            row = tables[0].rows[0]
            out(f"linear {row[0]}  max allocated {row[1]}  epochs {row[4]}  spark batches {row[5]}")

        yield show


#: Said once before the live view: what its figures are.
LEGEND = (
    "every 2 s: linear = every ID at or below it has completed (what readers may read); "
    "max allocated = the highest ID handed out to a writer; epochs = what the Python reader "
    "took; spark batches = micro-batches Spark completed. Ctrl-C stops early."
)


def run_demo(
    settings: Settings,
    *,
    duration: float,
    writers: int = 3,
    rate: float = 50.0,
    spark: bool = True,
    terminal: bool = False,
    out: Callable[[str], None] = print,
    metrics: Any = None,
) -> DemoResult:
    """Run the demo for ``duration`` seconds (or until Ctrl-C) and check the result. With
    ``metrics`` (a prometheus-client registry), the Python reader's client reports there (its
    reader and Redis link: `streams.metrics.ClientCollector`)."""
    checkpoint = tempfile.mkdtemp(prefix="streams-demo-")
    with connect(settings.database_url, settings.redis_url, settings.prefix) as client:
        if metrics is not None:
            from ..metrics import ClientCollector

            metrics.register(ClientCollector(client))
        stream = _setup(settings, client, spark)
        spark_note = " and a Spark query (group demo-spark)" if spark else ""
        out(
            f"stream {stream}: {writers} writer processes at {rate:g} facts/s each, "
            f"a Python reader (group demo-python){spark_note}"
        )
        result = DemoResult(stream)
        reader = _PythonReader(client, stream)
        reader.thread.start()
        query = None
        if spark:
            result.spark_log = os.path.join(tempfile.gettempdir(), f"streams-{stream}-spark.log")
            out(f"starting Spark (its own log: {result.spark_log})...")
            query = _spark_query(settings, stream, checkpoint, result.spark_log)
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        procs = [
            ctx.Process(
                target=_writer_process,
                args=(
                    settings.database_url,
                    settings.redis_url,
                    settings.prefix,
                    stream,
                    k,
                    rate,
                    stop,
                ),
                daemon=True,
            )
            for k in range(writers)
        ]
        with _sigint_ignored():
            for proc in procs:
                proc.start()
        started = time.monotonic()
        out(LEGEND if not terminal else LEGEND.replace("every 2 s: ", ""))
        try:
            with _live(terminal, out) as show:
                deadline = started + duration
                while time.monotonic() < deadline:
                    show(_view(client, stream, reader, query))
                    time.sleep(0.5 if terminal else 2.0)
        except KeyboardInterrupt:
            result.interrupted = True
            out("stopping (Ctrl-C): the writers finish, the readers read what committed...")
        finally:
            result.seconds = time.monotonic() - started
            stop.set()
            for proc in procs:
                proc.join(timeout=30)
        for proc in procs:
            if proc.exitcode != 0:
                result.problems.append(f"writer process {proc.name} exited with {proc.exitcode}")
        reader.drain()
        if reader.error is not None:
            result.problems.append(f"Python reader failed: {reader.error!r}")
        if query is not None:
            query.drain()
        _check(settings, client, stream, reader, query, result)
    shutil.rmtree(checkpoint, ignore_errors=True)
    return result


def _check(
    settings: Settings,
    client: Client,
    stream: str,
    reader: _PythonReader,
    query: _SparkStep | None,
    result: DemoResult,
) -> None:
    info = client.stream(stream)
    with psycopg.connect(settings.database_url) as conn:
        stored = conn.execute(
            "SELECT stream_id, count(*) FROM streams_facts WHERE stream = %s "
            "GROUP BY stream_id ORDER BY stream_id",
            (info.id,),
        ).fetchall()
        user_ids = {
            int(r[0])
            for r in conn.execute(
                f"SELECT stream_id FROM {USER_TABLE} WHERE stream = %s AND stream_id = ANY(%s)",
                (stream, [int(i) for i, _ in stored]),
            ).fetchall()
        }
        sink = (
            conn.execute(
                f"SELECT stream_id, row_no, batch_id FROM {SINK_TABLE} WHERE stream = %s "
                "ORDER BY stream_id, row_no",
                (stream,),
            ).fetchall()
            if query is not None
            else []
        )
    expected = [(int(i), int(n)) for i, n in stored]
    result.committed_facts = len(expected)
    result.committed_rows = sum(n for _, n in expected)
    got = [(f.stream_id, len(f.payloads)) for f in reader.facts]
    result.python_facts = len(got)
    result.epochs = reader.epochs
    if got != expected:
        ids = [i for i, _ in got]
        dupes = len(ids) - len(set(ids))
        missing = sorted({i for i, _ in expected} - set(ids))[:5]
        result.problems.append(
            f"Python reader: {len(got)} facts delivered, {len(expected)} committed "
            f"(duplicates {dupes}, missing e.g. {missing}, in order {ids == sorted(ids)})"
        )
    # Nothing may show as lagging after the run: each group holds the end it delivered.
    linear = client.positions(stream).linear
    held = {g.group: g.position for g in client.groups(stream)}
    for group in ("demo-python", "demo-spark") if query is not None else ("demo-python",):
        if held.get(group) != linear and not reader.error:
            result.problems.append(f"group {group} holds {held.get(group)}, not {linear}")
    multi_row = [i for i, n in expected if n > 1]
    if multi_row and not user_ids.issuperset(multi_row):
        result.problems.append("a fact() committed its rows but not its user-table row")
    if query is not None:
        result.spark_batches = query.batches
        per_fact: dict[int, list[int]] = {}
        batch_of: dict[int, set[int]] = {}
        for stream_id, _row, batch_id in sink:
            per_fact.setdefault(int(stream_id), []).append(int(_row))
            batch_of.setdefault(int(stream_id), set()).add(int(batch_id))
        spark_got = [(i, len(rows)) for i, rows in sorted(per_fact.items())]
        result.spark_facts = len(spark_got)
        if spark_got != expected:
            result.problems.append(
                f"Spark: {len(spark_got)} facts in {SINK_TABLE}, {len(expected)} committed"
            )
        torn = [i for i, batches in batch_of.items() if len(batches) > 1]
        if torn:
            result.problems.append(f"Spark: facts split across micro-batches: {torn[:5]}")
        order = [min(batch_of[i]) for i, _ in spark_got]
        if order != sorted(order):
            result.problems.append("Spark: a later batch delivered a smaller stream ID")


def print_summary(result: DemoResult, out: Callable[[str], None], terminal: bool) -> None:
    table = Table(
        "summary",
        ["CHECK", "RESULT"],
    )
    table.rows = [
        ["committed", f"{result.committed_facts} facts, {result.committed_rows} rows"],
        ["Python reader", f"{result.python_facts} facts in {result.epochs} epochs"],
        [
            "Spark query",
            f"{result.spark_facts} facts in {result.spark_batches} batches"
            if result.spark_batches or result.spark_facts
            else "not run",
        ],
        ["verdict", _verdict(result)],
    ]
    if result.spark_log is not None:
        table.rows.append(["Spark's log", result.spark_log])
    print_tables([table], sys.stdout, terminal=terminal)
    for problem in result.problems:
        out(f"problem: {problem}")


def _verdict(result: DemoResult) -> str:
    if not result.ok:
        return "FAILED"
    if result.interrupted:
        return (
            f"interrupted (Ctrl-C) after {result.seconds:.0f} s: every fact committed until "
            "then exactly once, whole, in order"
        )
    return "every fact exactly once, whole, in order"
