"""Schema migrations run the way an operator runs them: ``alembic upgrade head`` in a checkout,
and `streams.migrate.upgrade` (what ``streams migrate`` and the wheel use)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

import psycopg
import pytest
from helpers import REPO_ROOT
from servers import create_database, drop_database

import streams
from streams.migrate import current_revision, upgrade

TABLES = (
    "streams_facts",
    "streams_idempotency_keys",
    "streams_keys",
    "streams_proofs",
    "streams_reader_groups",
    "streams_registry",
    "streams_sink_commits",
    "streams_sink_queries",
    "streams_writers",
)
VERSION_TABLE = "streams_alembic_version"
HEAD = "0009_idempotency_keys"


# ---------------------------------------------------------------------------------------------
# Alembic in a checkout vs `streams.migrate`


@pytest.fixture
def empty_database(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url, prefix="streams_alembic")
    yield url
    drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))


def _alembic(url: str, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    env["STREAMS_DATABASE_URL"] = url
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"alembic {' '.join(args)}: {proc.stdout}\n{proc.stderr}"


def _tables(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = current_schema() AND table_name LIKE 'streams%'"
        ).fetchall()
    return {row[0] for row in rows}


def _sequences(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT sequence_name FROM information_schema.sequences "
            "WHERE sequence_schema = current_schema()"
        ).fetchall()
    return {row[0] for row in rows}


def test_alembic_upgrade_downgrade_and_streams_migrate(empty_database: str) -> None:
    url = empty_database
    assert _tables(url) == set()

    _alembic(url, "upgrade", "head")
    assert _tables(url) == {*TABLES, VERSION_TABLE}
    assert current_revision(url) == HEAD
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(HEAD,)]

    # A stream's sequence is part of the schema too: downgrade must remove it.
    with streams.connect(url) as client:
        info = client.create_stream("alembic-check")
        with client.writer("alembic-check", instance="alembic-test") as writer:
            assert writer.append({"n": 1}).first_id == 1
    assert info.sequence_name in _sequences(url)

    _alembic(url, "downgrade", "base")
    assert set(TABLES).isdisjoint(_tables(url))
    assert current_revision(url) is None
    assert _sequences(url) == set()

    upgrade(url)
    assert set(TABLES) <= _tables(url)
    assert current_revision(url) == HEAD
    upgrade(url)  # idempotent
    assert current_revision(url) == HEAD
    with streams.connect(url) as client:
        assert client.streams() == []
