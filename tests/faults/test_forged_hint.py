"""One forged Redis line costs a process's fast path a while, not for good.

``POSITION <a stream this database does not have> x 0 5``, published once on the replication
channel, makes every link that hears it (after a registry read) quarantine itself: a follower
stops applying signed ranges and reads PostgreSQL, delivering every fact exactly once, in order;
when the quarantine ends (shortened here by patching `streams.core.foreign.QUARANTINE_BASE`)
the link is live again, the prover's signed ranges are applied again, and the conviction was
counted once, in the link's stats and in Prometheus. Before quarantines, the fast path never
came back: ``the fast path to come back`` timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import prometheus_client
import pytest
import redis
import redis.asyncio
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

import streams
from streams import Client
from streams.bench.common import drop_streams
from streams.core.epochs import Fact
from streams.metrics import ClientCollector
from streams.reader import Reader
from streams.transport.link import AsyncRedisLink
from streams.writer import Writer

pytestmark = pytest.mark.timeout(180)

#: Seconds of the quarantine in these tests (60 in production).
QUARANTINE = 8.0

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(registry: prometheus_client.CollectorRegistry) -> Samples:
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def deliver(reader: Reader, through: int, got: list[Fact], timeout: float = 30.0) -> None:
    """Poll ``reader`` until it has delivered everything up to ``through`` (into ``got``)."""
    deadline = time.monotonic() + timeout
    while reader.position() < through:
        assert time.monotonic() < deadline, f"delivered up to {reader.position()} of {through}"
        epoch = reader.poll(timeout=0.5)
        if epoch is not None:
            got += epoch.facts


def append_until(
    writer: Writer, reader: Reader, got: list[Fact], ids: list[int], done: Any, what: str
) -> None:
    """Append one fact at a time, each delivered before the next, until ``done()``."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        ids.append(writer.append({"n": len(ids)}).last_id)
        deliver(reader, ids[-1], got)


def test_a_forged_position_turns_signed_ranges_off_for_a_while_only(
    streams_url: str,
    redis_url: str,
    redis_prefix: str,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("streams.core.foreign.QUARANTINE_BASE", QUARANTINE)
    name = unique_name
    with contextlib.ExitStack() as stack:
        reading: list[Client] = [
            stack.enter_context(
                streams.connect(
                    streams_url, redis_url=redis_url, prefix=redis_prefix, shared_proofs=True
                )
            )
            for _ in range(2)
        ]
        writing = stack.enter_context(
            streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix)
        )
        stack.callback(drop_streams, streams_url, [name])
        writing.create_stream(name)
        readers = [stack.enter_context(c.reader(name)) for c in reading]
        provers = [c._proofs for c in reading]
        wait_until(
            lambda: any(p is not None and name in p.proving for p in provers), 15, "a prover"
        )
        # The follower: the reading process that does not prove, taking the other's lines.
        side = 0 if provers[1] is not None and name in provers[1].proving else 1
        follower, client = readers[side], reading[side]
        link = client._link
        assert link is not None
        registry = prometheus_client.CollectorRegistry()
        registry.register(ClientCollector(client))
        writer = stack.enter_context(writing.writer(name, instance="w"))
        got: list[Fact] = []
        ids: list[int] = []
        core = follower.core
        append_until(
            writer, follower, got, ids, lambda: core.counters.signed_ranges > 0, "signed ranges"
        )

        raw = redis.Redis.from_url(redis_url)
        stack.callback(raw.close)
        assert raw.publish(redis_prefix, f"POSITION {name}_not_here x 0 5") >= 3
        wait_until(lambda: link.foreign is not None, 15, "the conviction")
        wait_until(lambda: not follower.live, 5, "the follower told the link is not live")
        applied = core.counters.signed_ranges
        for n in range(10):
            ids.append(writer.append({"quarantined": n}).last_id)
        deliver(follower, ids[-1], got)  # from PostgreSQL
        during = samples(registry)
        assert link.foreign is not None, "the quarantine ended before the reads: too slow here?"
        assert core.counters.signed_ranges == applied, (
            "a signed range was applied while quarantined"
        )

        wait_until(lambda: link.connected, QUARANTINE + 10, "the fast path to come back")
        append_until(
            writer,
            follower,
            got,
            ids,
            lambda: core.counters.signed_ranges > applied,
            "signed ranges again",
        )
        after = samples(registry)

        # Every fact exactly once, in order, and as PostgreSQL alone has them.
        assert [f.stream_id for f in got] == ids
        with streams.connect(streams_url) as plain, plain.reader(name) as truth:
            expected: list[Fact] = []
            deliver(truth, ids[-1], expected)
        assert got == expected
        # One conviction, counted: by the follower's link and in its metrics.
        assert link.stats.convictions == {"synapse-commands": 0, "unknown-streams": 1}
        assert link.foreign is None and link.quarantine is None
        prefix = (("prefix", redis_prefix),)
        reason = (("prefix", redis_prefix), ("reason", "unknown-streams"))
        series = "streams_link_foreign_convictions_total"
        assert during[(series, reason)] == after[(series, reason)] == 1
        assert after[(series, (("prefix", redis_prefix), ("reason", "synapse-commands")))] == 0
        assert 0 < during[("streams_link_quarantine_seconds", prefix)] <= QUARANTINE
        assert after[("streams_link_quarantine_seconds", prefix)] == 0
        assert during[("streams_link_connected", prefix)] == 0
        assert after[("streams_link_connected", prefix)] == 1


def test_the_asyncio_link_ends_its_quarantine_too(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same listen plan drives the asyncio link: it is live again after the quarantine,
    its listeners hear so, and it publishes what a reconnect publishes."""
    monkeypatch.setattr("streams.core.foreign.QUARANTINE_BASE", 1.0)
    states: list[bool] = []

    class Listener:
        def on_hint(self, hint: Any) -> None:
            pass

        def on_link_state(self, connected: bool) -> None:
            states.append(connected)

    async def until(predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def main() -> list[bytes]:
        watch = redis.asyncio.Redis.from_url(redis_url)
        pubsub = watch.pubsub()
        await pubsub.subscribe(redis_prefix)
        link = AsyncRedisLink(redis_url, redis_prefix, "async-q", known_streams=lambda: ["mine"])
        try:
            await until(lambda: link.connected, 15, "the link")
            link.attach_writer("mine", "w1", lambda: 7)
            link.add_listener(Listener())
            await watch.publish(redis_prefix, "POSITION not_here x 0 5")
            await until(lambda: link.foreign is not None, 15, "the conviction")
            assert states == [False]
            heard_before = await drain(pubsub)
            assert b"POSITION not_here x 0 5" in heard_before
            await until(lambda: link.connected, 10, "the end of the quarantine")
            assert states == [False, True]
            assert link.stats.convictions["unknown-streams"] == 1
            await asyncio.sleep(0.3)
            return await drain(pubsub)
        finally:
            await link.aclose()
            await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]
            await watch.aclose()

    async def drain(pubsub: Any) -> list[bytes]:
        lines = []
        while (message := await pubsub.get_message(timeout=0.05)) is not None:
            if message["type"] == "message":
                lines.append(message["data"])
        return lines

    after = asyncio.run(main())
    assert b"POSITION mine w1 7 7" in after and b"REPLICATE" in after, after
