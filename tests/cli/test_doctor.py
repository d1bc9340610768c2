"""`streams doctor`: sequence repair targets, declared fact tables, unseen IDs and another
deployment on the replication channel (issue 7)."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import redis
from click.testing import CliRunner
from helpers import write_user_fact
from servers import create_database, database_name, drop_database

import streams
from streams import Client
from streams.command import main
from streams.migrate import upgrade


def doctor(url: str, *extra: str) -> tuple[int, dict[str, dict[str, Any]]]:
    result = CliRunner().invoke(main, ["doctor", "--json", "--database-url", url, *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, {c["name"]: c for c in json.loads(result.stdout)}


def test_doctor_reports_ids_in_undeclared_tables_and_missing_declared_ones(
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    client.create_stream(unique_name)
    for _ in range(3):
        write_user_fact(client, streams_url, unique_name, declared_table)
    code, checks = doctor(streams_url)
    tables = checks[f"stream {unique_name}: fact tables"]
    assert tables["ok"] is True
    assert "3 of the last 3 IDs have no row" in tables["detail"]
    assert "does not declare" in tables["detail"]
    # Declared: every ID is seen.
    client.set_fact_tables(unique_name, [f"{declared_table}.stream_id"])
    code, checks = doctor(streams_url)
    detail = checks[f"stream {unique_name}: fact tables"]["detail"]
    assert detail == f"besides streams_facts: public.{declared_table}.stream_id"
    # A declared table that was dropped cannot be seen: a failing check.
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {declared_table}")
    code, checks = doctor(streams_url)
    assert code == 1
    failing = [c for c in checks.values() if not c["ok"]]
    assert any("declared tables do not exist" in c["detail"] for c in failing), failing


def test_doctor_sees_a_sequence_behind_a_declared_table(
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    client.create_stream(unique_name, fact_tables=[f"{declared_table}.stream_id"])
    last = max(write_user_fact(client, streams_url, unique_name, declared_table) for _ in range(3))
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


def _labelled_facts(client: Client, url: str, stream: str, table: str, label: str, n: int) -> int:
    """``n`` facts of ``stream`` written only in ``table`` with ``item`` = label; the last ID."""
    with client.writer(stream, instance="w") as writer, psycopg.connect(url) as conn:
        for _ in range(n):
            with writer.fact(conn) as fact:
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (fact.stream_id, label))
    return int(fact.stream_id)


def test_doctor_counts_only_the_streams_own_rows_of_a_shared_table(
    client: Client, unique_name: str, declared_table: str, streams_url: str
) -> None:
    """Two streams keep their facts in one table, ``item`` saying whose a row is: each
    stream's IDs 1, 2, 3 are in the table, but only the rows labelled for it are its own."""
    first, second = unique_name, f"{unique_name}_2"
    client.create_stream(first, fact_tables=[f"{declared_table}.stream_id WHERE item = 'first'"])
    client.create_stream(second, fact_tables=[f"{declared_table}.stream_id where item='second'"])
    assert _labelled_facts(client, streams_url, first, declared_table, "first", 5) == 5
    # The second stream's rows carry the wrong label (a bug in the user's code): the first
    # stream's rows 1, 2, 3 must not count as the second stream's.
    assert _labelled_facts(client, streams_url, second, declared_table, "oops", 3) == 3
    _, checks = doctor(streams_url)
    own = checks[f"stream {first}: fact tables"]["detail"]
    assert own == f"besides streams_facts: public.{declared_table}.stream_id WHERE item = 'first'"
    detail = checks[f"stream {second}: fact tables"]["detail"]
    assert detail.startswith(
        f"besides streams_facts: public.{declared_table}.stream_id WHERE item = 'second'; "
        "3 of the last 3 IDs have no row in any of them"
    ), detail
    assert "WHERE leaves out" in detail and "(KEY, COLUMN)" in detail
    # Labelled right: every ID is seen.
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"UPDATE {declared_table} SET item = 'second' WHERE item = 'oops'")
    _, checks = doctor(streams_url)
    detail = checks[f"stream {second}: fact tables"]["detail"]
    assert detail == (
        f"besides streams_facts: public.{declared_table}.stream_id WHERE item = 'second'"
    )
    # Set back, the second stream's sequence is behind its own rows (3), not the first's (5).
    seq = client.stream(second).sequence_name
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"SELECT setval('{seq}', 1)")
    _, checks = doctor(streams_url)
    check = checks[f"stream {second}: sequence"]
    assert check["ok"] is False
    assert "sequence at 1, highest ID used 3 (facts 3," in check["detail"], check
    assert checks[f"stream {first}: sequence"]["ok"] is True
    result = CliRunner().invoke(
        main, ["doctor", "--repair", "--json", "--database-url", streams_url]
    )
    report = json.loads(result.stdout)
    assert f"stream {second}: sequence moved to 3" in report["repaired"], report["repaired"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks[f"stream {second}: sequence"]["ok"] is True
    assert client.stream(second).sequence_name == seq
    with client.writer(second, instance="v") as writer:
        assert writer.append({"after": 1}).first_id == 4


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
        pubsub = r.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
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


def test_doctor_and_keys_say_what_nothing_means_on_an_empty_stream(
    postgres_admin_url: str,
) -> None:
    """No `None` in what a person reads: an empty stream has no facts yet, an old key no
    recorded incarnation."""
    url = create_database(postgres_admin_url, prefix="streams_doctor_empty")
    try:
        upgrade(url)
        with streams.connect(url) as client:
            client.create_stream("empty")
        result = CliRunner().invoke(main, ["doctor", "--all-streams", "--database-url", url])
        assert "None" not in result.stdout, result.stdout
        assert (
            "stream empty: sequence: sequence at 0, no ID used yet (no facts, no writer or "
            "group positions)" in result.stdout
        ), result.stdout
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE streams_keys SET incarnation = NULL")
        listed = CliRunner().invoke(main, ["keys", "list", "--database-url", url])
        assert listed.exit_code == 0, listed.output
        assert "None" not in listed.stdout, listed.stdout
        assert "incarnation not recorded (a key from before revision 0012)" in listed.stdout
    finally:
        drop_database(postgres_admin_url, database_name(url))
