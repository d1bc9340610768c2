"""Group fencing (issue 27, item 3): a reader group has one live consumer. Opening a group takes
its next generation; a reader that opened it before (a zombie: stalled, partitioned, orphaned)
is fenced, its commits (`commit()` and `commit(conn=...)`) raise `GroupFenced` and move nothing,
on any of its streams (`streams.store.reader_groups`; docs/design/fencing.md). Real
PostgreSQL, sync and asyncio; the race of an open with a commit held in its transaction.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from faultkit import in_thread
from helpers import wait_until
from psycopg.pq import TransactionStatus

import streams
from streams import Client
from streams.command import main
from streams.store.driver import run
from streams.store.reader_groups import group_position
from streams.store.registry import drop_stream


def positions(client: Client, stream: str) -> dict[str, int]:
    return {g.group: g.position for g in client.groups(stream)}


def generations(url: str, stream_id: int) -> dict[str, tuple[int, str]]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT group_name, generation, owner FROM streams_group_generations WHERE stream = %s",
            (stream_id,),
        ).fetchall()
    return {name: (int(generation), owner) for name, generation, owner in rows}


def waits_for_a_lock(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as admin:
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return row is not None and row[0] == "Lock"


def blocked_backends(url: str, blocker: int) -> list[int]:
    """Sessions waiting for a lock ``blocker`` holds."""
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (blocker,)
        ).fetchall()
    return [int(pid) for (pid,) in rows]


def test_a_reader_opened_after_another_fences_it(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        writer.append_batch([{"n": n} for n in range(9)])
    old = client.reader(stream, group="g", page_size=4)  # 3 facts an epoch
    try:
        assert [f.stream_id for f in old.poll() or ()] == [1, 2, 3]
        assert old.commit() == {stream: 3}
        assert [f.stream_id for f in old.poll() or ()] == [4, 5, 6]
        with client.reader(stream, group="g") as new:  # the old one is a zombie from here
            assert new.position() == 3
            with pytest.raises(streams.GroupFenced) as fenced:
                old.commit()
            assert (fenced.value.group, fenced.value.stream) == ("g", stream)
            assert (fenced.value.generation, fenced.value.current) == (1, 2)
            assert positions(client, stream) == {"g": 3}
            with psycopg.connect(streams_url) as conn:
                conn.execute("SELECT 1")  # the caller's transaction, with its effects
                with pytest.raises(streams.GroupFenced):
                    old.commit(conn=conn)
                assert conn.info.transaction_status == TransactionStatus.INERROR
                conn.rollback()
            assert positions(client, stream) == {"g": 3}
            # The live consumer commits what it delivered; the zombie still cannot.
            facts = list(new.facts())
            assert [f.stream_id for f in facts] == list(range(4, 10))
            assert new.commit() == {stream: 9}
            with pytest.raises(streams.GroupFenced):
                old.commit()
        # streams positions (and groups list) show the generation, its owner and its age.
        runner = CliRunner()
        result = runner.invoke(main, ["positions", stream, "--json", "--database-url", streams_url])
        assert result.exit_code == 0, result.output
        (entry,) = json.loads(result.stdout)
        group = entry["groups"]["g"]
        assert group["position"] == 9 and group["generation"] == 2
        assert ":" in group["owner"] and group["taken_at"] and group["taken_age_ms"] >= 0
        result = runner.invoke(main, ["positions", stream, "--database-url", streams_url])
        assert result.exit_code == 0 and "GENERATION" in result.stdout
        result = runner.invoke(
            main, ["groups", "list", stream, "--json", "--database-url", streams_url]
        )
        (listed,) = json.loads(result.stdout)
        assert (listed["group"], listed["generation"]) == ("g", 2)
    finally:
        old.close()


def test_asyncio_reader_is_fenced_the_same_way(streams_url: str, unique_name: str) -> None:
    asyncio.run(_asyncio_fenced(streams_url, unique_name))


async def _asyncio_fenced(streams_url: str, stream: str) -> None:
    async with await streams.aconnect(streams_url, lease_seconds=2.0) as client:
        await client.create_stream(stream)
        async with await client.writer(stream) as writer:
            await writer.append_batch([{"n": n} for n in range(6)])
        old = await client.reader(stream, group="g", page_size=4)
        try:
            epoch = await old.poll()
            assert epoch is not None and [f.stream_id for f in epoch.facts] == [1, 2, 3]
            assert await old.commit() == {stream: 3}
            epoch = await old.poll()
            assert epoch is not None and old.position() == 6
            async with await client.reader(stream, group="g") as new:
                assert new.position() == 3
                with pytest.raises(streams.GroupFenced):
                    await old.commit()
                async with await psycopg.AsyncConnection.connect(streams_url) as conn:
                    with pytest.raises(streams.GroupFenced):
                        await old.commit(conn=conn)
                    assert conn.info.transaction_status == TransactionStatus.INERROR
                    await conn.rollback()
                assert {g.group: g.position for g in await client.groups(stream)} == {"g": 3}
                assert [g.generation for g in await client.groups(stream)] == [2]
        finally:
            await old.aclose()


def test_a_fenced_reader_of_several_streams_moves_none_of_them(
    client: Client, stream: str, streams_url: str, unique_name: str
) -> None:
    other = f"{unique_name}_b"
    client.create_stream(other)
    with client.writer(stream) as wa, client.writer(other) as wb:
        wa.append_batch([{"a": n} for n in range(3)])
        wb.append_batch([{"b": n} for n in range(3)])
    both = client.reader([stream, other], group="g")
    try:
        assert both.commit() == {stream: 0, other: 0}
        assert len(list(both.facts())) == 6
        # A reader of only the first stream takes the group there: the generation of the
        # second stays the reader's own, and still nothing moves on either.
        with client.reader(other, group="g") as taker:
            assert taker.position() == 0
            with pytest.raises(streams.GroupFenced) as fenced:
                both.commit()
            assert (fenced.value.stream, fenced.value.current) == (other, 2)
            with psycopg.connect(streams_url) as conn, pytest.raises(streams.GroupFenced):
                both.commit(conn=conn)
        assert positions(client, stream) == {"g": 0}
        assert positions(client, other) == {"g": 0}
        assert generations(streams_url, client.stream(stream).id)["g"][0] == 1
        assert generations(streams_url, client.stream(other).id)["g"][0] == 2
    finally:
        both.close()


def test_an_open_waits_for_a_commit_held_in_its_transaction_and_sees_it(
    client: Client, stream: str, streams_url: str
) -> None:
    """The race: the old consumer's commit holds the generation row (FOR SHARE) in the caller's
    open transaction while a new consumer opens the group. The open waits for it, then sees
    the committed position (not the one before), and the old consumer is fenced after."""
    with client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(5)])
    old = client.reader(stream, group="g")
    try:
        facts = list(old.facts())
        with psycopg.connect(streams_url) as conn:
            assert old.commit(conn=conn) == {stream: facts[-1].stream_id}
            pid = conn.info.backend_pid
            thread, out = in_thread(lambda: client.reader(stream, group="g"))
            wait_until(lambda: bool(blocked_backends(streams_url, pid)), 10, "the open to wait")
            (waiting,) = blocked_backends(streams_url, pid)
            assert waits_for_a_lock(streams_url, waiting)
            assert not out  # still waiting
            conn.commit()
        thread.join(10)
        (new,) = out
        assert not isinstance(new, BaseException), new
        with new:
            assert new.position() == facts[-1].stream_id  # it saw the old one's commit
            assert new.poll() is None
            with pytest.raises(streams.GroupFenced):
                old.commit()
    finally:
        old.close()
    assert positions(client, stream) == {"g": facts[-1].stream_id}


def test_deleting_a_group_removes_its_generations_and_fences_its_consumer(
    client: Client, stream: str, streams_url: str, unique_name: str
) -> None:
    with client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(3)])
    info = client.stream(stream)
    with client.reader(stream, group="g") as reader:
        list(reader.facts())
        reader.commit()
        assert set(generations(streams_url, info.id)) == {"g"}
        assert client.delete_group(stream, "g") is True
        assert generations(streams_url, info.id) == {}
        with pytest.raises(streams.GroupFenced) as fenced:
            reader.commit()
        assert fenced.value.current is None
        assert positions(client, stream) == {}
        # Opened again (generation 1 again, a new token), the old consumer stays fenced.
        with client.reader(stream, group="g", start=2) as again:
            assert generations(streams_url, info.id)["g"][0] == 1
            with pytest.raises(streams.GroupFenced):
                reader.commit()
            assert again.commit() == {stream: 1}
    with psycopg.connect(streams_url, autocommit=True) as conn:
        assert run(conn, drop_stream(stream))
    assert generations(streams_url, info.id) == {}


def test_group_rows_carry_the_incarnation(client: Client, stream: str, streams_url: str) -> None:
    with client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(2)])
    info = client.stream(stream)
    with client.reader(stream, group="g") as reader, psycopg.connect(streams_url) as conn:
        reader.core.incarnation = "inc-a"
        reader.commit()
        found: Any = run(conn, group_position(info, "g"))
        assert (found.position, found.incarnation) == (0, "inc-a")
        list(reader.facts())
        reader.core.incarnation = "inc-b"
        reader.commit(conn=conn)
        conn.commit()
        found = run(conn, group_position(info, "g"))
        assert (found.position, found.ts_floor > 0, found.incarnation) == (2, True, "inc-b")
