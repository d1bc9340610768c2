"""The Spark source with ``readDatabaseUrl``: the driver proves on the primary, executors read
their ranges on a hot standby once it has replayed past the driver's proof (`streams.store.reads`,
``read_range`` with ``proof_lsn``), and never read what it has not replayed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from helpers import rows_returned, wait_until
from pgpair import postgres_pair

import streams
from streams.migrate import upgrade

pytestmark = pytest.mark.timeout(240)


def test_executors_read_on_the_standby_behind_the_fence(spark: Any, unique_name: str) -> None:
    with postgres_pair(synchronous=False) as pair:
        upgrade(pair.primary_url)
        with streams.connect(pair.primary_url) as client:
            client.create_stream(unique_name)
            with client.writer(unique_name) as writer:
                writer.append_batch([{"n": n} for n in range(25)])
        pair.wait_replayed()
        pair.pause_replay()
        with streams.connect(pair.primary_url) as client, client.writer(unique_name) as writer:
            writer.append_batch([{"n": n} for n in range(25, 40)])
        before = rows_returned(pair.standby_url)
        found: list[Any] = []

        def read() -> None:
            df = (
                spark.read.format("streams")
                .option("stream", unique_name)
                .option("databaseUrl", pair.primary_url)
                .option("readDatabaseUrl", pair.standby_url)
                .option("standbyMaxWait", "60s")
                .option("partitions", "2")
                .load()
            )
            found.extend(df.select("stream_id").collect())

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        time.sleep(2.0)
        assert thread.is_alive(), "read facts the standby had not replayed"
        pair.resume_replay()
        thread.join(120)
        assert sorted(r["stream_id"] for r in found) == list(range(1, 41))
        wait_until(lambda: rows_returned(pair.standby_url) >= before + 40, 5.0, "stats")
