"""Readers against a real PostgreSQL (and Redis): starts, epochs, frontiers, groups, waits."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from helpers import wait_until

import streams
from streams import Antichain, Client, Epoch, Fact, Reader, TimestampMode

UTC = dt.UTC
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


# ---------------------------------------------------------------------------- helpers


def at_ms(ms: int) -> dt.datetime:
    """The aware datetime of ``ms`` milliseconds since the Unix epoch (exact)."""
    return EPOCH + dt.timedelta(milliseconds=ms)


def past_ms(seconds_ago: float = 3600.0) -> int:
    """A whole-second time well in the past, so client timestamps are not capped to arrival."""
    return int(time.time() - seconds_ago) * 1000


def db_facts(url: str, stream: str) -> dict[int, tuple[int, list[Any]]]:
    """Committed facts of ``stream``: id -> (raw timestamp of row 0, payloads in row order)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT f.stream_id, f.row_no, f.ts, f.payload FROM streams_facts f "
            "JOIN streams_registry r ON r.id = f.stream WHERE r.name = %s "
            "ORDER BY f.stream_id, f.row_no",
            (stream,),
        ).fetchall()
    facts: dict[int, tuple[int, list[Any]]] = {}
    for stream_id, row_no, ts, payload in rows:
        if row_no == 0:
            facts[stream_id] = (ts, [])
        facts[stream_id][1].append(payload)
    return facts


def drain(reader: Reader, first_timeout: float = 0.0) -> list[Epoch]:
    """Every epoch available now (waiting up to ``first_timeout`` for the first one)."""
    first = reader.poll(timeout=first_timeout)
    if first is None:
        return []
    return [first, *reader.epochs(idle_timeout=0.0)]


def read_until(reader: Reader, count: int, timeout: float = 5.0) -> list[Epoch]:
    """Epochs until at least ``count`` facts have arrived."""
    epochs: list[Epoch] = []
    deadline = time.monotonic() + timeout
    while sum(len(e) for e in epochs) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            got = sum(len(e) for e in epochs)
            raise AssertionError(f"only {got} of {count} facts within {timeout}s")
        epoch = reader.poll(timeout=remaining)
        if epoch is not None:
            epochs.append(epoch)
    return epochs


def check_epochs(epochs: Sequence[Epoch], stream: str, start: int) -> list[Fact]:
    """Assert the epochs of ``stream`` are consecutive from ``start`` and each holds exactly
    facts of its range, in strictly increasing ID order; returns the stream's facts."""
    position = start
    facts: list[Fact] = []
    for epoch in epochs:
        assert epoch.lower[stream] == position, (epoch, position)
        assert epoch.upper[stream] >= position, epoch
        mine = [f for f in epoch.facts if f.stream == stream]
        for fact in mine:
            assert position < fact.stream_id <= epoch.upper[stream], (epoch, fact)
            assert not facts or fact.stream_id > facts[-1].stream_id, (facts[-1], fact)
        facts.extend(mine)
        position = epoch.upper[stream]
    return facts


def ids(facts: Sequence[Fact]) -> list[int]:
    return [f.stream_id for f in facts]


class Background(threading.Thread):
    """Run ``target`` after ``delay`` seconds in a thread, keeping any exception for join."""

    def __init__(self, target: Callable[[], object], delay: float = 0.0) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self._delay = delay
        self.error: BaseException | None = None

    def run(self) -> None:
        time.sleep(self._delay)
        try:
            self._target_fn()
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float = 10.0) -> None:
        self.join(timeout)
        assert not self.is_alive(), "background work did not finish"
        if self.error is not None:
            raise self.error


# ---------------------------------------------------------------------------- start positions


