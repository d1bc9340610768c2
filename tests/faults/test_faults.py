"""Fault injection against real PostgreSQL and Redis: Redis is only ever a wake-up.

Readers must deliver exactly the committed facts, in stream-ID order, whatever happens on the
replication channel: forged and malformed commands, a Redis server that dies and comes back, a
subscriber that loses half its messages, no Redis at all. Readers and writers killed with
SIGKILL must not lose or pin anything either: a reader group resumes right after its committed
position, and a writer's reserved-but-uncommitted ID stops holding readers back once its
connection is gone.

Every reader here is driven by a `Follower`, which checks after every poll that the reader's
position never passes a fact it has not delivered: the facts it delivered are exactly the
stored facts up to its position, in order, and the position is at most the linear position
PostgreSQL proves (`Client.positions`).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from pathlib import Path

import psycopg
import pytest
import redis
from faultkit import Appender, Child, Follower, RestartableRedis, link_of, stored_ids
from helpers import wait_until
from servers import new_redis_prefix

import streams
from streams import Client
from streams.core.protocol import MAX_LINE_BYTES, PositionCommand, RdataCommand, parse

LOCALHOST = "127.0.0.1"


# ---------------------------------------------------------------------------- 1. forged commands


def _malformed_lines(stream: str) -> list[bytes]:
    s = stream.encode()
    return [
        b"!!garbage!! \x00\x01\x02 ~~~",
        bytes(range(256)),  # control bytes, a newline and invalid UTF-8
        b"POSITION " + s + b" ghost 0 \xff\xfe",  # invalid UTF-8
        b"RDATA " + s + b' ghost 5 "' + b"x" * MAX_LINE_BYTES + b'"',  # > 1 MiB
        b"RDATA " + s + b' ghost 5 {"first":NaN,"count":1,"ts":0}',
        b"RDATA " + s + b' ghost 5 {"first":Infinity}',
        b"RDATA " + s + b' ghost 5 {"first":1e400}',
        b"RDATA " + s + b" ghost 5 " + b"[" * 100_000 + b"]" * 100_000,  # nested too deeply
        b"RDATA " + s + b" ghost 5 {",
        b"RDATA " + s + b" ghost 5",  # missing the row
        b"POSITION " + s + b" ghost 5",  # missing a token
        b"POSITION",
        b"POSITION " + s + b" ghost 0 5\nPOSITION " + s + b" ghost 0 6",  # newline inside
        b"POSITION " + s + b" ghost 0 5\r",
        b"POSITION " + s + b" gh\x07ost 0 5",  # control character in a name
        b"POSITION " + s + b" ghost 0 0005",  # non-canonical token
        b"POSITION " + s + b" ghost 0 -5",
        b"POSITION " + s + b" ghost 0 9223372036854775808",  # beyond bigint
        b"POSITION " + s + b" ghost 0 batch",
        b"REPLICATE now",
        b"FROB " + s,
        b"",
    ]


def test_forged_and_malformed_commands_move_nothing(
    streams_url: str, stream: str, redis_url: str, redis_prefix: str
) -> None:
    with contextlib.ExitStack() as stack:
        rc = stack.enter_context(
            streams.connect(
                streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=1.0
            )
        )
        # The holder keeps a fact open for a while: a long lease, so the server does not abort
        # its idle transaction; no Redis, so the reader only hears about it from PostgreSQL.
        hc = stack.enter_context(streams.connect(streams_url, lease_seconds=10.0))
        local = stack.enter_context(rc.writer(stream, instance="local-w"))
        holder = stack.enter_context(hc.writer(stream, instance="holder"))
        link = link_of(rc)
        pub = redis.Redis.from_url(redis_url)
        stack.callback(pub.close)
        watch = pub.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
        stack.callback(watch.close)
        watch.subscribe(redis_prefix)
        reader = stack.enter_context(rc.reader(stream, poll_interval=0.05))
        follower = stack.enter_context(Follower(reader, hc, streams_url))
        wait_until(lambda: link.connected, 15, "the reader's Redis link")

        first = local.append({"n": "local"}).last_id
        second = holder.append({"n": "holder"}).last_id
        follower.pump_until(
            lambda: reader.live and follower.position >= max(first, second), 15, "caught up, live"
        )
        stats = link.core.stats
        malformed_before = stats.malformed

        with psycopg.connect(streams_url) as hconn, holder.fact(hconn) as held:
            held.add({"n": "held"})
            held_id = held.stream_id
            later = local.append({"n": "after the held fact"}).last_id
            assert later > held_id
            # Nothing of local-w is pending and nobody allocates after it: its position is its
            # last ID, and must stay there whatever the channel says.
            assert local.position == later
            s = stream
            forged = [
                f"POSITION {s} ghost 0 1000000",
                f'RDATA {s} ghost 999999 {{"first":999999,"count":1,"ts":0}}',
                f'RDATA {s} ghost batch {{"first":999998,"count":2,"ts":0}}',
                f"POSITION {s} ghost 0 {2**63 - 1}",
                f"POSITION {s} ghost 1000000 3",
                # The reserved-but-uncommitted ID, announced as if committed:
                f'RDATA {s} holder {held_id} {{"first":{held_id},"count":1,"ts":0}}',
                f"POSITION {s} holder {held_id} {held_id + 50}",
                # The reader's own process's writer, forged by another publisher:
                f"POSITION {s} local-w 0 1000000",
                f'RDATA {s} local-w 1000001 {{"first":1000001,"count":1,"ts":0}}',
                # (A POSITION for a stream this database does not know is evidence of another
                # deployment on the channel: the link goes quiet; tests/test_synapse.py.)
                "REPLICATE",
            ]
            forged_bytes = [line.encode() for line in forged]
            malformed = _malformed_lines(stream)
            for line in [*forged_bytes, *malformed]:  # a malformed line last: see the wait below
                assert pub.publish(redis_prefix, line) >= 1, "nobody listens on the channel"
            # One publisher's messages arrive in order: once the last malformed line is
            # counted, every forged line has been handled too.
            wait_until(
                lambda: stats.malformed >= malformed_before + len(malformed),
                15,
                "the malformed lines to arrive",
            )
            assert stats.malformed == malformed_before + len(malformed)
            for line in forged_bytes[7:9]:  # the forged local-w lines are echoes: no hint
                assert link.core.on_message(line, time.monotonic()) == ([], []), line
            assert local.position == later

            follower.pump_for(1.0)
            assert follower.position < held_id, "the reader passed an uncommitted ID"
            assert later not in follower.delivered
            for token, instance in [(held_id, "holder"), (1000000, "ghost"), (1000000, "local-w")]:
                with pytest.raises(streams.WaitTimeout):
                    reader.wait_for_position(stream, token, instance, timeout=0.3)
            assert link.connected

        # The held fact committed: it and the fact behind it arrive, nothing invented.
        follower.pump_until(lambda: follower.position >= later, 15, "the held fact")
        assert held_id in follower.delivered
        # The link's thread survived it all: a real message from another publisher is heard.
        received = stats.received
        pub.publish(redis_prefix, f"POSITION {stream} ghost 0 1")
        wait_until(lambda: stats.received > received, 15, "the link to hear a valid line")
        assert link.connected
        # And the reader keeps working.
        last = holder.append({"n": "afterwards"}).last_id
        follower.pump_until(lambda: follower.position >= last, 15, "a fact after the forgeries")
        assert follower.delivered == follower.all_stored()
        assert not {999998, 999999, 1000000, 1000001} & set(follower.delivered)

        # The writer in the reader's process ignored the forged POSITION naming it: neither its
        # own position nor the one it persisted nor anything it announced jumped.
        wait_until(
            lambda: hc.positions(stream).writers["local-w"].position >= local.position,
            15,
            "local-w to persist its position",
        )
        positions = hc.positions(stream)
        assert local.position <= positions.max_allocated < 1000
        assert positions.writers["local-w"].position <= positions.max_allocated
        announced = []
        deadline = time.monotonic() + 2.0  # local-w keeps announcing every lease / 4
        while (message := watch.get_message(timeout=0.2)) is not None:
            if time.monotonic() > deadline:
                break
            data = message.get("data")
            if message.get("type") != "message" or data in forged_bytes:
                continue
            with contextlib.suppress(ValueError):
                cmd = parse(data)
                if isinstance(cmd, PositionCommand) and cmd.instance_name == "local-w":
                    announced.append(cmd.new_token)
                elif isinstance(cmd, RdataCommand) and cmd.instance_name == "local-w":
                    announced.append(cmd.token or 0)
        assert announced, "local-w announced nothing"
        assert max(announced) <= positions.max_allocated, announced


# ---------------------------------------------------------------------------- 2. Redis restarts


def test_redis_restart_mid_stream_converges(
    streams_url: str, unique_name: str, tmp_path: Path
) -> None:
    server = RestartableRedis(tmp_path)
    with contextlib.ExitStack() as stack:
        stack.callback(server.close)
        server.start(first=True)
        prefix = new_redis_prefix()
        wc = stack.enter_context(
            streams.connect(streams_url, redis_url=server.url, prefix=prefix, lease_seconds=1.0)
        )
        rc = stack.enter_context(
            streams.connect(streams_url, redis_url=server.url, prefix=prefix, lease_seconds=1.0)
        )
        rc.create_stream(unique_name)
        writer = stack.enter_context(wc.writer(unique_name, instance="steady"))
        reader = stack.enter_context(rc.reader(unique_name))  # default poll intervals
        follower = stack.enter_context(Follower(reader, rc, streams_url))
        rlink, wlink = link_of(rc), link_of(wc)
        appender = Appender(writer, pace=0.005)
        appender.start()
        stack.callback(appender.stop)

        follower.pump_until(
            lambda: reader.live and wlink.connected and len(follower.delivered) >= 20,
            15,
            "a live reader under load",
        )
        server.kill()
        follower.pump_until(lambda: not reader.live, 15, "the reader to notice Redis is gone")
        acked, delivered = len(appender.acked), len(follower.delivered)
        follower.pump_for(1.0, poll=0.5)  # the reader's own (fallback) polling
        assert not appender.errors, appender.errors[:3]
        assert len(appender.acked) >= acked + 5, "writes stalled while Redis was down"
        assert len(follower.delivered) > delivered, "the reader did not poll PostgreSQL"
        assert not rlink.connected

        hints = rlink.core.stats.hints
        server.start()
        # Links back off (capped at 5 s) and reconnect; the reader is live only once a probe
        # after the reconnect has re-established it.
        wait_until(lambda: rlink.connected, 20, "the reader's link to reconnect")
        assert not reader.live, "live again before any probe since the reconnect"
        follower.pump_until(lambda: reader.live, 20, "the reader to be live again", poll=0.5)
        wait_until(lambda: wlink.connected, 20, "the writer's link to reconnect")
        follower.pump_until(
            lambda: rlink.core.stats.hints > hints, 15, "hints over the restarted Redis"
        )
        assert rlink.core.stats.reconnects >= 1 and wlink.core.stats.reconnects >= 1
        runs = [
            v for i, v in enumerate(follower.live_seen) if i == 0 or follower.live_seen[i - 1] != v
        ]
        assert runs[-3:] == [True, False, True], runs

        appender.stop()
        assert not appender.errors, appender.errors[:3]
        follower.pump_until(
            lambda: follower.position >= appender.acked[-1], 15, "the last committed fact"
        )
        assert follower.delivered == appender.acked == follower.all_stored()


# ---------------------------------------------------------------------------- 3. lost messages


def test_reader_with_a_lossy_subscriber_misses_nothing(
    streams_url: str, stream: str, redis_url: str, redis_prefix: str
) -> None:
    with contextlib.ExitStack() as stack:
        wc = stack.enter_context(
            streams.connect(
                streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=1.0
            )
        )
        rc = stack.enter_context(
            streams.connect(
                streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=1.0
            )
        )
        rng = random.Random(20240613)
        counts = {"dropped": 0, "kept": 0}
        loss = [0.5]

        def discard(data: bytes) -> bool:
            drop = rng.random() < loss[0]
            counts["dropped" if drop else "kept"] += 1
            return drop

        rlink = link_of(rc)
        rlink.core.discard = discard
        writer = stack.enter_context(wc.writer(stream, instance="paced"))
        reader = stack.enter_context(rc.reader(stream, poll_interval=0.25))
        follower = stack.enter_context(Follower(reader, rc, streams_url))
        wait_until(lambda: rlink.connected and link_of(wc).connected, 15, "both Redis links")

        appender = Appender(writer, pace=0.004, limit=300)
        appender.start()
        stack.callback(appender.stop)
        follower.pump_until(
            lambda: not appender.is_alive() and follower.position >= appender.acked[-1],
            45,
            "all 300 facts",
            poll=1.0,  # woken by the hints that got through, else by its 0.25 s timer
        )
        assert not appender.errors, appender.errors[:3]
        assert len(appender.acked) == 300
        assert follower.delivered == appender.acked == follower.all_stored()
        assert counts["dropped"] >= 20 and counts["kept"] >= 20, counts
        assert rlink.core.stats.hints > 0

        # Then every message is lost while the link stays up (so the reader believes it is
        # live): its own timer alone must still bring every fact.
        loss[0] = 1.0
        kept = counts["kept"]
        more = Appender(writer, pace=0.01, limit=30)
        more.start()
        stack.callback(more.stop)
        follower.pump_until(
            lambda: not more.is_alive() and follower.position >= more.acked[-1],
            30,
            "30 facts without any hint",
            poll=5.0,
        )
        assert not more.errors, more.errors[:3]
        assert counts["kept"] == kept and reader.live
        assert follower.delivered == appender.acked + more.acked == follower.all_stored()


# ---------------------------------------------------------------------------- 4. reader killed

READER_CHILD = """
    import sys, time, streams
    url, stream, group = sys.argv[1:4]
    client = streams.connect(url)
    reader = client.reader(stream, group=group, page_size=7, poll_interval=0.05)
    print("START", reader.position(), flush=True)
    while True:
        epoch = reader.poll(timeout=1.0)
        if epoch is None:
            continue
        print("FACTS", *[fact.stream_id for fact in epoch.facts], flush=True)
        print("COMMITTED", reader.commit()[stream], flush=True)
        time.sleep(0.01)
