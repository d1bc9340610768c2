"""``rediss+sentinel://``: Sentinel over TLS (issue 30, part 3).

A master, a replica and three Sentinels that listen on TLS ports only (a throwaway CA,
`redisha.make_tls`); the URL carries ``ssl_ca_certs``. A threaded writer and an asyncio reader
use the fast path, the doctor sees the topology, the master is killed, both follow the
promoted replica over TLS, and the fast path works again; nothing acked is lost.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from redisha import make_tls, sentinel_set
from servers import new_redis_prefix

import streams
from streams.ops.redis_topology import redis_topology
from streams.transport.link import AsyncRedisLink, RedisLink

POLL_INTERVAL = 5.0


def test_sentinel_over_tls(streams_url: str, unique_name: str, tmp_path: Path) -> None:
    prefix = new_redis_prefix()
    with sentinel_set(tmp_path, tls=make_tls(tmp_path / "tls")) as ha:
        assert ha.url.startswith("rediss+sentinel://")
        ok, detail = redis_topology(ha.url)
        assert ok, detail
        writing = streams.connect(streams_url, redis_url=ha.url, prefix=prefix)

        async def main() -> None:
            async with await streams.aconnect(
                streams_url, redis_url=ha.url, prefix=prefix
            ) as reading:
                writing.create_stream(unique_name)
                writer = writing.writer(unique_name, instance="w1")
                reader = await reading.reader(unique_name, poll_interval=POLL_INTERVAL)
                links: list[RedisLink | AsyncRedisLink] = [writing.link, reading.link]  # type: ignore[list-item]
                acked: list[int] = []
                delivered: list[int] = []

                async def fast() -> float:
                    started = time.monotonic()
                    acked.append(writer.append({"probe": True}).first_id)
                    while acked[-1] not in delivered:
                        assert time.monotonic() - started < POLL_INTERVAL, "no hint"
                        epoch = await reader.poll(timeout=0.01)
                        if epoch is not None:
                            delivered.extend(f.stream_id for f in epoch.facts)
                    return time.monotonic() - started

                async def live(master: int) -> None:
                    deadline = time.monotonic() + 30
                    while not all(
                        link.connected
                        and str(link._target).startswith("rediss://")
                        and f":{master}/" in str(link._target)
                        for link in links
                    ):
                        assert time.monotonic() < deadline, "a link did not follow the master"
                        await asyncio.sleep(0.02)

                await live(ha.master_port())
                await asyncio.sleep(0.3)
                assert await fast() < 1.0
                old = ha.kill_master()
                for n in range(20):
                    acked.append(writer.append({"n": n}).first_id)
                new = await asyncio.to_thread(ha.wait_failover, old)
                await live(new)
                await asyncio.sleep(0.3)
                latency = await fast()
                assert latency < 1.0, latency
                assert delivered == sorted(set(delivered)) and set(acked) <= set(delivered)
                writer.close()
                await reader.aclose()

        try:
            asyncio.run(main())
        finally:
            writing.close()