def test_start_earliest_latest_and_stream_id(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        before = writer.append_batch([{"n": n} for n in range(5)])
        with client.reader(stream) as earliest:
            facts = check_epochs(drain(earliest), stream, 0)
            assert ids(facts) == list(before.ids)
            assert [f.payload for f in facts] == [{"n": n} for n in range(5)]
        with client.reader(stream, start=3) as from_id:
            assert from_id.position() == 2
            assert ids(check_epochs(drain(from_id), stream, 2)) == [3, 4, 5]
        with client.reader(stream, start="latest") as latest:
            assert latest.position() == before.last_id
            assert drain(latest) == []
            after = writer.append({"n": "after"})
            facts = check_epochs(read_until(latest, 1), stream, before.last_id)
            assert ids(facts) == [after.first_id]
            assert facts[0].payload == {"n": "after"}
        with client.reader(stream, start=after.first_id + 10) as beyond:
            later = writer.append_batch([{"n": "later"}] * 12)
            facts = check_epochs(read_until(beyond, 2), stream, after.first_id + 9)
            assert ids(facts) == [i for i in later.ids if i >= after.first_id + 10]


def test_start_at_a_gap_id_begins_at_the_next_fact(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer, psycopg.connect(streams_url) as conn:
        writer.append({"n": 1})
        with pytest.raises(RuntimeError), writer.fact(conn) as lost:
            lost.add({"lost": True})
            raise RuntimeError("roll back")
        kept = writer.append({"n": 2})
    with client.reader(stream, start=lost.stream_id) as reader:
        assert ids(check_epochs(drain(reader), stream, lost.stream_id - 1)) == [kept.first_id]


def test_start_at_a_datetime(client: Client, stream: str) -> None:
    assert client.stream(stream).timestamping is TimestampMode.CLIENT_PREFER
    base = past_ms()
    with client.writer(stream, instance="w") as writer:
        for k in range(4):
            writer.append({"k": k}, timestamp=base + 1000 * k)
        for start_ms, expected in [
            (base - 5, [1, 2, 3, 4]),
            (base + 1500, [3, 4]),
            (base + 2000, [3, 4]),  # ">=": a fact exactly at the start is included
            (base + 3000, [4]),
        ]:
            with client.reader(stream, start=at_ms(start_ms)) as reader:
                begin = reader.position()
                facts = check_epochs(drain(reader), stream, begin)
                assert ids(facts) == expected, start_ms
                assert all(f.timestamp >= start_ms for f in facts)
        # A start after every fact: nothing now, facts appended later are delivered.
        with client.reader(stream, start=at_ms(base + 10_000)) as reader:
            assert reader.position() == 4
            assert drain(reader) == []
            after = writer.append({"k": "after"})  # arrival time: now, after the start
            assert ids(check_epochs(read_until(reader, 1), stream, 4)) == [after.first_id]


def test_position_before_time_finds_out_of_order_facts_through_the_time_index(
    client: Client, stream: str, streams_url: str
) -> None:
    """`position_before_time` answers from the time index, then checks the rows before its
    candidate for facts written out of order; beyond `TIME_START_STEPS` windows it scans. Each
    answer equals the definition (first ID with ts >= t, minus one), computed by brute force."""
    import random

    from streams.store.driver import run
    from streams.store.rows import TIME_START_STEPS, TS_FLOOR_WINDOW, position_before_time

    info = client.stream(stream)
    rng = random.Random(7)
    n = TS_FLOOR_WINDOW * (TIME_START_STEPS + 3)
    # Mostly ascending timestamps with writers' jitter; some facts far out of order, some
    # multi-row facts.
    ts = {i: 1_000_000 + 10 * i + rng.randrange(-40, 40) for i in range(1, n + 1)}
    for i in rng.sample(range(1, n), 20):
        ts[i] += 5_000  # written out of order with the 500 facts after it
    # A chain of out-of-order facts, one window apart, longer than TIME_START_STEPS windows.
    # Each link is found in the window before the previous one (ts rising as IDs fall).
    for k in range(TIME_START_STEPS + 2):
        ts[n - 10 - k * (TS_FLOOR_WINDOW * 9 // 10)] = 5_000_000 + k
    with psycopg.connect(streams_url, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO streams_facts (stream, stream_id, row_no, instance, ts, payload) "
                "VALUES (%s, %s, %s, 'w', %s, '{}')",
                [(info.id, i, r, ts[i]) for i in ts for r in range(1 + (i % 97 == 0))],
            )
        conn.execute("SELECT setval(%s::regclass, %s)", (info.sequence_name, n))
        conn.execute("ANALYZE streams_facts")
        probes = [rng.choice(list(ts.values())) + d for d in (-1, 0, 1) for _ in range(10)]
        for t in [0, 5_000_000, 5_000_005, 5_000_100, 1_000_000 + 10 * n, *probes]:
            matching = [i for i, v in ts.items() if v >= t]
            expected = min(matching) - 1 if matching else None
            assert run(conn, position_before_time(info, t)) == expected, t
        # The documented limit: a lone fact far more than a window before the candidate (a
        # transaction held open for thousands of facts, or a writer's timestamps skewed far
        # ahead) is not looked for; a reader started there from earliest would count it.
        island = 3 * TS_FLOOR_WINDOW
        for stream_id, late in [(island, 9_000_001), (n, 9_000_000)]:
            conn.execute(
                "UPDATE streams_facts SET ts = %s WHERE stream = %s AND stream_id = %s",
                (late, info.id, stream_id),
            )
        assert run(conn, position_before_time(info, 9_000_000)) == n - 1  # exact: island - 1
        assert run(conn, position_before_time(info, 9_000_001)) == island - 1


def test_start_datetime_between_milliseconds_excludes_the_earlier_fact(
    client: Client, stream: str
) -> None:
    # Fact timestamps are whole ms; a start 0.5 ms after a fact's timestamp is after the fact.
    base = past_ms()
    with client.writer(stream, instance="w") as writer:
        writer.append({"k": 0}, timestamp=base)
        writer.append({"k": 1}, timestamp=base + 1)
    start = at_ms(base) + dt.timedelta(microseconds=500)
    with client.reader(stream, start=start) as reader:
        begin = reader.position()
        facts = check_epochs(drain(reader), stream, begin)
    assert ids(facts) == [2], "the fact at base ms is before a start of base + 0.5 ms"


def test_start_timedelta_ago(client: Client, stream: str) -> None:
    now = int(time.time() * 1000)
    with client.writer(stream, instance="w") as writer:
        writer.append({"age": "2h"}, timestamp=now - 7_200_000)
        writer.append({"age": "10m"}, timestamp=now - 600_000)
        recent = writer.append({"age": "now"})
    with client.reader(stream, start=dt.timedelta(hours=1)) as reader:
        begin = reader.position()
        facts = check_epochs(drain(reader), stream, begin)
    assert [f.payload["age"] for f in facts] == ["10m", "now"]
    assert facts[-1].stream_id == recent.first_id
    with client.reader(stream, start=dt.timedelta(days=1)) as reader:
        assert len(check_epochs(drain(reader), stream, 0)) == 3


def test_start_datetime_does_not_skip_a_pending_fact_at_or_after_it(
    client: Client, stream: str, streams_url: str
) -> None:
    """A pending fact whose timestamp is >= the start must be delivered once it commits."""
    base = past_ms()
    with (
        client.writer(stream, instance="a") as a,
        client.writer(stream, instance="b") as b,
        psycopg.connect(streams_url) as conn,
    ):
        a.append({"n": "old"}, timestamp=base - 60_000)
        with a.fact(conn, timestamp=base + 1000) as held:
            held.add({"n": "held"})
            later = b.append({"n": "later"}, timestamp=base + 2000)
            reader = client.reader(stream, start=at_ms(base))
        try:
            begin = reader.position()
            epochs = drain(reader, first_timeout=2.0)  # the held fact has committed now
        finally:
            reader.close()
    # The held fact (timestamp base + 1 s >= start) must not be skipped.
    assert ids(check_epochs(epochs, stream, begin)) == [held.stream_id, later.first_id]
    # Everything that may appear at or after the start was still ahead of the reader.
    assert begin < held.stream_id, f"started at position {begin}, past the pending fact"


def test_start_live_skips_what_was_active_at_join(
    client: Client, stream: str, streams_url: str
) -> None:
    with (
        client.writer(stream, instance="a") as a,
        client.writer(stream, instance="b") as b,
        psycopg.connect(streams_url) as conn,
    ):
        a.append_batch([{"n": n} for n in range(3)])
        with client.reader(stream, start="live") as quiet:
            assert quiet.position() == 3
            assert drain(quiet) == []
            fresh = b.append({"n": "fresh"})
            assert ids(check_epochs(read_until(quiet, 1), stream, 3)) == [fresh.first_id]
        # Join while a fact is pending and a later one committed: both were active at join.
        with a.fact(conn) as held:
            held.add({"n": "held"})
            active = b.append({"n": "active"})
            live = client.reader(stream, start="live")
        try:
            assert live.position() == held.stream_id - 1
            after = b.append({"n": "after"})
            facts = check_epochs(read_until(live, 1), stream, held.stream_id - 1)
            assert ids(facts) == [after.first_id]
            assert live.position() == after.first_id > active.first_id
        finally:
            live.close()


@pytest.mark.parametrize(
    "start",
    [
        0,
        -1,
        True,
        False,
        "nope",
        "",
        1.5,
        None,
        dt.datetime(2024, 1, 1),  # naive
        dt.timedelta(seconds=-1),
    ],
)
def test_bad_start_is_a_usage_error(client: Client, stream: str, start: Any) -> None:
    with pytest.raises(streams.UsageError):
        client.reader(stream, start=start)


def test_bad_stream_lists(client: Client, stream: str) -> None:
    unique_name = stream
    missing = f"{unique_name}_missing"
    with pytest.raises(streams.UnknownStream) as info:
        client.reader(missing)
    assert info.value.stream == missing
    with pytest.raises(streams.UnknownStream):
        client.reader([stream, missing])
    with pytest.raises(streams.UsageError):
        client.reader([])
    with pytest.raises(streams.UsageError):
        client.reader([stream, stream])
    for page_size in (0, -3, True):
        with pytest.raises(streams.UsageError):
            client.reader(stream, page_size=page_size)
    with pytest.raises(streams.UsageError):
        client.reader(stream, group="")


# ---------------------------------------------------------------------------- epochs


def test_epochs_are_consecutive_whole_and_match_the_table(
    client: Client, stream: str, streams_url: str
) -> None:
    sizes = [2, 2, 10, 1, 3, 1, 4, 1, 1, 1, 5]
    expected: list[tuple[int, list[Any]]] = []
    with client.writer(stream, instance="w") as writer, psycopg.connect(streams_url) as conn:
        for n, size in enumerate(sizes):
            if size == 1:
                ack = writer.append({"fact": n, "row": 0})
                expected.append((ack.first_id, [{"fact": n, "row": 0}]))
                continue
            rows = [{"fact": n, "row": r} for r in range(size)]
            with writer.fact(conn) as fact:
                fact.add(*rows[:1])
                fact.add(*rows[1:])  # rows added in two calls stay in order
            expected.append((fact.stream_id, rows))
            if n == 4:
                with pytest.raises(RuntimeError), writer.fact(conn) as gone:
                    gone.add({"gone": 1}, {"gone": 2})
                    raise RuntimeError("roll back")
        last = writer.append_batch([{"tail": t} for t in range(7)])
        expected.extend((i, [{"tail": t}]) for t, i in enumerate(last.ids))
    with client.reader(stream, page_size=3) as reader:
        epochs = drain(reader)
        facts = check_epochs(epochs, stream, 0)
        assert reader.position() == last.last_id
    assert [(f.stream_id, list(f.payloads)) for f in facts] == expected
    table = db_facts(streams_url, stream)
    assert [(i, p) for i, (_, p) in table.items()] == expected
    assert gone.stream_id not in table and gone.stream_id not in ids(facts)
    big = next(f for f in facts if len(f.payloads) == 10)
    assert big.payload == {"fact": 2, "row": 0}
    assert len(epochs) > 5  # the pages really did cut the stream
    assert all(len(e.facts) >= 1 for e in epochs)  # no empty page: nothing rolled back at the end
    for epoch in epochs:  # a page holds at most 3 rows, unless one fact alone is bigger
        row_count = sum(len(f.payloads) for f in epoch)
        assert row_count <= 3 or len(epoch) == 1, epoch
    # With the default page size everything comes in one epoch.
    with client.reader(stream) as one:
        (epoch,) = drain(one)
        assert [(f.stream_id, list(f.payloads)) for f in epoch] == expected
        assert (epoch.lower[stream], epoch.upper[stream]) == (0, last.last_id)


def test_rolled_back_facts_never_appear_but_the_position_passes_them(
    client: Client, stream: str, streams_url: str
) -> None:
    with (
        client.writer(stream, instance="w") as writer,
        psycopg.connect(streams_url) as conn,
        client.reader(stream) as reader,
    ):
        first = writer.append({"n": 1})
        with pytest.raises(RuntimeError), writer.fact(conn) as gap1:
            gap1.add({"lost": 1})
            raise RuntimeError("roll back")
        facts = check_epochs(drain(reader), stream, 0)
        assert ids(facts) == [first.first_id]
        assert reader.position() == gap1.stream_id  # the frontier moved over the gap
        second = writer.append({"n": 2})
        with writer.fact(conn) as kept:
            kept.add({"kept": 1})
        with pytest.raises(RuntimeError), writer.fact(conn) as gap2:
            raise RuntimeError("roll back, no rows at all")
        epochs = drain(reader)
        facts = check_epochs(epochs, stream, gap1.stream_id)
        assert ids(facts) == [second.first_id, kept.stream_id]
        assert reader.position() == gap2.stream_id
        # Only a gap: an epoch with no facts still moves the frontier.
        with pytest.raises(RuntimeError), writer.fact(conn) as gap3:
            raise RuntimeError("roll back")
        epoch = reader.poll(timeout=2.0)
        assert epoch is not None and len(epoch) == 0
        assert (epoch.lower[stream], epoch.upper[stream]) == (gap2.stream_id, gap3.stream_id)
    assert {"lost": 1} not in [p for _, ps in db_facts(streams_url, stream).values() for p in ps]


def test_timestamps_never_decrease_for_readers(
    client: Client, stream: str, streams_url: str
) -> None:
    info = client.stream(stream)
    assert (info.timestamping, info.uncapped) == (TimestampMode.CLIENT_PREFER, False)
    base = past_ms()
    a = client.writer(stream, instance="a")
    b = client.writer(stream, instance="b")  # registered before any fact: its floor is 0
    try:
        a.append({"n": 1}, timestamp=base + 5000)
        b.append({"n": 2}, timestamp=base + 1000)
        b.append({"n": 3}, timestamp=base + 3000)
        a.append({"n": 4}, timestamp=base + 2000)  # raised by a itself to base + 5000
        b.append_batch([{"n": 5}, {"n": 6}], timestamps=[base + 9000, base + 4000])
    finally:
        a.close()
        b.close()
    raw = [ts for ts, _ in db_facts(streams_url, stream).values()]
    assert raw != sorted(raw), "the test needs stored timestamps that decrease"
    floors = [max(raw[: i + 1]) for i in range(len(raw))]
    assert [t - base for t in floors] == [5000, 5000, 5000, 5000, 9000, 9000]
    with client.reader(stream, page_size=3, group="g") as reader:
        first = reader.poll()
        assert first is not None and [f.timestamp for f in first] == floors[:2]
        reader.commit()
        rest = check_epochs(drain(reader), stream, 2)
        assert [f.timestamp for f in rest] == floors[2:]
    # Starting mid-stream (by ID, or resuming a group) keeps the running maximum.
    with client.reader(stream, start=3) as mid:
        assert [f.timestamp for f in check_epochs(drain(mid), stream, 2)] == floors[2:]
    with client.reader(stream, group="g") as resumed:
        assert [f.timestamp for f in check_epochs(drain(resumed), stream, 2)] == floors[2:]


def test_iterating_and_closing_a_reader(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_batch([{"n": n} for n in range(4)])
        reader = client.reader(stream, page_size=2)
        assert repr(reader) == f"<Reader streams=[{stream!r}] group=None>"
        seen: list[int] = []
        for epoch in reader:  # blocks for more: stop once everything has arrived
            seen.extend(ids(epoch.facts))
            if len(seen) == 4:
                break
        assert seen == list(ack.ids)
        later = writer.append({"n": 4})
        assert next(reader.facts(idle_timeout=2.0)).payload == {"n": 4}
        assert reader.position() == later.first_id
        reader.close()
        reader.close()  # idempotent
        with pytest.raises(streams.UsageError):
            reader.poll()


# ---------------------------------------------------------------------------- pending facts


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_pending_fact_holds_the_frontier(
    client: Client, stream: str, streams_url: str, outcome: str
) -> None:
    with (
        client.writer(stream, instance="a") as a,
        client.writer(stream, instance="b") as b,
        psycopg.connect(streams_url) as conn,
        client.reader(stream) as reader,
    ):
        first = b.append({"n": "first"})
        expect_error = pytest.raises(RuntimeError) if outcome == "rollback" else None
        with expect_error or contextlib.nullcontext(), a.fact(conn) as held:
            held.add({"n": "held", "row": 0}, {"n": "held", "row": 1})
            later = b.append_batch([{"n": "later", "i": i} for i in range(3)])
            other = client.reader(stream)  # a reader joining now is held back too
            try:
                facts = check_epochs(drain(reader), stream, 0)
                assert ids(facts) == [first.first_id]
                assert reader.position() == held.stream_id - 1
                assert reader.poll(timeout=0.3) is None
                assert reader.position() < held.stream_id
                assert reader.probe().less_equal(held.stream_id)
                assert ids(check_epochs(drain(other), stream, 0)) == [first.first_id]
            finally:
                other.close()
            if outcome == "rollback":
                raise RuntimeError("roll back")
        facts = check_epochs(read_until(reader, 3), stream, held.stream_id - 1)
        committed = [held.stream_id] if outcome == "commit" else []
        assert ids(facts) == [*committed, *later.ids]
        if outcome == "commit":
            assert facts[0].payloads == ({"n": "held", "row": 0}, {"n": "held", "row": 1})
        assert reader.position() == later.last_id


# ---------------------------------------------------------------------------- several streams


def test_reader_of_two_streams(client: Client, stream: str, unique_name: str) -> None:
    other = f"{unique_name}_b"
    client.create_stream(other)
    with client.writer(stream, instance="wa") as wa, client.writer(other, instance="wb") as wb:
        a = wa.append_batch([{"a": i} for i in range(3)])
        b = wb.append_batch([{"b": i} for i in range(2)])
        with client.reader([stream, other], group="both") as reader:
            assert reader.streams == (stream, other)
            (epoch,) = drain(reader)
            assert dict(epoch.lower) == {stream: 0, other: 0}
            assert dict(epoch.upper) == {stream: a.last_id, other: b.last_id}
            assert [(f.stream, f.stream_id) for f in epoch] == [
                *((stream, i) for i in a.ids),
                *((other, i) for i in b.ids),
            ]
            assert reader.frontier == Antichain([(a.last_id + 1, b.last_id + 1)])
            assert reader.position(stream) == a.last_id
            assert reader.position(other) == b.last_id
            with pytest.raises(streams.UsageError):
                reader.position()
            with pytest.raises(streams.UsageError):
                reader.position("not_followed")
            with pytest.raises(streams.UsageError):
                reader.probe()
            probe = reader.probe(stream)
            assert not probe.less_equal(a.last_id) and probe.less_equal(a.last_id + 1)
            assert not probe.less_than(a.last_id + 1) and probe.less_than(a.last_id + 2)
            vector = reader.vector_probe()
            assert vector.less_equal((a.last_id + 1, b.last_id + 1))
            assert not vector.less_equal((a.last_id, b.last_id + 5))
            assert not vector.less_equal((a.last_id + 5, b.last_id))
            # Only the second stream moves: the first keeps its position in the epoch.
            more = wb.append({"b": "more"})
            (epoch,) = read_until(reader, 1)
            assert dict(epoch.lower) == {stream: a.last_id, other: b.last_id}
            assert dict(epoch.upper) == {stream: a.last_id, other: more.first_id}
            assert [(f.stream, f.stream_id) for f in epoch] == [(other, more.first_id)]
            assert reader.frontier == Antichain([(a.last_id + 1, more.first_id + 1)])
            assert reader.commit() == {stream: a.last_id, other: more.first_id}
    assert [(g.group, g.position) for g in client.groups(stream)] == [("both", a.last_id)]
    assert [(g.group, g.position) for g in client.groups(other)] == [("both", more.first_id)]


# ---------------------------------------------------------------------------- reader groups


def test_reader_groups_resume_commit_forward_only_and_win_over_start(
    client: Client, stream: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_batch([{"n": n} for n in range(10)])
        assert list(ack.ids) == list(range(1, 11))
        assert client.groups(stream) == []
        # A full page leaves its last fact for the next one: 4 rows a page, 3 facts.
        old = client.reader(stream, group="g", page_size=4)
        try:
            first = old.poll()
            assert first is not None and ids(first.facts) == [1, 2, 3]
            assert old.commit() == {stream: 3}
            (row,) = client.groups(stream)
            assert (row.stream, row.group, row.position, row.lag) == (stream, "g", 3, 7)
            with client.reader(stream, group="g", start="latest") as new:
                assert new.position() == 3  # the group wins over start
                facts = check_epochs(drain(new), stream, 3)
                assert ids(facts) == list(range(4, 11))
                assert new.commit() == {stream: 10}
            (row,) = client.groups(stream)
            assert (row.position, row.lag) == (10, 0)
            # The old reader (at 3) commits: the new one opened the group since (generation
            # 2), so the old one is fenced and the group stays at 10.
            with pytest.raises(streams.GroupFenced):
                old.commit()
            assert client.groups(stream)[0].position == 10
        finally:
            old.close()
        more = writer.append_batch([{"n": n} for n in range(10, 14)])
        (row,) = client.groups(stream)
        assert (row.position, row.lag) == (10, 4)
        with client.reader(stream, group="g", start=1) as resumed:
            assert ids(check_epochs(drain(resumed), stream, 10)) == list(more.ids)
        with client.reader(stream, group="fresh", start=12) as fresh:
            assert fresh.position() == 11  # no committed position: start applies
            assert fresh.group == "fresh"
        assert [g.group for g in client.groups(stream)] == ["g"]
        with client.reader(stream) as plain, pytest.raises(streams.UsageError):
            plain.commit()
        assert client.delete_group(stream, "g") is True
        assert client.groups(stream) == []
        with client.reader(stream, group="g", start="latest") as again:
            assert again.position() == more.last_id


# ---------------------------------------------------------------------------- waiting


def test_wait_for_position(client: Client, stream: str, streams_url: str) -> None:
    with (
        client.writer(stream, instance="a") as a,
        client.writer(stream, instance="b") as b,
        psycopg.connect(streams_url) as conn,
        client.reader(stream) as reader,
    ):
        first = b.append({"n": 1})
        reader.wait_for_position(stream, first.last_id, timeout=2.0)
        assert reader.position() == 0  # waiting is about visibility, not delivery
        with a.fact(conn) as held:
            held.add({"n": "held"})
            later = b.append({"n": 2})
            started = time.monotonic()
            with pytest.raises(streams.WaitTimeout):
                reader.wait_for_position(stream, later.last_id, timeout=0.3)
            assert time.monotonic() - started >= 0.3
            with pytest.raises(TimeoutError):
                reader.wait_for_position(stream, held.stream_id, timeout=0.1)
            # b's own facts through `later` are complete once b persisted its position...
            reader.wait_for_position(stream, later.last_id, instance="b", timeout=5.0)
            # ... but a's are not: its fact is still pending.
            with pytest.raises(streams.WaitTimeout):
                reader.wait_for_position(stream, later.last_id, instance="a", timeout=0.3)
            with pytest.raises(streams.UsageError):
                reader.wait_for_position("not_followed", 1, timeout=0.1)
        reader.wait_for_position(stream, later.last_id, timeout=2.0)
        assert ids(check_epochs(drain(reader), stream, 0)) == [
            first.first_id,
            held.stream_id,
            later.first_id,
        ]

        # A wait in progress returns as soon as the holding transaction commits.
        reserved = threading.Event()
        token: list[int] = []

        def hold_then_commit() -> None:
            with a.fact(conn) as fact:
                fact.add({"n": "late"})
                token.append(fact.stream_id)
                reserved.set()
                time.sleep(0.4)

        worker = Background(hold_then_commit)
        worker.start()
        assert reserved.wait(5.0)
        started = time.monotonic()
        reader.wait_for_position(stream, token[0], timeout=5.0)
        elapsed = time.monotonic() - started
        worker.finish()
        assert 0.2 <= elapsed < 3.0, elapsed


# ---------------------------------------------------------------------------- asyncio


def test_async_reader(streams_url: str, unique_name: str) -> None:
    async def main() -> None:
        async with await streams.aconnect(streams_url, lease_seconds=2.0) as client:
            await client.create_stream(unique_name)
            async with (
                await client.writer(unique_name, instance="aw") as writer,
                await psycopg.AsyncConnection.connect(streams_url) as conn,
            ):
                acks = [await writer.append({"n": n}) for n in range(5)]
                async with writer.fact(conn) as multi:
                    await multi.add(*({"row": r} for r in range(4)))
                reader = await client.reader(unique_name, group="ag", page_size=3)
                try:
                    assert isinstance(reader, streams.AsyncReader)
                    epoch = await reader.poll(timeout=2.0)
                    assert epoch is not None and ids(epoch.facts) == [1, 2]
                    assert await reader.commit() == {unique_name: 2}
                finally:
                    await reader.aclose()
                with pytest.raises(streams.UsageError):
                    await reader.poll()
                (row,) = await client.groups(unique_name)
                assert (row.position, row.lag) == (2, 4)
                async with await client.reader(unique_name, group="ag") as reader:
                    epochs = [e async for e in reader.epochs(idle_timeout=0.0)]
                    facts = check_epochs(epochs, unique_name, 2)
                    assert ids(facts) == [3, 4, 5, multi.stream_id]
                    assert facts[-1].payloads == tuple({"row": r} for r in range(4))
                    assert reader.frontier == Antichain([(multi.stream_id + 1,)])
                    # Following: a fact appended while the reader waits arrives.
                    task = asyncio.create_task(_append_later(writer, {"n": "later"}, 0.2))
                    epoch = await reader.poll(timeout=5.0)
                    later = await task
                    assert epoch is not None and ids(epoch.facts) == [later.first_id]
                    # A pending fact holds the frontier; a wait times out, then succeeds.
                    async with writer.fact(conn) as held:
                        await held.add({"n": "held"})
                        with pytest.raises(streams.WaitTimeout):
                            await reader.wait_for_position(unique_name, held.stream_id, timeout=0.2)
                        assert await reader.poll(timeout=0.2) is None
                    await reader.wait_for_position(unique_name, held.stream_id, timeout=2.0)
                    got = [f async for f in reader.facts(idle_timeout=0.0)]
                    assert ids(got) == [held.stream_id]
                    assert await reader.commit() == {unique_name: held.stream_id}
                assert len(acks) == 5
                await reader.aclose()  # closing twice is harmless

    asyncio.run(main())


async def _append_later(writer: streams.AsyncWriter, payload: Any, delay: float) -> streams.Ack:
    await asyncio.sleep(delay)
    return await writer.append(payload)


# ---------------------------------------------------------------------------- Redis


@pytest.fixture
def redis_clients(
    streams_url: str, redis_url: str, redis_prefix: str
) -> Iterator[tuple[Client, Client]]:
    """Two clients on one Redis prefix, each with its own link: (reader side, writer side)."""
    with (
        streams.connect(
            streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=2.0
        ) as reading,
        streams.connect(
            streams_url, redis_url=redis_url, prefix=redis_prefix, lease_seconds=2.0
        ) as writing,
    ):
        yield reading, writing


def test_redis_hint_wakes_a_live_reader(
    redis_clients: tuple[Client, Client], unique_name: str
) -> None:
    reading, writing = redis_clients
    reading.create_stream(unique_name)
    with (
        reading.reader(unique_name, poll_interval=30.0) as reader,
        writing.writer(unique_name, instance="remote") as writer,
    ):
        assert reading.link is not None and writing.link is not None
        assert reading.link is not writing.link
        wait_until(lambda: reader.poll() is None and reader.live, what="the reader to go live")
        link = writing.link
        wait_until(lambda: link.connected, what="the writer's link to connect")
        for n in range(3):
            worker = Background(lambda n=n: writer.append({"n": n}), delay=0.2)  # type: ignore[misc]
            started = time.monotonic()
            worker.start()
            epoch = reader.poll(timeout=10.0)
            elapsed = time.monotonic() - started
            worker.finish()
            assert epoch is not None, "nothing delivered"
            assert [f.payload for f in epoch] == [{"n": n}]
            # poll_interval is 30 s: only the Redis hint can have woken the reader this soon.
            assert elapsed < 2.0, elapsed
        assert reader.live


def test_redis_hint_wakes_a_live_async_reader(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    async def main() -> None:
        options: dict[str, Any] = {
            "redis_url": redis_url,
            "prefix": redis_prefix,
            "lease_seconds": 2.0,
        }
        async with (
            await streams.aconnect(streams_url, **options) as reading,
            await streams.aconnect(streams_url, **options) as writing,
        ):
            await reading.create_stream(unique_name)
            async with (
                await reading.reader(unique_name, poll_interval=30.0) as reader,
                await writing.writer(unique_name, instance="remote") as writer,
            ):
                assert reading.link is not writing.link
                deadline = time.monotonic() + 10.0
                while not (await reader.poll() is None and reader.live):
                    assert time.monotonic() < deadline, "the async reader never went live"
                    await asyncio.sleep(0.01)
                while not (writing.link is not None and writing.link.connected):
                    assert time.monotonic() < deadline, "the writer's link never connected"
                    await asyncio.sleep(0.01)
                for n in range(3):
                    started = time.monotonic()
                    task = asyncio.create_task(_append_later(writer, {"n": n}, 0.2))
                    epoch = await reader.poll(timeout=10.0)
                    elapsed = time.monotonic() - started
                    await task
                    assert epoch is not None, "nothing delivered"
                    assert [f.payload for f in epoch] == [{"n": n}]
                    assert elapsed < 2.0, elapsed
                assert reader.live

    asyncio.run(main())


# ---------------------------------------------------------------------------- concurrency


def test_concurrent_writers_and_a_following_reader(
    client: Client, stream: str, streams_url: str
) -> None:
    acked: list[int] = []
    gaps: list[int] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        with client.writer(stream, instance=f"w{k}") as w, psycopg.connect(streams_url) as conn:
            for i in range(40):
                if i % 4 == 0:
                    got = list(
                        w.append_batch([{"w": k, "i": i, "j": j} for j in range(1 + i % 5)]).ids
                    )
                elif i % 4 == 2:
                    # Held open a while, so later IDs of other threads commit first.
                    with w.fact(conn) as fact:
                        fact.add({"w": k, "i": i, "row": 0})
                        time.sleep(0.005 * (1 + i % 3))
                        fact.add({"w": k, "i": i, "row": 1})
                    got = [fact.stream_id]
                elif i % 17 == 3:
                    try:
                        with w.fact(conn) as fact:
                            fact.add({"w": k, "i": i, "lost": True})
                            raise RuntimeError("roll back")
                    except RuntimeError:
                        with lock:
                            gaps.append(fact.stream_id)
                    continue
                else:
                    got = [w.append({"w": k, "i": i}).first_id]
                with lock:
                    acked.extend(got)

    workers = [Background(lambda k=k: work(k)) for k in range(3)]  # type: ignore[misc]
    epochs: list[Epoch] = []
    with client.reader(stream, page_size=7) as reader:
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers):
            epoch = reader.poll(timeout=0.05)
            if epoch is not None:
                epochs.append(epoch)
        for worker in workers:
            worker.finish()
        reader.wait_for_position(stream, max(acked + gaps), timeout=5.0)
        epochs.extend(reader.epochs(idle_timeout=0.0))
        assert reader.position() == max(acked + gaps)
    facts = check_epochs(epochs, stream, 0)
    assert len(epochs) > 3
    assert ids(facts) == sorted(acked)
    table = db_facts(streams_url, stream)
    assert ids(facts) == list(table)
    assert [list(f.payloads) for f in facts] == [p for _, p in table.values()]
    assert not set(gaps) & set(ids(facts))


def test_payloads_beyond_orjson_still_read(client: Client, stream: str) -> None:
    """Integers beyond 64 bits are valid JSON and JSONB: the fast decoder's fallback reads them."""
    payloads: list[Any] = [{"big": 2**80, "neg": -(2**70)}, {"plain": [1, "two", None, 3.5]}]
    with client.writer(stream, instance="w") as writer:
        writer.append_batch(payloads)
    with client.reader(stream) as reader:
        assert [f.payload for f in reader.facts()] == payloads
