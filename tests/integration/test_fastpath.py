"""The fast write path (issue 10, item 1).

* A single-fact append is one autocommit statement: one round trip, no ``BEGIN``/``COMMIT``,
  and it still refuses, in the statement, an ID below its reservation floor (the probe
  argument) and a fenced writer (the fencing argument).
* A batch pipelines ``BEGIN`` with its reservation.
* Heartbeats are not run after every append.
* `RedisLink` publishes inline (fire-and-forget) and, with no reader attached, discards data
  lines of known streams unparsed, while still answering ``REPLICATE``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
import redis
import redis.asyncio
from helpers import wait_until

import streams
from streams import Client
from streams.core.constants import data_channel
from streams.core.protocol import PositionCommand, RdataCommand, ReplicateCommand, serialize
from streams.core.replication import Announcer, Hint, LinkCore
from streams.store.driver import Autocommit, Commit, Pipeline, Query
from streams.transport import connections
from streams.transport.link import AsyncRedisLink, RedisLink


def _ops_of(gen: Any, results: list[Any]) -> list[Any]:
    """Drive a generator with canned results; the ops it yielded."""
    ops = [next(gen)]
    for result in results:
        try:
            ops.append(gen.send(result))
        except StopIteration:
            break
    return ops


def test_single_append_is_one_autocommit_statement(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        core = writer.core
        gen = core.append([{"n": 1}], [None])
        op = next(gen)
        assert isinstance(op, Autocommit)
        token_floor = core.tracker.max_allocated
        with pytest.raises(StopIteration) as stop:
            gen.send([(token_floor + 1, token_floor + 1)])
        assert stop.value.value.ids == (token_floor + 1,)


def test_batch_pipelines_begin_with_the_reservation(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        core = writer.core
        floor = core.tracker.max_allocated
        gen = core.append([{"n": 1}, {"n": 2}], [None, None])
        ops = _ops_of(gen, [[((floor + 1, floor + 1), (floor + 2, floor + 1))], [], []])
        assert [type(op) for op in ops] == [Pipeline, type(ops[1]), Commit]
        assert isinstance(ops[0].queries[0], Query)
        gen.close()


def test_single_append_round_trips_and_data(client: Client, stream: str, streams_url: str) -> None:
    with client.writer(stream, instance="w") as writer:
        acks = [writer.append({"n": n}) for n in range(20)]
        assert [a.first_id for a in acks] == sorted(a.first_id for a in acks)
        assert writer._conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert not writer._conn.autocommit  # restored after each append
        batch = writer.append_batch([{"b": n} for n in range(5)])
        assert batch.count == 5
    with psycopg.connect(streams_url) as conn:
        (count,) = conn.execute(
            "SELECT count(*) FROM streams_facts f JOIN streams_registry r ON r.id = f.stream "
            "WHERE r.name = %s",
            (stream,),
        ).fetchone()  # type: ignore[misc]
    assert count == 25
    assert client.positions(stream).linear == batch.last_id


def test_single_append_refuses_an_id_below_its_floor(
    client: Client, stream: str, streams_url: str
) -> None:
    """The in-statement check: an ID at or below what this process knew was allocated (the
    sequence was set back) fails the statement, so nothing is written."""
    with client.writer(stream, instance="w") as writer:
        first = writer.append({"n": 1})
        writer.append({"n": 2})
        seq = writer.stream.sequence_name
        with psycopg.connect(streams_url, autocommit=True) as conn:
            conn.execute("SELECT setval(%s, %s)", (seq, first.first_id + 5))
            writer.core.tracker.note_allocated(first.first_id + 100)
            with pytest.raises(streams.SequenceRewound):
                writer.append({"n": "refused"})
            (rows,) = conn.execute(
                "SELECT count(*) FROM streams_facts WHERE payload->>'n' = 'refused'"
            ).fetchone()  # type: ignore[misc]
        assert rows == 0
        assert writer.core.tracker.pending_count == 0
        assert writer.core.tracker.in_flight_count == 0


def test_fenced_single_append_writes_nothing(client: Client, stream: str) -> None:
    writer = client.writer(stream, instance="w")
    try:
        writer.append({"n": 1})
        # A new writer under the same name takes it over, fencing the first.
        with client.writer(stream, instance="w"), pytest.raises(streams.WriterFenced):
            writer.append({"n": "late"})
    finally:
        writer._stopped.set()
        writer._wake.set()
        writer._thread.join()
        writer._conn.close()
        if writer._spare is not None:
            writer._spare.close()


def test_appends_do_not_run_a_heartbeat_each(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        beats = 0
        original = writer.core.heartbeat

        def counting() -> Any:
            nonlocal beats
            beats += 1
            return original()

        writer.core.heartbeat = counting  # type: ignore[method-assign]
        for n in range(200):
            writer.append({"n": n})
        assert beats < 20, beats
        # ... but the persisted position still follows soon after.
        last = writer.append({"n": "last"}).last_id
        wait_until(lambda: client.positions(stream).writers["w"].position >= last, 5)


# ------------------------------------------------------------------------------ Redis


def test_link_core_skips_data_lines_without_readers() -> None:
    core = LinkCore("p", "me", check_streams=True, skip_data_without_readers=True)
    core.add_writer(Announcer("known", "w", 0))
    line = serialize(RdataCommand("known", "other", 5, {"first": 5, "count": 1, "ts": 0}))
    assert core.on_message(line, 0.0) == ([], [])
    assert core.stats.skipped == 1 and core.stats.hints == 0
    # An unknown stream is still parsed (rule (b) of the foreign check needs its name).
    core.on_message(serialize(PositionCommand("unknown", "other", 1, 2)), 0.0)
    assert core.stats.skipped == 1 and core.stats.hints == 1
    # REPLICATE is always answered.
    _, replies = core.on_message(serialize(ReplicateCommand()), 0.0)
    assert replies == [serialize(PositionCommand("known", "w", 0, 0))]
    # With a reader attached, data lines give hints again.
    core.add_reader()
    hints, _ = core.on_message(line, 0.0)
    assert [h.token for h in hints] == [5]


def test_inline_publish_reaches_subscribers(redis_url: str, redis_prefix: str) -> None:
    link = RedisLink(redis_url, redis_prefix, "fastpath-test")
    sub = redis.Redis.from_url(redis_url).pubsub()  # type: ignore[no-untyped-call,unused-ignore]
    try:
        # RDATA goes on the stream's data channel, the REPLICATE answer on the main channel.
        sub.subscribe(link.core.channel, data_channel(redis_prefix, "s"))
        wait_until(lambda: link.connected, 15, "the link to subscribe")
        announcer = Announcer("s", "w", 0)
        link.add_writer(announcer)
        announcer.committed((1,), 0)
        link.publish(announcer.update(1))
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(b.startswith(b"RDATA") for b in got):
            message = sub.get_message(timeout=0.2)
            if message is not None and message["type"] == "message":
                got.append(message["data"])
        assert any(b.startswith(b"RDATA s w 1 ") for b in got), got
        assert link.core.stats.published >= 1
        # A REPLICATE from elsewhere is answered (the link has no reader: it reads in bursts).
        redis.Redis.from_url(redis_url).publish(link.core.channel, b"REPLICATE")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and b"POSITION s w 1 1" not in got:
            message = sub.get_message(timeout=0.2)
            if message is not None and message["type"] == "message":
                got.append(message["data"])
        assert b"POSITION s w 1 1" in got
    finally:
        sub.close()
        link.close()


def test_lines_within_the_publish_window_all_arrive(redis_url: str, redis_prefix: str) -> None:
    """Lines sent faster than the window are batched; the flusher sends the tail."""
    link = RedisLink(redis_url, redis_prefix, "fastpath-window", publish_window=0.05)
    sub = redis.Redis.from_url(redis_url).pubsub()  # type: ignore[no-untyped-call,unused-ignore]
    try:
        sub.subscribe(data_channel(redis_prefix, "s"))
        wait_until(lambda: link.connected, 15, "the link to subscribe")
        announcer = Announcer("s", "w", 0)
        link.add_writer(announcer)
        for n in range(1, 51):
            announcer.committed((n,), 0)
            link.publish(announcer.update(n))
        got: set[int] = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(got) < 50:
            message = sub.get_message(timeout=0.2)
            if message is not None and message["type"] == "message":
                words = message["data"].split(b" ")
                if words[0] == b"RDATA":
                    got.add(int(words[3]))
        assert got == set(range(1, 51))
        # The flusher counts a batch after sending it: the subscriber may see it first.
        wait_until(lambda: link.core.stats.published == 50, 5, "the batch to be counted")
        assert link.dropped == 0
    finally:
        sub.close()
        link.close()


def _as_without_hiredis(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our RESP2 parser and redis-py's (for the connect step) in pure Python, as on a machine
    without hiredis."""
    monkeypatch.setattr("streams.core.resp._FAST", None)
    options = connections.client_options
    monkeypatch.setattr(
        connections,
        "client_options",
        lambda *a, **k: {**options(*a, **k), "parser_class": redis._parsers._RESP2Parser},
    )


