"""`streams doctor`: sequence repair targets, declared fact tables, unseen IDs and another
deployment on the replication channel (issue 7)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from click.testing import CliRunner

from streams import Client
from streams.cli import main


def doctor(url: str, *extra: str) -> tuple[int, dict[str, dict[str, Any]]]:
    result = CliRunner().invoke(main, ["doctor", "--json", "--database-url", url, *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, {c["name"]: c for c in json.loads(result.stdout)}


@pytest.fixture
def user_table(streams_url: str, unique_name: str) -> Iterator[str]:
    table = f"doc_{unique_name.replace('-', '_')}"
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (stream_id bigint)")
    yield table
    with psycopg.connect(streams_url, autocommit=True) as conn:
        # Streams of the shared test database must stay healthy for other tests' doctors.
        conn.execute(
            "UPDATE streams_registry SET fact_tables = '[]' WHERE fact_tables::text LIKE %s",
            (f"%{table}%",),
        )
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def user_fact(client: Client, url: str, stream: str, table: str) -> int:
    with client.writer(stream, instance="w") as writer, psycopg.connect(url) as conn:
        with writer.fact(conn) as fact:
            conn.execute(f"INSERT INTO {table} VALUES (%s)", (fact.stream_id,))
        return fact.stream_id


def test_doctor_reports_ids_in_undeclared_tables_and_missing_declared_ones(
    client: Client, unique_name: str, user_table: str, streams_url: str
) -> None:
    client.create_stream(unique_name)
    for _ in range(3):
        user_fact(client, streams_url, unique_name, user_table)
    code, checks = doctor(streams_url)
    tables = checks[f"stream {unique_name}: fact tables"]
    assert tables["ok"] is True
    assert "3 of the last 3 IDs have no row" in tables["detail"]
    assert "does not declare" in tables["detail"]
    # Declared: every ID is seen.
    client.set_fact_tables(unique_name, [f"{user_table}.stream_id"])
    code, checks = doctor(streams_url)
    detail = checks[f"stream {unique_name}: fact tables"]["detail"]
    assert detail == f"besides streams_facts: public.{user_table}.stream_id"
    # A declared table that was dropped cannot be seen: a failing check.
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {user_table}")
    code, checks = doctor(streams_url)
    assert code == 1
    failing = [c for c in checks.values() if not c["ok"]]
    assert any("declared tables do not exist" in c["detail"] for c in failing), failing


def test_doctor_sees_a_sequence_behind_a_declared_table(
    client: Client, unique_name: str, user_table: str, streams_url: str
) -> None:
    client.create_stream(unique_name, fact_tables=[f"{user_table}.stream_id"])
    last = max(user_fact(client, streams_url, unique_name, user_table) for _ in range(3))
    seq = client.stream(unique_name).sequence_name
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"SELECT setval('{seq}', 1)")
    code, checks = doctor(streams_url)
    check = checks[f"stream {unique_name}: sequence"]
    assert code == 1
    assert check["ok"] is False
    assert f"highest ID used {last}" in check["detail"]
    assert "BEHIND" in check["detail"]
    with client.writer(unique_name, instance="v") as writer:  # repairs, as the check says
        assert writer.append({"after": 1}).first_id > last
    code, checks = doctor(streams_url)
    assert checks[f"stream {unique_name}: sequence"]["ok"] is True


def test_doctor_warns_when_another_deployment_shares_the_channel(
    client: Client, stream: str, streams_url: str, redis_url: str, redis_prefix: str
) -> None:
    name = f"redis channel {redis_prefix!r}"
    code, checks = doctor(streams_url, "--redis-url", redis_url, "--prefix", redis_prefix)
    assert checks[name]["ok"] is True, checks[name]
    # A Synapse homeserver answering REPLICATE on the same channel.
    stop = threading.Event()
    ready = threading.Event()

    def fake_synapse() -> None:
        r = redis.Redis.from_url(redis_url)
        pubsub = r.pubsub()  # type: ignore[no-untyped-call]
        pubsub.subscribe(redis_prefix)
        ready.set()
        while not stop.is_set():
            message = pubsub.get_message(timeout=0.05)
            if message and message["type"] == "message" and message["data"].startswith(b"REP"):
                r.publish(redis_prefix, "POSITION events master 53 53")
                r.publish(redis_prefix, 'LOCK_RELEASED ["master","lock","key"]')
        pubsub.close()
        r.close()

    thread = threading.Thread(target=fake_synapse)
    thread.start()
    try:
        assert ready.wait(5)
        code, checks = doctor(streams_url, "--redis-url", redis_url, "--prefix", redis_prefix)
    finally:
        stop.set()
        thread.join()
    assert code == 1
    assert checks[name]["ok"] is False
    assert "prefix" in checks[name]["detail"].lower()
