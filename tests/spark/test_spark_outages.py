"""The Spark source through PostgreSQL outages: a partition (a proxy that freezes, then cuts
the driver's and the executors' connections) and restarts of the server (fast and immediate),
while a writer appends.

A streaming query (trigger ``0 seconds``, small micro-batches, two partitions) collects every
micro-batch in this process. The query must not fail: the driver runs its statements again on a
new connection (`QueryDriver.run` in `streams_spark.query_driver`), and an executor's read goes on
from the row
after the last one it handed to Spark (`streams_spark.source.read_partition`). At the end, every
acknowledged fact is in exactly one micro-batch, whole, and the batches hold exactly the stored
facts, in stream-ID order across batches.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from faultkit import Appender, RestartablePostgres, restartable_postgres
from proxy import Proxy

import streams
from streams.devservers import ensure_database

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LEASE = 5.0


class Query:
    """A running streaming query that collects ``(batch_id, [(stream_id, row_no), ...])``."""

    def __init__(self, spark: Any, url: str, stream: str, checkpoint: Path) -> None:
        self.batches: list[tuple[int, list[tuple[int, int]]]] = []
        self._lock = threading.Lock()

        def sink(df: Any, batch_id: int) -> None:
            rows = [(r.stream_id, r.row_no) for r in df.select("stream_id", "row_no").collect()]
            with self._lock:
                self.batches.append((batch_id, rows))

        self.query = (
            spark.readStream.format("streams")
            .option("stream", stream)
            .option("databaseUrl", url)
            .option("maxFactsPerTrigger", "200")
            .option("partitions", "2")
            .option("pollInterval", "50ms")
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime="0 seconds")
            .start()
        )

    def ids(self) -> list[int]:
        with self._lock:
            return [i for _, rows in self.batches for i, row in rows if row == 0]

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.query.isActive, f"the query stopped: {self.query.exception()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    def wait_past(self, acked: list[int], timeout: float, what: str) -> None:
        """Until the query delivered past the last ID acknowledged so far."""
        target = acked[-1]
        self.wait_for(lambda: bool(self.ids()) and self.ids()[-1] >= target, timeout, what)

    def stop_and_check(self, url: str, stream: str, acked: list[int]) -> None:
        self.wait_past(acked, 120, "the last acknowledged fact")
        self.query.stop()
        assert self.query.exception() is None
        with psycopg.connect(url, autocommit=True) as conn:
            stored = conn.execute(
                "SELECT f.stream_id, f.row_no FROM streams_facts f JOIN streams_registry r "
                "ON r.id = f.stream WHERE r.name = %s ORDER BY 1, 2",
                (stream,),
            ).fetchall()
        rows = [row for _, batch in sorted(self.batches) for row in batch]
        assert len(rows) == len(set(rows)), "a row in two micro-batches"
        assert sorted(rows) == rows, "micro-batches out of stream-ID order"
        delivered = set(rows)
        assert delivered <= {tuple(r) for r in stored}, "a row that is not stored"
        last = rows[-1][0]
        assert [tuple(r) for r in stored if r[0] <= last] == rows, "a fact lost or torn"
        assert set(acked) <= {i for i, _ in rows}, "an acknowledged fact never delivered"


@contextlib.contextmanager
def appending(client: streams.Client, stream: str) -> Iterator[list[Appender]]:
    """A single-fact and a batch writer appending until the block ends."""
    with client.writer(stream, instance="single") as one, client.writer(stream, instance="b") as b:
        appenders = [Appender(one, pace=0.005), Appender(b, pace=0.02, batch=4)]
        for appender in appenders:
            appender.start()
        try:
            yield appenders
        finally:
            for appender in appenders:
                appender.stop()


def acked(appenders: list[Appender]) -> list[int]:
    return sorted(i for a in appenders for i in a.acked)


def test_the_source_rides_out_a_partition_from_postgres(
    spark: Any, streams_url: str, unique_name: str, tmp_path: Path
) -> None:
    with (
        Proxy.for_url(streams_url) as proxy,
        streams.connect(streams_url, lease_seconds=LEASE) as client,
    ):
        client.create_stream(unique_name)
        with appending(client, unique_name) as appenders:
            time.sleep(0.5)
            query = Query(spark, proxy.url(streams_url), unique_name, tmp_path / "checkpoint")
            query.wait_past(acked(appenders), 90, "the first micro-batches")
            with proxy.frozen():
                time.sleep(3.0)  # a partition: nothing flows, nothing is closed
            query.wait_past(acked(appenders), 60, "facts after the partition")
            connections = proxy.connections
            for _ in range(4):  # resets, some in the middle of a read
                proxy.cut()
                time.sleep(0.7)
            query.wait_past(acked(appenders), 60, "facts after the resets")
            assert proxy.connections > connections, "nothing reconnected"
        for appender in appenders:
            assert not appender.errors, appender.errors[:3]
        query.stop_and_check(streams_url, unique_name, acked(appenders))


class _SmallBatches:
    """An ADBC connection whose cursors return record batches of about 64 KiB, so that a
    read of a few MB is many batches and a reset can fall between two of them."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def cursor(self) -> Any:
        cur = self._conn.cursor()
        cur.adbc_statement.set_options(**{"adbc.postgresql.batch_size_hint_bytes": "65536"})
        return cur

    def close(self) -> None:
        self._conn.close()


