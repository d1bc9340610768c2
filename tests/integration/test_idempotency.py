"""Idempotent appends (`streams.store.idempotency`) and group commits in the caller's
transaction (`streams.store.reader_groups.commit_group_in`), on real PostgreSQL, sync and asyncio.

Appends: a key written once returns the original `Ack` to every later append with it; batches
with some keys written; a claim whose transaction rolls back lets the next append write; a
waiting duplicate holds no reservation; a fenced writer records no key; keys expire with the
stream's window and `prune` removes them; ``fact(conn, key=...)`` in its own and in a joined
transaction. Commits: ``commit(conn=...)`` commits with the caller's transaction or not at all,
and a stale consumer gets `GroupMoved` with its transaction failed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
from faultkit import in_thread
from helpers import fact_rows, wait_until
from psycopg.pq import TransactionStatus

import streams
from streams import Client
from streams.store.driver import run
from streams.store.idempotency import FACT_ID
from streams.store.registry import drop_stream


def key_rows(url: str, stream: str) -> dict[str, int]:
    """Each key of the stream and its fact's ID, as its key row and its claim's row say."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT k.key, {FACT_ID} FROM streams_idempotency_keys k "
            "JOIN streams_registry r ON r.id = k.stream "
            "LEFT JOIN streams_idempotency_claims c "
            "  ON c.stream = k.stream AND c.written_at = k.written_at AND c.claim = k.claim "
            "WHERE r.name = %s",
            (stream,),
        ).fetchall()
    return dict(rows)


def test_a_key_writes_once_and_every_retry_gets_the_original_ack(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="a") as a, client.writer(stream, instance="b") as b:
        first = a.append({"order": 1}, key="order-1")
        assert not first.duplicate and first.duplicates == ()
        again = a.append({"order": 1}, key="order-1")
        other = b.append({"order": "different payload"}, key="order-1")  # not checked
        assert again == first and other == first
        assert (again.first_id, again.first_timestamp) == (first.first_id, first.first_timestamp)
        assert again.duplicate and other.duplicates == (0,)
        unkeyed = a.append({"order": 1})
        assert unkeyed.first_id == first.first_id + 1  # the duplicates reserved no ID
    rows = fact_rows(streams_url, stream)
    assert [(r[0], r[4]) for r in rows] == [
        (first.first_id, {"order": 1}),
        (unkeyed.first_id, {"order": 1}),
    ]
    assert key_rows(streams_url, stream) == {"order-1": first.first_id}


def test_a_batch_writes_its_new_keys_and_returns_the_originals_of_the_others(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream) as writer:
        single = writer.append({"n": 1}, key="k1")
        mixed = writer.append_batch([{"n": 0}, {"n": 1}, {"n": 2}], keys=["k0", "k1", "k2"])
        assert mixed.duplicates == (1,) and not mixed.duplicate
        assert mixed.ids[1] == single.first_id
        assert mixed.ids[0] < mixed.ids[2] and mixed.ids[0] > single.first_id
        assert (mixed.first_id, mixed.last_id, mixed.count) == (single.first_id, mixed.ids[2], 3)
        assert mixed.first_timestamp == single.first_timestamp
        retried = writer.append_batch([{"n": 0}, {"n": 1}, {"n": 2}], keys=["k0", "k1", "k2"])
        assert retried == mixed and retried.duplicate and retried.duplicates == (0, 1, 2)
        assert retried.ids == mixed.ids
        with pytest.raises(streams.UsageError, match="distinct"):
            writer.append_batch([1, 2], keys=["same", "same"])
        with pytest.raises(streams.UsageError, match="one entry per payload"):
            writer.append_batch([1, 2], keys=["only-one"])
        with pytest.raises(streams.UsageError, match="non-empty string"):
            writer.append(1, key="")
    rows = fact_rows(streams_url, stream)
    assert [r[4] for r in rows] == [{"n": 1}, {"n": 0}, {"n": 2}]
    assert key_rows(streams_url, stream) == dict(zip(["k0", "k1", "k2"], mixed.ids, strict=True))


