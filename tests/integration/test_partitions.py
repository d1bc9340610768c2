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
from helpers import partition_bound, partition_parents
from servers import create_database, drop_database

import streams
from streams import Client
from streams.core.constants import facts_bucket, facts_partition
from streams.migrate import upgrade
from streams.store.driver import run
from streams.store.registry import drop_stream
from streams.store.stream_objects import FACTS_TREE


def _partition_of(url: str, stream: str) -> str | None:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT t.relid::regclass::text FROM ({FACTS_TREE}) t "
            "JOIN streams_registry r ON t.relid = to_regclass('streams_facts_' || r.id) "
            "WHERE t.isleaf AND r.name = %s",
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
            f"JOIN ({FACTS_TREE}) t ON t.relid = c.oid "
            "WHERE l.pid = pg_backend_pid()"
        ).fetchall()
    assert {r[0] for r in rows} <= {facts_partition(info.id)}, rows


# ---------------------------------------------------------------------------------------------
# Buckets (revision 0018): a stream's partition hangs under the bucket of its ID


@pytest.fixture
def bucket_url(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url, prefix="streams_bucket")
    upgrade(url)
    yield url
    drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))


def test_partitions_hang_under_the_bucket_of_their_id_across_a_bucket_boundary(
    bucket_url: str,
) -> None:
    """IDs 253-258 in one transaction: the end of bucket 0 (which lists its IDs from its first
    stream on) and the start of bucket 1; a later stream reuses its bucket; every stream is
    written and read, through its partition and through the root; a drop detaches from the
    bucket and leaves the others alone."""
    with psycopg.connect(bucket_url, autocommit=True) as conn:
        conn.execute("SELECT setval(pg_get_serial_sequence('streams_registry', 'id'), 252)")
    names = [f"s{n}" for n in range(6)]
    with streams.connect(bucket_url) as client:
        ids = [created.info.id for created in client.create_streams(names)]
        assert ids == list(range(253, 259))
        assert facts_bucket(255) == "streams_facts_b0" and facts_bucket(256) == "streams_facts_b1"
        assert partition_parents(bucket_url) == {facts_partition(i): facts_bucket(i) for i in ids}
        first, second = (partition_bound(bucket_url, f"streams_facts_b{b}") for b in (0, 1))
        assert first == "FOR VALUES IN (253, 254, 255)"
        assert second.startswith("FOR VALUES IN (256, 257,") and second.endswith(", 511)")
        later = client.create_stream("later")
        assert partition_parents(bucket_url)[facts_partition(later.id)] == "streams_facts_b1"
        for name in [*names, "later"]:
            with client.writer(name) as writer:
                writer.append_batch([{"stream": name, "n": n} for n in range(3)])
        for name in [*names, "later"]:
            with client.reader(name) as reader:
                assert [f.payload for f in reader.facts()] == [
                    {"stream": name, "n": n} for n in range(3)
                ]
        with psycopg.connect(bucket_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT tableoid::regclass::text, count(*) FROM streams_facts "
                "WHERE stream = ANY(%s) GROUP BY 1",
                ([*ids, later.id],),
            ).fetchall()
        assert dict(rows) == {facts_partition(i): 3 for i in [*ids, later.id]}
        assert client.drop_streams(["s2", "s3"]) == ["s2", "s3"]
        parents = partition_parents(bucket_url)
        assert facts_partition(255) not in parents and facts_partition(256) not in parents
        assert len(parents) == 5
        with client.reader("s4") as reader:
            assert len(list(reader.facts())) == 3
        # The last stream of a bucket takes the bucket with it; a bucket left detached by an
        # interrupted drop is made anew by the next stream of its range.
        client.drop_streams(["s0", "s1"])
        assert _relation_exists(bucket_url, "streams_facts_b0") is False
        client.drop_streams(["s4", "s5", "later"])
        assert _relation_exists(bucket_url, "streams_facts_b1") is False
        with psycopg.connect(bucket_url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE streams_facts_b1 (LIKE streams_facts INCLUDING DEFAULTS "
                "INCLUDING CONSTRAINTS) PARTITION BY LIST (stream)"
            )
            # Not while it holds a partition (detached by hand): dropping it would drop that.
            conn.execute(
                "CREATE TABLE kept PARTITION OF streams_facts_b1 FOR VALUES IN (400); "
                "INSERT INTO kept (stream, stream_id, instance, ts) VALUES (400, 1, 'w', 0)"
            )
            with pytest.raises(streams.StoreError, match="holds streams' partitions"):
                client.create_stream("refused")
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (1,)
            conn.execute("DROP TABLE kept")
        again = client.create_stream("again")
        assert partition_parents(bucket_url) == {facts_partition(again.id): "streams_facts_b1"}
        assert partition_bound(bucket_url, "streams_facts_b1").startswith(
            f"FOR VALUES IN ({again.id},"
        )
        with client.writer("again") as writer:
            writer.append({"again": True})
        with psycopg.connect(bucket_url, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM streams_facts").fetchone() == (1,)
        client.drop_streams(["again"])
        assert _relation_exists(bucket_url, "streams_facts_b1") is False


def _relation_exists(url: str, name: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    return bool(row and row[0])
