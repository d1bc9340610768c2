"""Recovery and sequence repair see every fact: declared user tables, writers, reader groups.

Issue 7: startup repair compared the sequence with ``streams_facts`` alone, so after a sequence
was set back (restore from a backup, a bad migration) an ID that a user table already held was
handed out again; a restarted writer whose persisted position was above the last stored fact got
a ``ValueError``; restarting one writer name again and again kept ``persisted_linear`` pinned
past the lease. Also: no connection of the library may sit idle in a transaction.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import psycopg
import pytest
from helpers import wait_until

import streams
from streams import Client, InvalidFactTables, SequenceRewound, StoreError, StreamsError
from streams._ops import run
from streams.core import WriterCore
from streams.store import FactTable


@pytest.fixture
def order_lines(streams_url: str, unique_name: str) -> Iterator[str]:
    """A user table holding facts of a stream (its own rows, keyed by stream ID)."""
    table = f"lines_{unique_name.replace('-', '_')}"
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (stream_id bigint NOT NULL, item text)")
        conn.execute(f"CREATE INDEX ON {table} (stream_id)")
    yield table
    with psycopg.connect(streams_url, autocommit=True) as conn:
        # Streams of the shared test database must stay healthy for other tests' doctors.
        conn.execute(
            "UPDATE streams_registry SET fact_tables = '[]' WHERE fact_tables::text LIKE %s",
            (f"%{table}%",),
        )
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def set_back(url: str, client: Client, stream: str, value: int = 1) -> None:
    """What a restore from an old backup does to a stream's sequence."""
    seq = client.stream(stream).sequence_name
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"SELECT setval('{seq}', {value})")


def write_user_fact(client: Client, url: str, stream: str, table: str, instance: str) -> int:
    with client.writer(stream, instance=instance) as writer, psycopg.connect(url) as conn:
        with writer.fact(conn) as fact:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'apple')", (fact.stream_id,))
        return fact.stream_id


# ---------------------------------------------------------------------------- declaring tables


def test_fact_tables_are_declared_validated_and_changeable(
    client: Client, unique_name: str, order_lines: str, streams_url: str
) -> None:
    info = client.create_stream(unique_name, fact_tables=[f"{order_lines}.stream_id"])
    assert info.fact_tables == (FactTable(f"public.{order_lines}", "stream_id"),)
    assert client.stream(unique_name).as_dict()["fact_tables"] == [
        f"public.{order_lines}.stream_id"
    ]
    # Idempotent with the same tables; different ones are a settings clash.
    client.create_stream(unique_name, fact_tables=[(order_lines, "stream_id")])
    client.create_stream(unique_name)  # None: whatever is declared
    with pytest.raises(StreamsError, match="exists already"):
        client.create_stream(unique_name, fact_tables=[])
    # Changeable later, validated.
    assert client.set_fact_tables(unique_name, []).fact_tables == ()
    for bad, message in [
        (["no_such_table.stream_id"], "no table"),
        ([f"{order_lines}.no_such_column"], "no table"),
        ([f"{order_lines}.item"], "integer type"),
        (["a.b.c.d"], "invalid fact table"),
        (['x"; DROP TABLE y; --.id'], "invalid fact table"),
        ("lines.stream_id", "not a single string"),
        (["streams_facts.stream_id"], "always included"),
    ]:
        with pytest.raises(InvalidFactTables, match=message):
            client.set_fact_tables(unique_name, bad)
    assert client.stream(unique_name).fact_tables == ()


# ---------------------------------------------------------------------------- repair


def test_repair_sees_facts_that_live_only_in_a_declared_table(
    client: Client, unique_name: str, order_lines: str, streams_url: str
) -> None:
    client.create_stream(unique_name, fact_tables=[f"{order_lines}.stream_id"])
    ids = [write_user_fact(client, streams_url, unique_name, order_lines, "w") for _ in range(3)]
    set_back(streams_url, client, unique_name)
    with client.writer(unique_name, instance="v") as writer:
        assert writer.append({"after": "restore"}).first_id > max(ids)