def test_a_keyed_batch_that_fails_after_its_reservation_leaves_no_pending_id_or_key(
    client: Client, stream: str, streams_url: str
) -> None:
    """A payload that cannot be stored fails the batch during its COPY, after its IDs were
    reserved: the transaction rolls back (no fact, no key) and the IDs complete as gaps."""
    with client.writer(stream) as writer:
        with pytest.raises(streams.PayloadNotSerializable):
            writer.append_batch([{"n": 1}, {"bad": float("nan")}], keys=["a", "b"])
        assert writer.core.tracker.pending_count == 0
        assert writer.core.tracker.in_flight_count == 0
        assert key_rows(streams_url, stream) == {}
        ack = writer.append_batch([{"n": 1}, {"n": 2}], keys=["a", "b"])
        assert ack.duplicates == ()
        assert writer.core.tracker.pending_count == 0
    assert [r[4] for r in fact_rows(streams_url, stream)] == [{"n": 1}, {"n": 2}]


def test_a_duplicate_waits_for_the_claim_without_a_reservation_and_writes_if_it_rolls_back(
    client: Client, stream: str, streams_url: str
) -> None:
    """The first claim is held in an open transaction (a joined fact); a second append with
    the key waits in its claim, holding no reservation lock (the linear position is held back
    by the first alone); the first rolls back; the second writes the fact."""
    with (
        client.writer(stream, instance="first") as first,
        client.writer(stream, instance="second") as second,
        psycopg.connect(streams_url) as conn,
    ):
        conn.execute("SELECT 1")  # a transaction of ours, which the fact joins
        with first.fact(conn, key="k") as fact:
            fact.add({"attempt": 1})
        pid = second._conn.info.backend_pid
        thread, out = in_thread(lambda: second.append({"attempt": 2}, key="k"))
        wait_until(lambda: waits_for_a_lock(streams_url, pid), 10, "the claim to wait")
        assert reservation_locks(streams_url) == {conn.info.backend_pid}
        conn.rollback()
        thread.join(10)
        (ack,) = out
        assert isinstance(ack, streams.Ack) and not ack.duplicate
        assert ack.first_id > fact.stream_id
    rows = fact_rows(streams_url, stream)
    assert [(r[0], r[4]) for r in rows] == [(ack.first_id, {"attempt": 2})]
    assert key_rows(streams_url, stream) == {"k": ack.first_id}


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_a_duplicate_that_waited_reads_the_original_committed_meanwhile(
    client: Client, stream: str, streams_url: str, batch: bool
) -> None:
    """The first claim is held in an open transaction; a second append with the key (alone,
    or in a batch with a new key) waits in its claim, holding no reservation lock; the first
    commits. The original is newer than the snapshot of the second's claiming statement, so
    only its second statement (the originals) can read it: it returns the first's `Ack`."""
    with (
        client.writer(stream, instance="first") as first,
        client.writer(stream, instance="second") as second,
        psycopg.connect(streams_url) as conn,
    ):
        conn.execute("SELECT 1")  # a transaction of ours, which the fact joins
        with first.fact(conn, key="k") as fact:
            fact.add({"attempt": 1})
        pid = second._conn.info.backend_pid
        thread, out = in_thread(
            (lambda: second.append_batch([{"new": 1}, {"attempt": 2}], keys=["n", "k"]))
            if batch
            else (lambda: second.append({"attempt": 2}, key="k"))
        )
        wait_until(lambda: waits_for_a_lock(streams_url, pid), 10, "the claim to wait")
        assert reservation_locks(streams_url) == {conn.info.backend_pid}
        conn.commit()
        thread.join(10)
        (ack,) = out
        assert isinstance(ack, streams.Ack), ack
        if batch:
            assert ack.duplicates == (1,) and ack.ids[1] == fact.stream_id
            assert ack.ids[0] > fact.stream_id
            assert ack.first_timestamp == fact.timestamp  # the original's (lowest ID)
        else:
            assert ack.duplicate and ack == fact.ack
            assert ack.first_timestamp == fact.timestamp
    rows = fact_rows(streams_url, stream)
    expected = [(fact.stream_id, {"attempt": 1})]
    if batch:
        expected.append((ack.ids[0], {"new": 1}))
    assert [(r[0], r[4]) for r in rows] == expected
    keys = {"k": fact.stream_id, **({"n": ack.ids[0]} if batch else {})}
    assert key_rows(streams_url, stream) == keys