"""


def test_group_reader_killed_resumes_after_its_commit(
    client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    group = "faulty-group"
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(client.writer(stream, instance="feeder"))
        writer.append_batch([{"n": i} for i in range(200)])
        appender = Appender(writer, pace=0.01)
        appender.start()
        stack.callback(appender.stop)
        child = Child(READER_CHILD, [streams_url, stream, group], tmp_path / "reader.err")
        stack.callback(child.close)

        assert child.next_line() == "START 0"
        seen: list[int] = []
        commits: list[int] = []

        def take(line: str) -> None:
            kind, *values = line.split()
            if kind == "FACTS":
                seen.extend(int(v) for v in values)
            elif kind == "COMMITTED":
                commits.append(int(values[0]))

        while len(commits) < 8:
            take(child.next_line())
        child.kill()  # mid-stream: between any two of its statements
        for line in child.remaining_lines():
            take(line)
        appender.stop()
        assert not appender.errors, appender.errors[:3]

        committed = {g.group: g.position for g in client.groups(stream)}[group]
        assert seen == sorted(set(seen)), "the child delivered out of order or twice"
        assert committed >= commits[-1], "the committed position went backwards"
        # It commits only what it printed, so everything up to the commit was delivered.
        with psycopg.connect(streams_url, autocommit=True) as conn:
            key = client.stream(stream).id
            assert set(stored_ids(conn, key, 0, committed)) <= set(seen)
            everything = stored_ids(conn, key)
        assert set(seen) <= set(everything), "the child delivered an invented fact"
        assert committed < everything[-1], "the child finished before it was killed"

        resumed = stack.enter_context(
            client.reader(stream, group=group, page_size=7, poll_interval=0.05)
        )
        assert resumed.position() == committed, "the group did not resume at its commit"
        follower = stack.enter_context(Follower(resumed, client, streams_url))
        follower.pump_until(lambda: follower.position >= everything[-1], 30, "the resumed reader")
        owed = [i for i in everything if i > committed]
        assert follower.delivered == owed, "the resumed reader skipped or repeated facts"
        assert follower.delivered[0] == min(i for i in everything if i > committed)
        assert set(seen) | set(follower.delivered) == set(everything)
        assert resumed.commit()[stream] == resumed.position()


# ---------------------------------------------------------------------------- 5. writer killed

WRITER_CHILD = """
    import sys, time, psycopg, streams
    url, stream, redis_url, prefix, lease = sys.argv[1:6]
    client = streams.connect(url, redis_url=redis_url, prefix=prefix, lease_seconds=float(lease))
    writer = client.writer(stream, instance="doomed")
    print("BEFORE", writer.append({"doomed": "committed"}).last_id, flush=True)
    conn = psycopg.connect(url)
    with writer.fact(conn) as fact:
        fact.add({"doomed": "held"})
        print("HOLDING", fact.stream_id, flush=True)
        time.sleep(3600)
