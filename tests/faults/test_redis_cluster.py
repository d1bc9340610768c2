"""Redis Cluster (issue 30, part 4): streams sharded by slot, and a shard restarted under load.

Three masters (`redisha.RedisCluster`); clients use the ``redis+cluster://`` URL. Streams whose
data channels hash to different shards are written and read: each stream's channel is
subscribed with ``SSUBSCRIBE`` on the master owning its slot (``PUBSUB SHARDNUMSUB`` there),
hints arrive over the fast path; one master is killed and restarted on its port with its
``nodes.conf``: the link resubscribes that shard's channels by itself, nothing acked is lost or
delivered twice, and hints flow again. The doctor's topology check sees the cluster whole, then
degraded while the shard is down.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from redisha import redis_cluster
from servers import new_redis_prefix

import streams
from streams.core.constants import data_channel, proof_channel
from streams.ops.redis_topology import redis_topology

POLL_INTERVAL = 5.0


def _delivered_fast(writer: Any, reader: Any, delivered: list[int]) -> float:
    """Seconds from an append to its delivery (polling the reader briefly)."""
    started = time.monotonic()
    last = writer.append({"probe": True}).first_id
    while last not in delivered:
        assert time.monotonic() - started < POLL_INTERVAL, "no hint: the fast path is down"
        epoch = reader.poll(timeout=0.01)
        if epoch is not None:
            delivered.extend(f.stream_id for f in epoch.facts)
    return time.monotonic() - started


def test_cluster_shards_streams_and_survives_a_shard_restart(
    streams_url: str, tmp_path: Path
) -> None:
    prefix = new_redis_prefix()
    with redis_cluster(tmp_path) as cluster:
        assert redis_topology(cluster.url)[0]
        # Streams on three different shards.
        names: dict[int, str] = {}
        i = 0
        while len(names) < 3:
            name = f"c{i}_{prefix[-6:]}"
            names.setdefault(cluster.node_of(data_channel(prefix, name)).port, name)
            i += 1
        streams_ = list(names.values())
        writing = streams.connect(streams_url, redis_url=cluster.url, prefix=prefix)
        reading = streams.connect(streams_url, redis_url=cluster.url, prefix=prefix)
        try:
            for name in streams_:
                writing.create_stream(name)
            writers = {n: writing.writer(n, instance="w1") for n in streams_}
            readers = {n: reading.reader(n, poll_interval=POLL_INTERVAL) for n in streams_}
            delivered: dict[str, list[int]] = {n: [] for n in streams_}
            acked: dict[str, list[int]] = {n: [] for n in streams_}
            deadline = time.monotonic() + 10
            while not (writing.link.connected and reading.link.connected):  # type: ignore[union-attr]
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.3)
            for name in streams_:  # sharded: subscribed on the owner, with SSUBSCRIBE
                for channel in (data_channel(prefix, name), proof_channel(prefix, name)):
                    owner = cluster.node_of(channel).client()
                    reply: Any = owner.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
                    assert int(reply[1]) >= 1, (channel, reply)
                    plain: Any = owner.execute_command("PUBSUB", "NUMSUB", channel)  # type: ignore[no-untyped-call]
                    assert int(plain[1]) == 0
                latency = _delivered_fast(writers[name], readers[name], delivered[name])
                assert latency < 1.0, latency
            stop = threading.Event()

            def append() -> None:
                n = 0
                while not stop.is_set():
                    for name in streams_:
                        acked[name].append(writers[name].append({"n": n}).first_id)
                    n += 1
                    time.sleep(0.01)

            def pump(seconds: float) -> None:
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    for name in streams_:
                        epoch = readers[name].poll(timeout=0.01)
                        if epoch is not None:
                            delivered[name].extend(f.stream_id for f in epoch.facts)

            appender = threading.Thread(target=append, daemon=True)
            appender.start()
            pump(0.5)
            victim_name = streams_[0]
            victim = cluster.node_of(data_channel(prefix, victim_name))
            cluster.kill(victim)
            killed_at = time.monotonic()
            pump(2.5)  # the cluster marks the node failed (node timeout 1 s)
            ok, detail = redis_topology(cluster.url)
            assert not ok and "degraded" in detail, detail
            cluster.restart(victim)
            restarted = time.monotonic() - killed_at
            # The link resubscribes the shard's channels by itself.
            channel = data_channel(prefix, victim_name)
            client = victim.client()
            while True:
                reply = client.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
                if int(reply[1]) >= 1:
                    break
                assert time.monotonic() - killed_at < 30, "the shard's channels not resubscribed"
                pump(0.05)
            resubscribed = time.monotonic() - killed_at
            # Hints flow again once every link is live (each retries at least once a second).
            while not (writing.link.connected and reading.link.connected):  # type: ignore[union-attr]
                assert time.monotonic() - killed_at < 30, "a link did not reconnect"
                pump(0.05)
            relinked = time.monotonic() - killed_at
            pump(0.5)
            stop.set()
            appender.join(10)
            for name in streams_:
                deadline = time.monotonic() + 3 * POLL_INTERVAL
                while not set(acked[name]) <= set(delivered[name]) and time.monotonic() < deadline:
                    pump(0.1)
                assert delivered[name] == sorted(set(delivered[name]))
                assert set(acked[name]) <= set(delivered[name])
            latency = _delivered_fast(
                writers[victim_name], readers[victim_name], delivered[victim_name]
            )
            assert latency < 1.0, latency
            assert redis_topology(cluster.url)[0]
            total = sum(len(a) for a in acked.values())
            print(
                f"\ncluster shard restart: {total} acked over {len(streams_)} streams, 0 lost; "
                f"shard back {restarted:.2f}s after the kill, channels resubscribed "
                f"{resubscribed:.2f}s after it, links live {relinked:.2f}s after it; "
                f"hinted delivery after {latency * 1000:.1f} ms"
            )
            for w in writers.values():
                w.close()
            for r in readers.values():
                r.close()
        finally:
            writing.close()
            reading.close()
