"""Network partitions between each role and its server (writers: `test_stalls`; Spark:
``tests/spark/test_spark_outages.py``).

A `proxy.Proxy` sits between one role and its server and freezes (stops forwarding, closes
nothing: what a partition looks like) or cuts (resets) the connections, while a writer appends
at a steady pace:

* a reader, or a reader group, cut off from PostgreSQL waits while frozen, reconnects after a
  cut, and delivers each fact exactly once, in order; the group's commit lands;
* the elected prover cut off from PostgreSQL is replaced by another process within about
  twice the proofs' staleness limit, and readers keep being served meanwhile;
* every process cut off from Redis loses only latency: appends go on at their pace, readers
  deliver from PostgreSQL, and the fast path comes back afterwards.

`faultkit.Follower` checks after every poll that nothing was lost, duplicated, reordered or
invented, and that no reader passes the linear position PostgreSQL proves.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
from faultkit import Appender, Follower, link_of
from helpers import wait_until
from proxy import Proxy
from servers import new_redis_prefix

import streams
from streams.core.constants import STALE_AFTER
from streams.proofs import ProofService
from streams.store.probe import REPLACE_PROVER_AFTER

LEASE = 5.0


@pytest.mark.parametrize("group", [None, "g"])
@pytest.mark.parametrize("fault", ["freeze", "cut"])
def test_a_reader_cut_off_from_postgres_resumes_exactly_once(
    streams_url: str, unique_name: str, fault: str, group: str | None
) -> None:
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(Proxy.for_url(streams_url))
        wc = stack.enter_context(streams.connect(streams_url, lease_seconds=LEASE))
        rc = stack.enter_context(streams.connect(proxy.url(streams_url), lease_seconds=LEASE))
        wc.create_stream(unique_name)
        appender = Appender(stack.enter_context(wc.writer(unique_name)), pace=0.005)
        appender.start()
        stack.callback(appender.stop)
        reader = stack.enter_context(rc.reader(unique_name, group=group, poll_interval=0.05))
        follower = stack.enter_context(Follower(reader, wc, streams_url, tolerate_lost=True))
        follower.pump_until(lambda: len(follower.delivered) >= 20, 30, "a reader under load")

        for _ in range(3):
            if fault == "freeze":
                proxy.freeze()
                thaw = threading.Timer(1.5, proxy.thaw)
                thaw.start()
                follower.pump_for(2.0, poll=0.2)  # a poll waits out the partition
                thaw.join()
            else:
                proxy.cut()
                follower.pump_for(0.3)
            if group is not None:
                reader.commit()  # lands, whatever the connection went through
            follower.pump_for(0.1)
            target = follower.position + 10
            follower.pump_until(lambda: follower.position > target, 15, "facts again")  # noqa: B023
        if fault == "freeze":
            assert follower.longest_poll >= 1.0, "the partition never held the reader"
        else:
            assert proxy.connections > 1, "the reader never reconnected"

        appender.stop()
        assert not appender.errors, appender.errors[:3]
        last = appender.acked[-1]
        follower.pump_until(lambda: follower.position >= last, 30, "the last acked fact")
        assert follower.delivered == follower.all_stored()
        assert set(appender.acked) <= set(follower.delivered)
        print(
            f"reader {fault} (group={group}): longest poll {follower.longest_poll:.2f}s, "
            f"{len(follower.delivered)} facts exactly once, {proxy.connections} connections"
        )
        if group is not None:
            reader.commit()
            with wc.reader(unique_name, group=group) as again:
                assert again.position() == reader.position()  # resumes after the commit


def test_a_prover_cut_off_from_postgres_is_replaced(
    streams_url: str, unique_name: str, redis_url: str
) -> None:
    """Two processes read one stream with shared proofs; the first, the elected prover, is
    partitioned from PostgreSQL. Its readers' proof record goes stale, the other process's
    reader probes by itself meanwhile, and after `REPLACE_PROVER_AFTER` the other process
    ends the frozen prover's session and takes over proving."""
    prefix = new_redis_prefix()
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(Proxy.for_url(streams_url))
        options: dict[str, Any] = {"redis_url": redis_url, "prefix": prefix, "lease_seconds": LEASE}
        wc = stack.enter_context(streams.connect(streams_url, **options))
        first = stack.enter_context(streams.connect(proxy.url(streams_url), **options))
        second = stack.enter_context(streams.connect(streams_url, **options))
        wc.create_stream(unique_name)
        appender = Appender(stack.enter_context(wc.writer(unique_name)), pace=0.01)
        appender.start()
        stack.callback(appender.stop)

        first_reader = stack.enter_context(first.reader(unique_name, shared_proofs=True))
        first_follower = stack.enter_context(
            Follower(first_reader, wc, streams_url, tolerate_lost=True)
        )
        first_follower.pump_until(
            lambda: unique_name in proofs_of(first).proving and len(first_follower.delivered) > 5,
            30,
            "the first process to prove",
        )
        second_reader = stack.enter_context(second.reader(unique_name, shared_proofs=True))
        second_follower = stack.enter_context(Follower(second_reader, wc, streams_url))
        second_follower.pump_for(1.0)
        assert unique_name not in proofs_of(second).proving

        proxy.freeze()
        frozen_at = time.monotonic()
        delivered = len(second_follower.delivered)
        second_follower.pump_until(
            lambda: unique_name in proofs_of(second).proving, 30, "the second process to prove"
        )
        took = time.monotonic() - frozen_at
        assert len(second_follower.delivered) > delivered, "the reader stalled meanwhile"
        bound = REPLACE_PROVER_AFTER / 1000 + 5.0
        assert took <= bound, f"replaced after {took:.1f}s (bound {bound}s)"
        print(f"the partitioned prover was replaced after {took:.2f}s (stale: {STALE_AFTER} ms)")

        proxy.thaw()
        proofs = proofs_of(second).proofs
        appender.stop()
        assert not appender.errors, appender.errors[:3]
        last = appender.acked[-1]
        for follower in (first_follower, second_follower):
            caught_up(follower, last)
        wait_until(lambda: proofs_of(second).proofs > proofs, 10, "the second to go on proving")
        wait_until(
            lambda: unique_name not in proofs_of(first).proving, 10, "the first to know it lost"
        )


