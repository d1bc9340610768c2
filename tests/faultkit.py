"""Tools of the fault tests (imported as ``from faultkit import ...``): a reader driven and
checked after every poll (`Follower`), writers that record what they were told (`Appender`),
and a private PostgreSQL server that can be restarted under load (`RestartablePostgres`).

The promises checked: nothing lost, duplicated, torn, reordered or invented. A `Follower`
asserts after every poll that the facts its reader delivered are exactly the stored facts up
to the reader's position, in order, and that the position never passes the linear position
PostgreSQL proves. An `Appender` records every acknowledged ID, and every append whose commit
outcome is unknown (`streams.CommitUnknown`), so a test can check each acked fact is stored
once and each unknown one at most once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from helpers import wait_until

import streams
from streams import Client
from streams.ops import embedded
from streams.transport.link import RedisLink

__all__ = [
    "Appender",
    "Follower",
    "RestartablePostgres",
    "backend_waits_for_a_lock",
    "in_thread",
    "link_of",
    "partition_locked",
    "payload_counts",
    "quiet_heartbeat",
    "restartable_postgres",
    "stored_ids",
    "terminate",
]


def stored_ids(
    conn: psycopg.Connection[tuple[Any, ...]],
    stream_key: int,
    after: int = 0,
    through: int = 2**63 - 1,
) -> list[int]:
    """IDs of the committed facts in ``(after, through]``, ascending."""
    rows = conn.execute(
        "SELECT DISTINCT stream_id FROM streams_facts "
        "WHERE stream = %s AND stream_id > %s AND stream_id <= %s ORDER BY stream_id",
        (stream_key, after, through),
    ).fetchall()
    return [int(row[0]) for row in rows]


def payload_counts(url: str, stream: str) -> dict[tuple[str, int], int]:
    """How many stored rows carry each ``(payload['w'], payload['n'])`` of an `Appender`."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT f.payload->>'w', (f.payload->>'n')::int, count(*) FROM streams_facts f "
            "JOIN streams_registry r ON r.id = f.stream WHERE r.name = %s "
            "AND f.payload ? 'w' GROUP BY 1, 2",
            (stream,),
        ).fetchall()
    return {(str(w), int(n)): int(count) for w, n, count in rows}


def link_of(client: Client) -> RedisLink:
    link = client.link
    assert link is not None, "this client was made without a Redis URL"
    return link