"""


@pytest.mark.parametrize(
    "child_lease",
    [
        1.0,
        # The server would abort the idle transaction only after 30 s: passing it sooner
        # shows the dead connection itself released the reservation.
        30.0,
    ],
)
def test_reader_passes_a_writer_killed_mid_transaction(
    streams_url: str,
    stream: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    child_lease: float,
) -> None:
    with contextlib.ExitStack() as stack:
        rc = stack.enter_context(
            streams.connect(
                streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=1.0
            )
        )
        sc = stack.enter_context(
            streams.connect(
                streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=1.0
            )
        )
        survivor = stack.enter_context(sc.writer(stream, instance="survivor"))
        reader = stack.enter_context(rc.reader(stream))
        follower = stack.enter_context(Follower(reader, rc, streams_url))
        survivor.append({"n": "first"})
        child = Child(
            WRITER_CHILD,
            [streams_url, stream, redis_url, redis_prefix, str(child_lease)],
            tmp_path / "writer.err",
        )
        stack.callback(child.close)
        before = int(child.next_line().split()[1])
        line = child.next_line()
        holding_at = time.monotonic()
        assert line.startswith("HOLDING"), line
        held = int(line.split()[1])
        ours = [survivor.append({"n": "while held"}).last_id]
        follower.pump_until(lambda: follower.position >= before, 15, "the child's committed fact")
        follower.pump_for(0.2)
        # With a 1 s lease the server itself aborts the idle transaction after 1 s: only
        # check the pin while that cannot have happened yet.
        if child_lease > 5 or time.monotonic() - holding_at < 0.8:
            assert follower.position < held, "the reader passed a reserved, uncommitted ID"

        child.kill()
        killed_at = time.monotonic()
        while follower.position <= held:
            assert time.monotonic() - killed_at < 15, "the reader never passed the dead ID"
            ours.append(survivor.append({"n": "after the kill"}).last_id)
            follower.poll(0.02)
        passed_after = time.monotonic() - killed_at
        assert passed_after < 5.0, passed_after

        ours.append(survivor.append({"n": "last"}).last_id)
        follower.pump_until(lambda: follower.position >= ours[-1], 15, "the survivor's facts")
        assert held not in follower.delivered
        assert held not in follower.all_stored()
        assert set(ours) <= set(follower.delivered)
        assert follower.delivered == follower.all_stored()


# ---------------------------------------------------------------------------- 6. no Redis at all


def test_reader_with_the_link_down_polls_postgres(
    client: Client, stream: str, streams_url: str
) -> None:
    with contextlib.ExitStack() as stack:
        # A bound socket that does not listen: connections to it are refused for as long as
        # the test holds it.
        closed = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        closed.bind((LOCALHOST, 0))
        port = closed.getsockname()[1]
        dc = stack.enter_context(
            streams.connect(
                streams_url,
                redis_url=f"redis://{LOCALHOST}:{port}/0",
                prefix=new_redis_prefix(),
                lease_seconds=1.0,
            )
        )
        local = stack.enter_context(dc.writer(stream, instance="offline"))  # writes still work
        remote = stack.enter_context(client.writer(stream, instance="elsewhere"))
        reader = stack.enter_context(dc.reader(stream))  # default poll intervals
        follower = stack.enter_context(Follower(reader, client, streams_url))
        link = link_of(dc)

        ids = [local.append({"n": i}).last_id for i in range(10)]
        ids += remote.append_batch([{"n": i} for i in range(10)]).ids
        follower.pump_until(lambda: follower.position >= max(ids), 15, "the first facts")
        wait_until(lambda: link.core.stats.reconnects >= 1, 15, "the link to try Redis")
        # Nothing in this process hears of the other writer's facts (the local writer, whose
        # heartbeat would announce the rising max allocated to local readers, is closed):
        # only polling finds them, at the fast fallback interval since the link is down.
        local.close()
        latencies = []
        for i in range(10):
            # Append while the reader is waiting inside `poll` (which probes once on entry).
            committed_at: list[tuple[int, float]] = []

            def append_later(i: int = i, done: list[tuple[int, float]] = committed_at) -> None:
                done.append((remote.append({"m": i}).last_id, time.monotonic()))

            timer = threading.Timer(0.05 + 0.02 * i, append_later)
            timer.start()
            epoch = reader.poll(timeout=10.0)
            seen_at = time.monotonic()
            timer.join()
            assert epoch is not None, "a remote fact was not found within 10 s"
            follower.delivered.extend(fact.stream_id for fact in epoch.facts)
            follower.check()
            assert [fact.stream_id for fact in epoch.facts] == [committed_at[0][0]]
            latencies.append(seen_at - committed_at[0][1])
        assert sum(latencies) / len(latencies) < 0.3, latencies
        probes = reader.core.counters.probes
        assert reader.poll(timeout=1.0) is None
        assert reader.core.counters.probes - probes >= 4, "not polling at the fallback interval"
        assert not reader.live and not link.connected
        assert not any(follower.live_seen)
        assert follower.delivered == follower.all_stored()
