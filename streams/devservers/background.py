"""Embedded servers kept running in the background (``streams up`` / ``down`` / ``status``), and
finding them from any program started in the project (`find_running`).

``streams up`` starts (or reuses) the project's servers exactly as ``--embedded`` does
(`embedded_servers`), then *pins* them: a ``.pinned`` file in each server's directory tells
the last process leaving a server not to stop it (`EmbeddedServer.stop`), and ``up.json`` in
the base directory records the URLs and pids. Any process may still join the pinned servers
(the demo, ``--embedded``); they leave them as they found them. ``streams down`` removes the
pins and stops each server no process uses any more; a server still in use stops when its
last user leaves, as before ``up``.

`find_running` looks for ``.streams/up.json`` in the working directory and its parents (as
git looks for ``.git``) and trusts it only while both recorded processes are alive and are
the servers of those directories (a pid recycled after a reboot is not a server). It reads
two small files and two ``/proc`` entries: cheap enough for every client opened without a URL
(`with_running_servers`: `streams.connect`, `aconnect`, the CLI, the Spark source and sink).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .accounts import postgres_directory
from .postgres_server import DEFAULT_DATABASE, _running_postgres
from .processes import (
    PINNED,
    STARTUP_TIMEOUT,
    _cmdline,
    _control_lock,
    _terminate,
    log,
    looks_like_server,
    pid_alive,
)
from .redis_server import _running_redis
from .servers import DEFAULT_BASE_DIR, EmbeddedURLs, embedded_servers

__all__ = [
    "PIN",
    "UP_FILE",
    "BackgroundServers",
    "ServerStatus",
    "bring_down",
    "bring_up",
    "describe",
    "find_running",
    "server_status",
    "with_running_servers",
]

#: In the base directory: what ``streams up`` started (URLs, pids, directories).
UP_FILE = "up.json"
#: In a server's directory: the last process leaving the server does not stop it.
PIN = PINNED


@dataclass(frozen=True)
class BackgroundServers:
    """What ``up.json`` records: the URLs, and each server's pid and directory."""

    base_dir: str
    database_url: str
    redis_url: str
    postgres_pid: int
    postgres_dir: str
    redis_pid: int
    redis_dir: str

    @property
    def urls(self) -> EmbeddedURLs:
        return EmbeddedURLs(self.database_url, self.redis_url)

    def alive(self) -> bool:
        """Both recorded processes run, and are these directories' servers."""
        # redis-server shows "redis-server 127.0.0.1:PORT" as its command line, not its dir.
        redis_address = self.redis_url.split("//", 1)[-1].split("/", 1)[0]
        return _is_server(self.postgres_pid, "postgres", [self.postgres_dir]) and _is_server(
            self.redis_pid, "redis-server", [self.redis_dir, redis_address]
        )


def _is_server(pid: int, binary: str, markers: list[str]) -> bool:
    return pid_alive(pid) and looks_like_server(_cmdline(pid) or "", binary, markers)


