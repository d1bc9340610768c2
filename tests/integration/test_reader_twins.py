"""`Reader` and `AsyncReader` behave alike: one scripted scenario, run through each.

Both shells drive the same plans (`streams.reader_plans`) with the kernel's two drivers
(`streams.plans`); what differs is only each world's sessions. The scenario is written once
(what the synchronous reader returns is used as it is, what the asyncio one returns is awaited)
and run on a fresh stream each time, so IDs come out the same; each step records what a caller
observes (epochs, positions, commits, Arrow rows, errors) and the two records must be equal.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

import streams
from streams import Client

Record = list[tuple[str, Any]]


async def may(value: Any) -> Any:
    """The synchronous reader's result as it is; the asyncio one's awaited."""
    return await value if inspect.isawaitable(value) else value


async def _entered(manager: Any) -> Any:
    return await manager if inspect.isawaitable(manager) else manager


async def _epochs(reader: Any) -> list[tuple[dict[str, int], list[Any]]]:
    got = []
    while (epoch := await may(reader.poll(0))) is not None:
        got.append((dict(epoch.upper), [f.payload for f in epoch.facts]))
    return got


async def _batches(reader: Any) -> list[list[Any]]:
    found = reader.batches(max_rows=2)
    if hasattr(found, "__aiter__"):
        return [batch.to_pylist() async for batch in found]
    return [batch.to_pylist() for batch in found]


def _rows(batches: list[list[Any]]) -> list[tuple[int, int, str]]:
    return [(r["stream_id"], r["row_no"], r["payload"]) for page in batches for r in page]


async def _outcome(record: Record, what: str, call: Any) -> Any:
    try:
        value = await may(call())
    except Exception as exc:  # compared by type and text
        record.append((what, ("raised", type(exc).__name__, str(exc))))
        return None
    record.append((what, value))
    return value


async def scenario(client: Any, stream: str, group: str) -> Record:
    record: Record = []
    reader = await _entered(client.reader(stream, group=group))
    try:
        record.append(("epochs", await _epochs(reader)))
        record.append(("position", reader.position(stream)))
        record.append(("frontier", str(reader.frontier)))
        record.append(("live", reader.live))
        await _outcome(record, "commit", reader.commit)
        await _outcome(record, "reached", lambda: reader.wait_for_position(stream, 4, timeout=5))
        await _outcome(
            record, "not reached", lambda: reader.wait_for_position(stream, 99, timeout=0.2)
        )
        await _outcome(record, "prove when caught up", lambda: reader.prove(0))
    finally:
        await may(reader.close() if hasattr(reader, "close") else reader.aclose())
    await _outcome(record, "poll after close", lambda: reader.poll(0))
    # A new consumer of the group resumes after the commit: nothing left.
    again = await _entered(client.reader(stream, group=group))
    try:
        record.append(("resumed", await _epochs(again)))
    finally:
        await may(again.close() if hasattr(again, "close") else again.aclose())
    # Arrow batches from the start, two rows at a time.
    fresh = await _entered(client.reader(stream, start="earliest"))
    try:
        record.append(("batches", _rows(await _batches(fresh))))
    finally:
        await may(fresh.close() if hasattr(fresh, "close") else fresh.aclose())
    return record


def _fresh_stream(client: Client, name: str) -> str:
    client.create_stream(name)
    with client.writer(name, instance="w") as writer:
        writer.append_batch([{"n": n} for n in range(3)])
        writer.append({"n": 3})
    return name


def test_reader_and_async_reader_behave_alike(
    streams_url: str, client: Client, unique_name: str
) -> None:
    pytest.importorskip("pyarrow")
    sync_stream = _fresh_stream(client, f"{unique_name}_s")
    async_stream = _fresh_stream(client, f"{unique_name}_a")

    sync_record = asyncio.run(scenario(client, sync_stream, "g"))

    async def run_async() -> Record:
        async with await streams.aconnect(streams_url, lease_seconds=2.0) as aclient:
            return await scenario(aclient, async_stream, "g")

    async_record = asyncio.run(run_async())

    def named(record: Record, stream: str) -> str:
        return repr(record).replace(stream, "<stream>")

    assert named(sync_record, sync_stream) == named(async_record, async_stream)
    # And the scenario saw what it should.
    got = dict(sync_record)
    assert [p for _, payloads in got["epochs"] for p in payloads] == [{"n": n} for n in range(4)]
    assert got["resumed"] == []
    assert [row[:2] for row in got["batches"]] == [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert got["poll after close"][0] == "raised"