class _Hints:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def on_hint(self, hint: Any) -> None:
        self.tokens.append(hint.token)

    def on_link_state(self, connected: bool) -> None:
        pass


@pytest.mark.parametrize("pure", [False, True], ids=["hiredis", "pure-python"])
def test_the_subscriber_reads_bursts_and_survives_a_killed_connection(
    redis_url: str, redis_prefix: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link reads its subscription itself (`streams.core.resp`): many messages per ``recv``,
    replies split across reads, with or without hiredis; a dropped connection is re-opened."""
    if pure:
        _as_without_hiredis(monkeypatch)
    link = RedisLink(redis_url, redis_prefix, f"{redis_prefix}-burst")
    hints = _Hints()
    publisher = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: link.connected, 15, "the link to subscribe")
        link.add_listener(hints)
        pipe = publisher.pipeline(transaction=False)
        for n in range(1, 501):
            pipe.publish(link.core.channel, f'RDATA s w{n % 3} {n} {{"x":"{"y" * n}"}}')
        pipe.execute()
        wait_until(lambda: len(hints.tokens) == 500, 10, "500 hints")
        assert hints.tokens == list(range(1, 501))
        reconnects = link.core.stats.reconnects
        # Only this link's subscriber (by its CLIENT SETNAME): other tests share this Redis.
        (sub,) = [c for c in publisher.client_list() if c["name"] == link.client_name("sub")]
        assert publisher.client_kill_filter(_id=sub["id"]) == 1
        wait_until(lambda: link.core.stats.reconnects > reconnects, 15, "a reconnect")
        wait_until(lambda: link.connected, 15, "the link to subscribe again")
        publisher.publish(link.core.channel, b"RDATA s w 501 {}")
        wait_until(lambda: hints.tokens[-1:] == [501], 10, "the hint after the reconnect")
    finally:
        publisher.close()
        link.close()


def test_the_async_subscriber_reads_bursts_and_survives_a_killed_connection(
    redis_url: str, redis_prefix: str
) -> None:
    """The asyncio link reads its subscription the same way (`connections.AsyncSubscriber`)."""

    async def main() -> None:
        link = AsyncRedisLink(redis_url, redis_prefix, f"{redis_prefix}-async")
        hints = _Hints()
        publisher = redis.asyncio.Redis.from_url(redis_url)

        async def until(predicate: Any, what: str) -> None:
            deadline = time.monotonic() + 15
            while not predicate():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.01)

        try:
            await until(lambda: link.connected, "the link to subscribe")
            link.add_listener(hints)
            pipe = publisher.pipeline(transaction=False)
            for n in range(1, 301):
                pipe.publish(link.core.channel, f'RDATA s w {n} {{"x":"{"y" * n}"}}')
            await pipe.execute()
            await until(lambda: len(hints.tokens) == 300, "300 hints")
            assert hints.tokens == list(range(1, 301))
            reconnects = link.core.stats.reconnects
            (sub,) = [
                c for c in await publisher.client_list() if c["name"] == link.client_name("sub")
            ]
            assert await publisher.client_kill_filter(_id=sub["id"]) == 1
            await until(lambda: link.core.stats.reconnects > reconnects, "a reconnect")
            await until(lambda: link.connected, "the link to subscribe again")
            await publisher.publish(link.core.channel, b"RDATA s w 301 {}")
            await until(lambda: hints.tokens[-1:] == [301], "the hint after the reconnect")
        finally:
            await publisher.aclose()
            await link.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("pure", [False, True], ids=["hiredis", "pure-python"])
def test_the_subscriber_speaks_resp2_whatever_the_url_says(
    redis_url: str, redis_prefix: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``?protocol=3`` in the URL must not make the subscriber expect RESP3 pushes (nor
    turn on redis-py's RESP3-only maintenance notifications, fatal without hiredis)."""
    if pure:
        _as_without_hiredis(monkeypatch)
    separator = "&" if "?" in redis_url else "?"
    link = RedisLink(f"{redis_url}{separator}protocol=3", redis_prefix, "fastpath-resp3")
    hints = _Hints()
    publisher = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: link.connected, 15, "the link to subscribe")
        link.add_listener(hints)
        publisher.publish(link.core.channel, b"RDATA s w 7 {}")
        wait_until(lambda: hints.tokens == [7], 10, "the hint")
        assert link.core.stats.reconnects == 0
    finally:
        publisher.close()
        link.close()