class Follower:
    """Drives a reader in this thread and checks its promises after every poll.

    ``tolerate_lost``: a `streams.ConnectionLost` out of a poll (PostgreSQL restarted or cut
    off for longer than the poll's timeout) is counted in `lost` and the next poll goes on;
    otherwise it fails the test.
    """

    def __init__(
        self, reader: streams.Reader, admin: Client, url: str, *, tolerate_lost: bool = False
    ) -> None:
        self.reader = reader
        self.admin = admin
        self.url = url
        self.stream = reader.streams[0]
        self.stream_key = admin.stream(self.stream).id
        self.conn: psycopg.Connection[tuple[Any, ...]] | None = psycopg.connect(
            url, autocommit=True
        )
        #: Where the reader started: it owes every stored fact after this.
        self.start = reader.position()
        self.delivered: list[int] = []
        self.live_seen: list[bool] = []
        self.tolerate_lost = tolerate_lost
        self.lost = 0
        self.longest_poll = 0.0

    def __enter__(self) -> Follower:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.conn is not None:
            self.conn.close()

    @property
    def position(self) -> int:
        return self.reader.position()

    def poll(self, timeout: float = 0.05) -> None:
        started = time.monotonic()
        try:
            epoch = self.reader.poll(timeout=timeout)
        except streams.ConnectionLost:
            if not self.tolerate_lost:
                raise
            self.lost += 1
            epoch = None
        self.longest_poll = max(self.longest_poll, time.monotonic() - started)
        if epoch is not None:
            self.delivered.extend(fact.stream_id for fact in epoch.facts)
            assert epoch.upper[self.stream] == self.reader.position()
        self.live_seen.append(self.reader.live)
        self.check()

    def _admin_conn(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.conn = psycopg.connect(self.url, autocommit=True)
        return self.conn

    def check(self) -> None:
        """The reader's promises, checked on PostgreSQL (skipped while it cannot be reached:
        a restart under test; the next poll checks everything again)."""
        position = self.reader.position()
        try:
            stored = stored_ids(self._admin_conn(), self.stream_key, self.start, position)
            linear = self.admin.positions(self.stream).linear
        except (psycopg.OperationalError, streams.StoreError):
            if not self.tolerate_lost:
                raise
            self.conn = None
            return
        assert self.delivered == stored, (
            f"at position {position} the reader delivered {self._diff(stored)}"
        )
        assert position <= linear, f"reader position {position} passed the linear {linear}"

    def _diff(self, stored: list[int]) -> str:
        extra = sorted(set(self.delivered) - set(stored))
        missing = sorted(set(stored) - set(self.delivered))
        dups = len(self.delivered) - len(set(self.delivered))
        ordered = self.delivered == sorted(self.delivered)
        return f"extra {extra[:10]}, missing {missing[:10]}, {dups} duplicates, ordered={ordered}"

    def pump_until(
        self, condition: Callable[[], bool], timeout: float, what: str, *, poll: float = 0.05
    ) -> None:
        """Poll until ``condition``; ``poll`` is the timeout of each `Reader.poll` (a long one
        leaves the reader to its own poll interval and hints, as in production)."""
        deadline = time.monotonic() + timeout
        while not condition():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}: position {self.position}, "
                    f"{len(self.delivered)} delivered, live={self.reader.live}"
                )
            self.poll(min(poll, remaining))

    def pump_for(self, seconds: float, *, poll: float = 0.05) -> None:
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            self.poll(min(poll, remaining))

    def all_stored(self) -> list[int]:
        return stored_ids(self._admin_conn(), self.stream_key, self.start)


class Appender(threading.Thread):
    """Appends at a steady pace; records every acknowledged ID and every error.

    Payloads are ``{"w": <writer instance>, "n": <attempt number>}`` (`payload_counts` reads
    them back). ``batch``: facts per `Writer.append_batch` (0: single `Writer.append`). The
    kinds of error met are in `errors`; `unknown` holds the attempt numbers whose commit
    outcome was unknown (`streams.CommitUnknown`); `longest` is the slowest append's seconds.
    """

    def __init__(
        self, writer: streams.Writer, pace: float, limit: int | None = None, *, batch: int = 0
    ) -> None:
        super().__init__(name=f"appender-{writer.instance}", daemon=True)
        self.writer = writer
        self.pace = pace
        self.limit = limit
        self.batch = batch
        self.acked: list[int] = []
        self.acked_n: list[int] = []
        self.unknown: list[int] = []
        self.errors: list[BaseException] = []
        self.longest = 0.0
        self.stopped = threading.Event()

    def run(self) -> None:
        n = 0
        name = self.writer.instance
        while not self.stopped.is_set() and (self.limit is None or n < self.limit):
            started = time.monotonic()
            try:
                if self.batch:
                    ack = self.writer.append_batch(
                        [{"w": name, "n": n, "i": i} for i in range(self.batch)]
                    )
                else:
                    ack = self.writer.append({"w": name, "n": n})
            except streams.CommitUnknown as exc:
                self.unknown.append(n)
                self.errors.append(exc)
            except Exception as exc:  # recorded: each test says which it allows
                self.errors.append(exc)
            else:
                self.acked.extend(ack.ids)
                self.acked_n.append(n)
            self.longest = max(self.longest, time.monotonic() - started)
            n += 1
            self.stopped.wait(self.pace)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=60)
        assert not self.is_alive(), "the appender thread is stuck"

    def error_kinds(self) -> set[str]:
        return {type(exc).__name__ for exc in self.errors}


