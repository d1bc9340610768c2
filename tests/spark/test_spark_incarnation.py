"""A Spark query never reads on from offsets of another database history.

A query's checkpoint holds offsets (stream positions) logged in one database's history; when
the database behind the same URL is recreated (or restored, or failed over), a restarted query
stops with `streams.DatabaseChanged` naming what changed, instead of skipping the new database's
facts up to its old positions (`streams_spark.query_driver.QueryDriver.check_offset`); with
``failOnDataLoss=false`` it warns and goes on from them. Executors check the same on their own
sessions (`streams_spark.executor._check_incarnation`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import fill_stream
from servers import database_name

from streams.migrate import upgrade

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(spark: Any, url: str, stream: str, checkpoint: Path, **options: str) -> list[int]:
    seen: list[int] = []

    def sink(df: Any, batch_id: int) -> None:
        seen.extend(r.stream_id for r in df.select("stream_id").collect())

    reader = spark.readStream.format("streams").option("stream", stream)
    for key, value in {"databaseUrl": url, **options}.items():
        reader = reader.option(key, value)
    query = (
        reader.load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    return sorted(seen)


def test_a_restarted_query_stops_on_a_recreated_database(
    spark: Any, postgres_admin_url: str, own_database: str, unique_name: str, tmp_path: Path
) -> None:
    fill_stream(own_database, unique_name, 5)
    checkpoint = tmp_path / "checkpoint"
    assert _run(spark, own_database, unique_name, checkpoint) == [1, 2, 3, 4, 5]

    name = database_name(own_database)
    with psycopg.connect(postgres_admin_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    upgrade(own_database)
    fill_stream(own_database, unique_name, 8)  # IDs 1..8 of the new database

    with pytest.raises(Exception, match="DatabaseChanged") as caught:
        _run(spark, own_database, unique_name, checkpoint)
    assert "another database" in str(caught.value)

    # failOnDataLoss=false: a warning, and the query goes on from its old positions.
    ids = _run(spark, own_database, unique_name, checkpoint, failOnDataLoss="false")
    assert ids == [6, 7, 8]
