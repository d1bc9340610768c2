"""The Spark source through a PostgreSQL failover (`tests/pgpair.py`): the primary killed, its
standby promoted, every connection on the libpq multi-host URL.

* Synchronous standby: the query goes on by itself. Its offsets were proven on the old
  timeline at WAL positions at or below the switch point (`streams_timeline_switchpoint`), so
  the driver takes them and the executors read the ranges planned there on the new primary;
  every acknowledged fact is in exactly one micro-batch, whole, in order. A plain Python reader
  on the same stream runs beside the query, and the seconds from the promotion to each one's
  first delivery of a fact appended after it are printed (``-s``). ``STREAMS_FAILOVER_ROUNDS``
  (default 1) runs that many failovers, each on a new pair, and prints the medians;
  ``STREAMS_FAILOVER_STREAMS`` creates that many other streams first (a bigger catalog: ADBC
  reads every column of it when it opens a database, `streams_spark.executor._adbc_connection`).
* An executor's fresh connection after a failover opens a session on the ADBC database it
  already has: it does not read the catalog again.
* Asynchronous standby cut off before the last facts: the query stops with
  `streams.DatabaseChanged` naming the offset proven after the switch point, instead of
  re-reading its ranges on a history that lacks some of their facts.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from faultkit import Appender
from pgpair import postgres_pair
from test_spark_outages import Query, acked

import streams
from streams.migrate import upgrade

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROUNDS = int(os.environ.get("STREAMS_FAILOVER_ROUNDS", "1"))
OTHER_STREAMS = int(os.environ.get("STREAMS_FAILOVER_STREAMS", "0"))


class Delivered(threading.Thread):
    """Polls a plain reader until stopped: every delivered ID, with when it first came."""

    def __init__(self, reader: streams.Reader) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.got: list[int] = []
        self.at: dict[int, float] = {}
        self.errors: list[BaseException] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                epoch = self.reader.poll(timeout=0.2)
            except streams.DatabaseChanged as exc:
                self.errors.append(exc)
                return
            except streams.StreamsError as exc:  # the server is down: poll tries again
                self.errors.append(exc)
                time.sleep(0.05)
                continue
            if epoch is not None:
                now = time.monotonic()
                for fact in epoch.facts:
                    self.got.append(fact.stream_id)
                    self.at.setdefault(fact.stream_id, now)


@dataclass(frozen=True)
class Resumed:
    """Seconds from the promotion to the first append after it and to its first delivery by
    the reader and the query; and, for scale, from an append before the kill to its delivery
    (what a micro-batch takes anyway)."""

    promote: float
    appended: float
    python: float
    spark: float
    python_before: float
    spark_before: float


def _first_append(writer: streams.Writer) -> int:
    deadline = time.monotonic() + 60
    while True:
        try:
            return writer.append({"probe": True}).ids[0]
        except streams.StreamsError:
            assert time.monotonic() < deadline, "no append succeeded after the failover"
            time.sleep(0.01)


def _delivered(reader: Delivered, fact: int) -> Callable[[], bool]:
    return lambda: fact in reader.at


def _deliveries(query: Query, reader: Delivered, fact: int, since: float) -> tuple[float, float]:
    """Seconds from ``since`` until the reader and the query delivered ``fact``."""
    spark_at = None
    deadline = time.monotonic() + 120
    while spark_at is None or fact not in reader.at:
        assert query.query.isActive, f"the query stopped: {query.query.exception()}"
        assert time.monotonic() < deadline, f"fact {fact} not delivered"
        if spark_at is None and fact in query.ids():
            spark_at = time.monotonic()
        time.sleep(0.005)
    return reader.at[fact] - since, spark_at - since


def _one_failover(spark: Any, stream: str, checkpoint: Path) -> Resumed:
    with postgres_pair(synchronous=True) as pair:
        upgrade(pair.primary_url)
        url = pair.multi_host_url
        with streams.connect(url, connect_timeout=20) as client:
            client.create_stream(stream)
            for n in range(OTHER_STREAMS):
                client.create_stream(f"{stream}_{n}")
            writer = client.writer(stream)
            # Slow enough for the query to keep up on a loaded machine: a backlog at the kill
            # would be timed as if it were the failover's.
            appender = Appender(writer, pace=0.02)
            reader = Delivered(client.reader(stream, start="earliest"))
            appender.start()
            reader.start()
            query = Query(spark, url, stream, checkpoint)
            try:
                try:
                    for _ in range(2):  # both caught up: what they deliver next is the failover's
                        query.wait_past(appender.acked, 300, "the first micro-batches")
                        query.wait_for(_delivered(reader, appender.acked[-1]), 60, "the reader")
                    with client.writer(stream, instance="before-failover") as before:
                        sent = time.monotonic()
                        earlier = _first_append(before)
                    usual = _deliveries(query, reader, earlier, sent)
                    pair.kill_primary()
                    promote = pair.promote()
                    promoted = time.monotonic()
                    with client.writer(stream, instance="after-failover") as after:
                        first = _first_append(after)
                    appended = time.monotonic() - promoted
                    python_s, spark_s = _deliveries(query, reader, first, promoted)
                    time.sleep(1.0)  # more appends after the failover
                finally:
                    appender.stop()
                writer.close()
                facts = sorted([*acked([appender]), earlier, first])
                query.stop_and_check(pair.standby_url, stream, facts)
                deadline = time.monotonic() + 60
                while not set(facts) <= set(reader.got):
                    assert time.monotonic() < deadline, "the reader missed an acknowledged fact"
                    time.sleep(0.05)
            finally:
                query.query.stop()  # no query left reading from servers that are gone
                reader.stopped.set()
                reader.join(timeout=30)
        assert not [e for e in reader.errors if isinstance(e, streams.DatabaseChanged)]
        assert len(reader.got) == len(set(reader.got)), "the reader delivered a fact twice"
        assert reader.got == sorted(reader.got), "the reader delivered out of order"
        return Resumed(promote, appended, python_s, spark_s, *usual)


@pytest.mark.timeout(400 * ROUNDS + OTHER_STREAMS)  # a stream takes up to a second to create
def test_a_query_rides_out_a_synchronous_failover(
    spark: Any, unique_name: str, tmp_path: Path
) -> None:
    rounds = [
        _one_failover(spark, f"{unique_name}_{n}", tmp_path / f"checkpoint{n}")
        for n in range(ROUNDS)
    ]
    print()
    for n, r in enumerate(rounds):
        print(
            f"synchronous failover {n + 1}/{ROUNDS} ({OTHER_STREAMS} other streams): promote "
            f"{r.promote:.2f} s; after it, first append {r.appended:.2f} s, delivered by a "
            f"Python reader {r.python:.2f} s, by a Spark query {r.spark:.2f} s (an append "
            f"before the kill: {r.python_before:.2f} s, {r.spark_before:.2f} s); each fact "
            "once, in order"
        )
    if ROUNDS > 1:
        python = statistics.median(r.python for r in rounds)
        spark_s = statistics.median(r.spark for r in rounds)
        usual = statistics.median(r.spark_before for r in rounds)
        print(
            f"medians of {ROUNDS}: Python reader {python:.2f} s, Spark query {spark_s:.2f} s "
            f"after the promotion ({spark_s - python:+.2f} s); Spark {usual:.2f} s after an "
            "append before the kill"
        )


def test_an_executor_reconnects_on_its_adbc_database_after_a_failover(unique_name: str) -> None:
    """A partition read as an executor reads it (`read_partition`), before and after a
    failover: the cached session is dead afterwards, and the new one is opened on the same ADBC
    database (no second read of the catalog), committing each statement by itself."""
    import pyarrow as pa
    from streams_spark import executor

    with postgres_pair(synchronous=True) as pair:
        upgrade(pair.primary_url)
        url = pair.multi_host_url
        with streams.connect(url, connect_timeout=20) as client:
            client.create_stream(unique_name)
            with client.writer(unique_name) as writer:
                last = [writer.append_batch([{"n": n}] * 3).ids[-1] for n in range(10)][-1]
            key = client.stream(unique_name).id
        part = executor.RangePartition(
            stream=unique_name,
            stream_key=key,
            after=0,
            through=last,
            ts_floor=0,
            epoch_upper=last,
            database_url=url,
        )
        try:
            before = pa.Table.from_batches(list(executor.read_partition(part)))
            first = executor._adbc_connection(url)
            pair.kill_primary()
            pair.promote()
            after = pa.Table.from_batches(list(executor.read_partition(part)))
            again = executor._adbc_connection(url)
            assert again is not first, "the dead session was used again"
            assert again.adbc_database is first.adbc_database, "the catalog was read again"
            with again.cursor() as cur:
                xids = []
                for _ in range(2):
                    cur.execute("SELECT pg_current_xact_id()::text")
                    xids.append(cur.fetchall()[0][0])
            assert xids[0] != xids[1], "the new session runs its statements in one transaction"
        finally:
            executor._close_adbc_connections()
        assert after.num_rows == before.num_rows == 30
        assert after.equals(before)


def test_a_query_stops_on_an_asynchronous_failover_that_lost_its_facts(
    spark: Any, unique_name: str, tmp_path: Path
) -> None:
    with postgres_pair(synchronous=False) as pair:
        upgrade(pair.primary_url)
        url = pair.multi_host_url
        with streams.connect(url, connect_timeout=20) as client:
            client.create_stream(unique_name)
            with client.writer(unique_name) as writer:
                kept = [writer.append({"n": n}).ids[0] for n in range(20)]
                pair.wait_replayed()
                pair.cut_off()
                lost = [writer.append({"n": n}).ids[0] for n in range(20, 30)]
            query = Query(spark, url, unique_name, tmp_path / "checkpoint")
            query.wait_past([*kept, *lost], 120, "every fact")
            pair.kill_primary()
            pair.promote()
            with client.writer(unique_name, instance="after") as again:
                again.append({"n": 30})
            deadline = time.monotonic() + 120
            while query.query.isActive:
                assert time.monotonic() < deadline, "the query went on after losing facts"
                time.sleep(0.2)
        error = str(query.query.exception())
        assert "DatabaseChanged" in error and "switch point" in error, error
        assert unique_name in error
