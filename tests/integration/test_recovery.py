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
from typing import Any

import psycopg
import pytest
from helpers import wait_until, write_user_fact

import streams
from streams import Client, InvalidFactTables, SequenceRewound, StoreError, StreamsError
from streams.store.driver import run
from streams.store.leases import UnseenIds, sequence_state, unseen_ids
from streams.store.registry import parse_fact_tables
from streams.store.writer_core import WriterCore
from streams.types import FactTable


def set_back(url: str, client: Client, stream: str, value: int = 1) -> None:
    """What a restore from an old backup does to a stream's sequence."""
    seq = client.stream(stream).sequence_name
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"SELECT setval('{seq}', {value})")


# ---------------------------------------------------------------------------- declaring tables


def test_fact_tables_are_declared_validated_and_changeable(
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    info = client.create_stream(unique_name, fact_tables=[f"{declared_table}.stream_id"])
    assert info.fact_tables == (FactTable(f"public.{declared_table}", "stream_id"),)
    assert client.stream(unique_name).as_dict()["fact_tables"] == [
        f"public.{declared_table}.stream_id"
    ]
    # Idempotent with the same tables; different ones are a settings clash.
    client.create_stream(unique_name, fact_tables=[(declared_table, "stream_id")])
    client.create_stream(unique_name)  # None: whatever is declared
    with pytest.raises(StreamsError, match="exists already"):
        client.create_stream(unique_name, fact_tables=[])
    # Changeable later, validated.
    assert client.set_fact_tables(unique_name, []).fact_tables == ()
    for bad, message in [
        (["no_such_table.stream_id"], "no table"),
        ([f"{declared_table}.no_such_column"], "no table"),
        ([f"{declared_table}.item"], "integer type"),
        (["a.b.c.d"], "invalid fact table"),
        (['x"; DROP TABLE y; --.id'], "invalid fact table"),
        ("lines.stream_id", "not a single string"),
        (["streams_facts.stream_id"], "always included"),
    ]:
        with pytest.raises(InvalidFactTables, match=message):
            client.set_fact_tables(unique_name, bad)
    assert client.stream(unique_name).fact_tables == ()


# ---------------------------------------------------------------------------- shared tables


def test_declarations_parse_and_render_in_every_form() -> None:
    """A declaration may name the column that says which stream a row belongs to; ``str``
    renders the full form, which `FactTable.parse` reads back."""
    whole = FactTable("public.order_lines", "stream_id")
    orders = FactTable(
        "public.order_lines", "stream_id", where_column="stream", where_value="orders"
    )
    quoted = FactTable("shop.order_lines", "stream_id", "stream", "it's 100%")
    for spec, expected in [
        ("order_lines.stream_id", whole),
        ("public.order_lines.stream_id", whole),
        (("order_lines", "stream_id"), whole),
        (["public.order_lines", "stream_id"], whole),
        ("order_lines.stream_id WHERE stream = 'orders'", orders),
        ("public.order_lines.stream_id where stream='orders'", orders),
        ("order_lines.stream_id  WhErE\tstream  =  'orders'", orders),
        (("order_lines", "stream_id", {"stream": "orders"}), orders),
        (["public.order_lines", "stream_id", {"stream": "orders"}], orders),
        (orders, orders),
        ("shop.order_lines.stream_id WHERE stream = 'it''s 100%'", quoted),
        (("shop.order_lines", "stream_id", {"stream": "it's 100%"}), quoted),
    ]:
        assert FactTable.parse(spec) == expected, spec
    assert str(whole) == "public.order_lines.stream_id"
    assert str(orders) == "public.order_lines.stream_id WHERE stream = 'orders'"
    assert str(quoted) == "shop.order_lines.stream_id WHERE stream = 'it''s 100%'"
    empty = FactTable("public.t", "id", "tag", "")
    assert str(empty) == "public.t.id WHERE tag = ''"
    for table in (whole, orders, quoted, empty):
        assert FactTable.parse(str(table)) == table
        assert FactTable.from_json(table.as_json()) == table
    # Stored as extra keys of the table's object; a row from before filters is the whole table.
    assert orders.as_json() == {
        "table": "public.order_lines",
        "column": "stream_id",
        "where_column": "stream",
        "where_value": "orders",
    }
    assert whole.as_json() == {"table": "public.order_lines", "column": "stream_id"}
    assert FactTable.from_json({"table": "public.order_lines", "column": "stream_id"}) == whole
    # Ordered (the whole table first) and hashable: declarations are sorted, without duplicates.
    other = FactTable("public.order_lines", "stream_id", "stream", "returns")
    assert sorted([other, orders, whole]) == [whole, orders, other]
    assert whole < orders < other and other > whole and orders <= orders
    assert len({orders, FactTable.parse(str(orders)), whole}) == 2
    assert parse_fact_tables([str(other), orders, "order_lines.stream_id", orders]) == (
        whole,
        orders,
        other,
    )


@pytest.mark.parametrize(
    "bad",
    [
        "order_lines.stream_id WHERE stream = orders",
        'order_lines.stream_id WHERE stream = "orders"',
        "order_lines.stream_id WHERE stream = 'orders",
        "order_lines.stream_id WHERE stream = 'it's'",
        "order_lines.stream_id WHERE stream",
        "order_lines.stream_id WHERE stream == 'orders'",
        "order_lines.stream_id WHERE o.stream = 'orders'",
        "order_lines.stream_id WHERE \"Stream\" = 'orders'",
        "order_lines.stream_id WHERE stream = 'orders' AND 1 = 1",
        "order_lines.stream_id WHERE stream = 'orders'; DROP TABLE order_lines",
        "order_lines.stream_id WHERE stream IN ('orders')",
        "order_lines WHERE stream = 'orders'",
        "WHERE stream = 'orders'",
        ("order_lines", "stream_id", {}),
        ("order_lines", "stream_id", {"stream": "orders", "kind": "x"}),
        ("order_lines", "stream_id", {"bad name": "orders"}),
        ("order_lines", "stream_id", "stream = 'orders'"),
        ("order_lines", "stream_id", {"stream": "orders"}, "more"),
        ("order_lines",),
    ],
)
def test_bad_declarations_are_rejected_showing_the_accepted_forms(bad: object) -> None:
    with pytest.raises(InvalidFactTables, match="invalid fact table") as info:
        FactTable.parse(bad)
    assert "WHERE column = 'value'" in str(info.value)
    assert "(table, column, {column: 'value'})" in str(info.value)


def test_a_filter_value_must_be_a_string_and_column_and_value_go_together() -> None:
    for bad in [
        ("order_lines", "stream_id", {"tenant": 7}),
        "order_lines.stream_id WHERE stream = 'a\x00b'",
    ]:
        with pytest.raises(InvalidFactTables, match="must be a string"):
            FactTable.parse(bad)
    with pytest.raises(InvalidFactTables, match="together"):
        FactTable("public.order_lines", "stream_id", where_column="stream")
    with pytest.raises(InvalidFactTables, match="together"):
        FactTable("public.order_lines", "stream_id", where_value="orders")


def test_a_filter_column_must_exist_and_compare_with_its_value(
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    client.create_stream(unique_name)
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {declared_table} ADD COLUMN tenant int")
    for bad, message in [
        (f"{declared_table}.stream_id WHERE stream = 'orders'", "no column 'stream'"),
        (f"{declared_table}.stream_id WHERE tenant = 'x'", "cannot be compared"),
        ("no_such_table.stream_id WHERE item = 'orders'", "no table"),
    ]:
        with pytest.raises(InvalidFactTables, match=message):
            client.set_fact_tables(unique_name, [bad])
        with pytest.raises(InvalidFactTables, match=message):
            client.create_stream(f"{unique_name}_new", fact_tables=[bad])
    assert client.stream(unique_name).fact_tables == ()
    assert all(s.name != f"{unique_name}_new" for s in client.streams())
    # Any type the value compares with: text, and an integer column given as a string.
    # (`Any`: the client's annotation names strings and pairs only, not the triple form.)
    tenant: Any = (declared_table, "stream_id", {"tenant": "7"})
    info = client.set_fact_tables(
        unique_name, [f"{declared_table}.stream_id WHERE item = 'x'", tenant]
    )
    assert [str(t) for t in info.fact_tables] == [
        f"public.{declared_table}.stream_id WHERE item = 'x'",
        f"public.{declared_table}.stream_id WHERE tenant = '7'",
    ]
    assert client.stream(unique_name).as_dict()["fact_tables"] == [str(t) for t in info.fact_tables]


def _labelled_facts(
    client: Client, url: str, stream: str, table: str, label: str, count: int
) -> list[int]:
    """``count`` facts of ``stream`` written only in ``table``, each row's ``item`` = label."""
    ids = []
    with client.writer(stream, instance="w") as writer, psycopg.connect(url) as conn:
        for _ in range(count):
            with writer.fact(conn) as fact:
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (fact.stream_id, label))
            ids.append(int(fact.stream_id))
    return ids


def test_streams_sharing_a_table_are_each_repaired_only_up_to_their_own_rows(
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    first, second = unique_name, f"{unique_name}_2"
    label = "it's 100%"  # a quote and a percent sign: a parameter, never SQL text
    client.create_stream(first, fact_tables=[f"{declared_table}.stream_id WHERE item = 'first'"])
    first_ids = _labelled_facts(client, streams_url, first, declared_table, "first", 100)
    assert first_ids == list(range(1, 101))
    shared: Any = (declared_table, "stream_id", {"item": label})  # as above: the triple form
    info = client.create_stream(second, fact_tables=[shared])
    assert [str(t) for t in info.fact_tables] == [
        f"public.{declared_table}.stream_id WHERE item = 'it''s 100%'"
    ]
    # A writer starting repairs the sequence: the first stream's 100 rows are not the second's.
    own = _labelled_facts(client, streams_url, second, declared_table, label, 3)
    assert own == [1, 2, 3]
    with psycopg.connect(streams_url) as conn:
        state = run(conn, sequence_state(client.stream(second)))
        assert state.max_stored == 3
        assert run(conn, unseen_ids(client.stream(second), 1000)) == UnseenIds(3, 0)
    # Set back (a restore): repaired to its own maximum, not the other stream's.
    set_back(streams_url, client, second)
    with client.writer(second, instance="v") as writer:
        assert writer.append({"after": "restore"}).first_id == 4
    set_back(streams_url, client, first)
    with client.writer(first, instance="v") as writer:
        assert writer.append({"after": "restore"}).first_id == 101
    # The same table declared whole sees every row: what the filter is for.
    client.set_fact_tables(second, [f"{declared_table}.stream_id"])
    with psycopg.connect(streams_url) as conn:
        assert run(conn, sequence_state(client.stream(second))).max_stored == 100


# ---------------------------------------------------------------------------- repair


def test_repair_sees_facts_that_live_only_in_a_declared_table(
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    client.create_stream(unique_name, fact_tables=[f"{declared_table}.stream_id"])
    ids = [write_user_fact(client, streams_url, unique_name, declared_table, "w") for _ in range(3)]
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
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    """Facts in an *undeclared* table: the writer's own persisted position still tells repair
    that those IDs were used (the bug report's ValueError('was the sequence reset?'))."""
    client.create_stream(unique_name)
    last = 0
    for _ in range(3):
        last = write_user_fact(client, streams_url, unique_name, declared_table, "w")
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
        assert [f.stream_id for f in reader.facts()][:3] == list(ack.ids)


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
    from streams.core.constants import reservation_lock_class
    from streams.store.holders import reservation_lock_holders

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
