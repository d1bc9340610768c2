"""Living next to Synapse: its whole command vocabulary, foreign-deployment detection, and the
read-only channel observer (`streams.ops.channel`).

The pure parts are tested here against the captured Synapse lines of
``fixtures/synapse_lines.txt``; the rest against real Redis and PostgreSQL (see conftest.py),
with a fake Synapse (a thread that answers ``REPLICATE`` with the captured lines) where needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from helpers import TESTS_DIR, wait_until
from hypothesis import given
from hypothesis import strategies as st

import streams
from streams.core.constants import data_channel
from streams.core.protocol import (
    COMMANDS,
    SYNAPSE_ONLY_COMMANDS,
    ForeignCommand,
    KeysCommand,
    PositionCommand,
    RdataCommand,
    parse,
    serialize,
)
from streams.core.replication import REFRESH_INTERVAL
from streams.ops.channel import ChannelPosition, ChannelTally, observe_channel
from streams.reader import Reader
from streams.store.reader_core import ReaderCore
from streams.store.writer_core import WriterCore
from streams.transport.link import AsyncRedisLink, RedisLink
from streams.writer import Writer

FIXTURE = TESTS_DIR / "fixtures" / "synapse_lines.txt"


def synapse_lines() -> list[bytes]:
    """The captured lines, in file order, exactly as Synapse sends them (a bare name gets the
    trailing space Synapse writes: ``NAME + " " + to_line()``)."""
    lines = []
    for text in FIXTURE.read_text("utf-8").splitlines():
        if text.strip() and not text.startswith("#"):
            lines.append(text.encode() if " " in text else text.encode() + b" ")
    return lines


def name_of(line: bytes) -> str:
    return line.split(b" ", 1)[0].decode()


# --- the captured vocabulary (pure) -----------------------------------------------------------


def test_fixture_covers_every_synapse_command() -> None:
    lines = synapse_lines()
    # KEYS is streams' own (the replication keys changed): Synapse never sends it.
    synapse = set(COMMANDS) - {KeysCommand.NAME}
    assert {name_of(line) for line in lines} == synapse | SYNAPSE_ONLY_COMMANDS
    master = {
        cmd.stream_name
        for cmd in map(parse, lines)
        if isinstance(cmd, PositionCommand) and cmd.instance_name == "master"
    }
    assert len(master) >= 18
    assert {"events", "caches", "typing", "thread_subscriptions"} <= master


@pytest.mark.parametrize("line", synapse_lines(), ids=name_of)
def test_every_synapse_line_parses_and_round_trips(line: bytes) -> None:
    cmd = parse(line)
    name = name_of(line)
    if name in SYNAPSE_ONLY_COMMANDS:
        assert cmd == ForeignCommand(name, line.split(b" ", 1)[1].decode())
    else:
        assert type(cmd) is COMMANDS[name]
    assert parse(serialize(cmd)) == cmd
    if name != "REPLICATE":  # we write REPLICATE without Synapse's trailing space
        assert serialize(cmd) == line


def test_tally_of_a_synapse_answer() -> None:
    tally = ChannelTally()
    for i, line in enumerate(synapse_lines()):
        tally.add(line, float(i))
    tally.add(b"FROB nonsense", 99.0)
    tally.add(b"POSITION events master 1 x", 99.0)
    report = tally.report("example.com", 3, 100.0)
    assert report.foreign is not None
    assert report.foreign.reason == "synapse-commands"
    assert set(report.foreign.evidence) == SYNAPSE_ONLY_COMMANDS
    assert "LOCK_RELEASED" in report.foreign.describe("example.com")
    assert sum(report.foreign_commands.values()) == sum(
        name_of(line) in SYNAPSE_ONLY_COMMANDS for line in synapse_lines()
    )
    assert report.foreign_commands["USER_SYNC"] == 3
    assert report.malformed == {
        "unknown command": 1,
        "new_token is not a canonical decimal integer": 1,
    }
    # RDATA raises the POSITION; batch rows are ignored; the last line that raised sets ms.
    by_key = {(p.stream, p.instance): p for p in report.positions}
    assert by_key["caches", "master"].new_token == 120554
    assert by_key["caches", "master"].prev_token == 120553
    assert by_key["presence", "master"].new_token == 3310
    assert by_key["receipts", "event_persister-1"] == ChannelPosition(
        "receipts", "event_persister-1", 9874, 9880, 19.0
    )
    assert report.ignored == {
        "ERROR": 1,
        "NAME": 1,
        "PING": 1,
        "RDATA": 1,
        "REPLICATE": 1,
        "SERVER": 1,
    }
    assert report.messages == len(synapse_lines()) + 2
    assert report.as_dict()["foreign"]["reason"] == "synapse-commands"
    assert {"events", "caches", "receipts"} <= report.streams


ENTRIES = st.tuples(
    st.sampled_from(["s1", "s2"]),
    st.sampled_from(["w1", "w2"]),
    st.integers(0, 30),
    st.integers(0, 30),
    st.sampled_from(["POSITION", "RDATA", "batch"]),
)


@given(st.lists(ENTRIES, max_size=30), st.none() | st.sets(st.sampled_from(["s1", "s2"])))
def test_tally_keeps_the_highest_token(
    entries: list[tuple[str, str, int, int, str]], known: set[str] | None
) -> None:
    tally = ChannelTally(known_streams=known)
    model: dict[tuple[str, str], tuple[int, int, float]] = {}
    for ms, (stream, instance, prev, new, kind) in enumerate(entries):
        key = (stream, instance)
        old = model.get(key)
        if kind == "POSITION":
            tally.add(serialize(PositionCommand(stream, instance, prev, new)), float(ms))
            if old is None or new > old[1]:
                model[key] = (prev, new, float(ms))
        elif kind == "RDATA":
            tally.add(serialize(RdataCommand(stream, instance, new, {})), float(ms))
            if old is None or new > old[1]:
                model[key] = (new if old is None else old[1], new, float(ms))
        else:
            tally.add(serialize(RdataCommand(stream, instance, None, {})), float(ms))
    report = tally.report("pfx", 1, 0.0)
    assert {
        (p.stream, p.instance): (p.prev_token, p.new_token, p.ms) for p in report.positions
    } == (model)
    assert [(p.stream, p.instance) for p in report.positions] == sorted(model)
    heard = {s for s, _ in model}
    if known is None or heard <= known:
        assert report.foreign is None
    else:
        assert report.foreign is not None
        assert report.foreign.evidence == tuple(sorted(heard - known))


# --- real Redis: helpers ----------------------------------------------------------------------


class Watch:
    """A raw redis-py subscriber of the channel and of every stream's data channel under its
    prefix, recording every line in arrival order."""

    def __init__(self, redis_url: str, channel: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.pubsub: Any = self.client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
        self.pubsub.psubscribe(data_channel(channel, "*"))
        wait_until(self._confirmed, 10, "the watch's data subscription")
        self.pubsub.subscribe(channel)
        self.lines: list[bytes] = []
        self._lock = threading.Lock()
        wait_until(self._confirmed, 10, "the watch subscription")

    def _confirmed(self) -> bool:
        message = self.pubsub.get_message(timeout=0.1)
        return message is not None and message["type"] in ("subscribe", "psubscribe")

    def pump(self, seconds: float = 0.0) -> list[bytes]:
        deadline = time.monotonic() + seconds
        while True:
            message = self.pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
            if message is not None and message["type"] in ("message", "pmessage"):
                self.lines.append(message["data"])
            elif time.monotonic() >= deadline:
                return self.lines

    def wait_for(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.lines):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; heard {self.lines[-20:]}")
            self.pump(0.05)

    def close(self) -> None:
        self.pubsub.close()
        self.client.close()


@pytest.fixture
def watch(redis_url: str, redis_prefix: str) -> Iterator[Watch]:
    w = Watch(redis_url, redis_prefix)
    yield w
    w.close()


class FakeSynapse:
    """A thread that answers every ``REPLICATE`` on the channel with captured Synapse lines,
    and records what else it hears."""

    def __init__(self, redis_url: str, channel: str, lines: list[bytes]) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.pubsub: Any = self.client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
        self.pubsub.subscribe(channel)
        self.channel = channel
        self.lines = lines
        self.heard: list[bytes] = []
        self.replicates = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the fake Synapse did not subscribe"

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self.pubsub.get_message(timeout=0.05)
            if message is None:
                continue
            if message["type"] == "subscribe":
                self._ready.set()
            elif message["type"] == "message":
                data = message["data"]
                self.heard.append(data)
                if data.rstrip(b" ") == b"REPLICATE" and data not in self.lines:
                    self.replicates += 1
                    pipe = self.client.pipeline(transaction=False)
                    for line in self.lines:
                        pipe.publish(self.channel, line)
                    pipe.execute()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pubsub.close()
        self.client.close()


def connected(link: RedisLink) -> Callable[[], bool]:
    return lambda: link.connected


def decided(link: RedisLink) -> Callable[[], bool]:
    """No stream name heard is waiting for a registry read (the reads are rate-limited)."""
    return lambda: not link.core.refresh_due(time.monotonic() + REFRESH_INTERVAL)


def registry_names(url: str) -> list[str]:
    """The ``known_streams`` function a client gives its link: reads the registry."""
    with streams.connect(url) as c:
        return [info.name for info in c.streams()]


def make_writer(url: str, stream: str, instance: str, link: RedisLink) -> Writer:
    core = WriterCore(stream, instance, lease_seconds=2.0, max_payload_bytes=1 << 20)
    return Writer(url, core, link)


def make_reader(url: str, names: list[str], link: RedisLink) -> Reader:
    return Reader(url, ReaderCore(names), link)


def read_ids(reader: Reader, stream: str, want: set[int], timeout: float) -> set[int]:
    got: set[int] = set()
    deadline = time.monotonic() + timeout
    while not want <= got:
        left = deadline - time.monotonic()
        assert left > 0, f"reader got {len(got & want)} of {len(want)} facts of {stream}"
        epoch = reader.poll(timeout=min(left, 0.5))
        if epoch is not None:
            got.update(f.stream_id for f in epoch.facts if f.stream == stream)
    return got


# --- task 3: a reader attaching asks for positions --------------------------------------------


def test_reader_attaching_publishes_replicate(
    streams_url: str, stream: str, redis_url: str, redis_prefix: str, watch: Watch
) -> None:
    with streams.connect(
        streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=2.0
    ) as c:
        link = c.link
        assert link is not None
        with c.writer(stream, instance="w-attach") as writer:
            wait_until(lambda: link.connected, 15, "the link")
            writer.append({"n": 1})
            watch.wait_for(lambda ls: any(b" w-attach " in x for x in ls), 10, "the writer")
            watch.pump(0.2)
            assert not any(x.startswith(b"REPLICATE") for x in watch.lines)  # no reader yet
            heard = len(watch.lines)
            with c.reader(stream):
                watch.wait_for(
                    lambda ls: b"REPLICATE" in ls[heard:], 10, "REPLICATE from the reader"
                )
                at = watch.lines.index(b"REPLICATE", heard)
                # ... and the writers answer it (this one hears its own link's request).
                position = f"POSITION {stream} w-attach {writer.position} {writer.position}"
                watch.wait_for(lambda ls: position.encode() in ls[at:], 10, "the writer's answer")
            assert link.foreign is None


# --- task 4: the channel observer on real Redis -----------------------------------------------


def test_observe_channel_hears_streams_writers(
    streams_url: str, stream: str, redis_url: str, redis_prefix: str, client: streams.Client
) -> None:
    other = f"{stream}_b"
    client.create_stream(other)
    with contextlib.ExitStack() as stack:
        clients = [
            stack.enter_context(
                streams.connect(
                    streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=2.0
                )
            )
            for _ in range(2)
        ]
        wa = stack.enter_context(clients[0].writer(stream, instance="wa"))
        wb = stack.enter_context(clients[1].writer(stream, instance="wb"))
        wc = stack.enter_context(clients[1].writer(other, instance="wc"))
        for c in clients:
            link = c.link
            assert link is not None
            wait_until(connected(link), 15, "the links")
        acks = {"wa": wa.append({"a": 1}), "wb": wb.append_batch([{"b": 1}, {"b": 2}])}
        wc.append({"c": 1})

        report = observe_channel(redis_url, redis_prefix, known_streams={stream, other})
        assert report.foreign is None
        assert report.receivers >= 3  # the observer and both links
        by_key = {(p.stream, p.instance): p for p in report.positions}
        assert set(by_key) == {(stream, "wa"), (stream, "wb"), (other, "wc")}
        for instance, ack in acks.items():
            assert by_key[stream, instance].new_token >= ack.last_id
        assert all(0 <= p.ms <= 2000 for p in report.positions)
        assert report.malformed == {}
        assert report.foreign_commands == {}
        assert report.ignored.get("REPLICATE", 0) >= 1  # our own, echoed
        assert 0 < report.elapsed_ms <= 2000 + 500

        stranger = observe_channel(redis_url, redis_prefix, known_streams={other})
        assert stranger.foreign is not None
        assert stranger.foreign.reason == "unknown-streams"
        assert stranger.foreign.evidence == (stream,)
        for c in clients:
            assert c.link is not None and c.link.foreign is None


def test_observe_channel_on_a_synapse_channel(redis_url: str, redis_prefix: str) -> None:
    lines = synapse_lines()
    fake = FakeSynapse(redis_url, redis_prefix, lines)
    try:
        report = observe_channel(redis_url, redis_prefix, window=0.25, cap=2.0)
        # The observer published nothing but REPLICATE (the fake also hears its own lines).
        assert [x for x in fake.heard if x not in lines] == [b"REPLICATE"]
        assert report.receivers == 2  # the observer and the fake Synapse
        assert report.foreign is not None
        assert report.foreign.reason == "synapse-commands"
        assert set(report.foreign.evidence) == SYNAPSE_ONLY_COMMANDS
        master = {p.stream for p in report.positions if p.instance == "master"}
        assert len(master) >= 18
        assert report.messages == len(lines) + 1  # and our REPLICATE, echoed
        assert report.malformed == {}
        # With the registry given, Synapse's streams are unknown too; the commands still win.
        again = observe_channel(redis_url, redis_prefix, known_streams=set())
        assert again.foreign is not None and again.foreign.reason == "synapse-commands"
    finally:
        fake.close()


# --- task 2 and 5: a streams link on a Synapse channel goes quiet -----------------------------


def test_synapse_on_the_channel_silences_the_link(
    streams_url: str,
    stream: str,
    redis_url: str,
    redis_prefix: str,
    watch: Watch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    # Synapse-only commands first: rule (a) decides whatever else the client wired.
    captured = synapse_lines()
    replay = [x for x in captured if name_of(x) in SYNAPSE_ONLY_COMMANDS] + [
        x for x in captured if name_of(x) not in SYNAPSE_ONLY_COMMANDS
    ]
    with streams.connect(
        streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=2.0
    ) as c:
        link = c.link
        assert link is not None
        states: list[bool] = []
        with c.writer(stream, instance="w-quiet") as writer, c.reader(stream) as reader:

            class Spy:
                def on_hint(self, hint: Any) -> None:
                    pass

                def on_link_state(self, connected: bool) -> None:
                    states.append(connected)

            wait_until(lambda: link.connected, 15, "the link")
            link.add_listener(Spy())
            ids = {writer.append({"before": i}).last_id for i in range(3)}
            watch.wait_for(
                lambda ls: any(x.startswith(b"RDATA " + stream.encode() + b" w-quiet") for x in ls),
                10,
                "the writer's RDATA before Synapse shows up",
            )

            publisher = redis.Redis.from_url(redis_url)
            try:
                for line in replay:
                    assert publisher.publish(redis_prefix, line) >= 2  # the link and the watch
                wait_until(lambda: link.foreign is not None, 10, "detection")
                assert not link.connected
                wait_until(lambda: states == [False], 5, "readers told the link is down")
                time.sleep(0.3)  # anything in flight at detection lands before the marker
                publisher.publish(redis_prefix, b"PING marker")
                for i in range(20):
                    ids.add(writer.append({"after": i}).last_id)
                publisher.publish(redis_prefix, b"REPLICATE ")  # Synapse reconnecting
                ids.update(a.last_id for a in [writer.append_batch([{"x": 1}, {"x": 2}])])
                # Readers still deliver every fact: they poll PostgreSQL.
                got = read_ids(reader, stream, ids, 20)
                assert ids <= got
                watch.pump(1.0)
            finally:
                publisher.close()

            after = watch.lines[watch.lines.index(b"PING marker") + 1 :]
            assert after == [b"REPLICATE "], after  # nothing from the link: not a word
            verdict = link.foreign
            assert verdict is not None
            assert verdict.reason == "synapse-commands"
            assert verdict.evidence == ("LOCK_RELEASED",)
            assert "LOCK_RELEASED" in verdict.line
            stats = link.stats
            foreign_lines = [x for x in replay if name_of(x) in SYNAPSE_ONLY_COMMANDS]
            assert stats.foreign == len(foreign_lines)
            assert stats.foreign_by_name["USER_SYNC"] == 3
            # The appends' RDATA/POSITION and the answers, none published: suppressed (the
            # channel is foreign) or unheard (nobody listened on the data channel).
            assert stats.suppressed + stats.unheard >= 20
            assert stats.malformed == 0
            assert not link.connected

    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert repr(redis_prefix) in message
    assert "STREAMS_PREFIX" in message and "LOCK_RELEASED" in message
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    # At most the peer's ERROR line: no warning per Synapse command.
    assert len([r for r in warnings if r.name == "streams.replication"]) <= 1, [
        r.getMessage() for r in warnings
    ]


# --- task 5: the default path never trips -----------------------------------------------------


def test_streams_only_channel_never_looks_foreign(
    streams_url: str, redis_url: str, redis_prefix: str, client: streams.Client, unique_name: str
) -> None:
    names = [f"{unique_name}_{i}" for i in range(3)]
    for name in names[:2]:
        client.create_stream(name)
    calls: list[int] = []

    def known() -> list[str]:
        calls.append(1)
        return registry_names(streams_url)

    links = [RedisLink(redis_url, redis_prefix, f"me-{i}", known_streams=known) for i in range(2)]
    with contextlib.ExitStack() as stack:
        for link in links:
            stack.callback(link.close)
        for link in links:
            wait_until(connected(link), 15, "the links")
        writers = {
            f"w{i}": stack.enter_context(
                make_writer(streams_url, names[i % 2], f"w{i}", links[i % 2])
            )
            for i in range(4)
        }
        readers = [
            stack.enter_context(make_reader(streams_url, names[:2], links[1 - i])) for i in range(2)
        ]
        want: dict[str, set[int]] = {name: set() for name in names}
        for i, w in enumerate(writers.values()):
            want[names[i % 2]].add(w.append({"i": i}).last_id)
        # A stream created after both links started (and after a registry read).
        wait_until(lambda: len(calls) >= 1, 10, "a registry read")
        client.create_stream(names[2])
        late = stack.enter_context(make_writer(streams_url, names[2], "w-late", links[0]))
        late_reader = stack.enter_context(make_reader(streams_url, [names[2]], links[1]))
        want[names[2]].add(late.append({"late": True}).last_id)
        for i, w in enumerate(writers.values()):
            want[names[i % 2]].add(w.append({"again": i}).last_id)
        read_ids(late_reader, names[2], want[names[2]], 15)
        for r in readers:
            got: dict[str, set[int]] = {name: set() for name in names[:2]}
            deadline = time.monotonic() + 15
            while not all(want[n] <= got[n] for n in names[:2]):
                assert time.monotonic() < deadline, "a reader fell behind"
                epoch = r.poll(timeout=0.5)
                if epoch is not None:
                    for fact in epoch.facts:
                        got[fact.stream].add(fact.stream_id)
        # Every name either link heard has been decided on (the checks are rate-limited).
        for link in links:
            wait_until(
                decided(link),
                3 * REFRESH_INTERVAL,
                "the registry checks",
            )
        for link in links:
            assert link.foreign is None, link.foreign
            assert link.connected
            assert link.stats.suppressed == 0
            assert link.stats.foreign == 0
        assert len(calls) >= 2  # the late stream was checked against a fresh read


# --- the asyncio link: the same rules, the registry read off the loop -------------------------


def test_async_link_unknown_stream_and_reader_replicate(
    streams_url: str, stream: str, redis_url: str, redis_prefix: str, watch: Watch
) -> None:
    threads: list[str] = []

    def known() -> list[str]:
        threads.append(threading.current_thread().name)
        return registry_names(streams_url)

    class Quiet:
        def __init__(self) -> None:
            self.states: list[bool] = []

        def on_hint(self, hint: Any) -> None:
            pass

        def on_link_state(self, connected: bool) -> None:
            self.states.append(connected)

    async def main() -> None:
        link = AsyncRedisLink(redis_url, redis_prefix, "async-me", known_streams=known)
        try:
            deadline = time.monotonic() + 15
            while not link.connected:
                assert time.monotonic() < deadline, "the async link"
                await asyncio.sleep(0.01)
            listener = Quiet()
            link.add_listener(listener)  # connected: REPLICATE now
            publisher = redis.asyncio.Redis.from_url(redis_url)
            try:
                # A known stream from another process: checked, fine.
                await publisher.publish(redis_prefix, f"POSITION {stream} w9 0 1")
                while not threads:  # the registry read (known() above)
                    assert time.monotonic() < deadline, "the registry read"
                    await asyncio.sleep(0.01)
                assert link.foreign is None
                await asyncio.sleep(REFRESH_INTERVAL)  # the next read is rate-limited
                await publisher.publish(redis_prefix, "POSITION s_not_in_this_database w9 0 1")
                deadline = time.monotonic() + 15
                while link.foreign is None:
                    assert time.monotonic() < deadline, "detection"
                    await asyncio.sleep(0.01)
            finally:
                await publisher.aclose()
            assert link.foreign.reason == "unknown-streams"
            assert link.foreign.evidence == ("s_not_in_this_database",)
            assert not link.connected
            assert listener.states == [False]
            assert link.core.add_reader() == []  # quarantined (60 s): quiet
        finally:
            await link.aclose()

    asyncio.run(main())
    watch.pump(0.2)
    assert b"REPLICATE" in watch.lines
    assert threads and all(name != "MainThread" for name in threads)  # asyncio.to_thread
