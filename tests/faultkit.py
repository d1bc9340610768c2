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

import base64
import contextlib
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import pytest
import redis
from helpers import wait_until
from servers import docker_available, free_port

import streams
from streams import Client, devservers
from streams.core.constants import data_channel, proof_channel, replication_channel
from streams.core.protocol import ProtocolError, RdataCommand, parse, serialize
from streams.transport.link import RedisLink

LOCALHOST = "127.0.0.1"

__all__ = [
    "Appender",
    "Attacker",
    "Child",
    "Follower",
    "RestartablePostgres",
    "RestartableRedis",
    "backend_waits_for_a_lock",
    "die_with_parent",
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


# ------------------------------------------------------------- child processes and Redis


#: What a `Child` runs first (``python -c DIE_WITH_PARENT PARENT_PID -c CODE ...`` or ``...
#: PARENT_PID SCRIPT ...``): ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills it when
#: the test's process dies, however it dies; then, if that parent is gone already, exit; then
#: the program. (Not ``preexec_fn``: unsafe in a process with threads.)
DIE_WITH_PARENT = """
import ctypes, os, runpy, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    sys.exit(70)
if sys.argv[2] == "-c":
    code, sys.argv = sys.argv[3], ["-c", *sys.argv[4:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def die_with_parent(program: list[str]) -> list[str]:
    """The command line that runs ``program`` (``["-c", CODE]`` or ``[SCRIPT]``, then its
    arguments) with this interpreter, in a child that dies with this process."""
    return [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *program]


class Child:
    """A Python child process running ``code`` (or the file ``script``, then ``code`` is
    ignored); its stdout lines arrive on a queue, and every one is also kept in `history`.

    It dies with this process (`die_with_parent`) and leads a process group of its own, which
    `close` kills whole: no child outlives its test.
    """

    def __init__(
        self,
        code: str,
        args: list[str],
        stderr_path: Path,
        *,
        script: Path | None = None,
        name: str = "",
    ) -> None:
        self.name = name or stderr_path.stem
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")  # noqa: SIM115 (closed in close())
        program = [str(script)] if script is not None else ["-c", textwrap.dedent(code)]
        self.proc = subprocess.Popen(
            die_with_parent([*program, *args]),
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.history: list[str] = []
        #: When each line of `history` arrived here (`time.monotonic`).
        self.times: list[float] = []
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.endswith("\n"):  # a line cut short by SIGKILL is dropped
                self.times.append(time.monotonic())
                self.history.append(line.rstrip("\n"))
                self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.stderr_path.read_text(errors="replace").splitlines()[-8:])
        return ""

    def next_line(self, timeout: float = 30.0) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child silent for {timeout}s: {self.stderr_tail()}") from None
        if line is None:
            raise AssertionError(
                f"child exited ({self.proc.poll()}) unexpectedly: {self.stderr_tail()}"
            )
        return line

    def kill(self) -> None:
        """SIGKILL, then collect everything it printed before dying."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._pump.join(timeout=30)

    def remaining_lines(self) -> list[str]:
        lines: list[str] = []
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return lines
            if line is not None:
                lines.append(line)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child (nothing if it has exited and been collected)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def close(self) -> None:
        """Kill the child's whole process group (it may be stopped: SIGKILL ends it too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._pump.join(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


class RestartableRedis:
    """A Redis server of this test alone, on a fixed port, that can be killed and restarted.

    A private ``redis-server`` if the binary is installed, else a Docker container (via
    testcontainers) bound to a fixed host port; neither means the test fails (never skips).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.binary = shutil.which("redis-server")
        self.host = LOCALHOST
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.container: Any = None
        self._container_started = False
        if self.binary is None:
            if not docker_available():
                pytest.fail(
                    "the Redis restart test needs a redis-server binary on PATH or a Docker "
                    "engine (testcontainers): found neither",
                    pytrace=False,
                )
            try:
                from testcontainers.community.redis import RedisContainer
            except ImportError:
                from testcontainers.redis import RedisContainer
            self.container = RedisContainer("redis:7").with_bind_ports(6379, self.port)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, *, first: bool = False) -> None:
        attempts = 3 if first else 10
        for attempt in range(attempts):
            if self._launch():
                return
            if first and self.binary is not None:
                self.port = free_port()  # lost a race for the port: any other will do
            else:
                time.sleep(0.2 * (attempt + 1))  # same port: let the kernel release it
        pytest.fail(f"could not start redis-server on port {self.port}", pytrace=False)

    def _launch(self) -> bool:
        if self.binary is not None:
            argv = [
                self.binary,
                "--port", str(self.port),
                "--bind", LOCALHOST,
                "--dir", str(self.workdir),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
            ]  # fmt: skip
            with open(self.workdir / "redis.log", "ab") as log:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        elif not self._container_started:
            self.container.start()
            self._container_started = True
            self.host = self.container.get_container_host_ip()
        else:
            self.container.get_wrapped_container().start()
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            probe = redis.Redis(
                host=self.host, port=self.port, socket_connect_timeout=1, socket_timeout=1
            )
            try:
                if probe.ping():
                    return True
            except redis.RedisError:
                time.sleep(0.05)
            finally:
                probe.close()
        return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        else:
            self.container.get_wrapped_container().kill()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.container is not None and self._container_started:
            with contextlib.suppress(Exception):
                self.container.stop()


