"""Shared proofs (`streams.proofs`): one elected prober per stream, followers that read its
record, and what happens when the prober is killed, stopped or forged."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from helpers import read_through, wait_until

import streams
from streams import Client
from streams.core.constants import STALE_AFTER, proof_channel
from streams.proofs import MIN_PROOF_GAP, proof_gap
from streams.reader import Reader
from streams.reader_plans import FOLLOWER_CHECK_INTERVAL

pytestmark = pytest.mark.timeout(120)

CHILD = textwrap.dedent(
    """
    import sys, streams
    url, redis_url, prefix, stream = sys.argv[1:5]
    client = streams.connect(url, redis_url=redis_url, prefix=prefix, shared_proofs=True)
    reader = client.reader(stream, start="latest", poll_interval=30.0)
    said = False
    while True:
        reader.poll(timeout=0.1)
        if not said and stream in client._proofs.proving:
            print("PROVING", flush=True)
            said = True
    """
)


@pytest.fixture
def clients(streams_url: str, redis_url: str, redis_prefix: str) -> Iterator[list[Client]]:
    """Four clients on one Redis prefix, each with its own link and prober thread."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                streams.connect(
                    streams_url, redis_url=redis_url, prefix=redis_prefix, shared_proofs=True
                )
            )
            for _ in range(4)
        ]


def self_probes(reader: Reader) -> int:
    return reader.core.counters.probes - reader.core.counters.proof_reads


def test_one_prober_serves_every_reader(clients: list[Client], unique_name: str) -> None:
    *reading, writing = clients
    writing.create_stream(unique_name)
    readers = [c.reader(unique_name, poll_interval=30.0) for c in reading]
    try:
        services = [c._proofs for c in reading]
        assert all(s is not None for s in services)
        wait_until(
            lambda: sum(unique_name in s.proving for s in services if s) == 1,
            10,
            "one prober elected",
        )
        for r in readers:
            r.poll()  # reads the first proof
        with writing.writer(unique_name, instance="w") as writer:
            started = time.monotonic()
            ids = [writer.append({"n": n}).last_id for n in range(40)]
            ids += writer.append_batch([{"b": n} for n in range(20)]).ids
        for r in readers:
            assert read_through(r, ids[-1]) == ids  # every fact once, in order
        # poll_interval is 30 s: the proofs' hints woke them, not the poll.
        assert time.monotonic() - started < 10
        prober = next(i for i, s in enumerate(services) if s and unique_name in s.proving)
        for i, r in enumerate(readers):
            if i != prober:
                assert r.core.counters.proof_reads > 0
                assert self_probes(r) <= 3, "a follower probes for itself only to start"
    finally:
        for r in readers:
            r.close()


