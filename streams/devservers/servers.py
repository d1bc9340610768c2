"""Both servers for the command line (``--embedded``, ``streams demo``): `embedded_servers`
starts (or joins) this project's PostgreSQL and Redis and stops them when the block ends,
however it ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from .accounts import postgres_directory
from .postgres_server import DEFAULT_DATABASE, ensure_database, start_postgres
from .processes import HOST
from .redis_server import start_redis

__all__ = ["DEFAULT_BASE_DIR", "EmbeddedURLs", "announcement", "embedded_servers"]

DEFAULT_BASE_DIR = Path(".streams")


class EmbeddedURLs(NamedTuple):
    """What `embedded_servers` yields; unpacks as ``(database_url, redis_url)``."""

    database_url: str
    redis_url: str


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
            from .. import migrate

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