# ------------------------------------------------------------- breaking one append


def quiet_heartbeat(client: Client, stream: str, writer: streams.Writer, ack: streams.Ack) -> None:
    """Wait until the heartbeat woken by ``ack``'s append has run (it persisted the position):
    the next is a lease/4 away. Heartbeats borrow the writer's connection between appends, so
    a test that freezes the network right after an append would otherwise freeze that
    heartbeat, not the append it means to."""
    wait_until(
        lambda: client.positions(stream).writers[writer.instance].position >= ack.last_id,
        10,
        "the heartbeat after the append",
    )


def backend_waits_for_a_lock(url: str, pid: int) -> Callable[[], bool]:
    def check() -> bool:
        with psycopg.connect(url, autocommit=True) as admin:
            row = admin.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
        return row is not None and row[0] == "Lock"

    return check


@contextlib.contextmanager
def partition_locked(url: str, client: streams.Client, stream: str) -> Iterator[None]:
    """Hold a SHARE lock on the stream's facts partition: appends wait for it in their
    ``INSERT`` or ``COPY`` (after their reservation), so a test can break them there."""
    from streams.core.constants import facts_partition

    with psycopg.connect(url) as holder:
        holder.execute(f"LOCK TABLE {facts_partition(client.stream(stream).id)} IN SHARE MODE")
        yield
        holder.rollback()


def in_thread(action: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``action`` on a thread; its result or exception lands in the returned list."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(action())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def terminate(url: str, pid: int) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))  # waits until gone


class RestartablePostgres:
    """A private PostgreSQL server (`streams.ops.embedded`, durable: an immediate shutdown
    must lose nothing that was acknowledged) behind a `proxy.Proxy`, so that clients keep
    one URL while the server restarts on a new port.

    `restart` stops it with SIGINT (``fast``: ends sessions, checkpoints) or SIGQUIT
    (``immediate``: no checkpoint, crash recovery at the next start) and starts it again.
    """

    def __init__(self, workdir: Path, settings: dict[str, str] | None = None) -> None:
        from proxy import Proxy

        self.workdir = workdir
        self.settings = dict(settings or {})
        self.server = embedded.start_postgres(workdir, durable=True, settings=self.settings)
        self.proxy = Proxy("127.0.0.1", self.server.port)
        self.admin_url = self.proxy.url(self.server.url)
        self.restarts = 0

    def url(self, database: str) -> str:
        return self.admin_url.rsplit("/", 1)[0] + f"/{database}"

    def restart(self, mode: str, down_for: float = 0.0) -> float:
        """Stop (``fast`` or ``immediate``), wait ``down_for`` seconds, start; returns the
        seconds the server was unreachable."""
        sig = {"fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode]
        old = self.server
        started = time.monotonic()
        os.kill(old.pid, sig)
        deadline = time.monotonic() + 60
        while old.running:
            assert time.monotonic() < deadline, f"postgres did not stop on {mode} shutdown"
            time.sleep(0.01)
        old.stop()  # releases this handle (the server is gone already)
        time.sleep(down_for)
        self.server = embedded.start_postgres(self.workdir, durable=True, settings=self.settings)
        self.proxy.retarget("127.0.0.1", self.server.port)
        self.restarts += 1
        return time.monotonic() - started

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proxy.close()
        self.server.stop()


@contextlib.contextmanager
def restartable_postgres(
    settings: dict[str, str] | None = None,
) -> Iterator[RestartablePostgres]:
    """A `RestartablePostgres` in a fresh directory (server ``settings`` added to its command
    line), removed afterwards. Not pytest's ``tmp_path``: as root, PostgreSQL runs as another
    user, who cannot enter it."""
    workdir = Path(tempfile.mkdtemp(prefix="streams-restart-"))
    try:
        server = RestartablePostgres(workdir, settings)
        try:
            yield server
        finally:
            server.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