def test_a_duplicate_whose_original_is_pruned_before_it_is_read_claims_the_key_again(
    client: Client, unique_name: str, streams_url: str
) -> None:
    """A single keyed append claims in one autocommit statement and reads a duplicate's
    original in the next: a prune in between (the key expired) leaves nothing to read, and the
    append starts over and writes the key anew (it has expired)."""
    client.create_stream(unique_name, key_window_ms=60_000)
    with client.writer(unique_name) as writer:
        original = writer.append({"n": 1}, key="k")

        def prune_between(gen: Any) -> Any:
            """Forward ``gen``'s operations, pruning the expired key after the first."""
            op, first = next(gen), True
            while True:
                result = yield op
                if first:
                    first = False
                    assert result[0][0] == 0  # the claim found the key written: a duplicate
                    client.set_key_window(unique_name, 1)
                    time.sleep(0.01)
                    assert client.prune(unique_name).keys_deleted == 1
                    assert claim_rows(streams_url, unique_name) == 0
                try:
                    op = gen.send(result)
                except StopIteration as stop:
                    return stop.value

        core = writer.core
        with writer._lock:  # the connection is shared with the heartbeat
            ack = run(writer._conn, prune_between(core.append([{"n": 2}], [None], ["k"])))
        assert not ack.duplicate and ack.first_id > original.first_id
        assert core.tracker.pending_count == 0
    assert [r[4] for r in fact_rows(streams_url, unique_name)] == [{"n": 1}, {"n": 2}]
    assert key_rows(streams_url, unique_name) == {"k": ack.first_id}


def test_prune_removes_a_claims_row_only_with_the_last_of_its_keys(
    client: Client, unique_name: str, streams_url: str
) -> None:
    """A batch's keys share one claim row. A prune skips a key row that a transaction holds
    locked (a claim in progress), and keeps the claim row that key still refers to; the next
    prune removes both."""
    client.create_stream(unique_name, key_window_ms=200)
    with client.writer(unique_name) as writer:
        batch = writer.append_batch([{"n": 1}, {"n": 2}], keys=["a", "b"])
    time.sleep(0.3)
    with psycopg.connect(streams_url) as locker:
        locker.execute(
            "SELECT 1 FROM streams_idempotency_keys k JOIN streams_registry r ON r.id = k.stream "
            "WHERE r.name = %s AND k.key = 'a' FOR UPDATE OF k",
            (unique_name,),
        ).fetchall()
        assert client.prune(unique_name).keys_deleted == 1
        assert set(key_rows(streams_url, unique_name)) == {"a"}
        assert key_rows(streams_url, unique_name)["a"] == batch.ids[0]  # its claim row is kept
        assert claim_rows(streams_url, unique_name) == 1
    assert client.prune(unique_name).keys_deleted == 1
    assert key_rows(streams_url, unique_name) == {}
    assert claim_rows(streams_url, unique_name) == 0


