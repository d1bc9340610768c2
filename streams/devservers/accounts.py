"""Who runs PostgreSQL, which refuses to run as root, and where its files go then.

As root, the server runs as the owner of an existing data directory, else as ``postgres`` or
``nobody`` (`postgres_account`). That account must be able to enter every directory on the way
to its data and its binaries: when it cannot, the data goes to a directory of its own under
``/var/tmp`` (`postgres_directory`) and the binaries are copied there (`_reachable_bindir`),
rather than opening up the permissions of the user's directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from .processes import EmbeddedServerError, _Account, log

__all__ = [
    "ROOT_FALLBACK_BASE",
    "blocked_ancestor",
    "can_traverse",
    "postgres_account",
    "postgres_directory",
]


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
