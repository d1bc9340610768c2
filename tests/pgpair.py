"""A private PostgreSQL primary and a hot streaming standby, built from the installed binaries.

`PostgresPair` starts a primary (`streams.embedded`, durable, ``wal_level=replica``), copies it
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
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from streams import embedded

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
        self.primary = embedded.start_postgres(
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

    def url(self, server: embedded.EmbeddedServer, database: str | None = None) -> str:
        return embedded.postgres_url(server.port, database or self.database)

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
            f"postgresql://{embedded.SUPERUSER}@{embedded.HOST}:{self.primary.port},"
            f"{embedded.HOST}:{self.standby.port}/{self.database}"
            "?target_session_attrs=read-write&connect_timeout=2"
        )

    # -- building --------------------------------------------------------------------------

    def _account_kwargs(self) -> dict[str, object]:
        owner = (self.workdir / "primary" / "data").stat().st_uid
        return embedded.postgres_account(owner).popen_kwargs()

    def _base_backup(self) -> None:
        bindir = embedded.find_postgres_bindir()
        self.standby_dir.mkdir(parents=True, exist_ok=True)
        data = self.standby_dir / "data"
        owner = (self.workdir / "primary" / "data").stat().st_uid
        os.chown(self.standby_dir, owner, -1)
        self.standby_dir.chmod(0o700)
        result = subprocess.run(
            [
                str(bindir / "pg_basebackup"),
                "-h",
                embedded.HOST,
                "-p",
                str(self.primary.port),
                "-U",
                embedded.SUPERUSER,
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

    def _start_standby(self) -> embedded.EmbeddedServer:
        server = embedded.start_postgres(self.standby_dir, durable=True, settings=PRIMARY_SETTINGS)
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
        bindir = embedded.find_postgres_bindir()
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

    def _in_recovery(self, server: embedded.EmbeddedServer) -> bool:
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
        return sock.connect_ex((embedded.HOST, port)) == 0


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
