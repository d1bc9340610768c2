"""Arrow batches (`streams.arrow`): `Reader.batches`, `AsyncReader.batches`, `read_arrow`,
against a real PostgreSQL (and Redis for a following reader): the same facts as `epochs()`, whole
facts only, exactly once across a group's reopen, retention, bounds, the schema of Spark's."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import threading
import time
from collections.abc import Generator, Iterable
from typing import Any

import pandas as pd
import psycopg
import pyarrow as pa
import pytest

import streams
from streams import Client, FactsPruned, UsageError
from streams.arrow import _epoch_batches, schema
from streams.core.epochs import Epoch, Fact

HOUR_MS = 3_600_000


def write_mixed(client: Client, url: str, stream: str) -> dict[int, list[Any]]:
    """Facts of 1 to 9 rows (a page of 4 rows cuts several of them, and two have more rows
    than a page), a rolled-back fact (a gap): stream ID -> payloads in row order."""
    expected: dict[int, list[Any]] = {}
    sizes = [1, 2, 9, 1, 3, 1, 4, 1, 1, 5, 1, 1]
    with client.writer(stream, instance="w") as writer, psycopg.connect(url) as conn:
        for n, size in enumerate(sizes):
            rows = [{"fact": n, "row": r, "text": "é"} for r in range(size)]
            if size == 1:
                expected[writer.append(rows[0]).first_id] = rows
                continue
            with writer.fact(conn) as fact:
                fact.add(*rows)
            expected[fact.stream_id] = rows
            if n == 4:
                with pytest.raises(RuntimeError), writer.fact(conn) as gone:
                    gone.add({"gone": 1})
                    raise RuntimeError("roll back")
        tail = writer.append_batch([{"tail": t} for t in range(6)])
        expected.update((i, [{"tail": t}]) for t, i in enumerate(tail.ids))
    return expected


def facts_of(batches: Iterable[pa.RecordBatch]) -> dict[int, list[Any]]:
    """Stream ID -> payloads (decoded) of every row of the batches; each fact must be whole in
    one batch, and appear in no other."""
    found: dict[int, list[Any]] = {}
    for batch in batches:
        assert batch.schema == schema()
        in_batch: dict[int, list[Any]] = {}
        rows = zip(
            batch.column("stream_id").to_pylist(),
            batch.column("row_no").to_pylist(),
            batch.column("payload").to_pylist(),
            strict=True,
        )
        for stream_id, row_no, payload in rows:
            payloads = in_batch.setdefault(stream_id, [])
            assert row_no == len(payloads)  # rows in order, none missing
            payloads.append(json.loads(payload))
        for stream_id, payloads in in_batch.items():
            assert stream_id not in found, f"fact {stream_id} in two batches"
            found[stream_id] = payloads
    return found


def test_batches_are_the_epochs_facts_whole_and_in_order(
    client: Client, stream: str, streams_url: str
) -> None:
    expected = write_mixed(client, streams_url, stream)
    with client.reader(stream, page_size=4) as reader:
        objects = [f for e in reader.epochs() for f in e]
    with client.reader(stream) as reader:
        batches = list(reader.batches(max_rows=4))
        assert reader.position() == max(expected)
        assert list(reader.batches()) == []  # caught up: nothing more
    assert len(batches) > 5
    assert all(b.num_rows <= 4 or b.column("stream_id").unique().to_pylist() for b in batches)
    for batch in batches:  # a batch over the limit is one fact, read alone
        if batch.num_rows > 4:
            assert len(batch.column("stream_id").unique()) == 1
    found = facts_of(batches)
    assert found == expected
    assert list(found) == sorted(found)
    # The same facts, instances and (running-maximum) timestamps as the object path.
    table = pa.Table.from_batches(batches)
    firsts = table.filter(pa.compute.equal(table.column("row_no"), 0))
    assert firsts.column("stream_id").to_pylist() == [f.stream_id for f in objects]
    assert firsts.column("instance").to_pylist() == [f.instance for f in objects]
    stamps = firsts.column("timestamp").cast(pa.int64()).to_pylist()
    assert stamps == [f.timestamp * 1000 for f in objects]
    assert set(table.column("stream").to_pylist()) == {stream}


def test_group_commit_after_a_batch_and_reopen_is_exactly_once(
    client: Client, stream: str, streams_url: str
) -> None:
    expected = write_mixed(client, streams_url, stream)
    delivered: list[pa.RecordBatch] = []
    with client.reader(stream, group="arrow-g") as reader:
        for batch in reader.batches(max_rows=4):
            delivered.append(batch)
            if len(delivered) == 3:
                break
        last = delivered[-1].column("stream_id")[-1].as_py()
        assert reader.position() == last  # the batch's end: a commit now commits through it
        assert reader.commit() == {stream: last}
        # Read further without committing: delivered again after the reopen.
        uncommitted = next(reader.batches(max_rows=4))
    with client.reader(stream, group="arrow-g") as reader:
        assert reader.position() == last
        rest = list(reader.batches(max_rows=4))
        reader.commit()
    assert rest[0].column("stream_id")[0].as_py() == uncommitted.column("stream_id")[0].as_py()
    assert facts_of(delivered + rest) == expected  # each fact once, across the reopen
    with client.reader(stream, group="arrow-g") as reader:
        assert list(reader.batches()) == []


def test_facts_pruned_under_the_reader(client: Client, unique_name: str) -> None:
    client.create_stream(unique_name, retention_ms=HOUR_MS)
    base = int((time.time() - 2 * 3600) * 1000)
    with client.writer(unique_name, instance="w") as writer:
        olds = writer.append_batch(
            [{"n": k} for k in range(40)], timestamps=[base + k for k in range(40)]
        ).ids
    with client.reader(unique_name) as reader:
        batches = reader.batches(max_rows=5)
        first = next(batches)
        assert reader.position() == first.column("stream_id")[-1].as_py() < olds[-1]
        assert client.prune(unique_name).after == olds[-1]
        # Pages read before the prune (the first step's, and the next step's, read ahead while
        # the first batch was taken) may still be delivered, whole and each checked; the first
        # read after it fails, skipping nothing.
        delivered = [first]
        with pytest.raises(FactsPruned) as caught:
            delivered += batches
        assert caught.value.position == reader.position() < olds[-1]
        got = pa.Table.from_batches(delivered).column("stream_id").to_pylist()
        assert got == list(olds[: len(got)]) and len(delivered) <= 4
    with pytest.raises(FactsPruned):  # a bounded read of pruned facts
        client.read_arrow(unique_name, start=olds[3] + 1, end=olds[6])


def test_read_arrow_bounds(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        ids = writer.append_batch([{"n": n} for n in range(20)]).ids
    table = client.read_arrow(stream, start=ids[3], end=ids[12], max_rows=4)
    assert isinstance(table, pa.Table) and table.schema == schema()
    assert table.column("stream_id").to_pylist() == list(ids[3:12])
    assert [json.loads(p)["n"] for p in table.column("payload").to_pylist()] == list(range(3, 12))
    everything = client.read_arrow(stream)
    assert everything.column("stream_id").to_pylist() == list(ids)
    beyond = client.read_arrow(stream, start=ids[15], end=ids[-1] + 1000)
    assert beyond.column("stream_id").to_pylist() == list(ids[15:])
    assert client.read_arrow(stream, start=ids[10], end=ids[5]).num_rows == 0
    for bad in (0, -3, True, "5"):
        with pytest.raises(UsageError):
            client.read_arrow(stream, end=bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="max_rows"):
        client.read_arrow(stream, max_rows=0)
    # Zero-copy into pandas: the numeric columns are views of the Arrow buffers.
    frame = table.to_pandas()
    assert isinstance(frame, pd.DataFrame)
    assert frame["stream_id"].tolist() == list(ids[3:12])
    assert str(frame["timestamp"].dtype) == "datetime64[us, UTC]"
    view = table.column("stream_id").chunk(0).to_numpy(zero_copy_only=True)
    assert view.tolist() == list(ids[3:6])  # a full page leaves its last fact for the next


def test_start_by_time_filters_as_epochs_do(client: Client, stream: str) -> None:
    base = int(time.time() - 3600) * 1000
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"n": n} for n in range(10)], timestamps=[base + n for n in range(10)])
    at = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=base + 6)
    with client.reader(stream, start=at) as reader:
        objects = [f.stream_id for f in reader.facts()]
    table = client.read_arrow(stream, start=at, max_rows=3)
    assert table.column("stream_id").to_pylist() == objects and len(objects) == 4


def test_following_with_redis_hints(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as client:
        client.create_stream(unique_name)
        with client.reader(unique_name, start="latest") as reader:
            assert list(reader.batches()) == []

            def append_later() -> None:
                time.sleep(0.2)
                with client.writer(unique_name, instance="w") as writer:
                    writer.append({"late": True})

            thread = threading.Thread(target=append_later)
            thread.start()
            started = time.monotonic()
            got = next(reader.batches(idle_timeout=10.0))
            thread.join()
            assert time.monotonic() - started < 5.0
            assert [json.loads(p) for p in got.column("payload").to_pylist()] == [{"late": True}]


def test_async_batches_and_read_arrow(streams_url: str, unique_name: str) -> None:
    async def main() -> None:
        async with await streams.aconnect(streams_url) as client:
            await client.create_stream(unique_name)
            async with await client.writer(unique_name, instance="aw") as writer:
                ack = await writer.append_batch([{"n": n} for n in range(9)])
            async with await client.reader(unique_name, group="ag") as reader:
                got = []
                async for batch in reader.batches(max_rows=4):
                    got.append(batch)
                    break
                assert reader.position() == got[0].column("stream_id")[-1].as_py()
                await reader.commit()
            async with await client.reader(unique_name, group="ag") as reader:
                got += [b async for b in reader.batches(max_rows=4)]
            assert facts_of(got) == {i: [{"n": n}] for n, i in enumerate(ack.ids)}
            table = await client.read_arrow(unique_name, start=ack.ids[2], end=ack.ids[5])
            assert table.column("stream_id").to_pylist() == list(ack.ids[2:5])

    asyncio.run(main())


def test_signed_range_epochs_become_batches() -> None:
    facts = (
        Fact("a", 3, "w", 1000, ({"x": "é"},)),
        Fact("a", 5, "w", 1001, ({"r": 0}, {"r": 1})),
        Fact("b", 2, "v", 7, (None,)),
    )
    (a, b) = _epoch_batches(Epoch({"a": 2, "b": 1}, {"a": 5, "b": 2}, facts))
    assert facts_of([a]) == {3: [{"x": "é"}], 5: [{"r": 0}, {"r": 1}]}
    assert a.column("timestamp").cast(pa.int64()).to_pylist() == [1_000_000, 1_001_000, 1_001_000]
    assert b.column("stream").to_pylist() == ["b"] and b.column("payload").to_pylist() == ["null"]


def test_the_schema_is_the_spark_sources() -> None:
    from streams_spark.executor import arrow_schema

    spark = arrow_schema()
    assert pa.schema([spark.field(i) for i in range(6)]) == schema()


def test_a_missing_extra_is_named(
    client: Client, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "adbc_driver_postgresql.dbapi", None)
    with client.reader(stream) as reader, pytest.raises(UsageError, match=r"streams\[arrow\]"):
        reader.batches()
    with pytest.raises(UsageError, match=r"streams\[arrow\]"):
        client.read_arrow(stream)


def test_a_prefetched_page_is_used_only_where_the_reader_is(client: Client, stream: str) -> None:
    """The next page is read while the caller takes a batch; an epoch delivered in between
    (`poll`) moves the reader, and the prefetched page is then read again, not delivered."""
    with client.writer(stream, instance="w") as writer:
        ids = list(writer.append_batch([{"n": n} for n in range(30)]).ids)
    with client.reader(stream, page_size=5) as reader:
        batches = reader.batches(max_rows=6)
        got = next(batches).column("stream_id").to_pylist()
        epoch = reader.poll()  # the object path, from where the batch ended
        assert epoch is not None
        got += [f.stream_id for f in epoch]
        for batch in batches:
            got += batch.column("stream_id").to_pylist()
    assert got == ids


def test_the_adbc_session_is_checked_on_the_readers_history(client: Client, stream: str) -> None:
    """Step 1 on the second session: a session on another database history reads nothing."""
    with client.writer(stream, instance="w") as writer:
        writer.append({"n": 1})
    with client.reader(stream) as reader:
        token = reader.core.incarnation
        assert token is not None
        other = "00000000-0000-0000-0000-000000000000" + token[token.index("/") :]
        reader.core.incarnation = other  # as if the reader had started on another history
        with pytest.raises(streams.DatabaseChanged):
            next(reader.batches())
        assert reader.position() == 0


def test_a_caller_who_leaves_waits_for_the_prefetch(
    client: Client, streams_url: str, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch nobody will use is waited for when the caller leaves (the generator closed,
    the task cancelled while it takes the prefetch): no read is left running on the sessions,
    and the prefetch thread is gone."""
    from streams import arrow

    read_pages = arrow._read_pages
    calls: list[int] = []
    running: list[int] = []

    def slow(*args: Any) -> Any:  # the first read at once, then slow ones (the prefetches)
        calls.append(1)
        running.append(1)
        try:
            if len(calls) > 1:
                time.sleep(0.5)
            return read_pages(*args)
        finally:
            running.pop()

    monkeypatch.setattr(arrow, "_read_pages", slow)
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"n": n} for n in range(200)])  # more than one read's pages
    with client.reader(stream) as reader:
        batches = reader.batches(max_rows=6)
        assert isinstance(batches, Generator)  # closed as the caller leaving early does
        next(batches)
        assert running  # the next pages are being read
        batches.close()
        assert not running
    assert not [t for t in threading.enumerate() if t.name.startswith("streams-arrow-prefetch")]

    async def main() -> None:
        async with (
            await streams.aconnect(streams_url) as aclient,
            await aclient.reader(stream) as areader,
        ):

            async def consume() -> None:
                async for _ in areader.batches(max_rows=6):
                    pass

            task = asyncio.ensure_future(consume())
            while len(calls) < 2:  # the prefetch runs once the task waits to take it
                await asyncio.sleep(0.01)
            assert running
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not running

    calls.clear()
    asyncio.run(main())