def test_a_writer_only_process_hears_no_other_process_append(
    redis_url: str, redis_prefix: str
) -> None:
    """Appends go on the stream's data channel: a link without a reader of the stream receives
    none of them (an append costs Redis nothing per writer process), a link with one does, and
    stops when its reader leaves."""
    writer = RedisLink(redis_url, redis_prefix, "fleet-writer", publish_window=0)
    quiet = RedisLink(redis_url, redis_prefix, "fleet-quiet", idle_read_interval=0)
    reading = RedisLink(redis_url, redis_prefix, "fleet-reading", idle_read_interval=0)
    heard: list[Hint] = []

    class Listener:
        def on_hint(self, hint: Hint) -> None:
            heard.append(hint)

        def on_link_state(self, connected: bool) -> None:
            pass

    listener = Listener()
    try:
        reading.add_listener(listener, ["s"])
        wait_until(
            lambda: writer.connected and quiet.connected and reading.connected,
            15,
            "the links to subscribe",
        )
        channel = data_channel(redis_prefix, "s")
        wait_until(lambda: _subscribers(redis_url, channel) == 1, 15, "the data subscription")
        announcer = Announcer("s", "w", 0)
        writer.add_writer(announcer)
        time.sleep(0.2)  # the connect step's lines are past
        before = quiet.core.stats.received
        for n in range(1, 101):
            announcer.committed((n,), 0)
            writer.publish(announcer.update(n))
        wait_until(lambda: any(h.token == 100 for h in heard), 10, "the reader to hear 100")
        time.sleep(0.2)
        assert quiet.core.stats.received == before
        assert {h.token for h in heard} >= set(range(1, 101))
        # The reader leaves: the link unsubscribes from the data channel.
        reading.remove_listener(listener, ["s"])
        wait_until(lambda: _subscribers(redis_url, channel) == 0, 15, "the unsubscription")
    finally:
        for link in (writer, quiet, reading):
            link.close()


