"""The asyncio client under Sentinel (issue 30, part 3): `streams.aconnect` end to end.

Two `AsyncClient`s (one writes, one reads) on a ``redis+sentinel://`` URL: hints arrive over
the fast path, a key rotation announces its keys on the master (`publish_now`), the master is
SIGKILLed under the writer, both asyncio links follow the promoted replica by themselves,
nothing acked is lost or delivered twice, and the fast path works again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from redisha import sentinel_set
from servers import new_redis_prefix

import streams
from streams.transport.link import AsyncRedisLink

POLL_INTERVAL = 5.0


def test_async_clients_follow_a_sentinel_failover(
    streams_url: str, unique_name: str, tmp_path: Path
) -> None:
    prefix = new_redis_prefix()
    with sentinel_set(tmp_path) as ha:

        async def main() -> None:
            async with (
                await streams.aconnect(streams_url, redis_url=ha.url, prefix=prefix) as writing,
                await streams.aconnect(streams_url, redis_url=ha.url, prefix=prefix) as reading,
            ):
                await writing.create_stream(unique_name)
                writer = await writing.writer(unique_name, instance="aw")
                reader = await reading.reader(unique_name, poll_interval=POLL_INTERVAL)
                links: list[AsyncRedisLink] = [writing.link, reading.link]  # type: ignore[list-item]
                acked: list[int] = []
                delivered: list[int] = []

                async def pump(seconds: float) -> None:
                    until = time.monotonic() + seconds
                    while time.monotonic() < until:
                        epoch = await reader.poll(timeout=0.02)
                        if epoch is not None:
                            delivered.extend(f.stream_id for f in epoch.facts)

                async def fast() -> float:
                    started = time.monotonic()
                    acked.append((await writer.append({"probe": True})).first_id)
                    while acked[-1] not in delivered:
                        assert time.monotonic() - started < POLL_INTERVAL, "no hint"
                        await pump(0.01)
                    return time.monotonic() - started

                async def live(master: int) -> None:
                    deadline = time.monotonic() + 30
                    while not all(
                        link.connected and str(link._target).endswith(f":{master}/0")
                        for link in links
                    ):
                        assert time.monotonic() < deadline, "a link did not follow the master"
                        await pump(0.02)

                await live(ha.master_port())
                await asyncio.sleep(0.3)
                assert await fast() < 1.0
                assert await writing.rotate_replication_keys() >= 1

                async def append(stop: asyncio.Event) -> None:
                    n = 0
                    while not stop.is_set():
                        acked.append((await writer.append({"n": n})).first_id)
                        n += 1
                        await asyncio.sleep(0.01)

                stop = asyncio.Event()
                appending = asyncio.create_task(append(stop))
                await pump(0.5)
                killed = time.monotonic()
                old = ha.kill_master()
                new = await asyncio.to_thread(ha.wait_failover, old)
                await live(new)
                relive = time.monotonic() - killed
                await pump(0.5)
                stop.set()
                await appending
                deadline = time.monotonic() + 3 * POLL_INTERVAL
                while not set(acked) <= set(delivered):
                    assert time.monotonic() < deadline, "acked facts not delivered"
                    await pump(0.1)
                assert delivered == sorted(set(delivered))
                await pump(0.3)
                latency = await fast()
                assert latency < 1.0, latency
                print(
                    f"\nasyncio sentinel failover: {len(acked)} acked, 0 lost; links live again "
                    f"{relive:.2f}s after the kill; hinted delivery {latency * 1000:.1f} ms"
                )
                await writer.aclose()
                await reader.aclose()

        asyncio.run(main())