# ------------------------------------------------------------- forged and replayed lines


def _flip_base64(text: str) -> str:
    """The base64 of ``text``'s bytes with the first one altered (a sealed payload changed)."""
    data = base64.b64decode(text)
    return base64.b64encode(bytes([data[0] ^ 1]) + data[1:]).decode() if data else "AA=="


class Attacker(threading.Thread):
    """Hears every proof channel of the prefix and publishes every attack on the lines
    (`tests/faults/test_signed_ranges.py`).

    ``every_channel``: also hears the replication channel (``<prefix>``) and every data
    channel (``<prefix>:data:<stream>``), and replays what it heard there, on the channel it
    came from or on another, and forges ``POSITION`` and ``RDATA`` lines of the real writers
    far ahead of the truth; it rides out Redis restarts (reconnects). ``pause``: seconds
    between two attacks. ``seed``: its choices.
    """

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        names: list[str],
        *,
        seed: int = 7,
        every_channel: bool = False,
        pause: float = 0.002,
    ) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.every_channel = every_channel
        self.pause = pause
        self.prefix = prefix
        self.names = names
        self.signed: list[RdataCommand] = []
        self.heard: list[tuple[str, bytes]] = []  # (channel, line): every_channel only
        self.writers: set[tuple[str, str]] = set()  # (stream, instance) heard
        self.sent: dict[str, int] = {}
        self.stop = threading.Event()
        self.rng = random.Random(seed)
        self.pubsub: Any = None
        self._subscribe()

    def _subscribe(self) -> None:
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
        self.pubsub.psubscribe(proof_channel(self.prefix, "*"))
        if self.every_channel:
            self.pubsub.psubscribe(data_channel(self.prefix, "*"))
            self.pubsub.subscribe(replication_channel(self.prefix))

    def _send(self, what: str, cmd: RdataCommand | bytes, stream: str) -> None:
        try:
            line = cmd if isinstance(cmd, bytes) else serialize(cmd)
        except ProtocolError:
            return
        self.client.publish(proof_channel(self.prefix, stream), line)
        self.sent[what] = self.sent.get(what, 0) + 1

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self._step()
            except (redis.RedisError, OSError):  # Redis restarting: hear it again when back
                if not self.every_channel:
                    raise
                self.sent["redis-down"] = self.sent.get("redis-down", 0) + 1
                self.stop.wait(0.2)
                with contextlib.suppress(redis.RedisError, OSError):
                    self.pubsub.close()
                    self._subscribe()

    def _step(self) -> None:
        message = self.pubsub.get_message(timeout=0.01)
        if message is not None and message["type"] in ("pmessage", "message"):
            channel = message["channel"]
            channel = channel.decode() if isinstance(channel, bytes) else str(channel)
            with contextlib.suppress(ProtocolError):
                cmd = parse(message["data"])
                if isinstance(cmd, RdataCommand) and cmd.instance_name.startswith("_proof:"):
                    self.signed.append(cmd)
                    del self.signed[:-500]
                name = getattr(cmd, "instance_name", "")
                stream = getattr(cmd, "stream_name", "")
                if name and not name.startswith("_proof:") and stream in self.names:
                    self.writers.add((stream, name))
            if self.every_channel:
                self.heard.append((channel, bytes(message["data"])))
                del self.heard[:-500]
        if self.signed:
            self._attack()
        if self.every_channel and self.heard:
            self._attack_every_channel()

    def _attack(self) -> None:
        rng = self.rng
        cmd = rng.choice(self.signed)
        row: Any = cmd.row
        proof = row["proof"]
        stream, inst, token = cmd.stream_name, cmd.instance_name, cmd.token
        assert token is not None
        other = next(n for n in self.names if n != stream)
        attacks: dict[str, Any] = {
            "replay": cmd,
            "duplicate": cmd,
            "other-stream": RdataCommand(other, inst, token, row),
            "truncate": RdataCommand(stream, inst, token, {**row, "proof": {
                **proof, "sealed": proof["sealed"][:-8]}}),
            "alter": RdataCommand(stream, inst, token, {**row, "proof": {
                **proof, "sealed": _flip_base64(proof["sealed"])}}),
            "stretch": RdataCommand(stream, inst, token + 1000, row),
            "forge": RdataCommand(stream, "_proof:evil", token + 1, {
                "sig": base64.b64encode(bytes(64)).decode(), "proof": {
                    **proof, "after": token}}),
            "beyond-truth": f"POSITION {stream} _proof:evil 0 999999999".encode(),
        }  # fmt: skip
        what = rng.choice(sorted(attacks))
        self._send(what, attacks[what], stream if what != "other-stream" else other)
        if what == "duplicate":
            self._send(what, cmd, stream)
        time.sleep(self.pause)

    def _attack_every_channel(self) -> None:
        rng = self.rng
        channel, line = rng.choice(self.heard)
        channels = [replication_channel(self.prefix)] + [
            ch(self.prefix, n) for n in self.names for ch in (data_channel, proof_channel)
        ]
        what = rng.choice(["replay", "replay-elsewhere", "writer-ahead", "rdata-invented"])
        if what == "replay":
            self._publish(what, channel, line)
        elif what == "replay-elsewhere":
            self._publish(what, rng.choice(channels), line)
        elif self.writers:
            stream, name = rng.choice(sorted(self.writers))
            ahead = rng.randint(1, 10**6)
            if what == "writer-ahead":
                forged = f"POSITION {stream} {name} 0 {ahead}".encode()
            else:
                body = f'{{"first":{ahead},"count":1,"ts":0}}'
                forged = f"RDATA {stream} {name} {ahead} {body}".encode()
            self._publish(what, rng.choice(channels), forged)

    def _publish(self, what: str, channel: str, line: bytes) -> None:
        self.client.publish(channel, line)
        self.sent[what] = self.sent.get(what, 0) + 1

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        with contextlib.suppress(redis.RedisError, OSError):
            self.pubsub.close()
        self.client.close()


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


