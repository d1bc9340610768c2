"""The Spark source through a PostgreSQL failover (`tests/pgpair.py`): the primary killed, its
standby promoted, every connection on the libpq multi-host URL.

* Synchronous standby: the query goes on by itself. Its offsets were proven on the old
  timeline at WAL positions at or below the switch point (`streams_timeline_switchpoint`), so
  the driver takes them and the executors read the ranges planned there on the new primary;
  every acknowledged fact is in exactly one micro-batch, whole, in order.
* Asynchronous standby cut off before the last facts: the query stops with
  `streams.DatabaseChanged` naming the offset proven after the switch point, instead of
  re-reading its ranges on a history that lacks some of their facts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from faultkit import Appender
from pgpair import postgres_pair
from test_spark_outages import Query, acked

import streams
from streams.migrate import upgrade

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_a_query_rides_out_a_synchronous_failover(
    spark: Any, unique_name: str, tmp_path: Path
) -> None:
    with postgres_pair(synchronous=True) as pair:
        upgrade(pair.primary_url)
        url = pair.multi_host_url
        with streams.connect(url, connect_timeout=20) as client:
            client.create_stream(unique_name)
            writer = client.writer(unique_name)
            appender = Appender(writer, pace=0.005)
            appender.start()
            try:
                time.sleep(0.5)
                query = Query(spark, url, unique_name, tmp_path / "checkpoint")
                query.wait_past(appender.acked, 120, "the first micro-batches")
                before = len(appender.acked)
                pair.kill_primary()
                killed = time.monotonic()
                pair.promote()
                deadline = time.monotonic() + 60
                while len(appender.acked) <= before:  # the writer's first append after it
                    assert time.monotonic() < deadline, "no append after the failover"
                    time.sleep(0.01)
                first_after = appender.acked[before]
                appended = time.monotonic() - killed
                query.wait_for(lambda: first_after in query.ids(), 120, "the first new fact")
                query.wait_past(appender.acked, 120, "facts after the failover")
                resumed = time.monotonic() - killed
                time.sleep(1.0)
            finally:
                appender.stop()
            writer.close()
        query.stop_and_check(pair.standby_url, unique_name, acked([appender]))
        print(
            f"\nSpark, synchronous failover: fact {first_after} appended {appended:.2f} s and "
            f"delivered {resumed:.2f} s after the kill; {len(appender.acked)} acked, 0 lost, "
            f"{len(query.ids())} delivered once"
        )


def test_a_query_stops_on_an_asynchronous_failover_that_lost_its_facts(
    spark: Any, unique_name: str, tmp_path: Path
) -> None:
    with postgres_pair(synchronous=False) as pair:
        upgrade(pair.primary_url)
        url = pair.multi_host_url
        with streams.connect(url, connect_timeout=20) as client:
            client.create_stream(unique_name)
            with client.writer(unique_name) as writer:
                kept = [writer.append({"n": n}).ids[0] for n in range(20)]
                pair.wait_replayed()
                pair.cut_off()
                lost = [writer.append({"n": n}).ids[0] for n in range(20, 30)]
            query = Query(spark, url, unique_name, tmp_path / "checkpoint")
            query.wait_past([*kept, *lost], 120, "every fact")
            pair.kill_primary()
            pair.promote()
            with client.writer(unique_name, instance="after") as again:
                again.append({"n": 30})
            deadline = time.monotonic() + 120
            while query.query.isActive:
                assert time.monotonic() < deadline, "the query went on after losing facts"
                time.sleep(0.2)
        error = str(query.query.exception())
        assert "DatabaseChanged" in error and "switch point" in error, error
        assert unique_name in error
