"""Writers against a real PostgreSQL: appends, positions, timestamps, recovery, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import psycopg
import pytest
from faultkit import backend_waits_for_a_lock, in_thread, partition_locked, terminate
from helpers import fact_rows, wait_until

import streams
from streams import Client, TimestampMode

# ---------------------------------------------------------------------------- streams


def test_create_stream_is_idempotent_and_checks_settings(client: Client, unique_name: str) -> None:
    info = client.create_stream(unique_name, timestamping="arrival", retention_ms=60_000)
    assert info.timestamping is TimestampMode.ARRIVAL
    assert client.create_stream(unique_name, timestamping="arrival", retention_ms=60_000) == info
    with pytest.raises(streams.StreamExists):
        client.create_stream(unique_name, timestamping="client-require")
    assert unique_name in [s.name for s in client.streams()]


@pytest.mark.parametrize("name", ["", "Bad", "a b", "x'; DROP TABLE streams_facts; --", "1a"])
def test_bad_stream_names_are_clear_errors(client: Client, name: str) -> None:
    with pytest.raises(streams.InvalidStreamName):
        client.create_stream(name)
    with pytest.raises(streams.InvalidStreamName):
        client.writer(name)


def test_unknown_stream(client: Client, unique_name: str) -> None:
    with pytest.raises(streams.UnknownStream):
        client.writer(unique_name)
    with pytest.raises(streams.UnknownStream):
        client.positions(unique_name)


def test_fresh_stream_has_nothing_allocated(client: Client, stream: str) -> None:
    # Synapse's START WITH pitfall: the sequence's first value is not allocated until nextval.
    positions = client.positions(stream)
    assert (positions.linear, positions.max_allocated) == (0, 0)
    with client.writer(stream, instance="w1") as writer:
        assert writer.append({"n": 1}).first_id == 1


# ---------------------------------------------------------------------------- appends


def test_append_and_batch(client: Client, stream: str, streams_url: str) -> None:
    with client.writer(stream, instance="w1") as writer:
        one = writer.append({"kind": "one"})
        batch = writer.append_batch([{"i": i} for i in range(100)])
        assert (one.count, batch.count) == (1, 100)
        assert list(batch.ids) == sorted(batch.ids) and batch.first_id > one.last_id
        assert batch.first_timestamp <= batch.last_timestamp
        assert one.last_timestamp <= batch.first_timestamp
        wait_until(lambda: client.positions(stream).writers["w1"].position == batch.last_id)
    rows = fact_rows(streams_url, stream)
    assert [r[0] for r in rows] == [one.first_id, *batch.ids]
    assert rows[1][4] == {"i": 0} and rows[-1][4] == {"i": 99}
    assert {r[2] for r in rows} == {"w1"}
    positions = client.positions(stream)
    assert positions.linear == positions.max_allocated == batch.last_id
    assert positions.writers["w1"].retired  # closed writers are caught up


def test_batch_ids_interleave_with_other_writers(client: Client, stream: str) -> None:
    with client.writer(stream, instance="a") as a, client.writer(stream, instance="b") as b:
        acks = [w.append_batch([{"w": w.instance}] * 3) for w in (a, b, a, b)]
    ids = [i for ack in acks for i in ack.ids]
    assert len(set(ids)) == len(ids) == 12


# ---------------------------------------------------------------------------- bad input


def _assert_nothing_leaked(client: Client, writer: streams.Writer, stream: str, url: str) -> None:
    assert writer.core.tracker.pending_count == 0
    assert writer.core.tracker.in_flight_count == 0
    assert fact_rows(url, stream) == []


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"x": object()}, streams.PayloadNotSerializable),
        ({"x": float("nan")}, streams.PayloadNotSerializable),
        ({"x": "nul\x00char"}, streams.PayloadNotSerializable),
        ({(1, 2): "tuple key"}, streams.PayloadNotSerializable),
        ("x" * (1024 * 1024 + 1), streams.PayloadTooLarge),
    ],
)
def test_bad_payloads_write_nothing(
    client: Client, stream: str, streams_url: str, payload: Any, error: type[Exception]
) -> None:
    with client.writer(stream, instance="w1") as writer:
        with pytest.raises(error):
            writer.append(payload)
        with pytest.raises(error):
            writer.append_batch([{"ok": 1}, payload])
        _assert_nothing_leaked(client, writer, stream, streams_url)
        assert writer.append({"ok": True}).first_id >= 1  # still usable


def test_payload_limit_is_configurable(streams_url: str, unique_name: str) -> None:
    with streams.connect(streams_url, max_payload_bytes=100) as small:
        small.create_stream(unique_name)
        with small.writer(unique_name) as writer:
            writer.append("x" * 90)
            with pytest.raises(streams.PayloadTooLarge) as info:
                writer.append("x" * 200)
    assert info.value.limit == 100


@pytest.mark.parametrize("timestamp", [-1, 1.5, "2024", True, 2**63])
def test_bad_timestamps(client: Client, stream: str, streams_url: str, timestamp: Any) -> None:
    with client.writer(stream) as writer:
        with pytest.raises(streams.InvalidTimestamp):
            writer.append({"x": 1}, timestamp=timestamp)
        with (
            pytest.raises(streams.InvalidTimestamp),
            psycopg.connect(streams_url) as conn,
            writer.fact(conn, timestamp=timestamp),
        ):
            pass
        _assert_nothing_leaked(client, writer, stream, streams_url)


def test_database_down_is_a_store_error_without_password(streams_url: str) -> None:
    url = "postgresql://someone:hunter2secret@127.0.0.1:1/nowhere"
    with pytest.raises(streams.StoreError) as info:
        streams.connect(url, connect_timeout=0)  # one attempt: no wait for a starting server
    assert "hunter2secret" not in str(info.value)
    assert "hunter2secret" not in repr(streams.Settings.resolve(url))


def test_configuration_errors() -> None:
    with pytest.raises(streams.ConfigurationError):
        streams.connect("mysql://x@y/z")
    with pytest.raises(streams.ConfigurationError):
        streams.connect("postgresql://x@y/z", lease_seconds=0)


# ---------------------------------------------------------------------------- timestamps


def test_timestamp_modes(client: Client, unique_name: str, streams_url: str) -> None:
    future = int(time.time() * 1000) + 3_600_000
    past = 1_000
    name = unique_name
    client.create_stream(name + "-req", timestamping="client-require")
    client.create_stream(name + "-arr", timestamping="arrival")
    client.create_stream(name + "-unc", uncapped=True)
    client.create_stream(name)
    with client.writer(name + "-req") as writer:
        with pytest.raises(streams.InvalidTimestamp):
            writer.append({"x": 1})
        with pytest.raises(streams.InvalidTimestamp):
            writer.append_batch([{"x": 1}, {"x": 2}], timestamps=[past, None])
        assert fact_rows(streams_url, name + "-req") == []
        assert writer.append({"x": 1}, timestamp=past).first_timestamp == past
    with client.writer(name + "-arr") as writer:
        ack = writer.append({"x": 1}, timestamp=past)
        assert abs(ack.first_timestamp - time.time() * 1000) < 60_000
    with client.writer(name + "-unc") as writer:
        assert writer.append({"x": 1}, timestamp=future).first_timestamp == future
    with client.writer(name) as writer:
        capped = writer.append({"x": 1}, timestamp=future)
        assert capped.first_timestamp < future  # lowered to arrival time
        ack = writer.append_batch([{"i": i} for i in range(3)], timestamps=[past, None, past])
        # raised to the running maximum: never below what came before
        assert ack.first_timestamp >= capped.first_timestamp
        assert ack.first_timestamp <= ack.last_timestamp


def test_timestamps_stay_monotonic_across_restart(client: Client, stream: str) -> None:
    with client.writer(stream, instance="w") as writer:
        high = writer.append({"x": 1}).last_timestamp
    with client.writer(stream, instance="w2") as writer:
        assert writer.append({"x": 2}, timestamp=5).first_timestamp >= high


# ---------------------------------------------------------------------------- positions


def test_idle_writer_does_not_pin_the_linear_position(client: Client, stream: str) -> None:
    idle = client.writer(stream, instance="idle")
    busy = client.writer(stream, instance="busy")
    try:
        ack = busy.append_batch([{"i": i} for i in range(5)])
        # PostgreSQL proves the linear position at once (no transaction holds an ID) ...
        assert client.positions(stream).linear == ack.last_id
        # ... and the idle writer's heartbeat brings its own persisted position up to it.
        wait_until(
            lambda: client.positions(stream).persisted_linear == ack.last_id,
            what="the idle writer's heartbeat to announce max allocated",
        )
        assert idle.position == ack.last_id
    finally:
        idle.close()
        busy.close()


def test_pending_fact_holds_the_linear_position(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="a") as a, client.writer(stream, instance="b") as b:
        with psycopg.connect(streams_url) as conn:
            with a.fact(conn) as fact:
                held = fact.stream_id
                later = b.append({"after": held})
                assert later.first_id > held
                b.heartbeat()
                a.heartbeat()
                positions = client.positions(stream)
                assert positions.linear < held <= positions.max_allocated
                assert a.core.tracker.pending_count == 1
                fact.add({"row": 0}, {"row": 1})
            a.heartbeat()
            b.heartbeat()
            wait_until(lambda: client.positions(stream).linear >= later.first_id)
        rows = fact_rows(streams_url, stream)
        assert [(r[0], r[1]) for r in rows] == [(held, 0), (held, 1), (later.first_id, 0)]


def test_fact_in_callers_tables_commit_and_rollback(
    client: Client, stream: str, streams_url: str, unique_name: str
) -> None:
    table = f"orders_{unique_name}"
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (stream_id bigint, item text)")
    with client.writer(stream, instance="w") as writer, psycopg.connect(streams_url) as conn:
        with writer.fact(conn) as fact:
            for item in ("a", "b", "c"):
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (fact.stream_id, item))
        committed = fact.stream_id
        with pytest.raises(RuntimeError), writer.fact(conn) as fact:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'lost')", (fact.stream_id,))
            raise RuntimeError("application failure")
        gap = fact.stream_id
        assert writer.core.tracker.pending_count == 0
        after = writer.append({"after": "gap"})
        assert writer.position >= after.first_id > gap > committed
        # A connection already in a transaction: the fact joins it, and the block does not
        # end it; the ID stays pending until the caller's rollback, found by the heartbeat.
        conn.execute("BEGIN")
        with writer.fact(conn) as joined:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'rolled back')", (joined.stream_id,))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert writer.core.tracker.pending_count == 1
        conn.rollback()
        wait_until(lambda: writer.core.tracker.pending_count == 0, what="the rollback noticed")
        assert writer.position >= joined.stream_id
    with psycopg.connect(streams_url) as check:
        rows = check.execute(f"SELECT stream_id, item FROM {table} ORDER BY item").fetchall()
    assert rows == [(committed, "a"), (committed, "b"), (committed, "c")]


def test_fact_whose_transaction_failed_or_ended_inside_the_block_is_not_taken_for_written(
    client: Client, stream: str, streams_url: str, unique_name: str
) -> None:
    """COMMIT of a failed transaction is a silent rollback in PostgreSQL; rows written after a
    failed `add` (its transaction rolled back) would commit without their reservation."""
    table = f"lines_{unique_name}"
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (stream_id bigint PRIMARY KEY, item text)")
    with client.writer(stream, instance="w") as writer, psycopg.connect(streams_url) as conn:
        # A statement that failed, its error swallowed inside the block.
        with (
            pytest.raises(streams.StoreError, match="nothing was written"),
            writer.fact(conn) as fact,
        ):
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'a')", (fact.stream_id,))
            with contextlib.suppress(psycopg.errors.UniqueViolation):
                conn.execute(f"INSERT INTO {table} VALUES (%s, 'b')", (fact.stream_id,))
        # A failed add (its transaction is rolled back), the error swallowed, then more rows.
        with (
            pytest.raises(streams.StoreError, match="nothing was written"),
            writer.fact(conn) as fact,
        ):
            with contextlib.suppress(streams.PayloadNotSerializable):  # a careless block
                fact.add({"n": 1}, {"n": "\ud800"})  # a lone surrogate: not UTF-8
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'late')", (fact.stream_id,))
        # The transaction committed by the block itself.
        with (
            pytest.raises(streams.UsageError, match="ended inside the block"),
            writer.fact(conn) as fact,
        ):
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'early')", (fact.stream_id,))
            conn.commit()
        assert writer.core.tracker.pending_count == 0
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        ok = writer.append({"still": "usable"})
        assert writer.position >= ok.last_id
    with psycopg.connect(streams_url) as check:
        items = [r[0] for r in check.execute(f"SELECT item FROM {table}").fetchall()]
    assert items == ["early"]  # the misuse committed it: the error says so
    assert [r[4] for r in fact_rows(streams_url, stream)] == [{"still": "usable"}]


def test_restart_recovers_position_and_rescans(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_batch([{"i": i} for i in range(10)])
    # Simulate a crash after committing facts but before the position was persisted.
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE streams_writers SET position = 2, retired = false "
            "WHERE instance = 'w' AND stream = (SELECT id FROM streams_registry WHERE name = %s)",
            (stream,),
        )
    with client.writer(stream, instance="w") as writer:
        assert writer.core.tracker.local_minimal_position >= ack.last_id
        assert writer.position >= ack.last_id
        assert writer.append({"again": 1}).first_id > ack.last_id


def test_sequence_behind_the_data_is_repaired(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_batch([{"i": i} for i in range(5)])
    seq = client.stream(stream).sequence_name
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"SELECT setval('{seq}', 1)")  # e.g. restored from an old backup
    with client.writer(stream, instance="w") as writer:
        assert writer.append({"after": "repair"}).first_id == ack.last_id + 1


# ---------------------------------------------------------------------------- fencing


def test_takeover_fences_the_previous_writer(client: Client, stream: str, streams_url: str) -> None:
    first = client.writer(stream, instance="same")
    first.append({"from": "first"})
    second = client.writer(stream, instance="same")
    try:
        with pytest.raises(streams.WriterFenced):
            first.append({"from": "first, fenced"})
        with (
            pytest.raises(streams.WriterFenced),
            psycopg.connect(streams_url) as conn,
            first.fact(conn),
        ):
            pass
        assert first.core.tracker.pending_count == 0
        second.append({"from": "second"})
    finally:
        first.close()
        second.close()
    payloads = [r[4]["from"] for r in fact_rows(streams_url, stream)]
    assert payloads == ["first", "second"]


def test_expired_lease_is_retired_and_stops_pinning(
    client: Client, stream: str, streams_url: str
) -> None:
    with streams.connect(streams_url, lease_seconds=0.5) as short:
        stuck = short.writer(stream, instance="stuck")
        # Stop its heartbeat without retiring it, as if the process had frozen.
        stuck._stopped.set()
        stuck._wake.set()
        stuck._thread.join()
        with client.writer(stream, instance="alive") as alive:
            ack = alive.append_batch([{"i": i} for i in range(3)])
            # The frozen writer holds no transaction, so the proven position passes it at once;
            # its persisted position is what pins until the lease expires and it is retired.
            assert client.positions(stream).linear >= ack.last_id
            wait_until(lambda: client.positions(stream).writers["stuck"].retired, timeout=10)
            assert client.positions(stream).persisted_linear >= ack.last_id
        with pytest.raises(streams.WriterFenced):
            stuck.append({"too": "late"})
        stuck._conn.close()
        if stuck._spare is not None:
            stuck._spare.close()


# ---------------------------------------------------------------------------- asyncio


def test_async_writer(streams_url: str, unique_name: str) -> None:
    async def main() -> None:
        async with await streams.aconnect(streams_url, lease_seconds=2.0) as client:
            await client.create_stream(unique_name)
            async with await client.writer(unique_name, instance="aw") as writer:
                acks = await asyncio.gather(*(writer.append({"n": n}) for n in range(50)))
                batch = await writer.append_batch([{"b": i} for i in range(10)])
                ids = sorted(i for ack in acks for i in ack.ids)
                assert len(set(ids)) == 50 and batch.first_id > 0
                async with await psycopg.AsyncConnection.connect(streams_url) as conn:
                    async with writer.fact(conn) as fact:
                        await fact.add({"multi": 1}, {"multi": 2})
                    # Cancellation in the middle of a caller's transaction: a gap, not a leak.
                    started = asyncio.Event()

                    async def held() -> None:
                        async with writer.fact(conn) as f:
                            await f.add({"never": "committed"})
                            started.set()
                            await asyncio.sleep(3600)

                    task = asyncio.create_task(held())
                    await started.wait()
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    assert writer.core.tracker.pending_count == 0
                    assert writer.core.tracker.in_flight_count == 0
                last = await writer.append({"last": True})
                assert writer.position >= last.last_id
            positions = await client.positions(unique_name)
            assert positions.linear == positions.max_allocated

    asyncio.run(main())
    payloads = [r[4] for r in fact_rows(streams_url, unique_name)]
    assert {"never": "committed"} not in payloads
    assert payloads.count({"multi": 1}) == 1


def test_lost_connection_is_a_gap_then_the_writer_reconnects(
    client: Client, stream: str, streams_url: str
) -> None:
    """The session ends while the append waits in its ``INSERT`` (for a lock the test holds):
    the append fails, its reserved ID is a gap (nothing pending or in flight), and the next
    append goes through on a new connection. (Ended while idle, the session is noticed before
    the append is sent, and the append goes through: `tests/faults/test_restarts.py`.)"""
    with client.writer(stream, instance="w") as writer:
        first = writer.append({"n": 1})
        pid = writer._conn.info.backend_pid
        with partition_locked(streams_url, client, stream):
            thread, out = in_thread(lambda: writer.append({"n": "lost"}))
            wait_until(backend_waits_for_a_lock(streams_url, pid), 10, "the INSERT to wait")
            terminate(streams_url, pid)
            thread.join(10)
        (error,) = out
        assert isinstance(error, streams.StoreError), error
        assert writer.core.tracker.pending_count == 0
        assert writer.core.tracker.in_flight_count == 0
        second = writer.append({"n": 2})
        assert second.first_id > first.first_id
        assert writer._conn.info.backend_pid != pid
    assert [r[4] for r in fact_rows(streams_url, stream)] == [{"n": 1}, {"n": 2}]


def test_a_repair_beside_busy_writers_never_sets_the_sequence_back(
    client: Client, stream: str, streams_url: str
) -> None:
    """Opening a writer repairs the stream's sequence (`streams_repair_sequence`). Beside
    writers appending, a repair that read the sequence before the facts saw IDs taken and
    committed meanwhile as "above the sequence" and set it back to them: the next reservation
    got an ID already handed out (`SequenceRewound`). Here repairs run in a loop while two
    writers append: no writer is refused, and every acknowledged fact is stored once."""
    import threading

    stop = threading.Event()
    acked: list[int] = []
    errors: list[BaseException] = []

    def append(k: int) -> None:
        try:
            with client.writer(stream, instance=f"busy{k}") as writer:
                while not stop.is_set():
                    acked.append(writer.append({"k": k}).first_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=append, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    repairs = 0
    with psycopg.connect(streams_url, autocommit=True) as conn:
        (stream_id,) = conn.execute(
            "SELECT id FROM streams_registry WHERE name = %s", (stream,)
        ).fetchone() or (None,)
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not errors:
            conn.execute("SELECT streams_repair_sequence(%s)", (stream_id,))
            repairs += 1
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert repairs > 100 and len(acked) > 100
    stored = [row[0] for row in fact_rows(streams_url, stream)]
    assert sorted(acked) == sorted(set(acked)) == sorted(stored)
