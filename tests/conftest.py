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
from collections.abc import Iterator

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
def client(streams_url: str) -> Iterator[Client]:
    """A `streams.Client` on the migrated session database, with a short writer lease."""
    with streams.connect(streams_url, lease_seconds=2.0) as c:
        yield c


@pytest.fixture
def stream(client: Client, unique_name: str) -> str:
    """A freshly created stream (default settings), by name."""
    client.create_stream(unique_name)
    return unique_name