def claim_keys(url: str, stream: str) -> list[list[str]]:
    """The keys each claim row of the stream lists (sorted), oldest claim first."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.keys FROM streams_idempotency_claims c "
            "JOIN streams_registry r ON r.id = c.stream WHERE r.name = %s "
            "ORDER BY c.written_at, c.claim",
            (stream,),
        ).fetchall()
    return [sorted(row[0]) for row in rows]


def test_prune_walks_the_claims_keys_in_steps_and_keeps_a_claim_with_a_locked_key(
    client: Client, unique_name: str, streams_url: str
) -> None:
    """A claim row lists the keys it wrote (a duplicate's key is not its own); prune walks
    expired claims' keys a step (``batch`` keys) at a time, a claim spanning steps included,
    skips a key row held locked and keeps that key's claim for the next prune, which removes
    both."""
    client.create_stream(unique_name, key_window_ms=300)
    with client.writer(unique_name) as writer:
        writer.append({"n": 0}, key="x")
        writer.append_batch([{"n": n} for n in range(5)], keys=["e", "d", "c", "b", "a"])
        writer.append_batch([{"n": 5}, {"n": 6}], keys=["f", "x"])  # "x": a duplicate
        writer.append({"n": 7}, key="g")
    assert claim_keys(streams_url, unique_name) == [["x"], ["a", "b", "c", "d", "e"], ["f"], ["g"]]
    time.sleep(0.4)
    with psycopg.connect(streams_url) as locker:
        locker.execute(
            "SELECT 1 FROM streams_idempotency_keys k JOIN streams_registry r ON r.id = k.stream "
            "WHERE r.name = %s AND k.key = 'c' FOR UPDATE OF k",
            (unique_name,),
        ).fetchall()
        assert client.prune(unique_name, batch=2).keys_deleted == 7
        assert set(key_rows(streams_url, unique_name)) == {"c"}
        assert claim_keys(streams_url, unique_name) == [["a", "b", "c", "d", "e"]]
    assert client.prune(unique_name, batch=2).keys_deleted == 1
    assert key_rows(streams_url, unique_name) == {}
    assert claim_rows(streams_url, unique_name) == 0


def test_dropping_a_stream_removes_its_keys_and_claims(
    client: Client, unique_name: str, streams_url: str
) -> None:
    info = client.create_stream(unique_name)
    with client.writer(unique_name) as writer:
        writer.append({"n": 1}, key="a")
        writer.append_batch([{"n": 2}, {"n": 3}], keys=["b", "c"])
    with psycopg.connect(streams_url) as conn:
        assert run(conn, drop_stream(unique_name))
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM streams_idempotency_keys WHERE stream = %(id)s), "
            "(SELECT count(*) FROM streams_idempotency_claims WHERE stream = %(id)s)",
            {"id": info.id},
        ).fetchone()
    assert counts == (0, 0)


def claim_rows(url: str, stream: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM streams_idempotency_claims c "
            "JOIN streams_registry r ON r.id = c.stream WHERE r.name = %s",
            (stream,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def waits_for_a_lock(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as admin:
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return row is not None and row[0] == "Lock"


def reservation_locks(url: str) -> set[int]:
    """Sessions of this database holding a reservation lock (streams.core.constants)."""
    from streams.store._common import RESERVATION_LOCKS

    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(f"SELECT l.pid FROM pg_locks l WHERE {RESERVATION_LOCKS}").fetchall()
    return {row[0] for row in rows}


def test_a_fenced_writer_records_no_key_and_the_next_writer_writes(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="old") as old:
        with psycopg.connect(streams_url, autocommit=True) as admin:
            admin.execute(
                "UPDATE streams_writers SET retired = true, generation = generation + 1 "
                "WHERE instance = 'old'"
            )
        with pytest.raises(streams.WriterFenced):
            old.append({"x": 1}, key="k")
        with pytest.raises(streams.WriterFenced):
            old.append_batch([{"x": 1}, {"x": 2}], keys=["k", "k2"])
    assert key_rows(streams_url, stream) == {}
    with client.writer(stream, instance="new") as new:
        ack = new.append({"x": 1}, key="k")
        assert not ack.duplicate
    assert key_rows(streams_url, stream) == {"k": ack.first_id}


def test_a_fenced_fact_fails_the_joined_transaction_and_records_no_key(
    client: Client, stream: str, streams_url: str, unique_name: str
) -> None:
    table = f"effects_{unique_name}"
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (item text)")
    with client.writer(stream, instance="old") as old, psycopg.connect(streams_url) as conn:
        with psycopg.connect(streams_url, autocommit=True) as admin:
            admin.execute("UPDATE streams_writers SET retired = true WHERE instance = 'old'")
            admin.execute("UPDATE streams_writers SET generation = generation + 1")
        conn.execute(f"INSERT INTO {table} VALUES ('effect')")
        with pytest.raises(streams.WriterFenced), old.fact(conn, key="k"):
            pass
        assert conn.info.transaction_status == TransactionStatus.INERROR
        conn.commit()  # PostgreSQL answers with a rollback
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    assert key_rows(streams_url, stream) == {}


def test_keys_expire_with_the_window_and_prune_removes_them(
    client: Client, unique_name: str, streams_url: str
) -> None:
    info = client.create_stream(unique_name, key_window_ms=300)
    assert info.key_window_ms == 300
    assert client.positions(unique_name).key_window_ms == 300
    with client.writer(unique_name) as writer:
        first = writer.append({"n": 1}, key="k")
        assert writer.append({"n": 1}, key="k").duplicate
        time.sleep(0.4)
        anew = writer.append({"n": 1}, key="k")  # older than the window: written anew
        assert not anew.duplicate and anew.first_id > first.first_id
        writer.append({"n": 2}, key="k2")
        time.sleep(0.4)
        assert client.prune(unique_name).keys_deleted == 2
    assert key_rows(streams_url, unique_name) == {}
    assert client.set_key_window(unique_name, 60_000).key_window_ms == 60_000
    with pytest.raises(ValueError, match="positive"):
        client.set_key_window(unique_name, 0)
    with pytest.raises(streams.StreamExists):
        client.create_stream(unique_name, key_window_ms=1000)


def test_a_batch_writes_its_expired_keys_anew_and_prune_removes_the_old_claims(
    client: Client, unique_name: str, streams_url: str
) -> None:
    client.create_stream(unique_name, key_window_ms=300)
    with client.writer(unique_name) as writer:
        first = writer.append_batch([{"n": 1}, {"n": 2}], keys=["a", "b"])
        time.sleep(0.4)
        # "a" expired: claimed anew (its row now refers to the new claim), "c" is new.
        second = writer.append_batch([{"n": 3}, {"n": 4}], keys=["a", "c"])
        assert second.duplicates == () and min(second.ids) > max(first.ids)
        assert writer.append_batch([{"n": 0}, {"n": 0}], keys=["c", "a"]).ids == (
            second.ids[1],
            second.ids[0],
        )
        assert key_rows(streams_url, unique_name) == {
            "a": second.ids[0],
            "b": first.ids[1],
            "c": second.ids[1],
        }
        assert claim_rows(streams_url, unique_name) == 2  # the first's still has "b"
        time.sleep(0.4)
        assert client.prune(unique_name).keys_deleted == 3
    assert key_rows(streams_url, unique_name) == {}
    assert claim_rows(streams_url, unique_name) == 0


def test_a_keyed_fact_in_its_own_transaction_and_its_duplicate(
    client: Client, stream: str, streams_url: str, unique_name: str
) -> None:
    table = f"orders_{unique_name}"
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (stream_id bigint, item text)")
    with client.writer(stream) as writer, psycopg.connect(streams_url) as conn:
        with writer.fact(conn, key="order-7") as fact:
            assert not fact.duplicate
            ack = fact.ack  # known before anything is added
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'first')", (fact.stream_id,))
            fact.add({"order": 7})
        with writer.fact(conn, key="order-7") as again:
            assert again.duplicate and again.ack == ack and again.stream_id == ack.first_id
            # A block that ignores the flag writes nothing: its transaction is rolled back.
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'second')", (again.stream_id,))
            with pytest.raises(streams.UsageError, match=r"fact\.duplicate"):
                again.add({"order": 7})
        assert writer.append({"other": True}, key="order-7") == ack
        assert writer.core.tracker.pending_count == 0
    with psycopg.connect(streams_url) as check:
        assert check.execute(f"SELECT stream_id, item FROM {table}").fetchall() == [
            (ack.first_id, "first")
        ]
    assert [r[4] for r in fact_rows(streams_url, stream)] == [{"order": 7}]


def test_commit_in_the_callers_transaction_commits_with_it_or_not_at_all(
    client: Client, stream: str, streams_url: str, unique_name: str
) -> None:
    table = f"applied_{unique_name}"
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (stream_id bigint)")
    with client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(5)])
    with client.reader(stream, group="g") as reader, psycopg.connect(streams_url) as conn:
        facts = list(reader.facts())
        for fact in facts[:2]:
            conn.execute(f"INSERT INTO {table} VALUES (%s)", (fact.stream_id,))
        assert reader.commit(facts[1], conn=conn) == {stream: facts[1].stream_id}
        assert group_position(client, stream) is None  # not committed yet
        conn.commit()
        assert group_position(client, stream) == facts[1].stream_id
        # Rolled back: neither the effects nor the position; the reader then knows the group
        # is not where it left it, and reopening it delivers those facts again.
        for fact in facts[2:]:
            conn.execute(f"INSERT INTO {table} VALUES (%s)", (fact.stream_id,))
        reader.commit(conn=conn)
        conn.rollback()
        with pytest.raises(streams.GroupMoved, match="rolled back"):
            reader.commit(conn=conn)
        assert conn.info.transaction_status == TransactionStatus.INERROR
        conn.rollback()
    with client.reader(stream, group="g") as reader, psycopg.connect(streams_url) as conn:
        rest = list(reader.facts())
        assert [f.stream_id for f in rest] == [f.stream_id for f in facts[2:]]
        for fact in rest:
            conn.execute(f"INSERT INTO {table} VALUES (%s)", (fact.stream_id,))
        reader.commit(conn=conn)
        conn.commit()
        applied = [row[0] for row in conn.execute(f"SELECT stream_id FROM {table} ORDER BY 1")]
    assert applied == [f.stream_id for f in facts]
    assert group_position(client, stream) == facts[-1].stream_id


def test_a_stale_consumer_cannot_commit_over_another(
    client: Client, stream: str, streams_url: str
) -> None:
    """Two consumers of one group read the same facts; the one that opened the group first is
    fenced by the second (`GroupFenced`, tests/integration/test_group_fencing.py): its commit
    in its transaction fails it, and the other's commits."""
    with client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(3)])
    with (
        client.reader(stream, group="g") as one,
        client.reader(stream, group="g") as two,
        psycopg.connect(streams_url) as c1,
        psycopg.connect(streams_url) as c2,
    ):
        assert len(list(one.facts())) == len(list(two.facts())) == 3
        with pytest.raises(streams.GroupFenced):
            one.commit(conn=c1)
        assert c1.info.transaction_status == TransactionStatus.INERROR
        c1.rollback()
        assert group_position(client, stream) is None
        two.commit(conn=c2)
        c2.commit()
        with pytest.raises(streams.UsageError, match="move it back"):
            two.commit(through=_first(two, stream, client), conn=c2)
    assert group_position(client, stream) == 3


