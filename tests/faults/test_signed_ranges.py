"""Readers that take facts from Redis (signed ranges, `streams.core.signing`) under attack.

A party with access to Redis alone forges, replays, reorders, truncates, duplicates, alters,
moves to another stream and drops the prober's lines, replays lines signed with a retired key,
and announces proofs beyond the truth, on several streams, while writers append; the readers
of two processes (one of them the prober, the other a follower) must end with exactly the
facts a reader without Redis sees: same IDs, rows, payloads, timestamps and writers, in order,
each once. And they must have used Redis (the attacks make them slower, never wrong)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
import redis
from faultkit import Attacker
from helpers import wait_until

import streams
from streams import Client
from streams.bench.common import drop_streams
from streams.core.constants import proof_channel
from streams.core.epochs import Fact
from streams.reader import Reader

pytestmark = pytest.mark.timeout(180)


def _facts_of(reader: Reader, through: dict[str, int], timeout: float = 60.0) -> list[Fact]:
    got: list[Fact] = []
    deadline = time.monotonic() + timeout
    while any(reader.position(s) < p for s, p in through.items()):
        assert time.monotonic() < deadline, {s: reader.position(s) for s in through}
        epoch = reader.poll(timeout=0.5)
        if epoch is not None:
            got += epoch.facts
    return got


class Follow(threading.Thread):
    """Polls a reader live (as a service does) until `finish` gives the positions to reach."""

    def __init__(self, reader: Reader) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.got: list[Fact] = []
        self.through: dict[str, int] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.through is None:
                epoch = self.reader.poll(timeout=0.2)
                if epoch is not None:
                    self.got += epoch.facts
            self.got += _facts_of(self.reader, self.through)
        except BaseException as exc:  # reported by `finish`
            self.error = exc

    def finish(self, through: dict[str, int]) -> list[Fact]:
        self.through = through
        self.join(90)
        assert not self.is_alive() and self.error is None, self.error
        return self.got


@pytest.fixture
def names(unique_name: str) -> list[str]:
    return [f"{unique_name}_a", f"{unique_name}_b"]


@pytest.fixture(params=["shared", "own"])
def clients(
    request: pytest.FixtureRequest, streams_url: str, redis_url: str, redis_prefix: str
) -> Iterator[list[Client]]:
    """Two reading processes (with ``own``, the second probes for itself: it follows no
    proof record, but still takes the first one's signed ranges), one whose link loses most
    signed lines, and a writing one."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                streams.connect(
                    streams_url, redis_url=redis_url, prefix=redis_prefix, shared_proofs=shared
                )
            )
            for shared in (True, request.param == "shared", True, False)
        ]


def _write(client: Client, streams_url: str, names: list[str], rounds: int) -> dict[str, int]:
    last: dict[str, int] = {}
    writers = {n: client.writer(n, instance=f"w{i}") for i, n in enumerate(names)}
    with psycopg.connect(streams_url, autocommit=False) as conn:
        for n in range(rounds):
            for name, writer in writers.items():
                if n % 7 == 3:  # a fact of several rows
                    with writer.fact(conn) as fact:
                        fact.add({"n": n, "row": 0}, {"n": n, "row": 1}, {"n": n, "row": 2})
                    last[name] = fact.stream_id
                elif n % 5 == 0:
                    last[name] = writer.append_batch([{"n": n, "b": b} for b in range(4)]).last_id
                else:
                    last[name] = writer.append({"n": n, "text": "é" * (n % 3)}).last_id
    for writer in writers.values():
        writer.close()
    return last


