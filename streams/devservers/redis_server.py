"""A private Redis server: started (or reused) on a free port of 127.0.0.1, nothing persisted
(streams uses Redis for pub/sub only); its pid and port in ``server.json``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import redis

from .binaries import find_redis_server
from .processes import (
    CONNECT_TIMEOUT,
    HOST,
    STARTUP_TIMEOUT,
    EmbeddedServer,
    _Account,
    _attach,
    _cmdline,
    _control_lock,
    _NotReady,
    _short,
    _start_on_free_port,
    _terminate,
    _wait_ready,
    log,
    looks_like_server,
    pid_alive,
)

__all__ = ["redis_argv", "redis_url", "start_redis"]


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


def redis_url(port: int) -> str:
    return f"redis://{HOST}:{port}/0"


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