def _read_up_file(path: Path) -> BackgroundServers | None:
    try:
        recorded = json.loads(path.read_text())
        return BackgroundServers(**{k: recorded[k] for k in BackgroundServers.__annotations__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_running(start: Path | None = None) -> BackgroundServers | None:
    """The servers ``streams up`` keeps running for the working directory (or ``start``) or a
    parent of it, if they still run; ``None`` else.

    Only a ``.streams`` directory and ``up.json`` of this user's, that nobody else may write,
    are trusted (as git's ``safe.directory``): under a shared directory such as ``/tmp``,
    another account could otherwise point this user's programs at a server of its own."""
    here = (start or Path.cwd()).absolute()
    for directory in (here, *here.parents):
        up_file = directory / DEFAULT_BASE_DIR / UP_FILE
        if up_file.is_file():
            if not (_ours(up_file.parent) and _ours(up_file)):
                log.warning("ignoring %s: not this user's, or writable by others", up_file)
                return None
            found = _read_up_file(up_file)
            if found is not None and found.alive():
                return found
            log.info("%s names servers that no longer run (streams up starts them)", up_file)
            return None
    return None


def _ours(path: Path) -> bool:
    """Owned by this user, writable by nobody else."""
    try:
        status = path.stat()
    except OSError:
        return False
    return status.st_uid == os.geteuid() and not status.st_mode & 0o022


def with_running_servers(
    database_url: str | None, redis_url: str | None
) -> tuple[str | None, str | None]:
    """The URLs to open a client with: those given or in the environment; else, when no
    database URL is configured at all, those of the servers `streams up` keeps running for the
    working directory (their Redis too, unless a Redis URL is configured)."""
    if database_url or os.environ.get("STREAMS_DATABASE_URL"):
        return database_url, redis_url
    found = find_running()
    if found is None:
        return database_url, redis_url  # `Settings.resolve` says how to configure one
    return found.database_url, redis_url or os.environ.get("STREAMS_REDIS_URL") or found.redis_url


def bring_up(
    base_dir: Path = DEFAULT_BASE_DIR,
    *,
    database: str = DEFAULT_DATABASE,
    announce: Callable[[str], None] | None = None,
) -> BackgroundServers:
    """Start (or reuse) the servers under ``base_dir``, migrate, and keep them running after
    this process ends (pinned). Idempotent: a second call finds them running."""
    base_dir = base_dir.absolute()
    with embedded_servers(base_dir, database=database) as urls:
        postgres_dir, redis_dir = postgres_directory(base_dir), base_dir / "redis"
        running = (_running_postgres(postgres_dir / "data", STARTUP_TIMEOUT),
                   _running_redis(redis_dir, STARTUP_TIMEOUT))  # fmt: skip
        assert running[0] is not None and running[1] is not None  # started just above
        servers = BackgroundServers(
            str(base_dir), urls.database_url, urls.redis_url,
            running[0][0], str(postgres_dir), running[1][0], str(redis_dir),
        )  # fmt: skip
        # Programs trust up.json only if nobody else may write it or its directory
        # (`find_running`), whatever the umask (002 on many desktops).
        base_dir.chmod(base_dir.stat().st_mode & 0o755)
        _write(base_dir / UP_FILE, json.dumps(asdict(servers), indent=2) + "\n")
        # The pins last: nothing after them can fail, so a failed `up` leaves nothing running.
        for directory in (postgres_dir, redis_dir):
            _write(directory / PIN, "kept running by `streams up`; `streams down` stops it\n")
        if announce is not None:
            versions = f"PostgreSQL {running[0][2]}, Redis {running[1][2]}"
            announce(f"streams: embedded servers up ({versions}), data in {base_dir}")
    return servers


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole (a reader never sees half of it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.chmod(0o644)
    partial.replace(path)


@dataclass(frozen=True)
class ServerStatus:
    """One server as ``streams status`` shows it."""

    kind: str
    directory: str
    running: bool
    pid: int | None = None
    port: int | None = None
    version: str | None = None
    pinned: bool = False
    users: bool = False  # other processes use it now (the demo, a command with --embedded)


def _in_use(directory: Path) -> bool:
    """Does a process hold the server's shared "in use" lock? Call under `_control_lock`."""
    users = directory / ".users.lock"
    if not users.exists():
        return False
    fd = os.open(users, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def _each_server(base_dir: Path) -> Iterator[list[tuple[str, Path, tuple[int, int, str] | None]]]:
    """Each server directory that exists, under its control lock, with what runs there."""
    base_dir = base_dir.absolute()
    found: list[tuple[str, Path, tuple[int, int, str] | None]] = []
    with contextlib.ExitStack() as stack:
        postgres_dir = base_dir / "postgres"
        if (base_dir / "postgres-location").exists() or postgres_dir.exists():
            postgres_dir = postgres_directory(base_dir)
        for kind, directory in (("postgres", postgres_dir), ("redis", base_dir / "redis")):
            if not directory.is_dir():
                continue
            stack.enter_context(_control_lock(directory))
            if kind == "postgres":
                pgdata = directory / "data"
                running = _running_postgres(pgdata, 5.0) if pgdata.exists() else None
            else:
                running = _running_redis(directory, 5.0)
            found.append((kind, directory, running))
        yield found


def server_status(base_dir: Path = DEFAULT_BASE_DIR) -> list[ServerStatus]:
    """What runs under ``base_dir`` (an empty list: no servers were ever made there)."""
    statuses: list[ServerStatus] = []
    with _each_server(base_dir) as servers:
        for kind, directory, running in servers:
            pid, port, version = running if running is not None else (None, None, None)
            pinned, users = (directory / PIN).exists(), _in_use(directory)
            status = ServerStatus(kind, str(directory), running is not None, pid, port, version)
            statuses.append(dataclasses.replace(status, pinned=pinned, users=users))
    return statuses


def bring_down(base_dir: Path = DEFAULT_BASE_DIR) -> list[str]:
    """Unpin the servers under ``base_dir`` and stop each that no process uses; one line per
    server saying what happened."""
    lines: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        (base_dir.absolute() / UP_FILE).unlink()
    with _each_server(base_dir) as servers:
        for kind, directory, running in servers:
            with contextlib.suppress(FileNotFoundError):
                (directory / PIN).unlink()
            if running is None:
                lines.append(f"{kind}: not running")
            elif _in_use(directory):
                lines.append(
                    f"{kind}: pid {running[0]} stays up while another process uses it "
                    "(it stops when the last one ends)"
                )
            else:
                stop_signal = signal.SIGINT if kind == "postgres" else signal.SIGTERM
                _terminate(running[0], None, stop_signal)
                if kind == "redis":
                    with contextlib.suppress(FileNotFoundError):
                        (directory / "server.json").unlink()
                lines.append(f"{kind}: stopped (pid {running[0]})")
    return lines


def describe(status: list[ServerStatus]) -> dict[str, Any]:
    """``streams status --json``: each server's fields, by kind."""
    return {s.kind: asdict(s) for s in status}
