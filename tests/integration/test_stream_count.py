"""The cost of a call about one stream does not grow with the other streams (issue 40).

Every statement the store sends on behalf of one stream is recorded while the calls run, then
replayed, each in a transaction of its own, under a generic plan (what a prepared statement of
a reader session gets: PostgreSQL 15 then opens and locks every partition its plan names, and
at 10^4 streams one statement overflows the lock table) and under a custom one; after it, the
transaction's locks must name no partition of ``streams_facts`` but this stream's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import streams
from streams import Client
from streams.core.constants import facts_bucket, facts_partition
from streams.store import driver
from streams.store.stream_objects import FACTS_TREE

#: Statements that cannot be replayed outside the call that sent them (they name a
#: transaction's own state, a cursor, or are pipelined text of the simple protocol).
_NOT_REPLAYED = re.compile(r"^\s*(COMMIT|ROLLBACK|BEGIN|SET |RESET |LISTEN|NOTIFY)", re.I)

OTHERS = 12


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, Any]]]:
    """Every (statement, params) the store executes in this process while the test runs."""
    seen: list[tuple[Any, Any]] = []
    execute, aexecute = driver._execute, driver._aexecute

    def note(op: Any) -> None:
        if isinstance(op, driver.Pipeline):
            seen.extend((q.statement, q.params) for q in op.queries)
        elif isinstance(op, driver.Send):
            seen.extend((s.decode(), None) for s in op.statements)
        elif isinstance(op, (driver.Query, driver.Autocommit)):
            seen.append((op.statement, op.params))

    def recording(conn: Any, op: Any) -> Any:
        note(op)
        return execute(conn, op)

    async def arecording(conn: Any, op: Any) -> Any:
        note(op)
        return await aexecute(conn, op)

    monkeypatch.setattr(driver, "_execute", recording)
    monkeypatch.setattr(driver, "_aexecute", arecording)
    yield seen


def _partitions_locked(conn: psycopg.Connection[Any]) -> set[str]:
    """The streams' partitions and buckets this session holds a lock on."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        f"JOIN ({FACTS_TREE}) t ON t.relid = c.oid "
        "WHERE l.pid = pg_backend_pid()"
    ).fetchall()
    return {str(r[0]) for r in rows}


def _replay(url: str, statements: list[tuple[Any, Any]], own: set[str]) -> dict[str, set[str]]:
    """Each statement that reads ``streams_facts`` (or a function that does), replayed under
    both plan modes: the foreign partitions it locked, by statement."""
    found: dict[str, set[str]] = {}
    replayed = 0
    with psycopg.connect(url) as conn:
        for statement, params in statements:
            text = statement.as_string(conn) if hasattr(statement, "as_string") else statement
            text = text.decode() if isinstance(text, bytes) else str(text)
            if _NOT_REPLAYED.match(text) or "streams_facts" not in text:
                continue
            for mode in ("force_generic_plan", "force_custom_plan"):
                try:
                    conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
                    for _ in range(2):  # the second execution runs the prepared plan
                        conn.execute(text, params, prepare=True)
                    foreign = _partitions_locked(conn) - own
                except psycopg.Error:
                    foreign = set()
                conn.rollback()
                replayed += 1
                if foreign:
                    found[" ".join(text.split())[:300]] = foreign
    assert replayed >= 4, f"only {replayed} statements about streams_facts were replayed"
    return found


def test_calls_about_one_stream_lock_only_its_partition(
    client: Client,
    streams_url: str,
    unique_name: str,
    recorded: list[tuple[Any, Any]],
) -> None:
    others = [f"{unique_name}_o{n}" for n in range(OTHERS)]
    client.create_streams(others)
    try:
        stream = unique_name
        client.create_stream(stream)
        key = client.stream(stream).id
        own = {facts_partition(key), facts_bucket(key)}  # a delete through the root: both
        recorded.clear()
        with client.writer(stream) as writer:
            writer.append({"n": 1})
            writer.append_batch([{"n": 2}, {"n": 3}])
            writer.append({"n": 4}, key="k1")
        with client.reader(stream, group="g") as reader:
            got = [f.payload for f in reader.facts()]
            reader.commit()
        assert got == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}]
        with client.reader(stream, group="g") as reader:
            assert list(reader.facts()) == []
        client.positions(stream)
        client.groups(stream)
        client.prune(stream)
        assert client.read_arrow(stream).num_rows == 4
        assert _replay(streams_url, recorded, own) == {}
    finally:
        client.drop_streams(others)


def test_create_streams_in_bulk(client: Client, unique_name: str) -> None:
    names = [f"{unique_name}_{n:03d}" for n in range(450)]  # more than one chunk
    try:
        third = streams.StreamSpec(names[2], retention_ms=60_000)
        made = client.create_streams([*names[:2], {"name": names[2], "retention_ms": 60_000}])
        assert [c.new for c in made] == [True, True, True]
        with pytest.raises(streams.StreamExists):  # other settings than the ones it has
            client.create_streams(names)
        made = client.create_streams([*names[:2], third, *names[3:]])
        assert [c.new for c in made] == [False] * 3 + [True] * 447
        assert made[2].info.retention_ms == 60_000
        assert [c.info.name for c in made] == names
        with pytest.raises(streams.StreamExists):
            client.create_streams([names[0]], exist_ok=False)
        with pytest.raises(streams.StreamExists):  # other settings: nothing of the chunk made
            client.create_streams([f"{unique_name}_new", {"name": names[1], "uncapped": True}])
        with pytest.raises(streams.UnknownStream):
            client.stream(f"{unique_name}_new")
        with pytest.raises(ValueError, match="twice"):
            client.create_streams(["a_x", "a_x"])
        with pytest.raises(ValueError, match="name"):
            client.create_streams([{"retention_ms": 5}])
        with client.writer(names[-1]) as writer:
            assert writer.append({"ok": True}).first_id == 1
    finally:
        assert sorted(client.drop_streams(names)) == names
    assert client.drop_streams(names[:3]) == []


def test_create_and_drop_streams_async(streams_url: str, unique_name: str) -> None:
    names = [f"{unique_name}_a{n}" for n in range(5)]

    async def twin() -> None:
        async with await streams.aconnect(streams_url) as client:
            made = await client.create_streams(names)
            assert all(c.new for c in made)
            assert await client.drop_streams(names) == names

    asyncio.run(twin())