def _first(reader: Any, stream: str, client: Client) -> Any:
    with client.reader(stream) as other:
        return next(iter(other.facts()))


def group_position(client: Client, stream: str) -> int | None:
    groups = {g.group: g.position for g in client.groups(stream)}
    return groups.get("g")


def test_asyncio_keyed_appends_facts_and_commits(streams_url: str, unique_name: str) -> None:
    asyncio.run(_asyncio_keyed(streams_url, unique_name))


async def _asyncio_keyed(streams_url: str, unique_name: str) -> None:
    async with await streams.aconnect(streams_url, lease_seconds=2.0) as client:
        await client.create_stream(unique_name)
        async with await client.writer(unique_name) as writer:
            first = await writer.append({"n": 1}, key="a")
            assert await writer.append({"n": 1}, key="a") == first
            batch = await writer.append_batch([{"n": 1}, {"n": 2}], keys=["a", "b"])
            assert batch.duplicates == (0,) and batch.ids[0] == first.first_id
            async with await psycopg.AsyncConnection.connect(streams_url) as conn:
                async with writer.fact(conn, key="c") as fact:
                    await fact.add({"n": 3})
                async with writer.fact(conn, key="c") as again:
                    assert again.duplicate and again.ack == fact.ack
                await conn.execute("SELECT 1")  # joined
                async with writer.fact(conn, key="d") as joined:
                    await joined.add({"n": 4})
                assert writer.core.tracker.pending_count == 1
                await conn.commit()
                deadline = time.monotonic() + 10
                while writer.core.tracker.pending_count and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert writer.core.tracker.pending_count == 0
        async with await client.reader(unique_name, group="g") as reader:
            got = [f async for f in reader.facts()]
            async with await psycopg.AsyncConnection.connect(streams_url) as conn:
                assert await reader.commit(conn=conn) == {unique_name: got[-1].stream_id}
                await conn.commit()
        assert [f.payload for f in got] == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}]
        assert {g.group: g.position for g in await client.groups(unique_name)} == {
            "g": got[-1].stream_id
        }
