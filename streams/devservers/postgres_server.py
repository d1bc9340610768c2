"""A private PostgreSQL server: ``initdb`` once, then started (or reused) on a free port of
127.0.0.1, trusting connections from there only, with no Unix socket.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from .accounts import _check_reachable, _reachable_bindir, postgres_account
from .binaries import find_postgres_bindir
from .processes import (
    CONNECT_TIMEOUT,
    HOST,
    STARTUP_TIMEOUT,
    EmbeddedServer,
    EmbeddedServerError,
    _Account,
    _attach,
    _cmdline,
    _control_lock,
    _NotReady,
    _short,
    _start_on_free_port,
    _wait_ready,
    log,
    looks_like_server,
    pid_alive,
)

__all__ = [
    "DEFAULT_DATABASE",
    "SUPERUSER",
    "PostmasterPid",
    "ensure_database",
    "parse_postmaster_pid",
    "pg_hba_conf",
    "postgres_argv",
    "postgres_url",
    "start_postgres",
]

DEFAULT_DATABASE = "streams"
SUPERUSER = "postgres"


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


def pg_hba_conf() -> str:
    """Client authentication: trust, from 127.0.0.1 only (no Unix socket is opened)."""
    return (
        "# Written by streams.devservers: a private server for this project, reachable from\n"
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


def postgres_url(port: int, database: str = SUPERUSER) -> str:
    return f"postgresql://{SUPERUSER}@{HOST}:{port}/{database}"


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
