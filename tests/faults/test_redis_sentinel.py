"""Redis under Sentinel (issue 30, part 3): the master is killed under writers and readers.

A master, a replica and three Sentinels (`redisha.SentinelSet`: quorum 2,
``down-after-milliseconds`` 1000); clients use the ``redis+sentinel://`` URL. The master is
SIGKILLed while a writer appends and a reader follows (threaded clients) and an asyncio link
listens; the Sentinels promote the replica. Promised: nothing acked is lost or delivered twice
(PostgreSQL is the truth), every link follows the new master by itself (it asks the Sentinels
at each reconnect and checks ``ROLE``), and the fast path works again: a fact appended after
the failover reaches the reader far sooner than its poll interval.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from redisha import sentinel_set
from servers import new_redis_prefix

import streams
from streams.ops.redis_topology import redis_topology
from streams.transport.link import AsyncRedisLink

#: The reader's fallback poll interval: a delivery much faster than this came from a hint.
POLL_INTERVAL = 5.0


def _port(url: str | None) -> int | None:
    return None if url is None else int(url.rsplit(":", 1)[1].split("/")[0])


def test_master_failover_loses_nothing_and_links_follow(
    streams_url: str, unique_name: str, tmp_path: Path
) -> None:
    prefix = new_redis_prefix()
    with sentinel_set(tmp_path) as ha:
        writing = streams.connect(streams_url, redis_url=ha.url, prefix=prefix)
        reading = streams.connect(streams_url, redis_url=ha.url, prefix=prefix)
        loop = asyncio.new_event_loop()
        loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
        loop_thread.start()

        async def _open() -> AsyncRedisLink:
            return AsyncRedisLink(ha.url, prefix, "async-follower")

        alink = asyncio.run_coroutine_threadsafe(_open(), loop).result(5)
        try:
            writing.create_stream(unique_name)
            writer = writing.writer(unique_name, instance="w1")
            reader = reading.reader(unique_name, poll_interval=POLL_INTERVAL)
            acked: list[int] = []
            delivered: list[int] = []
            stop = threading.Event()
            errors: list[BaseException] = []

            def append() -> None:
                n = 0
                try:
                    while not stop.is_set():
                        acked.append(writer.append({"n": n}).first_id)
                        n += 1
                        time.sleep(0.005)
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            def pump(until: float) -> None:
                while time.monotonic() < until:
                    epoch = reader.poll(timeout=0.05)
                    if epoch is not None:
                        delivered.extend(f.stream_id for f in epoch.facts)

            links = [writing.link, reading.link]
            assert all(link is not None for link in links)
            deadline = time.monotonic() + 10
            while not (all(link.connected for link in links) and alink.connected):  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "links never connected"
                time.sleep(0.02)
            first_master = ha.master_port()
            ok, detail = redis_topology(ha.url)
            assert ok and f"master 127.0.0.1:{first_master}" in detail, detail
            assert "3/3 Sentinel(s) answer (quorum 2); 1 healthy replica(s)" in detail, detail
            assert {_port(link._target) for link in links} == {first_master}  # type: ignore[union-attr]

            appender = threading.Thread(target=append, daemon=True)
            appender.start()
            pump(time.monotonic() + 1.0)
            killed_at = time.monotonic()
            old = ha.kill_master()
            new = ha.wait_failover(old)
            promoted_after = time.monotonic() - killed_at
            while not (
                all(link.connected and _port(link._target) == new for link in links)  # type: ignore[union-attr]
                and alink.connected
                and _port(alink._target) == new
            ):
                assert time.monotonic() - killed_at < 30, "a link did not follow the new master"
                pump(time.monotonic() + 0.02)
            relive_after = time.monotonic() - killed_at
            pump(time.monotonic() + 1.0)
            stop.set()
            appender.join(10)
            assert not errors, errors
            # Everything acked is delivered exactly once (what Redis lost came from PostgreSQL).
            deadline = time.monotonic() + 3 * POLL_INTERVAL
            while not set(acked) <= set(delivered) and time.monotonic() < deadline:
                pump(time.monotonic() + 0.1)
            assert sorted(delivered) == delivered
            assert len(delivered) == len(set(delivered))
            assert set(acked) <= set(delivered)
            # The fast path works again: a fact appended now is hinted, not polled for.
            pump(time.monotonic() + 0.3)
            started = time.monotonic()
            last = writer.append({"after": "failover"}).first_id
            while last not in delivered:
                assert time.monotonic() - started < POLL_INTERVAL, "no hint after failover"
                pump(time.monotonic() + 0.01)
            latency = time.monotonic() - started
            assert latency < POLL_INTERVAL / 5, latency
            ok, detail = redis_topology(ha.url)  # the replica is the master now: none left
            assert not ok and f"master 127.0.0.1:{new}" in detail, detail
            assert "no healthy replica" in detail, detail
            stats: Any = reading.link.stats  # type: ignore[union-attr]
            assert stats.reconnects >= 1
            print(
                f"\nsentinel failover: {len(acked)} acked, {len(delivered) - 1} delivered, "
                f"0 lost; promoted {promoted_after:.2f}s after the kill, links live again "
                f"{relive_after:.2f}s after it; first hinted delivery {latency * 1000:.1f} ms"
            )
            writer.close()
            reader.close()
        finally:
            asyncio.run_coroutine_threadsafe(alink.aclose(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            loop_thread.join(5)
            writing.close()
            reading.close()


def test_a_sentinel_url_that_names_no_service_is_refused() -> None:
    with pytest.raises(streams.ConfigurationError, match="service name"):
        streams.connect("postgresql://x/y", redis_url="redis+sentinel://127.0.0.1:1")
