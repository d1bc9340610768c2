"""The Spark source against real Spark (local[2]), PostgreSQL and Redis.

One SparkSession for all Spark tests (`tests/conftest.py`; starting one costs ~7-10 s). A missing
Java fails loudly.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import wait_until

import streams
from streams import Client

pytestmark = pytest.mark.timeout(240)

Row = dict[str, Any]


def rows_of(df: Any) -> list[Row]:
    """Rows with the timestamp as ms (no time-zone conversion on the way)."""
    out = df.selectExpr("*", "unix_micros(timestamp) AS ts_us").drop("timestamp").collect()
    return [r.asDict() for r in out]


def facts_of(rows: list[Row]) -> dict[tuple[str, int], tuple[str, int, list[Any]]]:
    """(stream, id) -> (instance, timestamp ms, payloads in row order)."""
    by_fact: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        by_fact.setdefault((row["stream"], row["stream_id"]), []).append(row)
    out = {}
    for key, fact_rows in by_fact.items():
        fact_rows.sort(key=lambda r: r["row_no"])
        assert [r["row_no"] for r in fact_rows] == list(range(len(fact_rows))), key
        assert len({(r["instance"], r["ts_us"]) for r in fact_rows}) == 1, key
        assert fact_rows[0]["ts_us"] % 1000 == 0
        out[key] = (
            fact_rows[0]["instance"],
            fact_rows[0]["ts_us"] // 1000,
            [json.loads(r["payload"]) for r in fact_rows],
        )
    return out


def reader_facts(
    client: Client, streams: list[str], **kwargs: Any
) -> dict[tuple[str, int], tuple[str, int, list[Any]]]:
    with client.reader(streams, **kwargs) as reader:
        return {
            (f.stream, f.stream_id): (f.instance, f.timestamp, list(f.payloads))
            for f in reader.facts()
        }


def stream_batches(
    spark: Any, options: dict[str, str], checkpoint: Path, *, trigger: str = "availableNow"
) -> list[tuple[int, list[Row]]]:
    """Run a query to the end (availableNow) and return every micro-batch's rows."""
    batches: list[tuple[int, list[Row]]] = []

    def sink(df: Any, batch_id: int) -> None:
        batches.append((batch_id, rows_of(df)))

    reader = spark.readStream.format("streams")
    for key, value in options.items():
        reader = reader.option(key, value)
    query = (
        reader.load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert not query.isActive
    assert query.exception() is None
    return batches


def write_mixed(client: Client, stream: str, url: str, *, base_ts: int | None = None) -> None:
    """Single facts, a batch, multi-row facts, rolled-back gaps and a skewed timestamp."""
    writer = client.writer(stream, instance="w-a")
    other = client.writer(stream, instance="w-b")
    try:
        writer.append({"n": 1})
        writer.append_batch([{"n": i} for i in range(2, 6)])
        with psycopg.connect(url) as conn:
            with writer.fact(conn) as fact:
                fact.add({"multi": 0}, {"multi": 1}, {"multi": 2})
            with pytest.raises(RuntimeError), writer.fact(conn) as fact:
                fact.add({"gone": True})
                raise RuntimeError("roll back: a permanent gap")
            with other.fact(conn) as fact:
                fact.add({"multi": "b0"}, {"multi": "b1"})
        now = int(time.time() * 1000)
        other.append({"skewed": True}, timestamp=now - 3_600_000)  # raised to the running max
        writer.append_batch([{"n": i} for i in range(6, 12)])
    finally:
        writer.close()
        other.close()


# ------------------------------------------------------------------------------ equality


def test_batch_and_stream_reads_equal_the_python_reader(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    write_mixed(client, stream, streams_url)
    expected = reader_facts(client, [stream])
    assert len(expected) == 14

    df = (
        spark.read.format("streams")
        .option("stream", stream)
        .option("databaseUrl", streams_url)
        .option("partitions", "3")
        .load()
    )
    rows = rows_of(df)
    assert facts_of(rows) == expected
    last = max(i for _, i in expected)
    assert {r["epoch_upper"] for r in rows} == {last}
    assert df.rdd.getNumPartitions() == 3

    # The running maximum computed in SQL gives the same.
    sql_rows = rows_of(
        spark.read.format("streams")
        .option("stream", stream)
        .option("databaseUrl", streams_url)
        .option("timestampIn", "sql")
        .load()
    )
    assert facts_of(sql_rows) == expected

    batches = stream_batches(
        spark, {"stream": stream, "databaseUrl": streams_url, "partitions": "2"}, tmp_path / "c"
    )
    assert facts_of([r for _, rows in batches for r in rows]) == expected
    # In stream-ID order within a partition: Spark keeps each partition's order on collect.
    for _, batch_rows in batches:
        keys = [(r["stream_id"], r["row_no"]) for r in batch_rows]
        assert keys == sorted(keys)


def test_bounded_batch_ranges(spark: Any, client: Client, stream: str, streams_url: str) -> None:
    writer = client.writer(stream, instance="w")
    writer.append_batch([{"i": i} for i in range(1, 21)])
    writer.close()

    def ids(**options: str) -> list[int]:
        reader = spark.read.format("streams").option("stream", stream)
        for k, v in {"databaseUrl": streams_url, **options}.items():
            reader = reader.option(k, v)
        return sorted(r.stream_id for r in reader.load().select("stream_id").collect())

    assert ids(startingPosition="5", endingPosition="9") == [5, 6, 7, 8, 9]
    frontier = json.dumps({"v": 1, "streams": {stream: 15}})
    assert ids(startingPosition=frontier) == list(range(16, 21))
    assert ids(startingPosition="latest") == []
    assert ids(endingPosition="1000") == list(range(1, 21))  # capped at the complete position
    assert ids(endingPosition="3") == [1, 2, 3]


def test_two_streams(
    spark: Any, client: Client, stream: str, unique_name: str, streams_url: str, tmp_path: Path
) -> None:
    second = unique_name + "x"
    client.create_stream(second)
    wa, wb = client.writer(stream, instance="a"), client.writer(second, instance="b")
    wa.append_batch([{"a": i} for i in range(5)])
    wb.append_batch([{"b": i} for i in range(3)])
    wa.close()
    wb.close()
    expected = reader_facts(client, [stream, second])
    options = {"streams": f"{stream},{second}", "databaseUrl": streams_url}
    batches = stream_batches(spark, {**options, "maxFactsPerTrigger": "4"}, tmp_path / "c")
    assert facts_of([r for _, rows in batches for r in rows]) == expected
    for _, rows in batches:
        assert len({(r["stream"], r["stream_id"]) for r in rows}) <= 4
    got_batch = rows_of(spark.read.format("streams").options(**options).load())
    assert facts_of(got_batch) == expected
    assert {r["epoch_upper"] for r in got_batch if r["stream"] == second} == {3}


# ------------------------------------------------------------------------------ admission


def test_max_facts_per_trigger_counts_facts_across_gaps_and_multi_row_facts(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    write_mixed(client, stream, streams_url)
    expected = reader_facts(client, [stream])
    batches = stream_batches(
        spark,
        {"stream": stream, "databaseUrl": streams_url, "maxFactsPerTrigger": "2"},
        tmp_path / "c",
    )
    seen: dict[int, int] = {}
    previous_upper = 0
    for batch_id, rows in batches:
        ids = {r["stream_id"] for r in rows}
        assert 1 <= len(ids) <= 2, (batch_id, ids)
        uppers = {r["epoch_upper"] for r in rows}
        assert len(uppers) == 1
        upper = uppers.pop()
        assert all(previous_upper < i <= upper for i in ids)
        previous_upper = upper
        for i in ids:
            assert i not in seen
            seen[i] = batch_id
    assert len(batches) == 7  # 14 facts, 2 per batch
    assert facts_of([r for _, rows in batches for r in rows]) == expected


def test_a_held_open_fact_is_never_skipped_and_later_facts_wait(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    first = client.writer(stream, instance="w1")
    second = client.writer(stream, instance="w2")
    first.append_batch([{"i": i} for i in range(1, 4)])  # 1..3
    delivered: list[int] = []
    offsets: list[str] = []

    def sink(df: Any, batch_id: int) -> None:
        delivered.extend(r.stream_id for r in df.select("stream_id").collect())

    query = (
        spark.readStream.format("streams")
        .option("stream", stream)
        .option("databaseUrl", streams_url)
        .option("pollInterval", "50ms")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "c"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        wait_until(lambda: sorted(delivered) == [1, 2, 3], 60, "the first facts")
        with psycopg.connect(streams_url) as conn, first.fact(conn) as held:
            held.add({"held": True})
            held_id = held.stream_id
            ack = second.append_batch([{"after": i} for i in range(3)])
            assert ack.first_id > held_id
            # Several triggers pass; keep the transaction busy (not idle past the lease).
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                conn.execute("SELECT 1")
                time.sleep(0.2)
                progress = query.lastProgress
                if progress:
                    offsets.append(progress["sources"][0]["endOffset"])
            assert sorted(delivered) == [1, 2, 3], "nothing past the held fact"
            assert all(json.loads(o)["streams"][stream] < held_id for o in offsets if o)
        wait_until(lambda: len(delivered) == 7, 30, "the held fact and the ones after it")
        assert sorted(delivered) == [1, 2, 3, held_id, *range(ack.first_id, ack.last_id + 1)]
    finally:
        query.stop()
        first.close()
        second.close()


def test_starting_timestamp_and_ago(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    now = int(time.time() * 1000)
    writer = client.writer(stream, instance="w")
    old = [now - 7_200_000 + i for i in range(3)]  # two hours ago
    writer.append_batch([{"old": i} for i in range(3)], timestamps=old)
    writer.append_batch([{"new": i} for i in range(4)], timestamps=[now - 10 + i for i in range(4)])
    writer.close()
    start = dt.datetime.fromtimestamp((now - 3_600_000) / 1000, dt.UTC)
    expected = reader_facts(client, [stream], start=start)
    assert len(expected) == 4
    base = {"stream": stream, "databaseUrl": streams_url}
    for extra in (
        {"startingTimestamp": start.isoformat()},
        {"startingTimestamp": str(now - 3_600_000)},
        {"startingAgo": "1h"},
    ):
        batch = rows_of(spark.read.format("streams").options(**base, **extra).load())
        assert facts_of(batch) == expected, extra
    key = "startingAgo"
    batches = stream_batches(spark, {**base, key: "30m"}, tmp_path / "c")
    assert facts_of([r for _, rows in batches for r in rows]) == expected
    # Exactly at the second old fact's millisecond: it is the first one read.
    iso = dt.datetime.fromtimestamp(old[1] / 1000, dt.UTC).isoformat()
    got = rows_of(spark.read.format("streams").options(**base, startingTimestamp=iso).load())
    assert sorted({r["stream_id"] for r in got}) == list(range(2, 8))


def test_a_start_by_time_drops_a_pending_fact_that_commits_with_an_earlier_time(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    """A fact pending when the query started, committed later with a timestamp before the
    start, is not the query's: the Python reader drops it, so must Spark, and in a way
    that a replay repeats (the start time rides in the offset until it stops mattering)."""
    patient = streams.connect(streams_url, lease_seconds=120.0)  # held across Spark's start
    early, late = patient.writer(stream, instance="early"), client.writer(stream, instance="late")
    delivered: list[Row] = []

    def sink(df: Any, batch_id: int) -> None:
        delivered.extend(rows_of(df))

    query = None
    try:
        with psycopg.connect(streams_url) as conn, early.fact(conn) as held:
            held.add({"pending": True})
            time.sleep(0.05)
            ack = late.append({"first": True})
            assert ack.first_id > held.stream_id and ack.first_timestamp > held.timestamp
            start = dt.datetime.fromtimestamp(ack.first_timestamp / 1000, dt.UTC)
            python_reader = client.reader([stream], start=start)  # opens (resolves) now
            query = (
                spark.readStream.format("streams")
                .option("stream", stream)
                .option("databaseUrl", streams_url)
                .option("startingTimestamp", start.isoformat())
                .option("pollInterval", "50ms")
                .load()
                .writeStream.foreachBatch(sink)
                .option("checkpointLocation", str(tmp_path / "c"))
                .trigger(processingTime="0 seconds")
                .start()
            )
            wait_until(
                lambda: "Waiting for data" in query.status["message"], 60, "the first trigger"
            )
            assert delivered == []
        later = late.append({"second": True})
        wait_until(lambda: len(delivered) >= 2, 60, "the facts at or after the start")
        assert [r["stream_id"] for r in delivered] == [ack.first_id, later.first_id]
        with python_reader:
            expected = {
                (f.stream, f.stream_id): (f.instance, f.timestamp, list(f.payloads))
                for f in python_reader.facts()
            }
        assert facts_of(delivered) == expected
        # The offsets Spark logged (a batch's start is the previous batch's end).
        log = sorted((tmp_path / "c" / "offsets").glob("[0-9]*"), key=lambda p: int(p.name))
        ends = [json.loads(p.read_text().splitlines()[-1]) for p in log]
        assert ends[-1]["streams"][stream] == later.first_id
        for end in ends:  # in force exactly until the first fact at the start time is read
            assert ("since" in end) == (end["streams"][stream] < ack.first_id), ends
    finally:
        if query is not None:
            query.stop()
        early.close()
        late.close()
        patient.close()


# ------------------------------------------------------------------------------ groups, lag


def test_group_commit_and_lag_listener(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    import streams_spark

    writer = client.writer(stream, instance="w")
    writer.append_batch([{"i": i} for i in range(10)])
    listener = streams_spark.LagListener()
    spark.streams.addListener(listener)
    try:
        delivered: list[int] = []
        query = (
            spark.readStream.format("streams")
            .option("stream", stream)
            .option("databaseUrl", streams_url)
            .option("group", "spark-test")
            .option("maxFactsPerTrigger", "4")
            .option("pollInterval", "50ms")
            .load()
            .writeStream.foreachBatch(
                lambda df, _: delivered.extend(r.stream_id for r in df.collect())
            )
            .option("checkpointLocation", str(tmp_path / "c"))
            .trigger(processingTime="0 seconds")
            .start()
        )
        try:
            wait_until(lambda: len(delivered) == 10, 60, "all facts")

            def committed() -> int | None:
                rows = {g.group: g for g in client.groups(stream)}
                return rows["spark-test"].position if "spark-test" in rows else None

            # The group holds a batch's end once Spark asks for the offset after it: a running
            # query with nothing new is not left a batch behind.
            wait_until(lambda: committed() == 10, 30, "the group commit")
            writer.append({"i": 10})
            wait_until(lambda: committed() == 11, 30, "the group commit of the next batch")
            wait_until(lambda: listener.lag(query.id) != {}, 30, "a lag report")
            assert set(listener.lag(query.id)) == {stream}
            assert listener.lag(query.id)[stream] >= 0
        finally:
            query.stop()
    finally:
        spark.streams.removeListener(listener)
        writer.close()
    group = {g.group: g for g in client.groups(stream)}["spark-test"]
    assert (group.position, group.lag) == (11, 0)


def test_lag_from_progress() -> None:
    from streams_spark import lag_from_progress

    class Source:
        endOffset = '{"v": 1, "streams": {"a": 5, "b": 7}}'
        latestOffset = '{"v": 1, "streams": {"a": 9, "b": 7}}'

    class Progress:
        sources = (Source(),)

    assert lag_from_progress(Progress()) == {"a": 4, "b": 0}


# ------------------------------------------------------------------------------ options


BAD_OPTIONS: list[tuple[dict[str, str], str]] = [
    ({}, "option stream"),
    ({"stream": "a", "streams": "b"}, "options stream and streams"),
    ({"stream": "Bad Name"}, "option stream"),
    ({"streams": "a,a"}, "option streams"),
    ({"databaseUrl": "mysql://u:hunter2@h/db"}, "option databaseUrl"),
    ({"redisUrl": "http://x"}, "option redisUrl"),
    ({"prefix": "bad prefix!"}, "option prefix"),
    ({"startingPosition": "soon"}, "option startingPosition"),
    ({"startingPosition": "0"}, "option startingPosition"),
    ({"startingPosition": '{"v": 1, "streams": {"zz": 3}}'}, "option startingPosition"),
    ({"startingPosition": "{nope"}, "option startingPosition"),
    ({"startingTimestamp": "yesterday"}, "option startingTimestamp"),
    ({"startingAgo": "15 parsecs"}, "option startingAgo"),
    ({"startingAgo": "1h", "startingPosition": "earliest"}, "startingPosition, startingAgo"),
    ({"endingPosition": "earliest"}, "option endingPosition"),
    ({"maxFactsPerTrigger": "0"}, "option maxFactsPerTrigger"),
    ({"minFactsPerTrigger": "many"}, "option minFactsPerTrigger"),
    ({"minFactsPerTrigger": "10", "maxFactsPerTrigger": "5"}, "minFactsPerTrigger (10)"),
    ({"maxTriggerDelay": "5m"}, "option maxTriggerDelay"),
    ({"minFactsPerTrigger": "3", "maxTriggerDelay": "soon"}, "option maxTriggerDelay"),
    ({"partitions": "-1"}, "option partitions"),
    ({"group": " "}, "option group"),
    ({"failOnDataLoss": "maybe"}, "option failOnDataLoss"),
    ({"pollInterval": "0s"}, "option pollInterval"),
    ({"maxFactPerTrigger": "5"}, "unknown option 'maxfactpertrigger'"),
    ({"statementTimeout": "0s"}, "option statementTimeout"),
    ({"statementTimeout": "soon"}, "option statementTimeout"),
    ({"prefetch": "maybe"}, "option prefetch"),
    ({"startingPositionByTimestamp": "{nope"}, "option startingPositionByTimestamp"),
    ({"startingPositionByTimestamp": '{"zz": 5}'}, "unknown ['zz'], missing ['a']"),
    ({"startingPositionByTimestamp": '{"a": true}'}, "option startingPositionByTimestamp"),
    ({"startingPositionByTimestamp": '{"a": "soon"}'}, "option startingPositionByTimestamp (a)"),
    ({"startingPositionByTimestamp": "[5]"}, "a JSON object of times by stream"),
    ({"startingAgo": "1h", "startingPositionByTimestamp": '{"a": 5}'}, "startingAgo, starting"),
    ({"endingTimestamp": "soon"}, "option endingTimestamp"),
    ({"endingPositionByTimestamp": '{"a": 1, "b": 2}'}, "option endingPositionByTimestamp"),
    ({"endingPosition": "7", "endingTimestamp": "5"}, "endingPosition, endingTimestamp"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_options_unit(options: dict[str, str], message: str) -> None:
    from streams_spark.options import parse_options

    from streams.errors import ConfigurationError

    raw = {"stream": "a", "databaseUrl": "postgresql://u:hunter2@h/db", **options}
    if options == {}:
        del raw["stream"]
    if "streams" in options and "stream" not in options:
        del raw["stream"]
    with pytest.raises(ConfigurationError) as info:
        parse_options(raw, environ={})
    assert message.lower() in str(info.value).lower()
    assert "hunter2" not in str(info.value)


def test_ending_options_apply_to_batch_reads_only() -> None:
    from streams_spark import StreamsDataSource

    from streams.errors import ConfigurationError

    for option, value in (("endingTimestamp", "5"), ("endingPositionByTimestamp", '{"a": 5}')):
        source = StreamsDataSource(
            {"stream": "a", "databaseUrl": "postgresql://h/db", option: value}
        )
        with pytest.raises(ConfigurationError, match=f"option {option} applies to batch reads"):
            source.streamReader(source.schema())


def test_bad_options_fail_when_the_query_is_defined(spark: Any, streams_url: str) -> None:
    """Through Spark: one AnalysisException at load(), naming the option, no password."""
    from pyspark.errors import AnalysisException

    cases = [
        ({"stream": "a", "partitions": "x"}, "option partitions"),
        ({"stream": "a", "databaseUrl": "mysql://u:hunter2@h/db"}, "option databaseUrl"),
        ({"stream": "a", "startingAgo": "forever"}, "option startingAgo"),
    ]
    for options, message in cases:
        for builder in (spark.read, spark.readStream):
            reader = builder.format("streams")
            if "databaseUrl" not in options:
                reader = reader.option("databaseUrl", streams_url)
            with pytest.raises(AnalysisException) as info:
                reader.options(**options).load()
            text = str(info.value)
            assert message in text
            assert "ConfigurationError" in text
            assert "hunter2" not in text
    with pytest.raises(AnalysisException, match="applies to streaming reads"):
        spark.read.format("streams").options(
            stream="a", databaseUrl=streams_url, maxFactsPerTrigger="3"
        ).load().collect()


def test_ending_position_is_rejected_for_a_stream(
    spark: Any, stream: str, streams_url: str, tmp_path: Path
) -> None:
    df = (
        spark.readStream.format("streams")
        .options(stream=stream, databaseUrl=streams_url, endingPosition="5")
        .load()
    )
    query = (
        df.writeStream.foreachBatch(lambda *_: None)
        .option("checkpointLocation", str(tmp_path / "c"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(Exception, match="option endingPosition applies to batch reads"):
        query.awaitTermination(60)


def test_unknown_stream_is_one_clear_error(spark: Any, streams_url: str) -> None:
    with pytest.raises(Exception, match="unknown stream 'no-such-stream'"):
        spark.read.format("streams").options(
            stream="no-such-stream", databaseUrl=streams_url
        ).load().collect()


# ------------------------------------------------------------------------------ driver behaviour


def test_idle_source_probes_lazily_and_a_redis_hint_wakes_it(
    client: Client, stream: str, streams_url: str, redis_url: str, redis_prefix: str
) -> None:
    """latestOffset in Spark's tight loop: one probe per interval, or one per hint."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    import streams

    config = parse_options(
        {"stream": stream, "databaseUrl": streams_url, "redisUrl": redis_url,
         "prefix": redis_prefix}
    )  # fmt: skip
    reader = StreamsStreamReader(config)
    try:
        start = reader.initialOffset()
        assert start == {
            "v": 1,
            "streams": {stream: 0},
            "floors": {stream: 0},
            "incarnation": reader.incarnation(),  # the database history (issue 27)
            "lsn": reader.proof_lsn,  # its proof's WAL position (issue 30)
        }
        assert start["lsn"] > 0
        wait_until(lambda: reader._link_up, 10, "the Redis link")
        reader.latestOffset(start, ReadAllAvailable())
        before = reader.probes
        t0 = time.monotonic()
        calls = 0
        while time.monotonic() - t0 < 1.5:
            assert reader.latestOffset(start, ReadAllAvailable()) == start
            calls += 1
            time.sleep(0.01)
        assert calls > 50
        assert reader.probes - before <= 2  # 1 s interval with Redis up, not 100/s
        with streams.connect(streams_url, redis_url, redis_prefix) as writing:
            writer = writing.writer(stream, instance="hinter")
            ack = writer.append({"x": 1})
            got: list[dict[str, Any]] = []

            def moved() -> bool:
                got.append(reader.latestOffset(start, ReadAllAvailable()))
                return bool(got[-1]["streams"][stream] >= ack.last_id)

            t1 = time.monotonic()
            wait_until(moved, 5, "the hinted position")
            assert time.monotonic() - t1 < 0.5  # the hint, not the 1 s poll
            writer.close()
        assert reader.reportLatestOffset() == {"v": 1, "streams": {stream: ack.last_id}}
    finally:
        reader.stop()


def test_stream_reader_is_picklable_and_opens_nothing_in_constructors(
    stream: str, streams_url: str
) -> None:
    import pickle

    from streams_spark import RangePartition, StreamsDataSource
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    source = StreamsDataSource({"stream": stream, "databaseUrl": streams_url})
    reader = source.streamReader(source.schema())
    assert isinstance(reader, StreamsStreamReader)
    assert reader._conn is None and reader._link is None
    reader.initialOffset()  # opens a connection lazily
    assert reader._conn is not None
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._conn is None
    secret = parse_options({"stream": stream, "databaseUrl": "postgresql://u:hunter2@h/db"})
    assert "hunter2" not in repr(secret)
    part = RangePartition(stream, 1, 0, 5, 0, 5, secret.database_url)
    assert "hunter2" not in repr(part)
    assert pickle.loads(pickle.dumps(part)) == part
    reader.stop()


def test_sequence_going_backwards_fails_or_warns(
    client: Client, stream: str, streams_url: str
) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    from streams.errors import StoreError

    writer = client.writer(stream, instance="w")
    writer.append_batch([{"i": i} for i in range(3)])
    writer.close()
    ahead = {"v": 1, "streams": {stream: 50}}  # a checkpoint from before a restore
    strict = StreamsStreamReader(parse_options({"stream": stream, "databaseUrl": streams_url}))
    with pytest.raises(StoreError, match="went backwards"):
        strict.latestOffset(ahead, ReadAllAvailable())
    strict.stop()
    lenient = StreamsStreamReader(
        parse_options({"stream": stream, "databaseUrl": streams_url, "failOnDataLoss": "false"})
    )
    assert lenient.latestOffset(ahead, ReadAllAvailable()) == {
        **ahead,
        "incarnation": lenient.incarnation(),
    }
    lenient.stop()


def test_retention_fails_or_warns_wherever_the_query_would_need_pruned_facts(
    spark: Any, client: Client, stream: str, streams_url: str
) -> None:
    """failOnDataLoss for retention (`streams prune`): a start below what was kept, a
    checkpoint from before a prune (its group deleted), and an executor that finds its range
    pruned under it; "earliest" is the oldest fact kept."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from streams_spark import RangePartition
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader, read_partition

    from streams import FactsPruned

    base = int(time.time() * 1000) - 7_200_000
    with client.writer(stream, instance="w") as writer:
        old = [writer.append({"old": k}, timestamp=base + k).first_id for k in range(6)]
        new = [writer.append({"new": k}).first_id for k in range(2)]
    client.set_retention(stream, 3_600_000)
    assert client.prune(stream).after == old[-1]

    def reader(**options: str) -> StreamsStreamReader:
        return StreamsStreamReader(
            parse_options({"stream": stream, "databaseUrl": streams_url, **options})
        )

    strict = reader(startingPosition="1")
    with pytest.raises(FactsPruned, match="failOnDataLoss=false"):
        strict.initialOffset()
    strict.stop()
    before_prune = {"v": 1, "streams": {stream: old[1]}}
    restarted = reader()  # from a checkpoint: Spark calls latestOffset first
    with pytest.raises(FactsPruned, match="removed by retention"):
        restarted.latestOffset(before_prune, ReadAllAvailable())
    restarted.stop()
    lenient = reader(startingPosition="1", failOnDataLoss="false")
    assert lenient.initialOffset()["streams"] == {stream: old[-1]}
    lenient.stop()
    lenient = reader(failOnDataLoss="false")
    assert lenient.latestOffset(before_prune, ReadAllAvailable())["streams"] == {stream: new[-1]}
    lenient.stop()
    earliest = spark.read.format("streams").options(stream=stream, databaseUrl=streams_url)
    assert sorted(r.stream_id for r in earliest.load().collect()) == new
    # An executor whose range was pruned after planning: the rows it read are not enough.
    part = RangePartition(stream, client.stream(stream).id, 0, new[-1], 0, new[-1], streams_url)
    with pytest.raises(FactsPruned, match="failOnDataLoss=false"):
        list(read_partition(part))
    lenient_part = dataclasses.replace(part, fail_on_data_loss=False)
    kept = [i for batch in read_partition(lenient_part) for i in batch.column(1).to_pylist()]
    assert kept == new


def test_commit_is_idempotent(client: Client, stream: str, streams_url: str) -> None:
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    writer = client.writer(stream, instance="w")
    writer.append_batch([{"i": i} for i in range(5)])
    writer.close()
    reader = StreamsStreamReader(
        parse_options({"stream": stream, "databaseUrl": streams_url, "group": "g"})
    )
    reader.commit({"v": 1, "streams": {stream: 4}})
    reader.commit({"v": 1, "streams": {stream: 4}})  # Spark repeats the last one
    reader.commit({"v": 1, "streams": {stream: 2}})  # never backwards
    reader.stop()
    (group,) = client.groups(stream)
    assert (group.group, group.position, group.lag) == ("g", 4, 1)
    # An explicit group's committed position wins over startingPosition, as for Python readers.
    again = StreamsStreamReader(
        parse_options({"stream": stream, "databaseUrl": streams_url, "group": "g"})
    )
    assert again.initialOffset()["streams"] == {stream: 4}
    again.stop()
    latest = StreamsStreamReader(
        parse_options(
            {
                "stream": stream,
                "databaseUrl": streams_url,
                "group": "g",
                "startingPosition": "latest",
            }
        )
    )
    assert latest.initialOffset()["streams"] == {stream: 4}
    latest.stop()
    other = StreamsStreamReader(
        parse_options(
            {
                "stream": stream,
                "databaseUrl": streams_url,
                "group": "new",
                "startingPosition": "latest",
            }
        )
    )
    assert other.initialOffset()["streams"] == {stream: 5}
    other.stop()


def test_partitions_are_deterministic_and_never_split_a_fact(
    client: Client, stream: str, streams_url: str
) -> None:
    from streams_spark.options import parse_options
    from streams_spark.source import RangePartition, StreamsStreamReader, read_partition

    write_mixed(client, stream, streams_url)
    config = parse_options({"stream": stream, "databaseUrl": streams_url, "partitions": "4"})
    start, end = {"v": 1, "streams": {stream: 0}}, {"v": 1, "streams": {stream: 15}}
    one, two = StreamsStreamReader(config), StreamsStreamReader(config)
    parts = one.partitions(start, end)

    # The same ranges; each plan's proof has its own WAL position (anything that wrote WAL
    # between the two, an autovacuum or another test's session, moves it).
    def ranges(planned: Any) -> list[Any]:
        return [dataclasses.replace(p, proof_lsn=0) for p in planned]

    assert ranges(parts) == ranges(two.partitions(start, end))
    assert 2 <= len(parts) <= 4
    seen: dict[int, int] = {}
    for index, part in enumerate(parts):
        assert isinstance(part, RangePartition)
        for batch in read_partition(part):
            for i in batch.column("stream_id").to_pylist():
                assert seen.setdefault(i, index) == index  # never in two partitions
    assert len(seen) == 14
    one.stop()
    two.stop()


def test_min_facts_per_trigger_waits_for_facts_or_the_delay(
    client: Client, stream: str, streams_url: str
) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMinRows
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    writer = client.writer(stream, instance="w")
    writer.append_batch([{"i": i} for i in range(3)])
    options = {
        "stream": stream,
        "databaseUrl": streams_url,
        "minFactsPerTrigger": "5",
        "maxTriggerDelay": "700ms",
        "pollInterval": "10ms",
    }
    reader = StreamsStreamReader(parse_options(options))
    try:
        limit = reader.getDefaultReadLimit()
        assert limit == ReadMinRows(5)
        start = reader.initialOffset()
        assert reader.latestOffset(start, limit) == start  # 3 < 5 facts: no batch yet
        writer.append_batch([{"i": i} for i in range(3, 5)])
        time.sleep(0.02)
        later = reader.latestOffset(start, limit)
        assert later["streams"] == {stream: 5}
        writer.append({"i": 5})
        time.sleep(0.02)
        assert reader.latestOffset(later, limit) == later  # 1 fact, the delay not yet over
        # Trigger.Once-style calls ignore the configured limits.
        assert reader.latestOffset(later, ReadAllAvailable())["streams"] == {stream: 6}
        time.sleep(0.8)
        assert reader.latestOffset(later, limit)["streams"] == {stream: 6}
    finally:
        reader.stop()
        writer.close()


def test_readme_spark_example_runs_as_written(
    spark: Any,
    postgres_admin_url: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's Python examples (they create `orders` with 1002 facts), then its Spark
    example, in one namespace, on a fresh database; its checkpoint goes to the working dir."""
    from helpers import readme_blocks
    from servers import create_database, database_name, drop_database

    from streams.migrate import upgrade

    url = create_database(postgres_admin_url)
    try:
        upgrade(url)
        monkeypatch.setenv("STREAMS_DATABASE_URL", url)
        monkeypatch.setenv("STREAMS_REDIS_URL", redis_url)
        monkeypatch.setenv("STREAMS_PREFIX", redis_prefix)
        monkeypatch.chdir(tmp_path)
        namespace: dict[str, Any] = {"__name__": "readme"}
        # Spark resolves a relative checkpoint against the JVM's start directory, and its
        # Python workers (where the source reads its options) have the JVM's environment: the
        # session began before this test's chdir and setenv. So the checkpoint gets an absolute
        # place in tmp_path, and the database its option. (tests/docs/test_quickstart.py runs
        # the block unchanged, in a Spark of its own.)
        checkpoint = repr(str(tmp_path / "checkpoints" / "orders"))
        blocks = readme_blocks("python") + [
            b.replace('"checkpoints/orders"', checkpoint).replace(
                '.option("stream", "orders")',
                f'.option("stream", "orders").option("databaseUrl", {url!r})',
            )
            for b in readme_blocks("python spark")
        ]
        for number, block in enumerate(blocks):
            exec(compile(block, f"README.md block {number}", "exec"), namespace)
        assert len(namespace["seen"]) == 1002
        listener, query = namespace["lag"], namespace["query"]
        assert listener.lag(query.id) == {"orders": 0}  # as the README's comment says
        # The group holds the last batch's end as soon as the run is over (README: "shows in
        # `streams positions` with its lag"), not one batch behind it.
        import streams

        with streams.connect(url) as client:
            group = {g.group: g for g in client.groups("orders")}["orders-analytics"]
            assert (group.position, group.lag) == (client.positions("orders").linear, 0)
    finally:
        drop_database(postgres_admin_url, database_name(url))


# ------------------------------------------------------------------------------ timestamps


def test_timestamps_equal_the_python_reader_across_a_long_out_of_order_window_and_a_prune(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    """A fact far ahead in time, then more than 1,000 facts of another writer behind it: every
    later fact's timestamp is raised to it (the running maximum). Batches that start more than
    1,000 facts after it, and a restart after retention removed it, report what the Python
    reader reports: the floor rides in the offset, it is not recomputed from recent facts."""
    now = int(time.time() * 1000)
    old = now - 3 * 3_600_000
    behind, ahead = (
        client.writer(stream, instance="behind"),
        client.writer(stream, instance="ahead"),
    )
    try:
        behind.append_batch(
            [{"b": i} for i in range(200)], timestamps=[old + i for i in range(200)]
        )
        ahead.append({"ahead": True}, timestamp=now - 3_600_000)  # 201
        behind.append_batch(
            [{"b": i} for i in range(200, 1499)], timestamps=[old + i for i in range(200, 1499)]
        )  # 202..1500
        options = {
            "stream": stream, "databaseUrl": streams_url, "maxFactsPerTrigger": "700",
            "group": "floors",
        }  # fmt: skip
        first = stream_batches(spark, options, tmp_path / "c")  # (0,700], (700,1400], (1400,1500]
        assert len(first) == 3
        behind.append_batch(
            [{"b": i} for i in range(1499, 1699)], timestamps=[old + i for i in range(1499, 1699)]
        )  # 1501..1700
    finally:
        behind.close()
        ahead.close()
    expected = reader_facts(client, [stream])
    assert len(expected) == 1700
    assert {ts for (_, i), (_, ts, _) in expected.items() if i > 201} == {now - 3_600_000}
    client.set_retention(stream, 30 * 60_000)
    assert client.prune(stream).after == 1500  # held at the group: the run's last batch end
    second = stream_batches(spark, options, tmp_path / "c")  # the same query, restarted
    got = facts_of([r for _, rows in first + second for r in rows])
    assert got == expected


def test_a_checkpoint_of_the_previous_version_resumes(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    """Offsets logged before they carried timestamp floors (and waiting streams) still resume:
    the floor is then computed as before, and later offsets carry it."""
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(5)])
        options = {"stream": stream, "databaseUrl": streams_url}
        first = stream_batches(spark, options, tmp_path / "c")
        for path in (tmp_path / "c" / "offsets").glob("[0-9]*"):
            lines = path.read_text().splitlines()
            offset = json.loads(lines[-1])
            assert "floors" in offset  # this version writes them; the previous one did not
            del offset["floors"]
            path.write_text("\n".join([*lines[:-1], json.dumps(offset)]))
        writer.append_batch([{"i": i} for i in range(5, 8)])
    second = stream_batches(spark, options, tmp_path / "c")
    got = facts_of([r for _, rows in first + second for r in rows])
    assert got == reader_facts(client, [stream])
    assert sorted({r["stream_id"] for _, rows in second for r in rows}) == [6, 7, 8]
    log = sorted((tmp_path / "c" / "offsets").glob("[0-9]*"), key=lambda p: int(p.name))
    assert "floors" in json.loads(log[-1].read_text().splitlines()[-1])


# ------------------------------------------------------------------------------ Kafka parity


def test_starting_timestamp_by_stream_and_ending_by_timestamp(
    spark: Any, client: Client, stream: str, unique_name: str, streams_url: str, tmp_path: Path
) -> None:
    second = unique_name + "x"
    client.create_stream(second)
    now = int(time.time() * 1000)
    hour = 3_600_000
    for name in (stream, second):
        with client.writer(name, instance="w") as writer:
            for k in range(4, 0, -1):  # 4h, 3h, 2h and 1h ago
                writer.append({"ago": k}, timestamp=now - k * hour)
    starts = {stream: now - 5 * hour // 2, second: now - 3 * hour // 2}

    def moment(ms: int) -> dt.datetime:
        return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)

    expected = {
        **reader_facts(client, [stream], start=moment(starts[stream])),
        **reader_facts(client, [second], start=moment(starts[second])),
    }
    assert len(expected) == 2 + 1
    # Milliseconds for one stream, ISO-8601 for the other.
    by_stream = json.dumps({stream: starts[stream], second: moment(starts[second]).isoformat()})
    base = {"streams": f"{stream},{second}", "databaseUrl": streams_url}
    batch = rows_of(
        spark.read.format("streams").options(**base, startingPositionByTimestamp=by_stream).load()
    )
    assert facts_of(batch) == expected
    streamed = stream_batches(
        spark, {**base, "startingPositionByTimestamp": by_stream}, tmp_path / "c"
    )
    assert facts_of([r for _, rows in streamed for r in rows]) == expected

    everything = reader_facts(client, [stream, second])
    end = now - 3 * hour // 2  # facts before it: 4h, 3h and 2h ago
    got = rows_of(spark.read.format("streams").options(**base, endingTimestamp=str(end)).load())
    assert facts_of(got) == {k: v for k, v in everything.items() if v[1] < end}
    ends = {stream: now - 5 * hour // 2, second: now}
    got = rows_of(
        spark.read.format("streams")
        .options(**base, endingPositionByTimestamp=json.dumps(ends))
        .load()
    )
    assert facts_of(got) == {k: v for k, v in everything.items() if v[1] < ends[k[0]]}


def test_progress_reports_each_streams_lag(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    """`reportLatestOffset` is what PostgreSQL proves complete, so each batch's progress says
    how far the query is behind the linear position: 10 facts, 4 per batch: 6, 2, 0."""
    import streams_spark

    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(10)])
    listener = streams_spark.LagListener()
    spark.streams.addListener(listener)
    try:
        query = (
            spark.readStream.format("streams")
            .options(stream=stream, databaseUrl=streams_url, maxFactsPerTrigger="4")
            .load()
            .writeStream.foreachBatch(lambda *_: None)
            .option("checkpointLocation", str(tmp_path / "c"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None
        lags = [streams_spark.lag_from_progress(p) for p in query.recentProgress]
        assert [lag for lag in lags if lag] == [{stream: 6}, {stream: 2}, {stream: 0}]
        wait_until(lambda: listener.lag(query.id) == {stream: 0}, 15, "the last lag event")
    finally:
        spark.streams.removeListener(listener)
