"""Redis Cluster with the asyncio client, and who listens on a cluster (issue 30, part 4).

* An `AsyncClient` reads (and another writes) on a three-master cluster beside a threaded
  writer: hints arrive over sharded pub/sub (the same `ClusterPlans` as the threaded link,
  driven on asyncio), a shard is killed and restarted under the threaded writer, the asyncio
  link resubscribes its channels by itself, nothing acked is lost or delivered twice, and the
  fast path works again.
* A writer-only process (threaded and asyncio) asks ``PUBSUB SHARDNUMSUB`` on the owner of its
  stream's data channel: it publishes nothing while nobody reads the stream, and publishes
  again once a reader attaches; the prover's follower count (``subscribers``) sees the reader.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redisha import RedisCluster, redis_cluster
from servers import new_redis_prefix

import streams
from streams.core.constants import data_channel, proof_channel
from streams.transport.link import AsyncRedisLink, RedisLink

POLL_INTERVAL = 5.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as built:
        yield built


def _on_shards(cluster: RedisCluster, prefix: str, count: int) -> list[str]:
    """``count`` stream names whose data channels hash to different masters."""
    names: dict[int, str] = {}
    i = 0
    while len(names) < count:
        name = f"a{i}_{prefix[-6:]}"
        names.setdefault(cluster.node_of(data_channel(prefix, name)).port, name)
        i += 1
    return list(names.values())


def test_async_client_on_a_cluster_survives_a_shard_restart(
    streams_url: str, cluster: RedisCluster
) -> None:
    prefix = new_redis_prefix()
    names = _on_shards(cluster, prefix, 3)
    writing = streams.connect(streams_url, redis_url=cluster.url, prefix=prefix)

    async def main() -> None:
        async with (
            await streams.aconnect(streams_url, redis_url=cluster.url, prefix=prefix) as areading,
            await streams.aconnect(streams_url, redis_url=cluster.url, prefix=prefix) as awriting,
        ):
            for name in names:
                await awriting.create_stream(name)
            writers = {n: writing.writer(n, instance="w1") for n in names}
            awriter = await awriting.writer(names[1], instance="aw")
            readers = {n: await areading.reader(n, poll_interval=POLL_INTERVAL) for n in names}
            delivered: dict[str, list[int]] = {n: [] for n in names}
            acked: dict[str, list[int]] = {n: [] for n in names}

            async def pump(seconds: float) -> None:
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    for name in names:
                        epoch = await readers[name].poll(timeout=0.01)
                        if epoch is not None:
                            delivered[name].extend(f.stream_id for f in epoch.facts)

            async def fast(name: str, async_writer: bool = False) -> float:
                started = time.monotonic()
                if async_writer:
                    last = (await awriter.append({"probe": True})).first_id
                else:
                    last = (await asyncio.to_thread(writers[name].append, {"p": 1})).first_id
                acked[name].append(last)
                while last not in delivered[name]:
                    assert time.monotonic() - started < POLL_INTERVAL, "no hint: fast path down"
                    await pump(0.01)
                return time.monotonic() - started

            links = (areading.link, awriting.link, writing.link)
            deadline = time.monotonic() + 10
            while not all(link is not None and link.connected for link in links):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            for name in names:
                assert await fast(name) < 1.0
            assert await fast(names[1], async_writer=True) < 1.0  # asyncio SPUBLISH

            stop = threading.Event()

            def append() -> None:
                n = 0
                while not stop.is_set():
                    for name in names:
                        acked[name].append(writers[name].append({"n": n}).first_id)
                    n += 1
                    time.sleep(0.01)

            appender = threading.Thread(target=append, daemon=True)
            appender.start()
            await pump(0.3)
            victim = cluster.node_of(data_channel(prefix, names[0]))
            cluster.kill(victim)
            killed = time.monotonic()
            await pump(2.0)
            # Not in a worker thread: the server would die with it (PR_SET_PDEATHSIG).
            cluster.restart(victim)
            client = victim.client()
            channel = data_channel(prefix, names[0])
            while True:  # both links (threaded writer: none; asyncio reader) resubscribe
                reply: Any = client.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
                if int(reply[1]) >= 1:
                    break
                assert time.monotonic() - killed < 30, "the shard's channels not resubscribed"
                await pump(0.05)
            # Hints flow again once every link is live (each retries at least once a second).
            while not all(link is not None and link.connected for link in links):
                assert time.monotonic() - killed < 30, "a link did not reconnect"
                await pump(0.05)
            await pump(0.3)
            stop.set()
            await asyncio.to_thread(appender.join, 10)
            for name in names:
                deadline = time.monotonic() + 3 * POLL_INTERVAL
                while not set(acked[name]) <= set(delivered[name]):
                    assert time.monotonic() < deadline, f"{name}: acked facts not delivered"
                    await pump(0.1)
                assert delivered[name] == sorted(set(delivered[name]))
            latency = await fast(names[0])
            assert latency < 1.0, latency
            print(
                f"\nasyncio reader on a cluster: {sum(map(len, acked.values()))} acked, 0 lost; "
                f"hinted delivery after the shard restart {latency * 1000:.1f} ms"
            )
            for w in writers.values():
                w.close()

    try:
        asyncio.run(main())
    finally:
        writing.close()


def test_writers_publish_only_where_someone_listens_on_a_cluster(
    streams_url: str, cluster: RedisCluster
) -> None:
    prefix = new_redis_prefix()
    name = _on_shards(cluster, prefix, 1)[0]
    writing = streams.connect(streams_url, redis_url=cluster.url, prefix=prefix)

    async def main() -> None:
        async with await streams.aconnect(
            streams_url, redis_url=cluster.url, prefix=prefix
        ) as awriting:
            writing.create_stream(name)
            writer = writing.writer(name, instance="w1")
            awriter = await awriting.writer(name, instance="aw")
            assert writing.link is not None and awriting.link is not None
            links: tuple[RedisLink | AsyncRedisLink, ...] = (writing.link, awriting.link)
            deadline = time.monotonic() + 10
            while not all(link.connected for link in links):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            # Nobody reads the stream: after the first check (1 s) nothing more goes out.
            until = time.monotonic() + 1.6
            while time.monotonic() < until:
                writer.append({"n": 1})
                await awriter.append({"n": 1})
                await asyncio.sleep(0.05)
            published = [link.stats.published for link in links]
            for _ in range(10):
                writer.append({"n": 2})
                await awriter.append({"n": 2})
            assert [link.stats.published for link in links] == published
            assert all(link.stats.unheard >= 10 for link in links)
            # A reader attaches (its REPLICATE tells writers to publish again).
            reading = streams.connect(streams_url, redis_url=cluster.url, prefix=prefix)
            try:
                reader = reading.reader(name, poll_interval=POLL_INTERVAL)
                assert reading.link is not None
                deadline = time.monotonic() + 10
                while not reading.link.connected:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                proofs = proof_channel(prefix, name)
                while (reading.link.subscribers([proofs]) or {}).get(proofs, 0) < 1:
                    assert time.monotonic() < deadline, "the prover would see no follower"
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(reader.poll, 2.0)  # what was appended before
                acks = [
                    await asyncio.to_thread(writer.append, {"n": 3}),
                    await awriter.append({"n": 3}),
                ]
                started = time.monotonic()
                got: list[int] = []
                while not {a.first_id for a in acks} <= set(got):
                    assert time.monotonic() - started < POLL_INTERVAL, "no hint"
                    epoch = await asyncio.to_thread(reader.poll, 0.01)
                    if epoch is not None:
                        got.extend(f.stream_id for f in epoch.facts)
                assert time.monotonic() - started < 1.0
                assert all(
                    link.stats.published > p for link, p in zip(links, published, strict=True)
                )
                reader.close()
            finally:
                reading.close()
            writer.close()

    try:
        asyncio.run(main())
    finally:
        writing.close()
