"""Several streaming queries started at once in one SparkSession (issue: a driver running two
queries failed every task of both with ``java.io.OptionalDataException`` while deserializing
a ``HashMap``, on every restart of the queries inside that driver).

The cause is Spark's (4.x, `PythonStreamingSourceRunner.init`): each query's source runner
puts four entries (``SPARK_LOCAL_DIRS``, ``SPARK_AUTH_SOCKET_TIMEOUT``, ``SPARK_BUFFER_SIZE``,
``SPARK_PYTHON_RUNTIME``) into the environment map of the *registered* data source, a plain
``java.util.HashMap`` shared by every query and every task of that format in the session.
Two queries starting at once insert into it from two threads; a lost update of its size
leaves it inconsistent for good, and every task serialized with it afterwards fails to
deserialize. `streams_spark.register` puts those keys in while nothing runs, so a query
start only replaces values (no structural change: safe under concurrent reads).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from streams import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

RUNNER_KEYS = {
    "SPARK_LOCAL_DIRS",
    "SPARK_AUTH_SOCKET_TIMEOUT",
    "SPARK_BUFFER_SIZE",
    "SPARK_PYTHON_RUNTIME",
}


def _registered_env(spark: Any) -> Any:
    """The JVM map every `streams` query and task of this session shares (classic Spark)."""
    manager = spark._jsparkSession.sessionState().dataSourceManager()
    return manager.lookupDataSource("streams").dataSourceCls().envVars()


def test_a_query_start_changes_no_shared_map_of_the_session(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    import streams_spark

    streams_spark.register(spark)  # a fresh registration: a fresh map
    env = _registered_env(spark)
    keys = set(env.keySet())
    assert keys >= RUNNER_KEYS  # already there before any query runs
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"i": i} for i in range(3)])
    query = (
        spark.readStream.format("streams")
        .options(stream=stream, databaseUrl=streams_url)
        .load()
        .writeStream.foreachBatch(lambda *_: None)
        .option("checkpointLocation", str(tmp_path / "c"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    assert set(env.keySet()) == keys  # the query's start replaced values only


def test_queries_started_together_many_times(
    spark: Any, client: Client, unique_name: str, streams_url: str, tmp_path: Path
) -> None:
    """Rounds of 2, 3 and 4 queries started at the same moment from as many threads, each on a
    fresh registration (a fresh shared map, as in a new driver): every query reads exactly its
    stream's facts, no task fails."""
    import streams_spark

    names = [f"{unique_name}q{k}" for k in range(4)]
    for k, name in enumerate(names):
        client.create_stream(name)
        with client.writer(name, instance="w") as writer:
            writer.append_batch([{"q": k, "i": i} for i in range(20)])
    for round_no, width in enumerate([2, 3, 4, 2, 3, 4]):
        streams_spark.register(spark)
        barrier = threading.Barrier(width)
        results: dict[int, Any] = {}

        def run(
            k: int,
            round_no: int = round_no,
            barrier: threading.Barrier = barrier,
            results: dict[int, Any] = results,
        ) -> None:
            seen: list[int] = []
            try:
                df = (
                    spark.readStream.format("streams")
                    .options(stream=names[k], databaseUrl=streams_url, maxFactsPerTrigger="7")
                    .load()
                )
                writer = (
                    df.writeStream.foreachBatch(
                        lambda batch, _: seen.extend(r.stream_id for r in batch.collect())
                    )
                    .option("checkpointLocation", str(tmp_path / f"r{round_no}q{k}"))
                    .trigger(availableNow=True)
                )
                barrier.wait(30)
                query = writer.start()
                query.awaitTermination(120)
                results[k] = query.exception() or sorted(seen)
            except BaseException as exc:  # reported below
                results[k] = exc

        threads = [threading.Thread(target=run, args=(k,)) for k in range(width)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert {k: results.get(k) for k in range(width)} == {
            k: list(range(1, 21)) for k in range(width)
        }, f"round {round_no} ({width} queries, {time.monotonic() - started:.1f}s)"
