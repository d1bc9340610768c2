"""The processes of the development servers: whose they are, the locks that share them between
processes, the handle (`EmbeddedServer`), and starting one on a free port until it answers.

Both servers (`streams.devservers.postgres_server`, `streams.devservers.redis_server`) run
through here; what differs between them (command lines, probes, pid files) is in their modules.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

from ..errors import ConfigurationError

__all__ = [
    "CONNECT_TIMEOUT",
    "HOST",
    "PINNED",
    "POLL_INTERVAL",
    "PORT_ATTEMPTS",
    "STARTUP_TIMEOUT",
    "STOP_TIMEOUT",
    "EmbeddedServer",
    "EmbeddedServerError",
    "Kind",
    "free_port",
    "looks_like_server",
    "pid_alive",
]

# The logger keeps the name it had when this package was one module, `streams.embedded`: the
# library's loggers are named after what they report on (`streams.writer`, `streams.redis`),
# and logging configurations name them.
log = logging.getLogger("streams.embedded")

HOST = "127.0.0.1"
CONNECT_TIMEOUT = 2  # seconds, per readiness probe
STARTUP_TIMEOUT = 30.0  # seconds for a server to accept connections
STOP_TIMEOUT = 10.0  # seconds for a server to shut down before it is killed
POLL_INTERVAL = 0.02  # seconds between readiness polls
PORT_ATTEMPTS = 3  # a free port may be taken before the server binds it: retry on another
#: In a server's directory: its last user leaves it running (`streams.devservers.background`).
PINNED = ".pinned"

Kind = Literal["postgres", "redis"]


class EmbeddedServerError(ConfigurationError):
    """An embedded server cannot be started: binaries missing, unusable directory, crash."""


def looks_like_server(cmdline: str, binary_name: str, markers: Iterable[str]) -> bool:
    """Whether a process command line is ``binary_name`` started for us (one of ``markers``,
    e.g. our data directory or ``127.0.0.1:<port>``, appears in it): guards against a recycled
    PID in a stale pid file."""
    words = cmdline.split()
    if not words or Path(words[0]).name != binary_name:
        return False
    return any(marker and marker in cmdline for marker in markers)


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
    the server is stopped unless another process still uses it or it is pinned (`PINNED`)."""

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
                if (self.directory / PINNED).exists():
                    log.info("%s in %s stays up: `streams up` keeps it", self.kind, self.directory)
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
