"""Tests of the test infrastructure: server discovery (servers.py) and the conftest fixtures."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import redis
from helpers import TESTS_DIR
from servers import (
    DATABASE_URL_ENV,
    LOCAL_HOST,
    LOCAL_POSTGRES_PORT,
    LOCAL_REDIS_PORT,
    REDIS_URL_ENV,
    ServerHandle,
    ServerUnavailable,
    create_database,
    database_name,
    docker_available,
    drop_database,
    free_port,
    libpq_url,
    new_redis_prefix,
    new_stream_name,
    postgres_server,
    redact_url,
    redis_server,
    with_database,
)

from streams.devservers import EmbeddedServerError, find_postgres_bindir, find_redis_server

HERE = TESTS_DIR  # servers.py and conftest.py


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((LOCAL_HOST, port), timeout=1):
            return True
    except OSError:
        return False


def _database_exists(admin_url: str, name: str) -> bool:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name]).fetchone()
    return row is not None and row[0] == 1


def _ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


# --- redact_url and URL helpers ------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:secret@h/db",
        "postgresql://u:secret@h:5432/db?sslmode=require",
        "postgresql+psycopg://u:se@cret@h/db",
        "redis://:secret@localhost:6379/0",
        "postgresql://u@h/db?password=secret&application_name=x",
        "host=h user=u password=secret dbname=db",
        "host=h password='se cret' dbname=db",
    ],
)
def test_redact_url_hides_password(url: str) -> None:
    redacted = redact_url(url)
    assert "secret" not in redacted
    assert "cret" not in redacted
    assert "***" in redacted


def test_redact_url_keeps_the_rest() -> None:
    assert redact_url("postgresql://u:secret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact_url("postgresql://u@h:5432/db") == "postgresql://u@h:5432/db"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_url_helpers() -> None:
    assert with_database("postgresql://u@h:1/postgres?x=1", "other") == (
        "postgresql://u@h:1/other?x=1"
    )
    assert database_name("postgresql://u@h:1/other?x=1") == "other"
    assert libpq_url("postgresql+psycopg://u@h/db") == "postgresql://u@h/db"
    assert libpq_url("postgresql://u@h/db") == "postgresql://u@h/db"


def test_names_are_unique_lowercase_identifiers() -> None:
    names = {new_stream_name() for _ in range(100)}
    assert len(names) == 100
    assert all(re.fullmatch(r"s_[0-9a-f]{12}", name) for name in names)
    prefixes = {new_redis_prefix() for _ in range(100)}
    assert len(prefixes) == 100
    assert all(re.fullmatch(r"streams-test-[0-9a-f]{12}", p) for p in prefixes)


def test_unique_name_and_redis_prefix_fixtures(unique_name: str, redis_prefix: str) -> None:
    assert unique_name.isidentifier() and unique_name == unique_name.lower()
    assert unique_name[0].isalpha()
    assert redis_prefix.startswith("streams-test-")


# --- env tier ------------------------------------------------------------------------------


def test_env_tier_is_honoured(
    monkeypatch: pytest.MonkeyPatch, postgres_admin_url: str, redis_url: str
) -> None:
    monkeypatch.setenv(DATABASE_URL_ENV, postgres_admin_url)
    monkeypatch.setenv(REDIS_URL_ENV, redis_url)
    with postgres_server() as pg, redis_server() as rd:
        assert (pg.source, pg.url) == ("env", postgres_admin_url)
        assert (rd.source, rd.url) == ("env", redis_url)


def test_env_tier_unusable_is_fatal_and_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    # A configured but dead server must not silently fall back to another tier.
    port = free_port()
    monkeypatch.setenv(DATABASE_URL_ENV, f"postgresql://u:secret@{LOCAL_HOST}:{port}/db")
    monkeypatch.setenv(REDIS_URL_ENV, f"redis://:secret@{LOCAL_HOST}:{port}/0")
    for finder in (postgres_server, redis_server):
        with pytest.raises(ServerUnavailable) as info:
            finder()
        assert "is set but unusable" in str(info.value)
        assert "secret" not in str(info.value)


def test_env_tier_unset_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    with pytest.raises(ServerUnavailable, match=f"{DATABASE_URL_ENV} is not set"):
        postgres_server(tiers=("env",))


# --- docker tier ---------------------------------------------------------------------------


def test_docker_tier_without_engine_is_passed_over() -> None:
    if docker_available():
        pytest.skip("a Docker engine answers; not starting containers in a unit test")
    with pytest.raises(ServerUnavailable, match="no Docker engine answers"):
        postgres_server(tiers=("docker",))
    with pytest.raises(ServerUnavailable, match="no Docker engine answers"):
        redis_server(tiers=("docker",))


# --- local tier ----------------------------------------------------------------------------


def test_local_tier_finds_running_postgres() -> None:
    if not _listening(LOCAL_POSTGRES_PORT):
        pytest.skip(f"nothing listens on {LOCAL_HOST}:{LOCAL_POSTGRES_PORT}")
    with postgres_server(tiers=("local",)) as handle:
        assert handle.source == "local"
        with psycopg.connect(handle.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_local_tier_finds_running_redis() -> None:
    if not _listening(LOCAL_REDIS_PORT):
        pytest.skip(f"nothing listens on {LOCAL_HOST}:{LOCAL_REDIS_PORT}")
    with redis_server(tiers=("local",)) as handle:
        assert handle.source == "local"
        assert _ping(handle.url)


# --- private tier --------------------------------------------------------------------------


def _need(finder: Callable[[], Path]) -> Path:
    try:
        return finder()
    except EmbeddedServerError as exc:
        pytest.skip(str(exc))


def test_private_redis_starts_answers_and_stops() -> None:
    _need(find_redis_server)
    handle = redis_server(tiers=("private",))
    try:
        assert handle.source == "private"
        assert f":{LOCAL_REDIS_PORT}/" not in handle.url
        assert _ping(handle.url)
    finally:
        handle.close()
    assert not _ping(handle.url)
    handle.close()  # idempotent


def test_private_postgres_starts_answers_and_stops() -> None:
    _need(find_postgres_bindir)
    handle: ServerHandle = postgres_server(tiers=("private",))
    try:
        assert handle.source == "private"
        with psycopg.connect(handle.url) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    finally:
        handle.close()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(handle.url, connect_timeout=1).close()


def test_private_tier_unavailable_names_the_missing_binaries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The private tier is streams.devservers: its "not installed" error becomes the tier's reason.
    def missing() -> Path:
        raise EmbeddedServerError("no redis-server binary found (pip install ...)")

    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(prefix: str) -> str:
        made.append(mkdtemp(prefix=prefix))
        return made[-1]

    monkeypatch.setattr("streams.devservers.redis_server.find_redis_server", missing)
    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    with pytest.raises(ServerUnavailable, match="private: no redis-server binary found"):
        redis_server(tiers=("private",))
    assert len(made) == 1 and not Path(made[0]).exists()  # the temporary directory is gone


# --- databases and fixtures ----------------------------------------------------------------


def test_database_url_fixture_is_a_fresh_session_database(
    database_url: str, postgres_admin_url: str
) -> None:
    name = database_name(database_url)
    assert re.fullmatch(rf"streams_test_{os.getpid()}_[0-9a-f]{{8}}", name)
    assert name != database_name(postgres_admin_url)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == (name,)


def test_create_database_is_empty_and_drop_forces(postgres_admin_url: str) -> None:
    url = create_database(postgres_admin_url, prefix="streams_selftest")
    name = database_name(url)
    conn = psycopg.connect(url, autocommit=True)
    try:
        row = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')"
            " AND n.nspname NOT LIKE 'pg_toast%%'"
        ).fetchone()
        assert row == (0,)
        # An open session must not block the drop: WITH (FORCE) disconnects it.
        drop_database(postgres_admin_url, name)
        assert not _database_exists(postgres_admin_url, name)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    finally:
        conn.close()
        drop_database(postgres_admin_url, name)


def test_no_server_fails_loudly_instead_of_skipping(tmp_path: Path) -> None:
    # An inner pytest session with our conftest, allowed only the (unset) env tier.
    for helper in ("servers.py", "conftest.py"):
        shutil.copy(HERE / helper, tmp_path / helper)
    (tmp_path / "test_inner.py").write_text("def test_needs_db(database_url):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != DATABASE_URL_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
         "--server-tiers=env", "-q", "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert re.search(r"^1 error in ", output, re.MULTILINE), output
    assert "no PostgreSQL server available" in output, output
    assert f"{DATABASE_URL_ENV} is not set" in output, output