def test_held_facts_and_forged_proof_lines_skip_nothing(
    clients: list[Client], streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    *reading, writing = clients
    writing.create_stream(unique_name)
    readers = [c.reader(unique_name, poll_interval=30.0) for c in reading]
    raw = redis.Redis.from_url(redis_url)
    try:
        first = writing.writer(unique_name, instance="first")
        second = writing.writer(unique_name, instance="second")
        before = first.append({"n": 0}).last_id
        for r in readers:
            assert read_through(r, before) == [before]
        with psycopg.connect(streams_url) as conn, first.fact(conn) as held:
            held.add({"held": True})
            after = second.append_batch([{"after": n} for n in range(3)]).ids
            for _ in range(5):  # forged: a prober that does not exist claims a huge position
                raw.publish(redis_prefix, f"POSITION {unique_name} _proof:evil 0 999999")
                time.sleep(0.05)
            for r in readers:
                r.poll(timeout=0.3)
                assert r.position() == before, "nothing past the held fact"
            held_id = held.stream_id
        for r in readers:
            assert read_through(r, after[-1]) == [held_id, *after]
        first.close()
        second.close()
    finally:
        raw.close()
        for r in readers:
            r.close()


def test_a_stopped_then_killed_prober(
    clients: list[Client], streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """SIGSTOP: followers notice within the grace and probe for themselves; SIGKILL: the lock
    goes with the connection and another process becomes the prober."""
    local, writing = clients[0], clients[1]
    writing.create_stream(unique_name)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, streams_url, redis_url, redis_prefix, unique_name],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "PROVING"
        reader = local.reader(unique_name, poll_interval=30.0)
        service = local._proofs
        assert service is not None
        time.sleep(1.0)
        assert unique_name not in service.proving
        writer = writing.writer(unique_name, instance="w")

        def latency() -> float:
            started = time.monotonic()
            token = writer.append({"t": started}).last_id
            read_through(reader, token, timeout=10)
            return time.monotonic() - started

        running = [latency() for _ in range(5)]
        assert reader.core.counters.proof_reads > 0
        os.kill(child.pid, signal.SIGSTOP)
        stopped = [latency() for _ in range(5)]
        # A follower of fresh proofs hears no writer's hint: it notices the stopped prover
        # when the record goes stale (STALE_AFTER) at its next look (FOLLOWER_CHECK_INTERVAL),
        # not after its 30 s poll; from then on it probes itself and hears writers again.
        bound = STALE_AFTER / 1000 + FOLLOWER_CHECK_INTERVAL + 1.0
        assert max(stopped) < bound, stopped
        assert max(stopped[1:]) < 1.5, stopped
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        wait_until(lambda: unique_name in service.proving, 10, "a new prober")
        reads = reader.core.counters.proof_reads
        killed = [latency() for _ in range(5)]
        assert max(killed) < 1.5, killed
        assert reader.core.counters.proof_reads > reads, "the new prober's proofs are followed"
        print(f"latency s: running {running}, stopped {stopped}, after kill {killed}")
        writer.close()
        reader.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(10)


def test_shared_proofs_are_opt_in(
    streams_url: str, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as c:
        assert c.settings.shared_proofs is False
    monkeypatch.setenv("STREAMS_SHARED_PROOFS", "1")
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as c:
        assert c.settings.shared_proofs is True
    monkeypatch.setenv("STREAMS_SHARED_PROOFS", "maybe")
    with pytest.raises(streams.ConfigurationError, match="STREAMS_SHARED_PROOFS"):
        streams.connect(streams_url)


def test_a_proof_row_is_forward_only_and_a_stale_one_is_ignored(
    client: Client, stream: str, streams_url: str
) -> None:
    """Without a prober (no Redis), a reader told to follow proofs finds none or a stale one
    and probes for itself; `prove` never moves a row backwards, except from above the
    stream's sequence (where no prober puts it)."""
    from streams.store.driver import run
    from streams.store.probe import prove
    from streams.store.registry import load_stream

    with client.writer(stream, instance="w") as writer:
        ids = writer.append_batch([{"n": n} for n in range(5)]).ids
    with psycopg.connect(streams_url, autocommit=True) as conn:
        info = run(conn, load_stream(stream))
        assert run(conn, prove([info]))[stream].complete == ids[-1]
        conn.execute(
            "UPDATE streams_proofs SET complete = 2, proven_at = now() - interval '1 hour' "
            "WHERE stream = %s",
            (info.id,),
        )
        reader = client.reader(stream)
        reader.core.following.shared_proofs = True
        reader.core.proven.link_up = True  # as if the Redis link were live
        reader.core.proven.reconcile = True
        got: list[int] = []
        while (epoch := reader.poll()) is not None:
            got += [f.stream_id for f in epoch.facts]
        assert got == list(ids), "a stale proof is not followed"
        assert reader.core.counters.proof_reads == 0
        run(conn, prove([info]))
        row: Any = conn.execute(
            "SELECT complete FROM streams_proofs WHERE stream = %s", (info.id,)
        ).fetchone()
        assert row[0] == ids[-1]
        # Within the possible, never backwards: a fact pending in an open transaction holds
        # the prober's complete below an ID already allocated, which the row says.
        with (
            psycopg.connect(streams_url, autocommit=False) as pending,
            client.writer(stream, instance="p") as other,
        ):
            pending.execute("SELECT 1")  # in a transaction: the fact joins it, left open
            with other.fact(pending) as fact:
                fact.add({"n": "pending"})
            conn.execute(
                "UPDATE streams_proofs SET complete = %s WHERE stream = %s",
                (fact.stream_id, info.id),
            )
            assert run(conn, prove([info]))[stream].complete == ids[-1]
            row = conn.execute(
                "SELECT complete FROM streams_proofs WHERE stream = %s", (info.id,)
            ).fetchone()
            assert row[0] == fact.stream_id, "GREATEST: never backwards"
            pending.rollback()
        # Beyond max allocated (issue 29): no prober wrote it, so the next proof replaces it.
        conn.execute("UPDATE streams_proofs SET complete = %s WHERE stream = %s", (2**62, info.id))
        run(conn, prove([info]))
        row = conn.execute(
            "SELECT complete FROM streams_proofs WHERE stream = %s", (info.id,)
        ).fetchone()
        assert row[0] == fact.stream_id, "a row above the sequence is replaced"
        reader.close()


def test_fanout_bench_small_run(streams_url: str, redis_url: str) -> None:
    """The benchmark command end to end, tiny: every reader process gets every fact."""
    import json

    from click.testing import CliRunner

    from streams.bench.fanout import bench_fanout_command

    args = ["--database-url", streams_url, "--redis-url", redis_url, "--seconds", "0.5"]
    out = CliRunner().invoke(
        bench_fanout_command, [*args, "--readers", "2", "--rate", "100", "--json"]
    )
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    points = {p["mode"]: p for p in result["points"]}
    assert set(points) == {"redis", "shared", "own"}
    for mode in ("shared", "own"):
        assert points[mode]["delivered_min"] == points[mode]["delivered_expected"] > 0
    bad = CliRunner().invoke(bench_fanout_command, [*args, "--modes", "everyone"])
    assert bad.exit_code == 2 and "--modes" in bad.output


def test_a_prover_signs_no_range_retention_may_have_cut(
    client: Client, stream: str, streams_url: str
) -> None:
    """The prover reads the rows it signs as every read does, with the retention check after
    them: a range that starts below what retention removed is not signed (a reader would
    otherwise deliver it with facts missing, instead of raising FactsPruned)."""
    from streams.store.driver import run
    from streams.store.probe import READER_SESSION_SETUP
    from streams.store.reads import prove_with_rows
    from streams.store.registry import load_streams

    with client.writer(stream, instance="w") as writer:
        ids = [writer.append({"n": n}).last_id for n in range(6)]
    client.set_retention(stream, 1)
    time.sleep(0.05)
    pruned = client.prune(stream).after
    assert pruned >= ids[0]
    with psycopg.connect(streams_url, autocommit=True) as conn:
        for statement in READER_SESSION_SETUP:
            conn.execute(statement)
        (info,) = run(conn, load_streams([stream]))
        probes, rows = run(conn, prove_with_rows([info], {stream: pruned - 1}, 100))
        assert probes[stream].complete >= ids[-1] and stream not in rows
        _, rows = run(conn, prove_with_rows([info], {stream: pruned}, 100))
        assert [r[0] for r in rows[stream]] == [i for i in ids if i > pruned]


def test_proofs_are_spaced_by_the_number_of_followers(
    clients: list[Client], unique_name: str, redis_url: str, redis_prefix: str
) -> None:
    """Every proof line wakes every follower process: the prover counts them (``PUBSUB
    NUMSUB`` of the proof channel) and spaces its proofs so that they receive about
    `FOLLOWER_LINES_PER_SECOND` lines together (`streams.proofs.proof_gap`)."""
    *reading, writing = clients
    writing.create_stream(unique_name)
    readers = [c.reader(unique_name, poll_interval=30.0) for c in reading]
    # 60 more subscribers of the proof channel, standing in for 60 more follower processes.
    extra = redis.Redis.from_url(redis_url)
    listeners = [extra.pubsub() for _ in range(60)]  # type: ignore[no-untyped-call,unused-ignore]
    try:
        for listener in listeners:
            listener.subscribe(proof_channel(redis_prefix, unique_name))
        services = [c._proofs for c in reading]
        wait_until(
            lambda: sum(unique_name in s.proving for s in services if s) == 1, 10, "a prober"
        )
        prover = next(s for s in services if s and unique_name in s.proving)
        want = proof_gap(63)
        assert want > 0.035
        with writing.writer(unique_name, instance="w") as writer:
            writer.append({"n": -1})
            wait_until(lambda: prover._gap == want, 10, "the followers counted")
            before, started = prover.proofs, time.monotonic()
            ids = [writer.append({"n": n}).last_id for n in range(300)]
            elapsed = time.monotonic() - started
            proofs = prover.proofs - before
        # One proof per gap at most while hints flood in (plus a refresh a second); with the
        # 5 ms gap of few followers the same appends gave many more.
        assert proofs <= elapsed / want + elapsed + 2, (proofs, elapsed)
        for r in readers:
            assert read_through(r, ids[-1])[-300:] == ids  # every fact once, in order
    finally:
        for listener in listeners:
            listener.close()
        extra.close()
        for r in readers:
            r.close()


@pytest.mark.parametrize(
    ("followers", "gap"), [(0, MIN_PROOF_GAP), (8, MIN_PROOF_GAP), (32, 0.02), (10_000, 0.05)]
)
def test_proof_gap(followers: int, gap: float) -> None:
    assert proof_gap(followers) == pytest.approx(gap)
