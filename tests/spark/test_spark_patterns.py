"""The Spark source's ``streamPattern`` (issue 40): a query that follows every stream whose name
matches a regular expression in full, including streams created while it runs (each read from
its first fact), and lets dropped ones leave its offsets.

The driver tests call the reader's methods as Spark's planner process does (fast and exact,
like tests/spark/test_spark_driver.py); the last ones run real Spark queries.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from streams import Client

pytestmark = pytest.mark.timeout(240)

Key = tuple[str, int, int]  # (stream, stream_id, row_no)


def _reader(pattern: str, url: str, **options: str) -> Any:
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    return StreamsStreamReader(
        parse_options({"streamPattern": pattern, "databaseUrl": url, **options})
    )


def _latest(reader: Any, start: dict[str, Any]) -> dict[str, Any]:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    result: dict[str, Any] = reader.latestOffset(start, ReadAllAvailable())
    return result


def _batch(reader: Any, start: dict[str, Any], end: dict[str, Any]) -> list[Key]:
    """What Spark does with a batch: plan it, read every partition, commit the end."""
    from streams_spark.source import RangePartition, read_partition

    keys: list[Key] = []
    for part in reader.partitions(start, end):
        assert isinstance(part, RangePartition)
        for batch in read_partition(part):
            cols = batch.to_pydict()
            keys += zip(cols["stream"], cols["stream_id"], cols["row_no"], strict=True)
    reader.commit(end)
    return keys


def _write(client: Client, stream: str, count: int, tag: str = "") -> list[Key]:
    """``count`` one-row facts; their keys."""
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_batch([{"s": stream, "tag": tag, "i": i} for i in range(count)])
    return [(stream, int(i), 0) for i in ack.ids]


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stream": "a"}, "options streamPattern and stream"),
        ({"streams": "a,b"}, "options streamPattern and streams"),
        ({"streamPattern": "orders_("}, "option streamPattern: invalid stream pattern"),
        ({"streamPattern": ""}, "option streamPattern"),
        ({"startingPosition": '{"orders_1": 3}'}, "option startingPosition: a pattern query"),
        ({"endingPosition": '{"orders_1": 3}'}, "option endingPosition: a pattern query"),
        ({"startingPositionByTimestamp": '{"a": 5}'}, "option startingPositionByTimestamp"),
        ({"endingPositionByTimestamp": '{"a": 5}'}, "option endingPositionByTimestamp"),
    ],
)
def test_bad_pattern_options(options: dict[str, str], message: str) -> None:
    from streams_spark.options import parse_options

    from streams.errors import ConfigurationError

    raw = {"streamPattern": "orders_.*", "databaseUrl": "postgresql://h/db", **options}
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        parse_options(raw, environ={})


def test_pattern_options() -> None:
    from streams_spark.options import parse_options

    base = {"streamPattern": "orders_.*", "databaseUrl": "postgresql://h/db"}
    config = parse_options(base, environ={})
    assert config.pattern == "orders_.*"
    assert config.streams == ()
    assert "orders_.*" in repr(config)
    # The default group comes from the pattern (and the start), never from the streams.
    assert config.group == parse_options(base, environ={}).group
    assert config.group != parse_options({**base, "streamPattern": "orders_x.*"}).group
    assert parse_options({**base, "startingPosition": "latest"}).start.kind == "latest"
    assert parse_options({**base, "startingPosition": "7"}).start.id == 7


# ------------------------------------------------------------------------------ the driver


def test_pattern_driver_follows_created_and_dropped_streams(
    client: Client, unique_name: str, streams_url: str
) -> None:
    """Streams matching the pattern before and after the query started, every fact once;
    non-matching streams never; a dropped stream leaves the offsets, one created again under
    its name is read from its first fact; a new run from the last offset goes on."""
    names = [f"{unique_name}_m{i}" for i in range(4)]
    other = f"{unique_name}_x"
    client.create_streams([*names, other, f"{unique_name}m9"])
    expected = [k for n in names for k in _write(client, n, 3)]
    _write(client, other, 2)
    reader = _reader(rf"{unique_name}_m\d+", streams_url, pollInterval="10ms")
    got: list[Key] = []
    try:
        offset = reader.initialOffset()
        assert sorted(offset["streams"]) == names
        assert set(offset["ids"]) == set(names)
        end = _latest(reader, offset)
        got += _batch(reader, offset, end)
        offset = end
        assert sorted(got) == sorted(expected)

        # Created while it runs: the next latestOffset has it, at 0, and nothing of it yet.
        late = f"{unique_name}_m10"
        client.create_stream(late)
        expected += _write(client, late, 5)
        expected += _write(client, names[0], 1)
        time.sleep(0.02)
        end = _latest(reader, offset)
        assert end["streams"][late] == 0
        got += _batch(reader, offset, end)
        offset = end
        end = _latest(reader, offset)
        assert end["streams"][late] == 5
        got += _batch(reader, offset, end)
        offset = end
        assert sorted(got) == sorted(expected)
        assert _latest(reader, offset) == offset  # nothing new: the same offset

        # Dropped: it leaves the offsets, with no error.
        client.drop_streams([names[1]])
        time.sleep(0.02)
        end = _latest(reader, offset)
        assert names[1] not in end["streams"]
        got += _batch(reader, offset, end)
        offset = end

        # Dropped and created again under its name: another stream, from its first fact.
        client.drop_streams([names[2]])
        client.create_stream(names[2])
        expected += _write(client, names[2], 2, tag="again")
        time.sleep(0.02)
        for _ in range(3):
            end = _latest(reader, offset)
            got += _batch(reader, offset, end)
            offset = end
        assert offset["streams"][names[2]] == 2
        assert sorted(got) == sorted(expected)
        group = reader.config.group
    finally:
        reader.stop()
    assert client.groups(late) and {g.group for g in client.groups(late)} >= {group}

    # A new run from the last offset (a restart from the checkpoint): a stream created since
    # enters, and one its offset names but that was dropped meanwhile is left out.
    newer = f"{unique_name}_m11"
    client.create_stream(newer)
    expected += _write(client, newer, 3)
    client.drop_streams([names[3]])
    again = _reader(rf"{unique_name}_m\d+", streams_url, pollInterval="10ms")
    try:
        for _ in range(3):
            end = _latest(again, offset)
            got += _batch(again, offset, end)
            offset = end
        assert sorted(offset["streams"]) == sorted([names[0], names[2], late, newer])
    finally:
        again.stop()
    # Equal as multisets: every fact once (names[2]'s IDs 1 and 2 are two streams' facts).
    assert sorted(got) == sorted(expected)


def test_a_stream_dropped_under_a_planned_batch_leaves_cleanly(
    client: Client, unique_name: str, streams_url: str
) -> None:
    """Dropped after the driver planned a batch: its partition reads nothing (the task does
    not fail), the commit covers the other streams, the next offset leaves it out."""
    from streams_spark.source import RangePartition, read_partition

    names = [f"{unique_name}_d{i}" for i in range(3)]
    client.create_streams(names)
    expected = [k for n in names[1:] for k in _write(client, n, 2)]
    _write(client, names[0], 2)
    reader = _reader(rf"{unique_name}_d\d", streams_url, pollInterval="10ms")
    try:
        offset = reader.initialOffset()
        end = _latest(reader, offset)
        parts = reader.partitions(offset, end)
        assert all(isinstance(p, RangePartition) and p.by_pattern for p in parts)
        client.drop_streams([names[0]])
        got: list[Key] = []
        for part in parts:
            for batch in read_partition(part):
                cols = batch.to_pydict()
                got += zip(cols["stream"], cols["stream_id"], cols["row_no"], strict=True)
        assert sorted(got) == sorted(expected)
        reader.commit(end)
        assert reader.names == tuple(names[1:])
        # Replayed (a restart): planned without it.
        assert {p.stream for p in reader.partitions(offset, end)} == set(names[1:])
        time.sleep(0.02)
        after = _latest(reader, end)
        assert sorted(after["streams"]) == names[1:]
    finally:
        reader.stop()


def test_a_joined_stream_is_followed_on_redis(
    client: Client, unique_name: str, streams_url: str, redis_url: str, redis_prefix: str
) -> None:
    """With Redis, a stream that joined wakes the query with its writers' hints (well within
    the poll interval, 3 s here), as the ones that matched from the start do."""
    import streams

    name = f"{unique_name}_r1"
    reader = _reader(
        rf"{unique_name}_r\d",
        streams_url,
        redisUrl=redis_url,
        prefix=redis_prefix,
        pollInterval="3s",
    )
    try:
        offset = reader.initialOffset()
        assert offset["streams"] == {}
        wait_until(lambda: reader._link_up, 10, "the Redis link")
        client.create_stream(name)
        wait_until(lambda: name in _latest(reader, offset)["streams"], 10, "the join")
        offset = _latest(reader, offset)
        with (
            streams.connect(streams_url, redis_url, redis_prefix) as writing,
            writing.writer(name, instance="hinter") as writer,
        ):
            ack = writer.append({"x": 1})
            t0 = time.monotonic()
            wait_until(lambda: _latest(reader, offset)["streams"][name] >= ack.last_id, 5, "hint")
            assert time.monotonic() - t0 < 1.5
        client.drop_streams([name])
        wait_until(lambda: _latest(reader, offset)["streams"] == {}, 10, "the leave")
    finally:
        reader.stop()


def test_pattern_matching_nothing_yet_gives_empty_batches(
    client: Client, unique_name: str, streams_url: str
) -> None:
    from streams.errors import ConfigurationError

    reader = _reader(rf"{unique_name}_later_.*", streams_url, pollInterval="10ms")
    try:
        offset = reader.initialOffset()
        assert offset["streams"] == {}
        assert _latest(reader, offset) == offset
        assert reader.partitions(offset, offset) == []
        reader.commit(offset)
        name = f"{unique_name}_later_1"
        client.create_stream(name)
        expected = _write(client, name, 2)
        time.sleep(0.02)
        got: list[Key] = []
        for _ in range(2):
            end = _latest(reader, offset)
            got += _batch(reader, offset, end)
            offset = end
        assert got == expected
        # An offset naming a stream the pattern does not match is another query's checkpoint.
        with pytest.raises(ConfigurationError, match="option streamPattern"):
            _latest(reader, {"v": 1, "streams": {"orders": 3}})
    finally:
        reader.stop()


def test_pattern_batch_read(spark: Any, client: Client, unique_name: str, streams_url: str) -> None:
    names = [f"{unique_name}_b{i}" for i in range(3)]
    client.create_streams([*names, f"{unique_name}_c"])
    expected = [k for n in names for k in _write(client, n, 2)]
    _write(client, f"{unique_name}_c", 2)
    df = (
        spark.read.format("streams")
        .option("streamPattern", rf"{unique_name}_b\d")
        .option("databaseUrl", streams_url)
        .load()
    )
    got = [(r.stream, r.stream_id, r.row_no) for r in df.collect()]
    assert sorted(got) == sorted(expected)
    nothing = (
        spark.read.format("streams")
        .option("streamPattern", rf"{unique_name}_none")
        .option("databaseUrl", streams_url)
        .load()
    )
    assert nothing.count() == 0


# ------------------------------------------------------------------------------ Spark


def test_pattern_query_reads_streams_created_while_it_runs_exactly_once(
    spark: Any, client: Client, unique_name: str, streams_url: str, tmp_path: Path
) -> None:
    """~20 matching and a few non-matching streams, facts written before and while the query
    runs, streams created while it runs; then a restart from the checkpoint picks up where it
    was, streams created meanwhile included. Every matching fact exactly once."""
    matching = [f"{unique_name}_o{i}" for i in range(20)]
    others = [f"{unique_name}_p{i}" for i in range(3)] + [f"x{unique_name}_o1"]
    client.create_streams([*matching, *others])
    expected: list[Key] = []
    for name in matching:
        expected += _write(client, name, 3, tag="before")
    for name in others:
        _write(client, name, 2)

    got: list[Key] = []
    lock = threading.Lock()

    def sink(df: Any, batch_id: int) -> None:
        rows = [(r.stream, r.stream_id, r.row_no) for r in df.collect()]
        with lock:
            got.extend(rows)

    checkpoint = tmp_path / "c"

    def start(trigger: dict[str, Any]) -> Any:
        return (
            spark.readStream.format("streams")
            .option("streamPattern", rf"{unique_name}_o\d+")
            .option("databaseUrl", streams_url)
            .option("pollInterval", "200ms")
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(checkpoint))
            .trigger(**trigger)
            .start()
        )

    query = start({"processingTime": "0.5 seconds"})
    try:
        wait_until(lambda: len(got) >= len(expected), timeout=90)
        created = [f"{unique_name}_o{i}" for i in range(100, 105)]
        for name in created:
            client.create_stream(name)
            expected += _write(client, name, 4, tag="during")
        for name in matching[:5]:
            expected += _write(client, name, 2, tag="during")
        for name in others:
            _write(client, name, 1)
        wait_until(lambda: len(got) >= len(expected), timeout=90)
        # Dropped while it runs (all its facts read): it leaves the offsets, nothing fails.
        client.drop_streams([matching[0]])
        expected += _write(client, matching[1], 1, tag="after the drop")
        wait_until(lambda: len(got) >= len(expected), timeout=90)
        time.sleep(1.5)  # a few more (empty) batches: nothing twice
        assert query.exception() is None
    finally:
        query.stop()
    assert sorted(got) == sorted(expected)

    # Stopped; more facts and streams; a restart from the checkpoint reads exactly them.
    later = [f"{unique_name}_o{i}" for i in range(200, 203)]
    client.create_streams(later)
    for name in [*later, *matching[-3:], *created[:2]]:
        expected += _write(client, name, 2, tag="after")
    for _ in range(2):  # an availableNow run: joined streams enter, then are read
        query = start({"availableNow": True})
        query.awaitTermination(120)
        assert query.exception() is None
    assert sorted(got) == sorted(expected)
    assert len(got) == len(set(got))
    last = json.loads(
        (checkpoint / "offsets")
        .joinpath(
            max((p.name for p in (checkpoint / "offsets").iterdir() if p.name.isdigit()), key=int)
        )
        .read_text()
        .splitlines()[-1]
    )
    assert sorted(last["streams"]) == sorted([*matching[1:], *created, *later])


def test_pattern_query_over_1000_streams_with_10_created_while_it_runs(
    spark: Any, client: Client, unique_name: str, streams_url: str, tmp_path: Path
) -> None:
    """The issue's scale: 1,000 matching streams (facts in 50 of them, so that the first batch
    is 50 Spark tasks, not 1,000) and 10 created while the query runs; every fact once."""
    matching = [f"{unique_name}_k{i}" for i in range(1000)]
    client.create_streams([*matching, f"{unique_name}_kx"])
    expected: list[Key] = []
    for name in matching[::20]:
        expected += _write(client, name, 2)
    _write(client, f"{unique_name}_kx", 2)
    got: list[Key] = []
    lock = threading.Lock()

    def sink(df: Any, batch_id: int) -> None:
        rows = [(r.stream, r.stream_id, r.row_no) for r in df.collect()]
        with lock:
            got.extend(rows)

    query = (
        spark.readStream.format("streams")
        .option("streamPattern", rf"{unique_name}_k\d+")
        .option("databaseUrl", streams_url)
        .option("pollInterval", "200ms")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "c"))
        .trigger(processingTime="0.5 seconds")
        .start()
    )
    created = [f"{unique_name}_k{i}" for i in range(1000, 1010)]
    try:
        wait_until(lambda: len(got) >= len(expected), timeout=120)
        for name in created:
            client.create_stream(name)
            expected += _write(client, name, 3)
        expected += _write(client, matching[1], 1)
        wait_until(lambda: len(got) >= len(expected), timeout=60)
        time.sleep(1.0)
        assert query.exception() is None
        progress = query.lastProgress
    finally:
        query.stop()
    assert sorted(got) == sorted(expected)
    assert len(got) == len(set(got))
    end = progress["sources"][0]["endOffset"]
    assert len((json.loads(end) if isinstance(end, str) else end)["streams"]) == 1010
    client.drop_streams([*matching, *created, f"{unique_name}_kx"])
