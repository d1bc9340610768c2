"""A rewind: the data directory restored in place from a file-system snapshot (issue 38).

Such a restore keeps every identifier a database history has (`streams.core.incarnation`:
system identifier, OIDs, incarnation id, timeline), so nothing but the WAL position tells it.
Here a private PostgreSQL is stopped, its data directory copied (the snapshot), started again;
writers, a plain reader, a reader group and a Spark query go on past the snapshot; then the
server is stopped ``immediate`` and the copy put back in its place. Every process that saw a
durable WAL position past the snapshot (its connects, its probes, its heartbeats, the Spark
offsets in its checkpoint) refuses the server with `streams.DatabaseChanged` naming both
positions, instead of reading on from positions that history lost (and handing out again IDs
readers passed).

What cannot be noticed is written down in `streams.core.incarnation`: a process that never saw
past the snapshot, or a snapshot written past the position a process saw before it reconnects.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultkit import RestartablePostgres, copy_data_directory, restartable_postgres

import streams
from streams.devservers import ensure_database
from streams.migrate import upgrade

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LSN = r"[0-9A-F]+/[0-9A-F]+"


@pytest.fixture
def server() -> Iterator[RestartablePostgres]:
    with restartable_postgres() as pg:
        yield pg


def _url(pg: RestartablePostgres) -> str:
    url = pg.proxy.url(ensure_database(pg.server.url, "streams"))
    upgrade(url)
    return url


def _rewound(error: BaseException) -> tuple[str, str]:
    """The two positions a rewind's `DatabaseChanged` names (found, seen)."""
    text = str(error)
    match = re.search(rf"durable position is ({LSN}), below ({LSN}) seen there before", text)
    assert match is not None, text
    return match.group(1), match.group(2)


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def _append_as_a_service_would(writer: streams.Writer) -> None:
    """Append, trying again while the server restarts (an append fails at once then)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            writer.append({"after": "rewind"})
            return
        except streams.ConnectionLost:
            assert time.monotonic() < deadline, "the server did not come back"
            time.sleep(0.2)


def _spark_run(spark: Any, url: str, stream: str, checkpoint: Path) -> list[int]:
    seen: list[int] = []

    def sink(df: Any, batch_id: int) -> None:
        seen.extend(r.stream_id for r in df.select("stream_id").collect())

    query = (
        spark.readStream.format("streams")
        .option("stream", stream)
        .option("databaseUrl", url)
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    return sorted(seen)


def test_every_role_refuses_a_data_directory_restored_in_place(
    server: RestartablePostgres, unique_name: str
) -> None:
    url = _url(server)
    snapshot = server.workdir / "snapshot"
    client = streams.connect(url, lease_seconds=2, connect_timeout=20)
    client.create_stream(unique_name)
    writer = client.writer(unique_name)
    writer.append_batch([{"n": n} for n in range(10)])
    server.restart("fast", while_down=lambda data: copy_data_directory(data, snapshot))

    # Past the snapshot: more facts (and WAL), read by a plain reader and a group.
    for n in range(200):
        writer.append({"n": 10 + n})
    plain = client.reader(unique_name, start="earliest")
    group = client.reader(unique_name, group="billing")
    for reader in (plain, group):
        assert len(list(reader.facts())) == 210
    group.commit()
    time.sleep(1.5)  # a heartbeat of the writer's (every lease / 4) reads the flushed position

    server.restart("immediate", while_down=lambda data: copy_data_directory(snapshot, data))

    with pytest.raises(streams.DatabaseChanged) as raised:
        _append_as_a_service_would(writer)
    found, seen = _rewound(raised.value)
    assert _lsn(found) < _lsn(seen)
    assert "went back on timeline 1" in str(raised.value)
    for reader in (plain, group):
        with pytest.raises(streams.DatabaseChanged, match="the WAL went back"):
            reader.poll(timeout=20)  # it tries again while the server restarts
    # A new process knows no position: only what it is told can tell it (see the docstring).
    with streams.connect(url) as fresh:
        assert fresh.positions(unique_name).max_allocated < 210
    client.close()


def test_a_spark_query_refuses_a_checkpoint_past_a_rewound_database(
    server: RestartablePostgres, unique_name: str, spark: Any, tmp_path: Path
) -> None:
    url = _url(server)
    snapshot = server.workdir / "snapshot"
    with streams.connect(url) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            writer.append_batch([{"n": n} for n in range(5)])
    server.restart("fast", while_down=lambda data: copy_data_directory(data, snapshot))
    with streams.connect(url) as client, client.writer(unique_name) as writer:
        writer.append_batch([{"n": n} for n in range(100)])
    checkpoint = tmp_path / "checkpoint"
    assert _spark_run(spark, url, unique_name, checkpoint) == list(range(1, 106))

    server.restart("immediate", while_down=lambda data: copy_data_directory(snapshot, data))

    with pytest.raises(Exception, match="DatabaseChanged") as raised:
        _spark_run(spark, url, unique_name, checkpoint)
    found, seen = _rewound(raised.value)
    assert _lsn(found) < _lsn(seen)
    assert "offset" in str(raised.value)
