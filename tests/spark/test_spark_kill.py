"""Exactly once across ``kill -9`` of a Spark driver process, while writers keep appending.

A subprocess runs a streaming query (checkpoint directory, idempotent ``foreachBatch`` sink into a
PostgreSQL table keyed by (stream, stream_id, row_no)); the test SIGKILLs its whole process
group (the Python driver and its JVM) mid-stream, restarts it from the same checkpoint, and
checks the sink ends equal to the facts table, every fact whole and in one batch.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from helpers import wait_until

from streams import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONSUMER = r"""
import os, sys, time
import psycopg
from pyspark.sql import SparkSession
import streams_spark

url, stream, checkpoint, sink, trigger = sys.argv[1:6]
spark = (SparkSession.builder.master("local[2]").appName("kill-test")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
         .config("spark.python.authenticate.socketTimeout", "120s")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
streams_spark.register(spark)

def write(df, batch_id):
    rows = df.select("stream", "stream_id", "row_no", "payload", "epoch_upper").collect()
    with psycopg.connect(url) as conn:
        with conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {sink} (stream, stream_id, row_no, payload, epoch_upper, batch_id)"
                " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (stream, stream_id, row_no) DO UPDATE"
                f" SET writes = {sink}.writes + 1, batch_id = EXCLUDED.batch_id,"
                " payload = EXCLUDED.payload, epoch_upper = EXCLUDED.epoch_upper",
                [(r.stream, r.stream_id, r.row_no, r.payload, r.epoch_upper, batch_id)
                 for r in rows])
    print("batch", batch_id, len(rows), flush=True)

query = (spark.readStream.format("streams").option("stream", stream).option("databaseUrl", url)
         .option("maxFactsPerTrigger", "100").option("partitions", "2")
         .option("pollInterval", "50ms").load()
         .writeStream.foreachBatch(write).option("checkpointLocation", checkpoint))
if trigger == "availableNow":
    query = query.trigger(availableNow=True)
else:
    query = query.trigger(processingTime="0 seconds")
q = query.start()
q.awaitTermination()
print("done", flush=True)
"""


def _spawn(script: Path, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
    )
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: the driver and its JVM
        )


def test_exactly_once_across_kill_9_of_the_driver(
    client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("the Spark tests need Java 17+", pytrace=False)
    sink = f"sink_{stream}"
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {sink} (stream text, stream_id bigint, row_no int, payload text, "
            "epoch_upper bigint, batch_id bigint, writes int NOT NULL DEFAULT 1, "
            "PRIMARY KEY (stream, stream_id, row_no))"
        )
    script = tmp_path / "consume.py"
    script.write_text(CONSUMER)
    checkpoint = str(tmp_path / "checkpoint")
    log = tmp_path / "consumer.log"

    stop = threading.Event()
    errors: list[BaseException] = []

    def keep_writing(instance: str, seed: int) -> None:
        rng = random.Random(seed)
        writer = client.writer(stream, instance=instance)
        try:
            with psycopg.connect(streams_url) as conn:
                n = 0
                while not stop.is_set() and n < 600:
                    n += 1
                    choice = rng.random()
                    if choice < 0.15:
                        with writer.fact(conn) as fact:
                            fact.add(*({"w": instance, "n": n, "row": r} for r in range(3)))
                    elif choice < 0.25:
                        try:
                            with writer.fact(conn) as fact:
                                fact.add({"gone": n})
                                raise LookupError
                        except LookupError:
                            pass
                    elif choice < 0.5:
                        writer.append_batch([{"w": instance, "n": n, "i": i} for i in range(5)])
                    else:
                        writer.append({"w": instance, "n": n})
                    time.sleep(0.01 + rng.random() * 0.02)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)
        finally:
            writer.close()

    writers = [
        threading.Thread(target=keep_writing, args=(f"w{i}", i), daemon=True) for i in range(2)
    ]
    for thread in writers:
        thread.start()

    def sunk() -> int:
        with psycopg.connect(streams_url) as conn:
            return int(conn.execute(f"SELECT count(*) FROM {sink}").fetchone()[0])  # type: ignore[index]

    t0 = time.monotonic()
    first = _spawn(script, [streams_url, stream, checkpoint, sink, "continuous"], log)
    try:
        try:
            wait_until(lambda: sunk() > 150, 120, "the first run to sink some batches")
        except AssertionError:
            raise AssertionError(log.read_text()[-3000:]) from None
        time.sleep(random.uniform(0.0, 0.5))  # land the kill anywhere in a batch
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    killed_at = sunk()
    print(f"killed after {time.monotonic() - t0:.1f}s with {killed_at} rows sunk")
    time.sleep(0.5)  # writers keep going while no consumer runs
    stop.set()
    for thread in writers:
        thread.join(30)
    assert not errors, errors

    second = _spawn(script, [streams_url, stream, checkpoint, sink, "availableNow"], log)
    try:
        assert second.wait(180) == 0, log.read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    print(f"restarted run done after {time.monotonic() - t0:.1f}s")
    output = log.read_text()
    assert "done" in output

    with psycopg.connect(streams_url) as conn:
        (key,) = conn.execute(
            "SELECT id FROM streams_registry WHERE name = %s", (stream,)
        ).fetchone()  # type: ignore[misc]
        facts = conn.execute(
            "SELECT stream_id, row_no, payload::text FROM streams_facts WHERE stream = %s "
            "ORDER BY 1, 2",
            (key,),
        ).fetchall()
        got = conn.execute(
            f"SELECT stream_id, row_no, payload, batch_id, epoch_upper, writes FROM {sink} "
            "ORDER BY 1, 2"
        ).fetchall()
    assert killed_at < len(facts)
    # Equal to the facts table: nothing lost, nothing invented (payloads as JSON text).
    assert [(i, r) for i, r, *_ in got] == [(i, r) for i, r, _ in facts]
    import json

    assert [json.loads(p) for _, _, p, *_ in got] == [json.loads(p) for _, _, p in facts]
    # Every fact whole, in one batch; batches in stream-ID order, within their epoch.
    batch_of: dict[int, int] = {}
    for stream_id, _, _, batch_id, upper, _ in got:
        assert batch_of.setdefault(stream_id, batch_id) == batch_id
        assert stream_id <= upper
    ordered = [batch_of[i] for i in sorted(batch_of)]
    assert ordered == sorted(ordered)
    multi = [i for i in batch_of if sum(1 for g in got if g[0] == i) == 3]
    assert multi, "the writers wrote multi-row facts"
    # The kill landed mid-stream: Spark replays at most the one batch it had not committed,
    # whole (the sink writes a batch in one transaction), so the rows written twice are
    # exactly the rows of one batch, or there are none; no row is written three times.
    assert max(w for *_, w in got) <= 2
    rewritten = {(i, r) for i, r, _, _, _, w in got if w == 2}
    replayed = {b for _, _, _, b, _, w in got if w == 2}
    assert len(replayed) <= 1, replayed
    if replayed:
        assert rewritten == {(i, r) for i, r, _, b, _, _ in got if b in replayed}
    print(f"rows written twice (the replayed batch {sorted(replayed)}): {len(rewritten)}")
