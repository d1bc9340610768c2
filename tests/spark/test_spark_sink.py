"""The Spark sink against real Spark (local[2]), PostgreSQL and the source reading it back.

Batch writes (a row is a fact, rows sharing a key one fact, timestamps), streaming writes exactly
once when a micro-batch is replayed (from the sink's own record that Spark committed it, and
from the task commits when Spark never got to commit it), a task failing mid-write (no fact,
no pending ID, no live writer), and bad options.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Any

import psycopg
import pytest

from streams import Client
from streams.store import driver, registry, sinks
from streams.types import StreamInfo

pytestmark = pytest.mark.timeout(300)

UTC = dt.UTC


def write(df: Any, stream: str, url: str, **options: str) -> None:
    out = df.write.format("streams").mode("append").option("stream", stream)
    out = out.option("databaseUrl", url)
    for key, value in options.items():
        out = out.option(key, value)
    out.save()


def python_facts(client: Client, stream: str) -> list[tuple[int, str, int, list[Any]]]:
    """(stream ID, instance, timestamp ms, payloads) of every fact, as the Python reader has it."""
    with client.reader(stream) as reader:
        return [(f.stream_id, f.instance, f.timestamp, list(f.payloads)) for f in reader.facts()]


def spark_facts(spark: Any, stream: str, url: str) -> dict[int, tuple[int, list[Any]]]:
    """stream ID -> (timestamp ms, payloads in row order), read back with the source."""
    rows = (
        spark.read.format("streams")
        .option("stream", stream)
        .option("databaseUrl", url)
        .load()
        .selectExpr("stream_id", "row_no", "unix_millis(timestamp) AS ms", "payload")
        .collect()
    )
    out: dict[int, tuple[int, list[tuple[int, Any]]]] = {}
    for row in rows:
        ms, payloads = out.setdefault(row.stream_id, (row.ms, []))
        assert ms == row.ms
        payloads.append((row.row_no, json.loads(row.payload)))
    return {k: (ms, [p for _, p in sorted(rows)]) for k, (ms, rows) in out.items()}


def writer_rows(url: str, stream: str) -> list[tuple[str, bool]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT w.instance, w.retired FROM streams_writers w "
            "JOIN streams_registry r ON r.id = w.stream WHERE r.name = %s ORDER BY 1",
            (stream,),
        ).fetchall()


def assert_settled(client: Client, url: str, stream: str) -> None:
    """No live writer row, no reservation lock, every reserved ID completed (facts or gaps)."""
    assert all(retired for _, retired in writer_rows(url, stream))
    positions = client.positions(stream)
    assert positions.linear == positions.max_allocated
    assert positions.oldest_pending_ms is None


# ------------------------------------------------------------------------------ batch writes


def test_batch_write_rows_and_keyed_facts_read_back(
    spark: Any, client: Client, stream: str, streams_url: str
) -> None:
    base = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    rows = [
        ("o-1", 1, 10.5, base),
        ("o-2", 1, 3.0, base + dt.timedelta(seconds=1)),
        ("o-1", 2, 4.25, base + dt.timedelta(seconds=2)),
        ("o-3", 1, 7.0, None),
        ("o-1", 3, 1.0, base + dt.timedelta(seconds=1)),
    ]
    df = spark.createDataFrame(rows, "order string, line int, amount double, at timestamp")
    # One partition: the facts of one task, in the order their keys first appear.
    write(df.coalesce(1), stream, streams_url, keyColumn="order", timestampColumn="at")

    facts = python_facts(client, stream)
    assert [payloads for _, _, _, payloads in facts] == [
        [{"line": 1, "amount": 10.5}, {"line": 2, "amount": 4.25}, {"line": 3, "amount": 1.0}],
        [{"line": 1, "amount": 3.0}],
        [{"line": 1, "amount": 7.0}],
    ]
    assert {instance for _, instance, _, _ in facts} == {"spark-0"}
    ms = int(base.timestamp() * 1000)
    # A fact's timestamp is the latest of its rows'; one without any gets its arrival time,
    # never below the stream's running maximum.
    assert [ts for _, _, ts, _ in facts][:2] == [ms + 2000, ms + 2000]
    assert facts[2][2] >= ms + 2000
    # The source reads back the same facts, whole, with the same timestamps.
    assert spark_facts(spark, stream, streams_url) == {
        sid: (ts, payloads) for sid, _, ts, payloads in facts
    }
    assert_settled(client, streams_url, stream)
    with psycopg.connect(streams_url) as conn:
        # The job's task commits went with Spark's commit; its query row stays (retention).
        assert conn.execute(
            "SELECT count(*) FROM streams_sink_commits c JOIN streams_registry r "
            "ON r.id = c.stream WHERE r.name = %s",
            (stream,),
        ).fetchone() == (0,)


def test_batch_write_one_fact_per_row_payload_columns(
    spark: Any, client: Client, stream: str, streams_url: str
) -> None:
    n = 25_000  # more than one chunk per task
    df = spark.range(n).selectExpr(
        "id",
        "to_json(named_struct('n', id, 'tag', 'x')) AS doc",
        "named_struct('n', id, 'when', DATE'2026-01-02', 'price', CAST(1.50 AS DECIMAL(5,2)))"
        " AS rec",
        "id * 1000 AS ms",
    )
    write(df.repartition(3), stream, streams_url, payloadColumn="doc", timestampColumn="ms",
          instancePrefix="loader")  # fmt: skip
    facts = python_facts(client, stream)
    assert len(facts) == n
    assert sorted(p[0]["n"] for *_, p in facts) == list(range(n))
    assert all(len(p) == 1 and p[0]["tag"] == "x" for *_, p in facts)
    assert {instance for _, instance, _, _ in facts} == {"loader-0", "loader-1", "loader-2"}

    other = client.create_stream(f"{stream}-b").name
    write(df.limit(3).coalesce(1), other, streams_url, payloadColumn="rec")
    assert [p for *_, p in python_facts(client, other)] == [
        [{"n": n, "when": "2026-01-02", "price": "1.50"}] for n in range(3)
    ]
    third = client.create_stream(f"{stream}-c").name
    write(df.limit(2).coalesce(1), third, streams_url, payloadColumns="id,ms")
    assert [p for *_, p in python_facts(client, third)] == [
        [{"id": 0, "ms": 0}],
        [{"id": 1, "ms": 1000}],
    ]
    assert_settled(client, streams_url, stream)


def test_task_failing_mid_write_leaves_no_fact_and_no_pending_id(
    spark: Any, client: Client, stream: str, streams_url: str
) -> None:
    # Row 15000 is not JSON: the task has copied its first chunk (10000 facts, their IDs
    # reserved) when PostgreSQL refuses the second; the transaction rolls back.
    df = spark.range(20_000).selectExpr(
        "CASE WHEN id = 15000 THEN 'not json' ELSE to_json(named_struct('n', id)) END AS doc"
    )
    with pytest.raises(Exception, match="json"):
        write(df.coalesce(1), stream, streams_url, payloadColumn="doc")
    assert python_facts(client, stream) == []
    positions = client.positions(stream)
    assert positions.max_allocated >= 10_000  # IDs were reserved, and completed as gaps
    assert_settled(client, streams_url, stream)


# ------------------------------------------------------------------------------ streaming writes


def _source_rows(client: Client, name: str, count: int) -> None:
    with client.writer(name, instance="feeder") as writer:
        writer.append_batch([{"n": n} for n in range(count)])


def _run_stream(spark: Any, src: str, dst: str, url: str, checkpoint: Path) -> Any:
    query = (
        spark.readStream.format("streams")
        .option("stream", src)
        .option("databaseUrl", url)
        .option("maxFactsPerTrigger", "40")
        .option("partitions", "2")
        .load()
        .selectExpr("stream_id AS source_id", "payload")
        .writeStream.format("streams")
        .option("stream", dst)
        .option("databaseUrl", url)
        .option("payloadColumn", "payload")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    with contextlib.suppress(Exception):  # a failed query: the tests ask query.exception()
        query.awaitTermination(180)
    assert not query.isActive
    return query


def _delivered(client: Client, dst: str) -> list[int]:
    return sorted(p[0]["n"] for *_, p in python_facts(client, dst))


def test_streaming_write_replayed_batch_writes_nothing_twice(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    dst = client.create_stream(f"{stream}-out").name
    _source_rows(client, stream, 100)
    checkpoint = tmp_path / "ck"
    query = _run_stream(spark, stream, dst, streams_url, checkpoint)
    assert query.exception() is None
    assert _delivered(client, dst) == list(range(100))
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    assert last >= 2  # 100 facts, 40 a batch

    info = driver_info(streams_url, dst)
    committed, tasks = state(streams_url, info, str(query.id))
    assert (committed, tasks) == (last, [])  # Spark committed it: no task commits left

    # The driver died after the sink's commit and before Spark recorded it: Spark replays
    # the last batch, whose tasks find it committed and write nothing.
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    query = _run_stream(spark, stream, dst, streams_url, checkpoint)
    assert query.exception() is None
    assert _delivered(client, dst) == list(range(100))
    assert_settled(client, streams_url, dst)


def test_streaming_write_replay_before_spark_committed_uses_task_commits(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    dst = client.create_stream(f"{stream}-out").name
    _source_rows(client, stream, 100)
    checkpoint = tmp_path / "ck"
    info = driver_info(streams_url, dst)
    # Spark's commit of a micro-batch fails (after every task committed its facts): the query
    # fails with its last batch not committed, and a restart replays it.
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(
            f"""
            CREATE FUNCTION refuse_{dst.replace("-", "_")}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.stream = {info.id} AND NEW.committed_batch >= 1 THEN
                    RAISE EXCEPTION 'test: the driver dies in the sink commit';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER refuse_{dst.replace("-", "_")} BEFORE UPDATE ON streams_sink_queries
            FOR EACH ROW EXECUTE FUNCTION refuse_{dst.replace("-", "_")}();
            """
        )
    try:
        query = _run_stream(spark, stream, dst, streams_url, checkpoint)
        assert query.exception() is not None
    finally:
        with psycopg.connect(streams_url, autocommit=True) as conn:
            conn.execute(f"DROP TRIGGER refuse_{dst.replace('-', '_')} ON streams_sink_queries")
            conn.execute(f"DROP FUNCTION refuse_{dst.replace('-', '_')}()")
    assert _delivered(client, dst) == list(range(80))  # batches 0 and 1, 40 facts each
    committed, tasks = state(streams_url, info, str(query.id))
    assert committed == 0
    assert {batch for batch, _ in tasks} == {1}  # batch 1's tasks committed their facts

    query = _run_stream(spark, stream, dst, streams_url, checkpoint)
    assert query.exception() is None
    assert _delivered(client, dst) == list(range(100))  # batch 1 replayed: nothing twice
    committed, tasks = state(streams_url, info, str(query.id))
    assert committed == 2 and tasks == []
    assert_settled(client, streams_url, dst)
    shutil.rmtree(checkpoint)


def driver_info(url: str, name: str) -> StreamInfo:
    with psycopg.connect(url) as conn:
        return driver.run(conn, registry.load_stream(name))


def state(url: str, info: StreamInfo, query_id: str) -> tuple[Any, list[Any]]:
    with psycopg.connect(url) as conn:
        return driver.run(conn, sinks.sink_state(info, query_id))


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "option stream: name the stream"),
        ({"stream": "a,b"}, "option stream"),
        ({"stream": "{s}", "startingPosition": "1"}, "startingPosition applies to reads"),
        ({"stream": "{s}", "colour": "red"}, "unknown option 'colour'"),
        ({"stream": "{s}", "keyColumn": "nope"}, "keyColumn: 'nope' is not a column"),
        ({"stream": "{s}", "timestampColumn": "name"}, "timestampColumn: column 'name' is string"),
        ({"stream": "{s}", "payloadColumn": "n", "payloadColumns": "n"}, "give one of them"),
        ({"stream": "{s}", "payloadColumn": "raw"}, "'raw' is binary"),
        ({"stream": "{s}", "instancePrefix": "-x"}, "instancePrefix"),
        ({"stream": "{s}", "commitRetention": "5m"}, "commitRetention: at least 1h"),
        ({"stream": "{s}", "leaseSeconds": "0.5"}, "leaseSeconds: between 1s and 3600s"),
        ({"stream": "{s}", "leaseSeconds": "2h"}, "leaseSeconds: between 1s and 3600s"),
        ({"stream": "{s}-missing", "payloadColumns": "name"}, "unknown stream|does not exist"),
    ],
)
def test_bad_options_fail_the_write_with_a_clear_error(
    spark: Any, stream: str, streams_url: str, options: dict[str, str], message: str
) -> None:
    df = spark.createDataFrame([("a", 1, b"x")], "name string, n int, raw binary")
    out = df.write.format("streams").mode("append").option("databaseUrl", streams_url)
    for key, value in options.items():
        out = out.option(key, value.replace("{s}", stream))
    with pytest.raises(Exception, match=message):
        out.save()


def test_overwrite_and_secrets(
    spark: Any, stream: str, streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMS_CONNECT_TIMEOUT", "0")  # the dead URL below: one attempt
    df = spark.createDataFrame([("a",)], "name string")
    with pytest.raises(Exception, match="only appends"):
        df.write.format("streams").mode("overwrite").option("stream", stream).option(
            "databaseUrl", streams_url
        ).save()
    bad = "postgresql://user:hunter2@127.0.0.1:1/nowhere"
    with pytest.raises(Exception) as failure:
        df.write.format("streams").mode("append").option("stream", stream).option(
            "databaseUrl", bad
        ).save()
    assert "hunter2" not in str(failure.value)


# ------------------------------------------------------------------------------ the example


def test_produce_example_runs_with_spark_submit(
    client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    """spark/examples/produce.py as a user submits it: a batch job of multi-row facts, then a
    streaming query copying that stream, facts whole."""
    import os
    import subprocess
    import sys

    submit = Path(sys.executable).parent / "spark-submit"
    example = Path(__file__).parents[2] / "spark" / "examples" / "produce.py"
    env = {**os.environ, "STREAMS_DATABASE_URL": streams_url, "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}  # fmt: skip
    copy = client.create_stream(f"{stream}-copy").name

    def run(*args: str) -> None:
        proc = subprocess.run(
            [str(submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
             str(example), *args],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(stream, "--rows", "300", "--lines", "3", "--partitions", "3")
    facts = python_facts(client, stream)
    assert len(facts) == 100
    assert sorted(tuple(r["n"] for r in p) for *_, p in facts) == [
        (3 * k, 3 * k + 1, 3 * k + 2) for k in range(100)
    ]
    run(copy, "--from-stream", stream, "--available-now", "--checkpoint", "ck")
    assert [p for *_, p in python_facts(client, copy)] == [p for *_, p in facts]


def test_the_spark_page_sink_example_runs_as_written(
    postgres_admin_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/spark.md's sink example, in the test session's Spark (a fresh database)."""
    from helpers import REPO_ROOT, doc_blocks
    from servers import create_database, database_name, drop_database

    import streams
    from streams.migrate import upgrade

    url = create_database(postgres_admin_url)
    try:
        upgrade(url)
        monkeypatch.setenv("STREAMS_DATABASE_URL", url)
        with streams.connect(url) as client:
            client.create_stream("orders")
            client.create_stream("orders-audit")
            (block,) = doc_blocks(REPO_ROOT / "docs" / "spark.md", "python spark-sink")
            # Spark resolves a relative checkpoint against the JVM's start directory.
            checkpoint = repr(str(tmp_path / "checkpoints" / "orders-audit"))
            code = block.replace('"checkpoints/orders-audit"', checkpoint)
            namespace: dict[str, Any] = {"__name__": "docs"}
            exec(compile(code, "docs/spark.md sink block", "exec"), namespace)
            assert namespace["audit"].exception() is None
            orders = python_facts(client, "orders")
            assert sorted((p for *_, p in orders), key=len, reverse=True) == [
                [{"line": 1, "sku": "a-1", "qty": 2}, {"line": 2, "sku": "b-7", "qty": 1}],
                [{"line": 1, "sku": "a-1", "qty": 5}],
            ]
            audit = python_facts(client, "orders-audit")
            assert [p for *_, p in audit] == [p for *_, p in orders]
    finally:
        drop_database(postgres_admin_url, database_name(url))