@pytest.mark.parametrize("timestamp_in", ["arrow", "sql"])
def test_an_executor_read_cut_in_the_middle_goes_on_after_its_last_row(
    streams_url: str,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
    timestamp_in: str,
) -> None:
    """One partition read by `read_partition` as an executor does; the connection is reset
    after its first record batch. The read goes on from the next row: the same rows, with the
    same running timestamps, as a read that nothing interrupted."""
    import pyarrow as pa
    from streams_spark import executor as source

    real = source._adbc_connection
    monkeypatch.setattr(
        source, "_adbc_connection", lambda url, *args: _SmallBatches(real(url, *args))
    )
    with streams.connect(streams_url) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            for n in range(8):
                stamp = 1_700_000_000_000 + (n % 3) * 1000  # not monotonic: running maxima
                writer.append_batch([{"n": n, "i": i, "pad": "x" * 80} for i in range(2500)])
                writer.append({"n": n, "late": True}, timestamp=stamp)
        through = client.positions(unique_name).linear
        key = client.stream(unique_name).id
    with Proxy.for_url(streams_url) as proxy:
        part = source.RangePartition(
            stream=unique_name,
            stream_key=key,
            after=0,
            through=through,
            ts_floor=0,
            epoch_upper=through,
            database_url=proxy.url(streams_url),
            timestamp_in=timestamp_in,
        )
        whole = pa.Table.from_batches(list(source.read_partition(part)))
        batches = source.read_partition(part)
        first = [next(batches)]
        connections = proxy.connections
        proxy.cut()
        resumed = pa.Table.from_batches(first + list(batches))
        assert proxy.connections > connections, "the read never reconnected"
    assert whole.num_rows == 8 * 2501
    assert resumed.equals(whole)


@pytest.fixture
def restartable() -> Iterator[RestartablePostgres]:
    with restartable_postgres() as server:
        yield server


def test_the_source_rides_out_postgres_restarts(
    spark: Any, restartable: RestartablePostgres, unique_name: str, tmp_path: Path
) -> None:
    from streams.migrate import upgrade

    url = restartable.proxy.url(ensure_database(restartable.server.url, "streams"))
    upgrade(url)
    with streams.connect(url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        with appending(client, unique_name) as appenders:
            time.sleep(0.5)
            query = Query(spark, url, unique_name, tmp_path / "checkpoint")
            query.wait_past(acked(appenders), 90, "the first micro-batches")
            for mode in ("fast", "immediate"):
                restartable.restart(mode)
                time.sleep(1.0)
                query.wait_past(acked(appenders), 90, f"facts after a {mode} restart")
        for appender in appenders:
            for error in appender.errors:  # the writers' view of the restarts
                assert isinstance(error, streams.StoreError), error
        query.stop_and_check(url, unique_name, acked(appenders))


def test_the_source_rides_out_cancelled_and_terminated_sessions(
    spark: Any, streams_url: str, unique_name: str, tmp_path: Path
) -> None:
    """Every session of the query (the driver's and the executors', named by the URL's
    ``application_name``) has its statement cancelled (``pg_cancel_backend``: SQLSTATE 57014,
    as a statement timeout gives) or is terminated (``pg_terminate_backend``), again and again,
    while writers append. The query keeps running and every fact is in exactly one batch."""
    name = "spark-under-fire"
    url = streams_url + ("&" if "?" in streams_url else "?") + f"application_name={name}"
    hits = {"cancel": 0, "terminate": 0}
    stop = threading.Event()

    def fire() -> None:
        """Terminate every session of the query, or block its statements behind a lock on the
        registry (every probe reads it) and cancel them while they wait."""
        rng = random.Random(7)
        mine = "SELECT count(*) FILTER (WHERE pg_{}_backend(pid)) FROM pg_stat_activity WHERE "
        mine += "application_name = %s AND pid <> pg_backend_pid()"
        with (
            psycopg.connect(streams_url, autocommit=True) as admin,
            psycopg.connect(streams_url) as locker,
        ):
            while not stop.wait(rng.uniform(0.1, 0.3)):
                if rng.random() < 0.5:
                    ended = admin.execute(mine.format("terminate"), (name,)).fetchone()
                    hits["terminate"] += int(ended[0]) if ended else 0
                    continue
                locker.execute("LOCK TABLE streams_registry IN ACCESS EXCLUSIVE MODE")
                deadline, cancelled = time.monotonic() + 1.0, 0
                while not cancelled and time.monotonic() < deadline:
                    time.sleep(0.05)
                    found = admin.execute(
                        mine.format("cancel") + " AND wait_event_type = 'Lock'", (name,)
                    ).fetchone()
                    cancelled = int(found[0]) if found else 0
                locker.rollback()
                hits["cancel"] += cancelled

    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        with appending(client, unique_name) as appenders:
            time.sleep(0.5)
            query = Query(spark, url, unique_name, tmp_path / "checkpoint")
            query.wait_past(acked(appenders), 90, "the first micro-batches")
            firing = threading.Thread(target=fire, daemon=True)
            firing.start()
            try:
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    assert query.query.isActive, f"the query stopped: {query.query.exception()}"
                    time.sleep(0.2)
            finally:
                stop.set()
                firing.join(10)
            query.wait_past(acked(appenders), 90, "facts after the sessions were ended")
        for appender in appenders:
            assert not appender.errors, appender.errors[:3]
        assert hits["cancel"] > 0 and hits["terminate"] > 0, hits
        query.stop_and_check(streams_url, unique_name, acked(appenders))
