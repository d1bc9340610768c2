"""Shared fixtures: real PostgreSQL and Redis servers for the integration tests.

Servers come from :mod:`servers` (environment URLs, then Docker, then local servers at the
default ports, then private servers started from installed binaries; see its docstring).
Restrict the tiers with ``--server-tiers=docker`` or ``STREAMS_TEST_SERVER_TIERS=docker``.

If no server can be obtained, every test that needs one *fails* with the reasons: CI must
never skip integration tests silently.

Isolation: one fresh database per test session (``database_url``), dropped at the end; within
it, each test uses its own stream names (``unique_name``) and Redis channel prefix
(``redis_prefix``). Nothing sets ``STREAMS_DATABASE_URL``; tests pass URLs explicitly.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from hypothesis import settings
from servers import (
    TIERS,
    ServerHandle,
    ServerUnavailable,
    Source,
    create_database,
    database_name,
    drop_database,
    new_redis_prefix,
    new_stream_name,
    postgres_server,
    redis_server,
)

import streams
from streams import Client

settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SERVER_TIERS_ENV = "STREAMS_TEST_SERVER_TIERS"
_chosen: dict[str, ServerHandle] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--server-tiers",
        default=os.environ.get(SERVER_TIERS_ENV, ",".join(TIERS)),
        help=(
            "comma-separated tiers tried, in order, to obtain PostgreSQL and Redis: "
            f"{','.join(TIERS)} (default: all, or ${SERVER_TIERS_ENV})"
        ),
    )


def _tiers(config: pytest.Config) -> tuple[Source, ...]:
    raw = str(config.getoption("--server-tiers"))
    by_name: dict[str, Source] = {tier: tier for tier in TIERS}
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if not names or any(name not in by_name for name in names):
        raise pytest.UsageError(f"--server-tiers: expected some of {','.join(TIERS)}, got {raw!r}")
    return tuple(by_name[name] for name in names)


def pytest_configure(config: pytest.Config) -> None:
    _tiers(config)  # reject a bad --server-tiers before any test runs


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which servers the session used, so a CI log shows what was really tested."""
    for kind, handle in _chosen.items():
        terminalreporter.write_line(f"integration {kind}: {handle}")


def _obtain(kind: str, request: pytest.FixtureRequest) -> ServerHandle:
    finder = postgres_server if kind == "PostgreSQL" else redis_server
    try:
        handle = finder(_tiers(request.config))
    except ServerUnavailable as exc:
        reason = str(exc)
    else:
        _chosen[kind] = handle
        return handle
    # Outside the except block, so the report shows the reasons and no exception chain.
    pytest.fail(
        f"{reason}\nIntegration tests need a real {kind} server and are never skipped: set "
        "the STREAMS_TEST_*_URL variables, start Docker, run the server on its default "
        "port, or install its binaries.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def postgres_server_handle(request: pytest.FixtureRequest) -> Iterator[ServerHandle]:
    """The PostgreSQL server for the session (``.url``, ``.source``); stopped at the end."""
    handle = _obtain("PostgreSQL", request)
    yield handle
    handle.close()


@pytest.fixture(scope="session")
def postgres_admin_url(postgres_server_handle: ServerHandle) -> str:
    """``postgresql://`` URL of an administrative database; may ``CREATE DATABASE``."""
    return postgres_server_handle.url


@pytest.fixture(scope="session")
def database_url(postgres_admin_url: str) -> Iterator[str]:
    """URL of a fresh database ``streams_test_<pid>_<hex>`` for this session, dropped after."""
    url = create_database(postgres_admin_url)
    yield url
    drop_database(postgres_admin_url, database_name(url))


@pytest.fixture
def unique_name() -> str:
    """A fresh stream name for one test: ``s_<12 hex>``, a lowercase identifier."""
    return new_stream_name()


@pytest.fixture(scope="session")
def redis_server_handle(request: pytest.FixtureRequest) -> Iterator[ServerHandle]:
    """The Redis server for the session (``.url``, ``.source``); stopped at the end."""
    handle = _obtain("Redis", request)
    yield handle
    handle.close()


@pytest.fixture(scope="session")
def redis_url(redis_server_handle: ServerHandle) -> str:
    """``redis://`` URL of the session's Redis server."""
    return redis_server_handle.url


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A channel/key prefix unique to one test (``streams-test-<hex>``); keys under it are
    deleted afterwards, since the Redis server may be shared."""
    prefix = new_redis_prefix()
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def streams_url(database_url: str) -> str:
    """The session database, migrated to the `streams` schema head."""
    from streams.migrate import upgrade

    upgrade(database_url)
    return database_url


@pytest.fixture
def own_database(postgres_admin_url: str) -> Iterator[str]:
    """A migrated database of this test's own (dropped afterwards), for tests that drop,
    recreate or restore it under live clients."""
    from streams.migrate import upgrade

    url = create_database(postgres_admin_url, prefix="streams_own")
    upgrade(url)
    yield url
    drop_database(postgres_admin_url, database_name(url))


@pytest.fixture
def client(streams_url: str) -> Iterator[Client]:
    """A `streams.Client` on the migrated session database, with a short writer lease."""
    with streams.connect(streams_url, lease_seconds=2.0) as c:
        yield c


@pytest.fixture
def stream(client: Client, unique_name: str) -> str:
    """A freshly created stream (default settings), by name."""
    client.create_stream(unique_name)
    return unique_name


@pytest.fixture
def declared_table(streams_url: str, unique_name: str) -> Iterator[str]:
    """A user table that can hold facts of a stream: ``(stream_id bigint NOT NULL, item
    text)``, indexed on ``stream_id``; dropped afterwards, and taken out of every stream's
    declaration so the shared test database stays healthy for other tests' doctors."""
    table = f"lines_{unique_name.replace('-', '_')}"
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (stream_id bigint NOT NULL, item text)")
        conn.execute(f"CREATE INDEX ON {table} (stream_id)")
    yield table
    with psycopg.connect(streams_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE streams_registry SET fact_tables = '[]' WHERE fact_tables::text LIKE %s",
            (f"%{table}%",),
        )
        conn.execute(f"DROP TABLE IF EXISTS {table}")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession (local[2]) for every Spark test: starting one costs ~7-10 s. A missing
    Java fails loudly, never skips."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("the Spark tests need Java 17+ (java on PATH or JAVA_HOME)", pytrace=False)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    import streams_spark
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("streams-spark-tests")
        .config("spark.ui.enabled", "false")
        # A Python worker that takes longer than Spark's 15 s to connect back (on a loaded
        # machine) fails the query with "Python worker failed to connect back".
        .config("spark.python.authenticate.socketTimeout", "120s")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    streams_spark.register(session)
    yield session
    session.stop()
