"""Readers by pattern (`Client.reader(pattern=...)`): every matching stream, streams created
while the reader runs included (from their first fact), nothing of the others; with a group,
a reopened reader resumes on each; a dropped stream leaves cleanly. Each scenario is written
once and run through `Reader` and `AsyncReader` (as in test_reader_twins)."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from typing import Any

import pytest

import streams
from streams import Client
from streams.errors import InvalidPattern

OLD, EXTRA, NEW = 30, 5, 5


async def may(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _close(reader: Any) -> None:
    await may(reader.close() if hasattr(reader, "close") else reader.aclose())


def _write(client: Client, name: str, payloads: list[Any]) -> None:
    with client.writer(name, instance="w") as writer:
        writer.append_batch(payloads)


class Seen:
    """What a reader delivered, per stream, checked as it comes: in stream-ID order, once."""

    def __init__(self) -> None:
        self.payloads: dict[str, list[Any]] = {}
        self.last: dict[str, int] = {}

    def take(self, epoch: Any) -> None:
        for fact in epoch.facts:
            assert fact.stream_id > self.last.get(fact.stream, 0), "out of order or twice"
            self.last[fact.stream] = fact.stream_id
            self.payloads.setdefault(fact.stream, []).append(fact.payload)


def _nonempty(expected: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {name: payloads for name, payloads in expected.items() if payloads}


async def _drain(reader: Any, seen: Seen, until: Any, timeout: float = 10.0) -> None:
    """Poll until ``until()`` holds (AssertionError after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out; reader follows {len(reader.streams)}"
        epoch = await may(reader.poll(0.2))
        if epoch is not None:
            seen.take(epoch)


async def follow_scenario(client: Any, writer: Client, base: str, group: str | None) -> Seen:
    """30 matching and 5 other streams with facts; a pattern reader opened on them; while it
    reads, a thread writes to them and creates 5 matching streams (with facts written before
    the reader can have seen them): every matching fact exactly once, in order, none of the
    others. With a group, the reader is closed and reopened (after a commit), and resumes."""
    old = [f"{base}_m{i}" for i in range(OLD)]
    other = [f"{base}_x{i}" for i in range(EXTRA)]
    new = [f"{base}_m{OLD + i}" for i in range(NEW)]
    writer.create_streams(old + other)
    for name in old + other:
        _write(writer, name, [{"s": name, "n": 0}, {"s": name, "n": 1}])
    seen = Seen()
    pattern = rf"{base}_m\d+"
    reader = await may(client.reader(pattern=pattern, group=group, start="latest"))
    # start="latest" applies to the streams that match at open: nothing of theirs yet.
    expected: dict[str, list[Any]] = {name: [] for name in old}

    def write_meanwhile() -> None:
        for i, name in enumerate(old[:10] + other):
            _write(writer, name, [{"s": name, "n": 2}])
            if i % 3 == 0 and new[i // 3 :]:
                fresh = new[i // 3]
                writer.create_streams([fresh])
                _write(writer, fresh, [{"s": fresh, "n": 0}, {"s": fresh, "n": 1}])

    for name in old[:10]:
        expected[name] = [{"s": name, "n": 2}]
    for name in new:
        expected[name] = [{"s": name, "n": 0}, {"s": name, "n": 1}]
    try:
        assert sorted(reader.streams) == sorted(old)
        thread = threading.Thread(target=write_meanwhile)
        thread.start()
        try:
            await _drain(
                reader, seen, lambda: not thread.is_alive() and seen.payloads == _nonempty(expected)
            )
        finally:
            thread.join()
        assert sorted(reader.streams) == sorted(old + new)
        if group is not None:
            committed = await may(reader.commit())
            assert set(committed) == set(old + new)  # the new streams are in the group
            await _close(reader)
            reader = await may(client.reader(pattern=pattern, group=group, start="latest"))
        for name in new + old[10:12]:
            _write(writer, name, [{"s": name, "n": 9}])
            expected[name] = [*expected[name], {"s": name, "n": 9}]
        await _drain(reader, seen, lambda: seen.payloads == _nonempty(expected))
        assert await may(reader.poll(0.3)) is None  # and nothing more comes
        if group is not None:
            await may(reader.commit())
    finally:
        await _close(reader)
    assert seen.payloads == _nonempty(expected)
    assert not any(name in seen.payloads for name in other)
    return seen


@pytest.mark.parametrize("group", [None, "g"])
def test_pattern_reader_sync(client: Client, unique_name: str, group: str | None) -> None:
    asyncio.run(follow_scenario(client, client, unique_name, group))


@pytest.mark.parametrize("group", [None, "g"])
def test_pattern_reader_async(
    streams_url: str, client: Client, unique_name: str, group: str | None
) -> None:
    async def run() -> None:
        async with await streams.aconnect(streams_url, lease_seconds=2.0) as aclient:
            await follow_scenario(aclient, client, unique_name, group)

    asyncio.run(run())


async def drop_scenario(client: Any, writer: Client, base: str) -> None:
    """A dropped stream leaves the reader (no error, its frontier gone), the others go on; a
    stream created again under its name is a new stream, read from its first fact; a group
    commit that finds a stream dropped commits the others."""
    names = [f"{base}_d{i}" for i in range(3)]
    writer.create_streams(names)
    for name in names:
        _write(writer, name, [{"n": 0}])
    seen = Seen()
    reader = await may(client.reader(pattern=rf"{base}_d\d", group="g", poll_interval=0.1))
    try:
        await _drain(reader, seen, lambda: len(seen.payloads) == 3)
        assert len(next(iter(reader.frontier.elements))) == 3
        writer.drop_streams([names[0]])
        _write(writer, names[1], [{"n": 1}])
        await _drain(reader, seen, lambda: names[0] not in reader.streams)
        await _drain(reader, seen, lambda: len(seen.payloads[names[1]]) == 2)
        assert sorted(reader.streams) == names[1:]
        assert len(next(iter(reader.frontier.elements))) == 2
        assert set(await may(reader.commit())) == set(names[1:])
        with pytest.raises(streams.UsageError):
            reader.position(names[0])
        # Created again: another stream (new registry id, new stream IDs), from its first fact.
        seen.last.pop(names[0])
        writer.create_streams([names[0]])
        _write(writer, names[0], [{"n": "again"}])
        await _drain(reader, seen, lambda: len(seen.payloads[names[0]]) == 2)
        assert seen.payloads[names[0]] == [{"n": 0}, {"n": "again"}]
        # Dropped, then a commit before any step: the stream leaves, the others commit.
        writer.drop_streams([names[2]])
        assert set(await may(reader.commit())) == {names[0], names[1]}
        assert sorted(reader.streams) == names[:2]
        _write(writer, names[1], [{"n": 2}])
        await _drain(reader, seen, lambda: len(seen.payloads[names[1]]) == 3)
    finally:
        await _close(reader)


def test_dropped_stream_leaves_sync(client: Client, unique_name: str) -> None:
    asyncio.run(drop_scenario(client, client, unique_name))


def test_dropped_stream_leaves_async(streams_url: str, client: Client, unique_name: str) -> None:
    async def run() -> None:
        async with await streams.aconnect(streams_url, lease_seconds=2.0) as aclient:
            await drop_scenario(aclient, client, unique_name)

    asyncio.run(run())


def test_pattern_matching_nothing_waits(client: Client, unique_name: str) -> None:
    with client.reader(pattern=rf"{unique_name}_later", group="g", poll_interval=0.05) as reader:
        assert reader.streams == ()
        assert reader.poll(0.2) is None
        assert reader.commit() == {}
        client.create_stream(f"{unique_name}_later")
        _write(client, f"{unique_name}_later", [{"n": 1}])
        epoch = reader.poll(5.0)
        assert epoch is not None and [f.payload for f in epoch.facts] == [{"n": 1}]


def test_full_match_in_python_syntax(client: Client, unique_name: str) -> None:
    client.create_streams([f"{unique_name}_a1", f"{unique_name}_a12", f"x{unique_name}_a1"])
    # Full match: not x..._a1 (a prefix) nor ..._a12 (\d is one digit); \d is Python's.
    with client.reader(pattern=rf"{unique_name}_a\d") as reader:
        assert reader.streams == (f"{unique_name}_a1",)


def test_pattern_options_are_checked(client: Client, unique_name: str) -> None:
    with pytest.raises(InvalidPattern, match="not both"):
        client.reader([unique_name], pattern="x")
    with pytest.raises(ValueError, match="pass one of them"):
        client.reader()
    with pytest.raises(InvalidPattern, match="invalid stream pattern"):
        client.reader(pattern="(")


def test_pattern_reader_with_redis(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """With the Redis link: a joined stream's channels are watched (its writers' hints wake
    the reader), a dropped one's are not any more, and closing leaves no watch behind."""
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as client:
        asyncio.run(follow_scenario(client, client, unique_name, "g"))
        asyncio.run(drop_scenario(client, client, unique_name))
        link = client.link
        assert link is not None
        core = link.core
        assert not [s for s in (*core._watched, *core._watched_writers) if unique_name in s]


def _ops(gen: Any, ops: list[Any]) -> Any:
    """Run ``gen`` through, noting each operation it yields (for `streams.store.driver.run`)."""
    try:
        op = next(gen)
        while True:
            ops.append(op)
            op = gen.send((yield op))
    except StopIteration as stop:
        return stop.value


def test_many_streams_poll_with_the_probe_alone(client: Client, unique_name: str) -> None:
    """A caught-up reader of more than `ROWS_WITH_PROBE_MAX` streams probes them in one round
    trip of `PROBE_STATEMENTS` statements, however many; the pages of the streams with news
    follow in one more (pages smaller than the news too: nothing lost, nothing twice)."""
    from streams.store.driver import Pipeline, Receive, Send, run
    from streams.store.probe import PROBE_STATEMENTS
    from streams.store.reader_core import ROWS_WITH_PROBE_MAX

    names = [f"{unique_name}_{i}" for i in range(ROWS_WITH_PROBE_MAX + 4)]
    client.create_streams(names)
    for name in names:
        _write(client, name, [{"n": n} for n in range(5)])
    seen = Seen()
    with client.reader(pattern=rf"{unique_name}_\d+", page_size=2) as reader:
        for epoch in reader.epochs():
            seen.take(epoch)
        assert seen.payloads == {name: [{"n": n} for n in range(5)] for name in names}
        core = reader.core
        assert core.subscription is not None
        core.subscription.due = False
        ops: list[Any] = []
        assert run(reader._conn, _ops(core.step(), ops)) is None
        pipelines = [op for op in ops if isinstance(op, Pipeline)]
        assert [len(p.queries) for p in pipelines] == [PROBE_STATEMENTS]
        assert not [op for op in ops if isinstance(op, Send | Receive)]
        for name in names[:3]:
            _write(client, name, [{"n": 5}, {"n": 6}, {"n": 7}])
        ops.clear()
        epoch = run(reader._conn, _ops(core.step(), ops))
        assert epoch is not None
        sent = [op for op in ops if isinstance(op, Send)]
        assert len(sent) == 1 and len(sent[0].statements) == 3 + 1  # 3 pages, retention
        seen.take(epoch)
        for epoch in reader.epochs():
            seen.take(epoch)
    for name in names[:3]:
        assert seen.payloads[name] == [{"n": n} for n in range(8)]


def test_pattern_reader_arrow_batches(client: Client, unique_name: str) -> None:
    """`batches()` of a pattern reader: the streams that match, then a stream created since."""
    pytest.importorskip("pyarrow")
    client.create_streams([f"{unique_name}_1", f"{unique_name}_2", f"{unique_name}_x"])
    for name in (f"{unique_name}_1", f"{unique_name}_2", f"{unique_name}_x"):
        _write(client, name, [{"s": name}])
    with client.reader(pattern=rf"{unique_name}_\d", poll_interval=0.05) as reader:
        rows = [r for b in reader.batches() for r in b.to_pylist()]
        got = sorted(json.loads(r["payload"])["s"] for r in rows)
        assert got == [f"{unique_name}_1", f"{unique_name}_2"]
        client.create_stream(f"{unique_name}_3")
        _write(client, f"{unique_name}_3", [{"s": "new"}])
        rows = [r for b in reader.batches(idle_timeout=2.0, max_rows=1) for r in b.to_pylist()]
        got_new = [(r["stream"], json.loads(r["payload"])) for r in rows]
        assert got_new == [(f"{unique_name}_3", {"s": "new"})]
        assert "pattern=" in repr(reader) and "(3 streams)" in repr(reader)


def test_a_thousand_streams_and_ten_created_while_reading(client: Client, unique_name: str) -> None:
    """Issue 40's case: a pattern reader of 1,000 matching streams (and others that do not
    match), with 10 more created while it reads: each matching fact exactly once, in order."""
    old = [f"{unique_name}_m{i:04d}" for i in range(1000)]
    new = [f"{unique_name}_m{1000 + i:04d}" for i in range(10)]
    other = [f"{unique_name}_x{i}" for i in range(20)]
    client.create_streams(old + other)
    try:
        for name in old[::50] + other:  # facts on some before it opens
            _write(client, name, [{"s": name, "n": 0}])
        seen = Seen()
        with client.reader(pattern=rf"{unique_name}_m\d+") as reader:
            assert len(reader.streams) == 1000
            for epoch in reader.epochs():
                seen.take(epoch)
            for name in new:
                client.create_stream(name)
                _write(client, name, [{"s": name, "n": 0}, {"s": name, "n": 1}])
            for name in old[1::100]:
                _write(client, name, [{"s": name, "n": 0}])
            expected = {name: [{"s": name, "n": 0}] for name in old[::50] + old[1::100]}
            expected |= {name: [{"s": name, "n": 0}, {"s": name, "n": 1}] for name in new}
            asyncio.run(_drain(reader, seen, lambda: seen.payloads == expected, timeout=20.0))
            assert len(reader.streams) == 1010
        assert seen.payloads == expected
    finally:
        client.drop_streams(old + new + other)
