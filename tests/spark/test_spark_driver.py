"""The Spark source's driver and executor read against real PostgreSQL, without Spark: what
a micro-batch is planned from (the latest probe), starts above the complete position,
admission under `maxFactsPerTrigger`/`minFactsPerTrigger`, warnings, statement timeouts.

Spark calls these methods itself (`latestOffset`, `partitions`, `commit`); here the test calls
them as Spark's planner process does, which is fast and exact.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any

import psycopg
import pytest

from streams import Client

pytestmark = pytest.mark.timeout(120)


def _reader(stream: str, url: str, **options: str) -> Any:
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    return StreamsStreamReader(parse_options({"stream": stream, "databaseUrl": url, **options}))


def _offset(**positions: int) -> dict[str, Any]:
    return {"v": 1, "streams": dict(sorted(positions.items()))}


def _latest(reader: Any, start: dict[str, Any], limit: Any = None) -> dict[str, Any]:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    result: dict[str, Any] = reader.latestOffset(start, limit or ReadAllAvailable())
    return result


def restore_to(client: Client, url: str, stream: str, position: int) -> None:
    """What restoring an older backup does to a stream: the facts after ``position`` and the
    IDs reserved since are gone (the sequence is back at ``position``)."""
    info = client.stream(stream)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "DELETE FROM streams_facts WHERE stream = %s AND stream_id > %s", (info.id, position)
        )
        sequence = conn.execute(
            "SELECT sequence_name FROM streams_registry WHERE id = %s", (info.id,)
        ).fetchone()
        assert sequence is not None
        conn.execute("SELECT setval(%s::regclass, %s)", (sequence[0], position))


# ------------------------------------------------------------------------- defect 1: the proof


def test_batches_are_planned_only_from_the_latest_probe(
    client: Client, stream: str, streams_url: str
) -> None:
    """A database restored under a running query: the next batch ends at what PostgreSQL
    proves now, not at the largest position it ever proved; a query already past it is the
    failOnDataLoss case, on the driver (latestOffset, partitions) and on executors."""
    from streams_spark.source import RangePartition, read_partition

    from streams.errors import StoreError

    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(10)])  # 1..10
    reader = _reader(stream, streams_url, pollInterval="10ms")
    try:
        assert _latest(reader, reader.initialOffset())["streams"] == {stream: 10}
        restore_to(client, streams_url, stream, 5)
        time.sleep(0.05)
        assert _latest(reader, _offset(**{stream: 3}))["streams"] == {stream: 5}
        assert reader.reportLatestOffset()["streams"] == {stream: 5}
        time.sleep(0.05)  # checked at each probe
        with pytest.raises(StoreError, match="went backwards"):
            _latest(reader, _offset(**{stream: 8}))
    finally:
        reader.stop()
    # A batch logged before the restore, planned again after it (Spark replays it at restart).
    replay = _reader(stream, streams_url)
    try:
        with pytest.raises(StoreError, match="went backwards"):
            replay.partitions(_offset(**{stream: 3}), _offset(**{stream: 10}))
    finally:
        replay.stop()
    # An executor given a range PostgreSQL no longer proves complete.
    part = RangePartition(stream, client.stream(stream).id, 3, 10, 0, 10, streams_url)
    with pytest.raises(StoreError, match="went backwards"):
        list(read_partition(part))
    lenient = dataclasses.replace(part, fail_on_data_loss=False)
    kept = [i for batch in read_partition(lenient) for i in batch.column(1).to_pylist()]
    assert kept == [4, 5]


# ------------------------------------------------------------- defect 2: a start above complete


def test_a_start_above_the_complete_position_waits_for_it(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(3)])  # 1..3
        for option in ("50", json.dumps({"v": 1, "streams": {stream: 49}})):
            reader = _reader(stream, streams_url, startingPosition=option, pollInterval="10ms")
            try:
                start = reader.initialOffset()
                assert start["streams"] == {stream: 49}
                for _ in range(3):  # waits, as the Python reader does; no "went backwards"
                    assert _latest(reader, start) == start
                    time.sleep(0.02)
            finally:
                reader.stop()
        writer.append_batch([{"i": i} for i in range(3, 55)])  # 4..55
        reader = _reader(stream, streams_url, startingPosition="50", pollInterval="10ms")
        try:
            start = reader.initialOffset()
            end = _latest(reader, start)
            assert end["streams"] == {stream: 55}
            parts = reader.partitions(start, end)
            assert [(p.after, p.through) for p in parts] == [(49, 55)]
        finally:
            reader.stop()


# ---------------------------------------------------------------- defect 3: no stream starves


def test_a_small_budget_serves_every_stream(client: Client, stream: str, streams_url: str) -> None:
    names = [stream, stream + "b", stream + "c"]
    for name in names[1:]:
        client.create_stream(name)
    for name in names:
        with client.writer(name, instance="w") as writer:
            writer.append_batch([{"i": i} for i in range(6)])
    from streams_spark.options import parse_options
    from streams_spark.source import StreamsStreamReader

    reader = StreamsStreamReader(
        parse_options(
            {"streams": ",".join(names), "databaseUrl": streams_url, "maxFactsPerTrigger": "2"}
        )
    )
    try:
        offset = reader.initialOffset()
        moved: list[set[str]] = []
        for _ in range(3):
            end = _latest(reader, offset, reader.getDefaultReadLimit())
            assert sum(end["streams"][n] - offset["streams"][n] for n in names) == 2
            moved.append({n for n in names if end["streams"][n] > offset["streams"][n]})
            offset = end
        assert set().union(*moved) == set(names), moved  # every stream within 3 batches
    finally:
        reader.stop()


# ------------------------------------------------------------ defect 4: minFactsPerTrigger load


def test_min_facts_counts_once_per_probe(
    client: Client, stream: str, streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark.sql.streaming.datasource import ReadMinRows

    from streams.connector import count_facts as real

    calls: list[int] = []

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr("streams_spark.source.count_facts", counting)  # as the source calls it
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(3)])
    reader = _reader(stream, streams_url, minFactsPerTrigger="5", pollInterval="1s")
    try:
        start = reader.initialOffset()
        before = reader.probes
        for _ in range(100):  # Spark's tight loop: ~100 calls a second
            assert _latest(reader, start, ReadMinRows(5)) == start
        assert reader.probes - before <= 1
        assert len(calls) == reader.probes - before + 1  # one count per probe, not per call
    finally:
        reader.stop()


# ---------------------------------------------------------- defect 9: warnings that repeat


def test_data_loss_warnings_are_given_once(
    client: Client, stream: str, streams_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(3)])
    reader = _reader(stream, streams_url, failOnDataLoss="false", pollInterval="10ms")
    ahead = _offset(**{stream: 50})  # a checkpoint from before a restore
    try:
        with caplog.at_level(logging.WARNING, logger="streams.spark"):
            for _ in range(5):
                assert _latest(reader, ahead)["streams"] == ahead["streams"]
                time.sleep(0.02)
        assert reader.probes >= 5
        warned = [r for r in caplog.records if "went backwards" in r.getMessage()]
        assert len(warned) == 1
    finally:
        reader.stop()


# ----------------------------------------------------------- defect 5: every statement bounded


def test_every_statement_has_a_timeout_and_a_blocked_one_is_retried(
    client: Client, stream: str, streams_url: str
) -> None:
    from streams_spark.executor import RangePartition, _adbc_connection, read_partition

    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(4)])
    reader = _reader(stream, streams_url, statementTimeout="300ms", pollInterval="10ms")
    try:
        start = reader.initialOffset()
        shown = reader._connection().execute("SHOW statement_timeout").fetchone()
        assert shown == ("300ms",)
        # A lock held for longer than the timeout: the probe is cancelled and tried again.
        with psycopg.connect(streams_url) as holder:
            holder.execute("LOCK TABLE streams_registry IN ACCESS EXCLUSIVE MODE")
            release = threading.Timer(1.2, holder.rollback)
            release.start()
            t0 = time.monotonic()
            time.sleep(0.02)
            assert _latest(reader, start)["streams"] == {stream: 4}
            waited = time.monotonic() - t0
            release.join()
        assert waited >= 1.0
        assert reader.retries >= 1  # how many depends on the back-off: at least one
    finally:
        reader.stop()
    part = RangePartition(
        stream, client.stream(stream).id, 0, 4, 0, 4, streams_url, statement_timeout_ms=700
    )
    assert [i for b in read_partition(part) for i in b.column(1).to_pylist()] == [1, 2, 3, 4]
    conn = _adbc_connection(streams_url, statement_timeout_ms=700)
    with conn.cursor() as cur:
        cur.execute("SELECT current_setting('statement_timeout')")
        assert cur.fetchone() == ("700ms",)


# ------------------------------------------------------------------ group fencing (issue 27)


def test_a_newer_run_of_the_query_fences_the_group_of_an_older_one(
    client: Client, stream: str, streams_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each run of a query takes its group's next generation (at its first offset call, before
    the group's position is read): an older run still alive is fenced. With an explicit group
    its commit fails with GroupFenced; on the default group it warns once and commits no more
    (its checkpoint is where it resumes). The group never moves under the older run."""
    import streams

    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(6)])
    old = _reader(stream, streams_url, group="g")
    assert old.initialOffset()["streams"] == {stream: 0}
    old.commit(_offset(**{stream: 2}))
    new = _reader(stream, streams_url, group="g")
    assert new.initialOffset()["streams"] == {stream: 2}  # it saw the older run's commit
    with pytest.raises(streams.GroupFenced):
        old.commit(_offset(**{stream: 5}))
    (group,) = client.groups(stream)
    assert (group.position, group.generation) == (2, 2)
    assert group.owner is not None and group.owner.startswith("spark ")
    new.commit(_offset(**{stream: 4}))
    assert client.groups(stream)[0].position == 4
    # A run restarted from its checkpoint calls latestOffset first: that takes the group too.
    restarted = _reader(stream, streams_url, group="g")
    _latest(restarted, _offset(**{stream: 4}))
    with pytest.raises(streams.GroupFenced):
        new.commit(_offset(**{stream: 6}))
    # The default group (queries with the same options share it): a warning, no failure.
    first, second = _reader(stream, streams_url), _reader(stream, streams_url)
    first.initialOffset()
    first.commit(_offset(**{stream: 1}))
    second.initialOffset()
    with caplog.at_level(logging.WARNING, logger="streams"):
        first.commit(_offset(**{stream: 6}))
        first.commit(_offset(**{stream: 6}))
    warned = [r for r in caplog.records if "no longer commits" in r.getMessage()]
    assert len(warned) == 1
    assert {g.group: g.position for g in client.groups(stream)} == {
        "g": 4,
        first.config.group: 1,
    }
    for reader in (old, new, restarted, first, second):
        reader.stop()