def test_repair_sees_reader_group_and_writer_positions(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_batch([{"i": i} for i in range(5)])
    with client.reader(stream, group="g") as reader:
        assert len(list(reader.facts())) == 5
        reader.commit()
    # Facts gone from the built-in table (e.g. pruned), sequence restored from an old backup:
    # the group committed past ack.last_id, so those IDs must never be handed out again.
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute("DELETE FROM streams_facts WHERE stream = %s", (client.stream(stream).id,))
    set_back(streams_url, client, stream)
    with client.writer(stream, instance="v") as writer:
        assert writer.append({"after": "restore"}).first_id > ack.last_id
    with client.reader(stream, group="g") as reader:
        assert [f.payload for f in reader.facts()] == [{"after": "restore"}]


def test_restarted_writer_above_the_last_stored_fact_is_not_a_value_error(
    client: Client, unique_name: str, order_lines: str, streams_url: str
) -> None:
    """Facts in an *undeclared* table: the writer's own persisted position still tells repair
    that those IDs were used (the bug report's ValueError('was the sequence reset?'))."""
    client.create_stream(unique_name)
    last = 0
    for _ in range(3):
        last = write_user_fact(client, streams_url, unique_name, order_lines, "w")
    set_back(streams_url, client, unique_name)
    with client.writer(unique_name, instance="w") as writer:
        assert writer.append({"again": 1}).first_id > last


def test_sequence_set_back_under_a_running_writer_is_a_streams_error(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream, instance="w") as writer:
        ack = writer.append_batch([{"i": i} for i in range(3)])
        set_back(streams_url, client, stream)
        with pytest.raises(SequenceRewound, match="set back"):
            writer.append({"lost": False})
        with pytest.raises(SequenceRewound):
            writer.append_batch([{"lost": False}] * 2)
        assert writer.core.tracker.pending_count == 0
    # Nothing was written twice; a new writer repairs and goes on.
    with client.writer(stream, instance="w") as writer:
        assert writer.append({"after": 1}).first_id > ack.last_id
    with client.reader(stream) as reader:
        assert [f.id for f in reader.facts()][:3] == list(ack.ids)


def test_restarting_one_name_again_and_again_does_not_pin_persisted_linear(
    client: Client, stream: str, streams_url: str
) -> None:
    """A process that registers a name and dies before its first heartbeat, over and over,
    within the lease: each takeover persists max allocated (nothing of that name can be
    pending once the previous process is fenced), so persisted_linear keeps up."""
    with client.writer(stream, instance="busy") as busy, psycopg.connect(streams_url) as conn:
        for _ in range(5):
            busy.append_batch([{"n": n} for n in range(10)])
            core = WriterCore(stream, "flappy", lease_seconds=2.0, max_payload_bytes=1 << 20)
            run(conn, core.register())  # ... and the process "dies" here: no heartbeat, no close
            allocated = client.positions(stream).max_allocated
            busy.heartbeat()
            persisted = client.positions(stream).writers["flappy"].position
            assert persisted >= allocated
            time.sleep(0.3)
        busy.heartbeat()
        positions = client.positions(stream)
        assert positions.persisted_linear >= positions.max_allocated - 0


# ---------------------------------------------------------------------------- transactions


def _states(url: str, pids: list[int]) -> dict[int, str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, state FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
        ).fetchall()
    return {int(pid): str(state) for pid, state in rows}


def test_no_connection_of_the_library_sits_idle_in_a_transaction(
    client: Client, stream: str, streams_url: str
) -> None:
    """The client's administrative connection used to stay idle in a transaction after its
    schema check, holding AccessShareLock on the version table (blocking `streams migrate`)."""
    with client.writer(stream, instance="w") as writer, client.reader(stream, group="g") as rd:
        writer.append({"x": 1})
        list(rd.facts())
        rd.commit()
        client.positions(stream)
        client.groups(stream)
        client.streams()
        client.stream(stream)
        assert client._conn is not None
        pids = [
            client._conn.info.backend_pid,
            writer._conn.info.backend_pid,
            rd._conn.info.backend_pid,
        ]
        wait_until(
            lambda: set(_states(streams_url, pids).values()) == {"idle"},
            timeout=5,
            what="every connection idle (not idle in transaction)",
        )
        with psycopg.connect(streams_url, autocommit=True) as conn:
            held = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = 'streams_alembic_version' AND l.pid = ANY(%s)",
                (pids,),
            ).fetchone()
        assert held == (0,)


def test_lock_holders_with_unknown_transaction_start(
    client: Client, stream: str, streams_url: str
) -> None:
    """A holder whose xact_start is NULL (it does not report its activity) used to make
    `reservation_lock_holders` (and so `streams doctor`) raise TypeError."""
    from streams.constants import reservation_lock_class
    from streams.store import reservation_lock_holders

    info = client.stream(stream)
    with psycopg.connect(streams_url) as holder, psycopg.connect(streams_url) as conn:
        holder.execute("SET track_activities = off")
        holder.execute("SELECT 1")
        holder.commit()
        holder.execute(
            "SELECT pg_advisory_xact_lock_shared(%s, 1)",
            (reservation_lock_class(info.id),),
        )
        holders = run(conn, reservation_lock_holders(info))
        assert [h.pid for h in holders] == [holder.info.backend_pid]
        assert holders[0].transaction_seconds == 0.0
        assert client.positions(stream).linear == 0


def test_the_clients_own_connection_opens_on_use_and_comes_back_after_a_kill(
    client: Client, stream: str, streams_url: str
) -> None:
    """A process that only reads or writes holds no idle connection for the client's own
    calls (32 reader processes must fit in max_connections = 100); one killed by the server
    (a restart, an operator) is re-opened by the next call instead of failing every call."""
    with streams.connect(streams_url) as fresh:
        assert fresh._conn is None  # the schema check's connection is closed again
        with fresh.reader(stream) as rd:
            list(rd.facts())
        assert fresh._conn is None
        assert fresh.positions(stream).stream == stream
        assert fresh._conn is not None
        pid = fresh._conn.info.backend_pid
        with psycopg.connect(streams_url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: not _states(streams_url, [pid]), 5, "the backend to exit")
        with contextlib.suppress(StoreError):
            fresh.positions(stream)  # the call that finds it dead may fail, as any query
        assert fresh.positions(stream).stream == stream
        assert fresh._conn.info.backend_pid != pid