def caught_up(follower: Follower, last: int) -> None:
    follower.pump_until(lambda: follower.position >= last, 30, "the last fact", poll=0.5)
    assert follower.delivered == follower.all_stored()


def proofs_of(client: streams.Client) -> ProofService:
    service = client._proofs
    assert service is not None, "no reader with shared proofs in this client"
    return service


@pytest.mark.parametrize("fault", ["freeze", "cut"])
def test_every_process_cut_off_from_redis_loses_only_latency(
    streams_url: str, unique_name: str, redis_url: str, fault: str
) -> None:
    prefix = new_redis_prefix()
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(Proxy.for_url(redis_url))
        options: dict[str, Any] = {
            "redis_url": proxy.url(redis_url),
            "prefix": prefix,
            "lease_seconds": LEASE,
        }
        wc = stack.enter_context(streams.connect(streams_url, **options))
        rc = stack.enter_context(streams.connect(streams_url, **options))
        wc.create_stream(unique_name)
        appender = Appender(stack.enter_context(wc.writer(unique_name)), pace=0.005)
        appender.start()
        stack.callback(appender.stop)
        reader = stack.enter_context(rc.reader(unique_name, shared_proofs=True))
        follower = stack.enter_context(Follower(reader, rc, streams_url))
        rlink = link_of(rc)
        follower.pump_until(
            lambda: reader.live and len(follower.delivered) >= 20, 30, "a live reader"
        )
        hints = rlink.core.stats.hints

        if fault == "freeze":
            proxy.freeze()
        else:
            proxy.cut()
            proxy.freeze()  # and stays unreachable for a while
        acked, delivered = len(appender.acked), len(follower.delivered)
        appender.longest = 0.0  # from here on
        follower.pump_for(4.0, poll=0.5)
        slowest = appender.longest
        assert len(appender.acked) > acked + 100, "appends slowed down without Redis"
        assert slowest < 1.0, f"an append waited {slowest:.2f}s for Redis"
        assert len(follower.delivered) > delivered + 100, "the reader stopped without Redis"
        proxy.thaw()

        follower.pump_until(
            lambda: reader.live and rlink.core.stats.hints > hints + 10,
            30,
            "the fast path to come back",
            poll=0.5,
        )
        appender.stop()
        assert not appender.errors, appender.errors[:3]
        last = appender.acked[-1]
        follower.pump_until(lambda: follower.position >= last, 30, "the last fact", poll=0.5)
        assert follower.delivered == follower.all_stored()
        print(
            f"Redis {fault}: the slowest append took {slowest * 1000:.1f} ms; "
            f"{len(follower.delivered)} facts exactly once"
        )