def test_no_attack_by_a_redis_client_changes_what_readers_deliver(
    clients: list[Client],
    streams_url: str,
    redis_url: str,
    redis_prefix: str,
    names: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Keys are read again every half second, so a rotation takes effect within the test.
    monkeypatch.setattr("streams.core.reader_state.KEY_REFRESH", 0.5)
    monkeypatch.setattr("streams.proofs.KEY_REFRESH", 0.5)
    # A reader waits this long for the prover's line before it probes for itself: 50 ms in
    # production, where a late prover only costs a probe. On a loaded machine (CI) every line
    # came later than that in one run, the readers read everything from PostgreSQL, and "the
    # fast path was never used"; waiting longer keeps this test about the lines themselves.
    monkeypatch.setattr("streams.core.reader_state.PROOF_GRACE", 2.0)
    *reading, dropping_side, writing = clients
    for name in names:
        writing.create_stream(name)
    truth = streams.connect(streams_url)  # no Redis: PostgreSQL alone
    readers = [c.reader(names, poll_interval=30.0) for c in reading]
    # A reader whose link drops most signed lines (Redis losing them): PostgreSQL fills in.
    dropping = dropping_side.reader(names, poll_interval=30.0)
    assert dropping_side._link is not None
    rng = random.Random(3)
    dropping_side._link.core.discard = lambda raw: b" _proof:" in raw[:200] and rng.random() < 0.7
    attacker = Attacker(redis_url, redis_prefix, names)
    attacker.start()
    try:
        provers = [c._proofs for c in (*reading, dropping_side) if c._proofs is not None]
        wait_until(
            lambda: set(names) <= set().union(*(p.proving for p in provers)),
            15,
            "both streams to have a prover",
        )
        for r in (*readers, dropping):
            r.poll()
        follows = [Follow(r) for r in (*readers, dropping)]
        for f in follows:
            f.start()
        last = _write(writing, streams_url, names, 60)
        # Rotate: lines signed with the old key are replayed from here on; they must be refused.
        writing.rotate_replication_keys()
        time.sleep(1.0)
        last = _write(writing, streams_url, names, 60)
        with truth.reader(names) as plain:
            expected = _facts_of(plain, last)
        for follow in follows:
            got = follow.finish(last)
            for name in names:  # per stream: the order across streams is the reader's choice
                mine = [f for f in got if f.stream == name]
                want = [f for f in expected if f.stream == name]
                assert [f.stream_id for f in mine] == [f.stream_id for f in want]
                assert mine == want  # payloads, rows, timestamps, writers
        for reader in readers:
            assert reader.core.counters.signed_ranges > 0, "the fast path was never used"
        rejected = {
            why: sum(r.core.counters.rejected_ranges.get(why, 0) for r in readers)
            for why in ("bad-signature", "unknown-key")
        }
        assert rejected.get("bad-signature", 0) > 0 and rejected.get("unknown-key", 0) > 0, rejected
        assert dropping.core.counters.proof_reads > 0
        assert set(attacker.sent) >= {"replay", "truncate", "alter", "forge", "other-stream"}
    finally:
        attacker.close()
        for r in (*readers, dropping):
            r.close()
        truth.close()
        drop_streams(streams_url, names)


def test_a_forged_live_prover_only_makes_readers_probe_for_themselves(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """Lines of a prover that does not exist keep a process from taking over when the real
    prover leaves (it hears "a prover"): its readers then find the record stale and probe
    PostgreSQL themselves. Every fact, in order: slower, never wrong."""
    stop = threading.Event()
    raw = redis.Redis.from_url(redis_url)

    def forge() -> None:
        while not stop.is_set():
            raw.publish(proof_channel(redis_prefix, unique_name),
                        f"POSITION {unique_name} _proof:fake 999999 999999")  # fmt: skip
            stop.wait(0.2)

    with contextlib.ExitStack() as stack:
        first, second = (
            stack.enter_context(
                streams.connect(
                    streams_url, redis_url=redis_url, prefix=redis_prefix, shared_proofs=True
                )
            )
            for _ in range(2)
        )
        forger = threading.Thread(target=forge, daemon=True)
        try:
            first.create_stream(unique_name)
            leaving = first.reader(unique_name)
            assert first._proofs is not None
            wait_until(lambda: unique_name in first._proofs.proving, 10, "a prover")  # type: ignore[union-attr]
            reader = second.reader(unique_name, poll_interval=0.2)
            assert second._proofs is not None
            forger.start()
            leaving.close()  # the real prover resigns; only forged lines are heard from now
            wait_until(lambda: not first._proofs.proving, 10, "the prover to resign")  # type: ignore[union-attr]
            with first.writer(unique_name, instance="w") as writer:
                ids = [writer.append({"n": n}).last_id for n in range(30)]
            got = _facts_of(reader, {unique_name: ids[-1]}, timeout=30)
            assert [f.stream_id for f in got] == ids
            assert not second._proofs.proving, "forged lines kept it from taking over"
            assert reader.core.counters.probes > reader.core.counters.proof_reads, (
                "it probed for itself"
            )
            reader.close()
        finally:
            stop.set()
            if forger.is_alive():
                forger.join(5)
            raw.close()
            drop_streams(streams_url, [unique_name])
