"""A process never goes on silently in another database history (`streams.store.identity`).

The same URL reaches a database that was dropped and recreated, or restored (a copy made with
``CREATE DATABASE ... TEMPLATE``, as a dump restored into another database is, renamed into the
old one's place). Readers, group readers, writers and the client's own calls that reconnect
there stop with `streams.DatabaseChanged`, naming what changed, instead of going on from their
old positions (before: a reader skipped facts 1..n of the new database without an error and a
group reader committed its old position there).
"""

from __future__ import annotations

import contextlib

import psycopg
import pytest
from helpers import fill_stream
from servers import database_name

import streams
from streams.migrate import upgrade


def _drop(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def _create(admin_url: str, name: str, template: str | None = None) -> None:
    with psycopg.connect(admin_url, autocommit=True) as admin:
        copy = f' TEMPLATE "{template}"' if template else ""
        admin.execute(f'CREATE DATABASE "{name}"{copy}')


def test_every_role_stops_on_a_recreated_database(
    postgres_admin_url: str, own_database: str, unique_name: str
) -> None:
    name = database_name(own_database)
    fill_stream(own_database, unique_name, 5)
    client = streams.connect(own_database)
    reader = client.reader(unique_name)
    assert len(list(reader.facts())) == 5
    group = client.reader(unique_name, group="billing")
    assert len(list(group.facts())) == 5
    writer = client.writer(unique_name)
    writer.append({"n": 5})

    _drop(postgres_admin_url, name)
    _create(postgres_admin_url, name)
    upgrade(own_database)
    fill_stream(own_database, unique_name, 3)  # IDs 1..3 of the new database

    with pytest.raises(streams.DatabaseChanged, match="another database") as caught:
        reader.poll(1.0)
    assert "reader of " + unique_name in str(caught.value)
    with pytest.raises(streams.DatabaseChanged, match="streams schema was recreated"):
        group.commit()
    with pytest.raises(streams.DatabaseChanged):
        writer.append({"n": 6})
    with pytest.raises(streams.DatabaseChanged):
        client.positions(unique_name)
    with psycopg.connect(own_database) as conn:
        assert conn.execute("SELECT count(*) FROM streams_reader_groups").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM streams_facts").fetchone() == (3,)
    for closable in (reader, group, writer, client):
        with contextlib.suppress(streams.StreamsError):
            closable.close()

    # A new process (a new client) starts on the new history and reads all of it.
    with streams.connect(own_database) as fresh, fresh.reader(unique_name) as again:
        assert [f.payload["n"] for f in again.facts()] == [0, 1, 2]


def test_a_reader_stops_on_a_restored_copy_under_the_same_url(
    postgres_admin_url: str, own_database: str, unique_name: str
) -> None:
    name = database_name(own_database)
    fill_stream(own_database, unique_name, 5)
    backup = name + "_b"
    _create(postgres_admin_url, backup, template=name)  # the backup, taken at 5 facts
    try:
        with streams.connect(own_database) as client, client.reader(unique_name) as reader:
            with client.writer(unique_name) as writer:
                writer.append_batch([{"n": n} for n in range(5, 10)])
            assert len(list(reader.facts())) == 10
            # Restore the backup in place: the five last facts are gone, and the next appends
            # get their IDs again.
            _drop(postgres_admin_url, name)
            with psycopg.connect(postgres_admin_url, autocommit=True) as admin:
                admin.execute(f'ALTER DATABASE "{backup}" RENAME TO "{name}"')
            with pytest.raises(streams.DatabaseChanged, match="another database"):
                reader.poll(1.0)
    finally:
        with psycopg.connect(postgres_admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{backup}" WITH (FORCE)')


def test_a_group_row_of_another_incarnation_stops_its_readers_until_accepted(
    postgres_admin_url: str, own_database: str, unique_name: str
) -> None:
    """A restored dump brings the group rows with it: their positions were committed in the
    old history. A group reader opening one stops (`DatabaseChanged` naming the group) until
    `streams incarnation accept` binds it to this one; then it resumes from its position."""
    from click.testing import CliRunner

    from streams.command import main

    name = database_name(own_database)
    fill_stream(own_database, unique_name, 5)
    with streams.connect(own_database) as client:
        with client.reader(unique_name, group="billing") as reader:
            assert len(list(reader.facts())) == 5
            reader.commit()
        with client.writer(unique_name) as writer:
            writer.append({"n": 5})
    backup = name + "_b"
    _create(postgres_admin_url, backup, template=name)
    _drop(postgres_admin_url, name)
    with psycopg.connect(postgres_admin_url, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{backup}" RENAME TO "{name}"')  # the restore

    with streams.connect(own_database) as client:
        with pytest.raises(streams.DatabaseChanged, match=r"group 'billing' on stream") as e:
            client.reader(unique_name, group="billing")
        assert "its position 5 was committed in another incarnation" in str(e.value)
        cli = CliRunner()
        shown = cli.invoke(main, ["incarnation", "--database-url", own_database])
        assert shown.exit_code == 0, shown.output
        assert f"billing on {unique_name} at 5: another database" in shown.output
        accepted = cli.invoke(
            main, ["incarnation", "accept", "billing", "--database-url", own_database]
        )
        assert accepted.exit_code == 0, accepted.output
        assert f"group billing on {unique_name}: bound to incarnation" in accepted.output
        with client.reader(unique_name, group="billing") as reader:
            assert [f.payload["n"] for f in reader.facts()] == [5]
