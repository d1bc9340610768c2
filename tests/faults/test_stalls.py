"""No stream stalls past its lease behind a writer frozen or cut off in the middle of a COPY.

A writer in a child process (`tests/fault_child.py`) appends batches, or writes facts with
``fact.add`` in its own transaction (both are a ``COPY`` on the wire). The test waits until its
backend is in the ``COPY`` and then freezes it: SIGSTOP, or a proxy between the writer and
PostgreSQL that stops forwarding (a partition). The server's timers do not end such a
transaction (a backend reading COPY data from the client ignores ``statement_timeout``), so the
stream was held back until the process was killed. Now a reader notices the stream held back
and, once the writer's lease has expired, ends its session (the liveness argument,
docs/design/liveness.md): a fact appended after the freeze by another writer is delivered within
the lease plus a few seconds, the frozen batch never appears, every fact comes exactly once, in
order, whole, and the woken writer finds itself fenced.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from helpers import REPO_ROOT, TESTS_DIR, fact_rows
from proxy import Proxy

import streams
from streams.bench.common import drop_streams

LEASE = 2.0
#: The bound the stall must stay within: the lease (counted from the writer's last heartbeat,
#: at most ``lease / 4`` before the freeze), a second held before a reader checks, up to a
#: second between checks, up to a second for the server to end the session, and the polls.
BOUND = LEASE + 4.0


class Child:
    def __init__(self, role: str, url: str, stream: str, rows: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS_DIR / "fault_child.py"), role, url, stream, str(LEASE),
             str(rows)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.next("READY", 60)
        self.pid = int(ready.split()[1])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def next(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                done = self.proc.poll() is not None and self.proc.stderr is not None
                err = self.proc.stderr.read() if done and self.proc.stderr else ""
                raise AssertionError(f"no {prefix} line within {timeout}s; stderr: {err}") from None
            if line.startswith(prefix):
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


def wait_for_copy(url: str, pid: int, timeout: float = 60.0) -> None:
    """Until backend ``pid`` is in the middle of a COPY (polled every 2 ms)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as admin:
        while time.monotonic() < deadline:
            row = admin.execute(
                "SELECT state, left(query, 4) FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row == ("active", "COPY"):
                return
            time.sleep(0.002)
    raise AssertionError(f"backend {pid} never seen in a COPY")


@pytest.fixture
def delivered_after_freeze(
    streams_url: str, unique_name: str
) -> Iterator[Callable[[str, Callable[[Child], Any], str], None]]:
    """Run one freeze scenario: ``(role, freeze(child) -> thaw handle, child url)``."""
    children: list[Child] = []

    def scenario(role: str, freeze: Callable[[Child], Any], child_url: str) -> None:
        with streams.connect(streams_url, lease_seconds=LEASE) as client:
            client.create_stream(unique_name)
            child = Child(role, child_url, unique_name, rows=20_000 if role == "batch" else 5_000)
            children.append(child)
            child.next("ACK", 60)  # it writes; the next append is the one to freeze
            with client.reader(unique_name, poll_interval=0.1) as reader:
                # The reader catches up only after the freeze: before it, the child keeps
                # writing, and on a loaded machine a reader may never catch up with it.
                seen: list[int] = []
                wait_for_copy(streams_url, child.pid)
                thaw = freeze(child)
                frozen_at = time.monotonic()
                with client.writer(unique_name, instance="alive") as alive:
                    after = alive.append({"after": "the freeze"}).first_id
                # The reader delivers the fact appended after the freeze once the frozen
                # transaction is ended: that is the stall.
                deadline = frozen_at + BOUND + 10
                while after not in seen:
                    assert time.monotonic() < deadline, "the stream stayed held back"
                    epoch = reader.poll(timeout=0.5)
                    if epoch is not None:
                        seen += [f.stream_id for f in epoch.facts]
                stall = time.monotonic() - frozen_at
                thaw()
                # Woken, the frozen writer is fenced: its next appends fail, none commits.
                child.next("ERROR", 30)
                child.stop()
                seen += [f.stream_id for f in reader.facts()]
            rows = fact_rows(streams_url, unique_name)
        stored = sorted({r[0] for r in rows})
        assert seen == stored, "each fact exactly once, in order"
        per_fact: dict[int, int] = {}
        for stream_id, *_ in rows:
            per_fact[stream_id] = per_fact.get(stream_id, 0) + 1
        expected = 1 if role == "batch" else 5_000
        assert all(n == expected for i, n in per_fact.items() if i != after), "a torn fact"
        assert stall <= BOUND, f"held back {stall:.1f}s (bound {BOUND}s, lease {LEASE}s)"
        print(f"{role}: stream held back {stall:.2f}s behind the frozen writer (lease {LEASE}s)")

    yield scenario
    for child in children:
        child.stop()
    drop_streams(streams_url, [unique_name])  # up to a million facts: not left behind


def _sigstop(child: Child) -> Callable[[], None]:
    os.kill(child.proc.pid, signal.SIGSTOP)
    return lambda: os.kill(child.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("role", ["batch", "fact"])
def test_a_writer_stopped_in_a_copy_holds_the_stream_no_longer_than_its_lease(
    delivered_after_freeze: Callable[[str, Callable[[Child], Any], str], None],
    streams_url: str,
    role: str,
) -> None:
    delivered_after_freeze(role, _sigstop, streams_url)


@pytest.mark.parametrize("role", ["batch", "fact"])
def test_a_writer_cut_off_in_a_copy_holds_the_stream_no_longer_than_its_lease(
    delivered_after_freeze: Callable[[str, Callable[[Child], Any], str], None],
    streams_url: str,
    role: str,
) -> None:
    """The partition case: a proxy between the writer and PostgreSQL stops forwarding."""
    with Proxy.for_url(streams_url) as proxy:

        def partition(child: Child) -> Callable[[], None]:
            proxy.freeze()
            return proxy.thaw

        delivered_after_freeze(role, partition, proxy.url(streams_url))


def test_doctor_and_metrics_name_a_frozen_writer_past_its_lease_and_repair_ends_it(
    streams_url: str, unique_name: str
) -> None:
    """With nobody reading the stream, nothing ends the frozen session by itself: doctor
    names it (state, wait event, lease), the metrics show how long it held the stream past
    the lease, and ``doctor --repair`` ends it."""
    from click.testing import CliRunner

    from streams.command import main
    from streams.config import Settings
    from streams.metrics import DatabaseCollector

    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        child = Child("batch", streams_url, unique_name, rows=20_000)
        try:
            child.next("ACK", 60)
            wait_for_copy(streams_url, child.pid)
            os.kill(child.proc.pid, signal.SIGSTOP)
            time.sleep(LEASE + 1.0)
            result = CliRunner().invoke(main, ["doctor", "--json", "--database-url", streams_url])
            checks = {c["name"]: c for c in json.loads(result.stdout)}
            held = checks[f"stream {unique_name}: linear position"]
            assert not held["ok"]
            for words in ("writer 'frozen-batch'", "ClientRead", "lease expired"):
                assert words in held["detail"], held["detail"]
            families = {
                f.name: f for f in DatabaseCollector(Settings.resolve(streams_url)).collect()
            }
            past = {
                s.labels["stream"]: s.value
                for s in families["streams_held_past_lease_seconds"].samples
            }
            assert past[unique_name] > 0
            result = CliRunner().invoke(
                main, ["doctor", "--repair", "--json", "--database-url", streams_url]
            )
            assert any("frozen-batch" in action for action in json.loads(result.stdout)["repaired"])
            positions = client.positions(unique_name)
            assert positions.linear == positions.max_allocated  # the frozen batch is a gap
            os.kill(child.proc.pid, signal.SIGCONT)
            child.next("ERROR", 30)
        finally:
            child.stop()
            drop_streams(streams_url, [unique_name])


def test_only_sessions_this_role_may_signal_are_ended(streams_url: str) -> None:
    """`MAY_END_SESSION` filters the sessions readers end, so that ``pg_terminate_backend``
    never raises for one they may not end: a member of the session's role or of
    ``pg_signal_backend`` may, a superuser's session only a superuser."""
    import secrets

    from streams.store._common import MAY_END_SESSION

    plain, other = (f"streams_role_{secrets.token_hex(4)}" for _ in range(2))
    password = secrets.token_hex(8)
    with psycopg.connect(streams_url, autocommit=True) as admin:
        for role in (plain, other):
            admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        try:

            def url_as(role: str) -> str:
                parts = urlsplit(streams_url)
                netloc = f"{role}:{password}@{parts.hostname}:{parts.port or 5432}"
                return urlunsplit(parts._replace(netloc=netloc))

            with (
                psycopg.connect(url_as(plain), autocommit=True) as as_plain,
                psycopg.connect(url_as(other), autocommit=True) as as_other,
            ):

                def may_end(conn: psycopg.Connection[Any], pid: int) -> bool:
                    row = conn.execute(
                        f"SELECT {MAY_END_SESSION} FROM pg_stat_activity a WHERE a.pid = %s",
                        (pid,),
                    ).fetchone()
                    assert row is not None
                    return bool(row[0])

                superuser_pid = admin.info.backend_pid
                assert may_end(admin, as_plain.info.backend_pid)
                assert may_end(as_plain, as_plain.info.backend_pid)
                assert not may_end(as_plain, as_other.info.backend_pid)
                assert not may_end(as_plain, superuser_pid)
                admin.execute(f"GRANT pg_signal_backend TO {plain}")
                assert may_end(as_plain, as_other.info.backend_pid)
                assert not may_end(as_plain, superuser_pid)
        finally:
            for role in (plain, other):
                admin.execute(f"DROP ROLE IF EXISTS {role}")