def _subscribers(redis_url: str, channel: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.pubsub_numsub(channel)[0][1])
    finally:
        client.close()


def test_writer_lines_go_out_only_while_someone_listens(redis_url: str, redis_prefix: str) -> None:
    """Nobody on the data channel: after one check the link stops publishing writers' lines;
    a subscriber appears: within about LISTENERS_INTERVAL they flow again."""
    link = RedisLink(redis_url, redis_prefix, "fleet-unheard", publish_window=0)
    sub = redis.Redis.from_url(redis_url).pubsub()  # type: ignore[no-untyped-call,unused-ignore]
    try:
        wait_until(lambda: link.connected, 15, "the link to subscribe")
        announcer = Announcer("s", "w", 0)
        link.add_writer(announcer)
        n = 0

        def append() -> None:
            nonlocal n
            n += 1
            announcer.committed((n,), 0)
            link.publish(announcer.update(n))

        for _ in range(5):
            append()
        assert link.core.stats.unheard >= 3
        sub.subscribe(data_channel(redis_prefix, "s"))
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not got:
            append()
            message = sub.get_message(timeout=0.1)
            if message is not None and message["type"] == "message":
                got.append(message["data"])
        assert got and got[0].startswith(b"RDATA s w ")
    finally:
        sub.close()
        link.close()
