"""Facts partitioned by stream (revision ``0006_partitions``, issue 10's index locality).

Each stream has its own partition of ``streams_facts``. Creating or dropping a stream must not
stop the appends and reads of other streams (a writer may hold a transaction open for minutes),
and the upgrade from 0005 carries every fact over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import psycopg
import pytest
from servers import create_database, drop_database

import streams
from streams import Client
from streams.core.constants import facts_partition
from streams.migrate import upgrade
from streams.store.driver import run
from streams.store.registry import drop_stream


def _partition_of(url: str, stream: str) -> str | None:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT i.inhrelid::regclass::text FROM pg_inherits i "
            "JOIN streams_registry r ON i.inhrelid = to_regclass('streams_facts_' || r.id) "
            "WHERE i.inhparent = 'streams_facts'::regclass AND r.name = %s",
            (stream,),
        ).fetchone()
    return None if row is None else str(row[0])


def test_each_stream_writes_into_its_own_partition(
    client: Client, stream: str, streams_url: str
) -> None:
    info = client.stream(stream)
    assert _partition_of(streams_url, stream) == facts_partition(info.id)
    with client.writer(stream) as writer:
        writer.append({"n": 1})
        writer.append_batch([{"n": 2}, {"n": 3}])
    with psycopg.connect(streams_url) as conn:
        rows = conn.execute(
            "SELECT tableoid::regclass::text, count(*) FROM streams_facts WHERE stream = %s "
            "GROUP BY 1",
            (info.id,),
        ).fetchall()
    assert rows == [(facts_partition(info.id), 3)]


def _within(seconds: float, what: str, action: Callable[[], object]) -> None:
    """Run ``action`` on a thread; fail (instead of hanging) if it takes longer."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            action()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"{what} waited for another stream's open transaction"
    if errors:
        raise errors[0]


def test_creating_and_dropping_a_stream_never_stops_other_streams(
    stream: str, streams_url: str
) -> None:
    """A writer holds a fact open on ``stream`` (ROW EXCLUSIVE on streams_facts, for as long
    as its lease allows). Creating a stream (ATTACH: SHARE UPDATE EXCLUSIVE) goes through at
    once. Dropping one (DETACH CONCURRENTLY) waits for that transaction, but appends and reads
    of other streams go on meanwhile; it finishes once the fact commits."""
    other_name = f"{stream}_other"
    with streams.connect(streams_url, lease_seconds=30.0) as client:
        dropped = threading.Event()

        def drop() -> None:
            with psycopg.connect(streams_url) as conn:
                assert run(conn, drop_stream(other_name))
            dropped.set()

        with (
            client.writer(stream, instance="holder") as holder,
            psycopg.connect(streams_url) as conn,
        ):
            with holder.fact(conn) as fact:
                fact.add({"held": True})
                _within(10, "create_stream", lambda: client.create_stream(other_name))
                with client.writer(other_name) as other:
                    other.append({"other": 1})
                dropper = threading.Thread(target=drop, daemon=True)
                dropper.start()
                with client.writer(stream, instance="meanwhile") as meanwhile:
                    _within(10, "an append", lambda: meanwhile.append({"meanwhile": 1}))
                with client.reader(stream) as reader:  # nothing: the held fact comes first
                    _within(10, "a read", lambda: list(reader.facts()))
                assert not dropped.is_set()  # it waits for the held fact's transaction
            dropper.join(timeout=20)
            assert dropped.is_set()
        assert _partition_of(streams_url, other_name) is None
        with client.reader(stream) as reader:
            assert [f.payload for f in reader.facts()] == [{"held": True}, {"meanwhile": 1}]


@pytest.fixture
def url_at_0005(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url, prefix="streams_part")
    upgrade(url, "0005_retention")
    yield url
    drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))


def test_the_upgrade_moves_every_fact_into_its_streams_partition(url_at_0005: str) -> None:
    with psycopg.connect(url_at_0005) as conn:
        for key, name in ((1, "a"), (2, "b")):
            conn.execute(
                "INSERT INTO streams_registry (id, name, sequence_name, timestamping) "
                "OVERRIDING SYSTEM VALUE VALUES (%s, %s, %s, 'client-prefer')",
                (key, name, f"streams_seq_{key}"),
            )
            conn.execute(f"CREATE SEQUENCE streams_seq_{key}")
        conn.execute(
            "INSERT INTO streams_facts (stream, stream_id, instance, ts, payload) "
            "SELECT 1 + n % 2, n, 'w', n, jsonb_build_object('n', n) "
            "FROM generate_series(1, 1000) n"
        )
        conn.execute("SELECT setval('streams_seq_1', 1000), setval('streams_seq_2', 1000)")
    upgrade(url_at_0005)
    with psycopg.connect(url_at_0005) as conn:
        rows = conn.execute(
            "SELECT tableoid::regclass::text, count(*), sum(stream_id) FROM streams_facts "
            "GROUP BY 1 ORDER BY 1"
        ).fetchall()
        assert rows == [
            ("streams_facts_1", 500, sum(range(2, 1001, 2))),
            ("streams_facts_2", 500, sum(range(1, 1001, 2))),
        ]
    with streams.connect(url_at_0005) as client:
        with client.writer("a") as writer:
            assert writer.append({"after": True}).first_id > 1000
        with client.reader("b") as reader:
            assert len(list(reader.facts())) == 500


def test_a_sequence_repair_opens_only_its_streams_partition(
    client: Client, stream: str, streams_url: str
) -> None:
    """`streams_repair_sequence`, called again and again in one session (as `streams doctor
    --repair` does for every stream): each call locks its stream's partition only, never
    every partition (a plan cached for any stream would: at 10^4 streams, more locks than
    PostgreSQL's lock table holds)."""
    for n in range(3):
        client.create_stream(f"{stream}_other{n}")
    info = client.stream(stream)
    with psycopg.connect(streams_url) as conn:  # one transaction: its locks stay to the end
        for _ in range(8):  # past plpgsql's five custom plans
            conn.execute("SELECT streams_repair_sequence(%s, NULL)", (info.id,))
        rows = conn.execute(
            "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "JOIN pg_inherits i ON i.inhrelid = c.oid "
            "WHERE l.pid = pg_backend_pid() AND i.inhparent = 'streams_facts'::regclass"
        ).fetchall()
    assert {r[0] for r in rows} <= {facts_partition(info.id)}, rows