def copy_data_directory(source: Path, target: Path) -> None:
    """``target`` becomes an exact copy of the stopped server's ``source`` (owners kept: as
    root, PostgreSQL runs as another user): a file-system snapshot, or its restore in place."""
    if target.exists():
        shutil.rmtree(target)
    subprocess.run(["cp", "-a", str(source), str(target)], check=True)


def terminate(url: str, pid: int) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))  # waits until gone


class RestartablePostgres:
    """A private PostgreSQL server (`streams.devservers`, durable: an immediate shutdown
    must lose nothing that was acknowledged) behind a `proxy.Proxy`, so that clients keep
    one URL while the server restarts on a new port.

    `restart` stops it with SIGINT (``fast``: ends sessions, checkpoints) or SIGQUIT
    (``immediate``: no checkpoint, crash recovery at the next start) and starts it again.
    """

    def __init__(self, workdir: Path, settings: dict[str, str] | None = None) -> None:
        from proxy import Proxy

        self.workdir = workdir
        #: Server settings (``postgres -c``), kept across restarts.
        self.settings = dict(settings or {})
        self.server = devservers.start_postgres(workdir, durable=True, settings=self.settings)
        self.proxy = Proxy("127.0.0.1", self.server.port)
        self.admin_url = self.proxy.url(self.server.url)
        self.restarts = 0

    def url(self, database: str) -> str:
        return self.admin_url.rsplit("/", 1)[0] + f"/{database}"

    def restart(
        self,
        mode: str,
        down_for: float = 0.0,
        while_down: Callable[[Path], None] | None = None,
    ) -> float:
        """Stop (``fast`` or ``immediate``), wait ``down_for`` seconds (and run ``while_down``
        on the data directory), start; returns the seconds the server was unreachable."""
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
        if while_down is not None:
            while_down(old.directory / "data")
        self.server = devservers.start_postgres(self.workdir, durable=True, settings=self.settings)
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
