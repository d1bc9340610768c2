"""Clients that ride out a restart (issue 27): on real PostgreSQL servers.

* Opening a client, reader or writer (sync and asyncio) waits for a server that is down or
  starting, up to ``connect_timeout``, then fails with the clear `StoreError`; a failure that is
  not transient (an unknown database) fails at once (`streams.store.sessions`).
* A long-lived client's read-only calls survive a restart and a connection broken under them;
  a call that writes is never sent twice (`streams.client`, "Riding out a restart").

A *starting* server here is a real one: a private PostgreSQL (`StartingPostgres`) that the test
stops and starts on one port, and can hold in startup for as long as it likes by starting it as
a standby with ``hot_standby=off`` (it answers every connection with SQLSTATE 57P03, "the
database system is not accepting connections", until it is promoted).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from faultkit import backend_waits_for_a_lock, in_thread, terminate
from helpers import wait_until

import streams
from streams import ConnectionLost, StoreError, devservers
from streams.devservers import accounts, processes
from streams.migrate import upgrade
from streams.types import StreamPositions


class StartingPostgres:
    """A private PostgreSQL server on a fixed port, with a migrated database ``streams``: the
    test starts it (ready, or held in startup as a standby), promotes and stops it. Its
    processes are stopped by PID in `close`; none outlives the test."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        first = devservers.start_postgres(workdir, durable=False)  # initdb, once
        try:
            with psycopg.connect(first.url, autocommit=True) as admin:
                admin.execute("CREATE DATABASE streams")
            upgrade(first.url.rsplit("/", 1)[0] + "/streams")
        finally:
            first.stop()
        self.pgdata = workdir / "data"
        self.account = devservers.postgres_account(self.pgdata.stat().st_uid)
        self.bindir = accounts._reachable_bindir(devservers.find_postgres_bindir(), self.account)
        self.port = devservers.free_port()
        self.url = devservers.postgres_url(self.port, "streams")
        self.proc: subprocess.Popen[bytes] | None = None

    def _own(self, path: Path) -> None:
        path.touch()
        if self.account.uid is not None:
            os.chown(path, self.account.uid, self.account.gid or -1)

    def start(self, *, standby: bool = False) -> None:
        """Start the server; ``standby``: held in startup (57P03) until `promote`."""
        assert self.proc is None
        settings = {"hot_standby": "off"} if standby else {}
        if standby:
            self._own(self.pgdata / "standby.signal")
        else:  # a standby that was stopped, not promoted, comes up as a primary again
            (self.pgdata / "standby.signal").unlink(missing_ok=True)
        argv = devservers.postgres_argv(self.bindir, self.pgdata, self.port, False, settings)
        self.proc = processes._popen(argv, self.workdir, self.workdir / "server.log", self.account)
        if not standby:
            wait_until(self.ready, timeout=30, what="the private server accepts connections")

    def refusal(self) -> str | None:
        """The server's reason for refusing a connection now (None: it accepts them)."""
        try:
            psycopg.connect(self.url, connect_timeout=2).close()
        except psycopg.OperationalError as exc:
            return str(exc)
        return None

    def ready(self) -> bool:
        return self.refusal() is None

    def promote(self) -> None:
        """End the standby's recovery, as ``pg_ctl promote`` does: it then accepts connections."""
        assert self.proc is not None
        self._own(self.pgdata / "promote")
        os.kill(self.proc.pid, signal.SIGUSR1)

    def stop(self) -> None:
        """A fast shutdown (sessions are ended), waited for; SIGKILL if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()


@pytest.fixture(scope="module")
def private_pg() -> Iterator[StartingPostgres]:
    # Not pytest's tmp_path: as root, PostgreSQL runs as another user, who cannot enter it.
    workdir = Path(tempfile.mkdtemp(prefix="streams-starting-"))
    try:
        server = StartingPostgres(workdir)
        try:
            yield server
        finally:
            server.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def pg(private_pg: StartingPostgres) -> Iterator[StartingPostgres]:
    """The private server, running and ready, and left stopped after the test."""
    private_pg.stop()
    private_pg.start()
    try:
        yield private_pg
    finally:
        private_pg.stop()


def _joined(thread: threading.Thread, out: list[Any], timeout: float = 60) -> Any:
    thread.join(timeout)
    assert not thread.is_alive(), "still waiting"
    assert len(out) == 1
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


# --------------------------------------------------------------------------------------------
# Opening waits for a starting server


def test_opening_a_client_reader_or_writer_waits_for_a_starting_server(
    pg: StartingPostgres, unique_name: str
) -> None:
    with streams.connect(pg.url, connect_timeout=60) as client:
        client.create_stream(unique_name)
        pg.stop()

        def open_all() -> str:
            with streams.connect(pg.url, connect_timeout=60) as fresh:
                fresh.reader(unique_name).close()
                fresh.writer(unique_name).close()
            return "sync"

        async def aopen_all() -> str:
            fresh = await streams.aconnect(pg.url, connect_timeout=60)
            try:
                reader = await fresh.reader(unique_name)
                await reader.aclose()
                writer = await fresh.writer(unique_name)
                await writer.aclose()
            finally:
                await fresh.aclose()
            return "async"

        def reader_of_the_open_client() -> str:
            client.reader(unique_name).close()
            return "reader"

        def writer_of_the_open_client() -> str:
            client.writer(unique_name).close()
            return "writer"

        opening = [
            in_thread(action)
            for action in (
                open_all,
                lambda: asyncio.run(aopen_all()),
                reader_of_the_open_client,
                writer_of_the_open_client,
            )
        ]
        # Down (connections refused): everyone waits, where they used to fail at once.
        time.sleep(1.5)
        assert [out for _, out in opening] == [[]] * 4
        # Starting (57P03 on every connection): still waiting.
        pg.start(standby=True)
        wait_until(lambda: "not accepting connections" in (pg.refusal() or ""), timeout=30)
        time.sleep(1.0)
        assert [out for _, out in opening] == [[]] * 4
        started = time.monotonic()
        # Started for real: stopped and started again as a primary of the same timeline (a
        # promotion would begin a new one: a failover, which the open client must refuse, as
        # the next test shows).
        pg.stop()
        pg.start()
        results = [_joined(thread, out) for thread, out in opening]
        assert results == ["sync", "async", "reader", "writer"]
        assert time.monotonic() - started < 30


def test_an_open_client_goes_on_across_the_new_timeline_of_a_promotion(
    pg: StartingPostgres, unique_name: str
) -> None:
    """A promoted standby is a failover (a later timeline of the same database): a client
    that knew the old timeline goes on (its roles saw nothing the new one lacks:
    `streams.core.sightings`); the first writer session there moves the sequences past any
    ID the old timeline may have handed out (`streams_fence_stream`)."""
    other = f"{unique_name}_other"
    with streams.connect(pg.url) as client:
        client.create_streams([unique_name, other])
        pg.stop()
        pg.start(standby=True)
        wait_until(lambda: "not accepting connections" in (pg.refusal() or ""), timeout=30)
        pg.promote()
        wait_until(pg.ready, timeout=30, what="the promoted server")
        with client.reader(unique_name) as reader, client.writer(unique_name) as writer:
            ack = writer.append({"after": "promotion"})
            assert ack.ids[0] > 1_000_000  # fenced: IDs of the old timeline are never reused
            assert [f.stream_id for f in reader.facts()] == list(ack.ids)
        # Each stream is fenced by its own writers (revision 0019): the other stream's
        # sequence has not moved yet, and moves when its first writer opens.
        assert client.positions(other).max_allocated == 0
        with client.writer(other) as writer:
            assert writer.append({"after": "promotion"}).ids[0] > 1_000_000


def test_a_server_that_never_starts_fails_after_connect_timeout(pg: StartingPostgres) -> None:
    pg.stop()
    pg.start(standby=True)
    wait_until(lambda: "not accepting connections" in (pg.refusal() or ""), timeout=30)
    for name, call in (
        ("sync", lambda: streams.connect(pg.url, connect_timeout=3)),
        ("async", lambda: asyncio.run(streams.aconnect(pg.url, connect_timeout=3))),
    ):
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            call()
        waited = time.monotonic() - started
        assert 2.5 <= waited < 10, (name, waited)
        message = str(caught.value)
        assert message.startswith(f"cannot connect to PostgreSQL at {pg.url} (client): "), message
        assert "not accepting connections" in message  # the server's own reason
        assert "(still, after " in message  # it tried more than once
        assert "the server is not ready yet" in message  # what to do next
        assert caught.value.__cause__ is None and caught.value.__context__ is None


def test_what_is_not_transient_fails_at_once(streams_url: str) -> None:
    unknown = streams_url.rsplit("/", 1)[0] + "/streams_no_such_database"
    started = time.monotonic()
    with pytest.raises(StoreError, match="does not exist"):
        streams.connect(unknown, connect_timeout=30)
    assert time.monotonic() - started < 5


def test_connect_timeout_is_validated_and_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, streams_url: str
) -> None:
    with pytest.raises(streams.ConfigurationError, match="connect_timeout"):
        streams.connect(streams_url, connect_timeout=-1)
    monkeypatch.setenv("STREAMS_CONNECT_TIMEOUT", "7.5")
    with streams.connect(streams_url) as client:
        assert client.settings.connect_timeout == 7.5
    monkeypatch.setenv("STREAMS_CONNECT_TIMEOUT", "soon")
    with pytest.raises(streams.ConfigurationError, match="STREAMS_CONNECT_TIMEOUT"):
        streams.connect(streams_url)


# --------------------------------------------------------------------------------------------
# Read-only calls of a long-lived client ride out a restart


def _reads(client: streams.Client, stream: str) -> list[Any]:
    return [
        client.positions(stream),
        client.stream(stream).name,
        [info.name for info in client.streams()],
        client.groups(stream),
        client.group_streams("nobody"),
        len(client.replication_keys()),
    ]


def test_read_only_calls_survive_a_restart(pg: StartingPostgres, unique_name: str) -> None:
    with streams.connect(pg.url, connect_timeout=60) as client:
        client.create_stream(unique_name)
        before = _reads(client, unique_name)
        pg.stop()
        pg.start()
        # The client's connection was ended by the restart: each call works all the same.
        after = _reads(client, unique_name)
        assert after[1:] == before[1:]
        assert isinstance(after[0], StreamPositions)
        # Called while the server is down: the call waits for it.
        pg.stop()
        thread, out = in_thread(lambda: client.positions(unique_name))
        time.sleep(1.0)
        assert out == []
        pg.start()
        assert isinstance(_joined(thread, out), StreamPositions)


def test_async_read_only_calls_survive_a_restart(pg: StartingPostgres, unique_name: str) -> None:
    async def scenario() -> None:
        client = await streams.aconnect(pg.url, connect_timeout=60)
        try:
            await client.create_stream(unique_name)
            assert (await client.stream(unique_name)).name == unique_name
            await asyncio.to_thread(pg.stop)
            await asyncio.to_thread(pg.start)
            assert isinstance(await client.positions(unique_name), StreamPositions)
            assert unique_name in [info.name for info in await client.streams()]
            assert await client.groups(unique_name) == []
            assert await client.group_streams("nobody") == []
            assert await client.replication_keys()
        finally:
            await client.aclose()

    asyncio.run(scenario())


@contextlib.contextmanager
def _registry_locked(url: str) -> Iterator[None]:
    """Every read of the stream registry waits until this block ends."""
    with psycopg.connect(url) as holder:
        holder.execute("LOCK TABLE streams_registry IN ACCESS EXCLUSIVE MODE")
        yield
        holder.rollback()


def _break_under(url: str, pid: Callable[[], int], call: Callable[[], Any]) -> list[Any]:
    """Run ``call`` while its connection (backend ``pid()``) is ended under a statement."""
    with _registry_locked(url):
        thread, out = in_thread(call)
        backend = pid()
        wait_until(backend_waits_for_a_lock(url, backend), what="the call waits for the lock")
        terminate(url, backend)
        time.sleep(0.3)  # the call sees its connection broken, and tries again (or gives up)
    thread.join(30)
    assert not thread.is_alive()
    return out


def test_a_read_is_run_again_when_its_connection_breaks(
    client: streams.Client, stream: str, streams_url: str
) -> None:
    client.streams()  # opens the client's connection
    assert client._conn is not None
    pid = client._conn.info.backend_pid
    out = _break_under(streams_url, lambda: pid, lambda: client.positions(stream))
    assert len(out) == 1 and isinstance(out[0], StreamPositions), out


def test_an_async_read_is_run_again_when_its_connection_breaks(
    streams_url: str, stream: str
) -> None:
    async def scenario() -> Any:
        client = await streams.aconnect(streams_url)
        try:
            await client.streams()  # opens the client's connection
            assert client._conn is not None
            pid = client._conn.info.backend_pid
            with _registry_locked(streams_url):
                call = asyncio.create_task(client.groups(stream))
                await asyncio.to_thread(
                    wait_until, backend_waits_for_a_lock(streams_url, pid), what="lock wait"
                )
                await asyncio.to_thread(terminate, streams_url, pid)
                await asyncio.sleep(0.3)
            return await asyncio.wait_for(call, 30)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == []


def test_a_write_is_not_sent_twice_when_its_connection_breaks(
    client: streams.Client, stream: str, streams_url: str
) -> None:
    client.streams()
    assert client._conn is not None
    pid = client._conn.info.backend_pid
    out = _break_under(streams_url, lambda: pid, lambda: client.set_retention(stream, 60_000))
    assert len(out) == 1 and isinstance(out[0], ConnectionLost), out
    assert client.stream(stream).retention_ms is None  # nothing was committed, nothing retried


# ------------------------------------------------------------------ opening under a termination


@contextlib.contextmanager
def _incarnation_locked(url: str) -> Iterator[None]:
    """Hold the incarnation table exclusively: every session's opening check (the
    incarnation, `streams.store.identity.verify`) waits for it, where the test ends it."""
    with psycopg.connect(url) as holder:
        holder.execute("LOCK TABLE streams_incarnation IN ACCESS EXCLUSIVE MODE")
        yield
        holder.rollback()


def _waiting_openers(url: str) -> set[int]:
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE '%%FROM streams_incarnation%%'"
        ).fetchall()
    return {int(r[0]) for r in rows}


def _new_openers(url: str, ended: set[int]) -> set[int]:
    """The sessions waiting in an opening check, once there is one not ended yet."""
    deadline = time.monotonic() + 30
    while not (found := _waiting_openers(url) - ended):
        assert time.monotonic() < deadline, "no opening check waits"
        time.sleep(0.02)
    return found


def _opened_while_ended(url: str, call: Callable[[], Any], ends: int = 2) -> Any:
    """``call()`` (an opening) while the sessions it opens are ended ``ends`` times under
    its checks; its result (or what it raised)."""
    ended: set[int] = set()
    with _incarnation_locked(url):
        thread, out = in_thread(call)
        for _ in range(ends):
            waiting = _new_openers(url, ended)
            for pid in waiting:
                terminate(url, pid)
            ended |= waiting
        wait_until(lambda: bool(_waiting_openers(url) - ended), what="the opening tried again")
    thread.join(30)
    assert not thread.is_alive() and len(out) == 1
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _spark_driver_session(url: str, stream: str) -> Any:
    from streams_spark.options import parse_options
    from streams_spark.query_driver import QueryDriver

    driver = QueryDriver(parse_options({"streams": stream, "databaseUrl": url}, environ={}))
    return driver._connection()


OPENINGS: dict[str, Callable[[streams.Client, str, str], Any]] = {
    "connect": lambda client, url, stream: streams.connect(url),
    "aconnect": lambda client, url, stream: asyncio.run(_aopen(url)),
    "reader": lambda client, url, stream: client.reader(stream),
    "group": lambda client, url, stream: client.reader(stream, group="billing"),
    "writer": lambda client, url, stream: client.writer(stream),
    "async writer": lambda client, url, stream: asyncio.run(_awriter(url, stream)),
    "spark driver": lambda client, url, stream: _spark_driver_session(url, stream),
}


async def _aopen(url: str) -> str:
    client = await streams.aconnect(url)
    async with client:
        await client.streams()  # the connection the opening checked serves the first call
    return "opened"


async def _awriter(url: str, stream: str) -> int:
    client = await streams.aconnect(url)
    async with client:
        writer = await client.writer(stream)
        async with writer:
            return (await writer.append({"opened": True})).ids[0]


@pytest.mark.parametrize("opening", list(OPENINGS))
def test_opening_rides_out_its_session_ended_under_its_checks(
    client: streams.Client, stream: str, streams_url: str, opening: str
) -> None:
    """Issue 38: a supervisor restarting a consumer while sessions are being ended (a
    failover, ``pg_terminate_backend``): the opening checks (schema, incarnation, session
    settings, a group's generation, a writer's registration) run again on a new session,
    within ``connect_timeout``, as every read-only call does."""
    opened = _opened_while_ended(
        streams_url, lambda: OPENINGS[opening](client, streams_url, stream)
    )
    with contextlib.ExitStack() as stack:
        if hasattr(opened, "close"):
            stack.callback(opened.close)
        if isinstance(opened, streams.Writer):
            assert opened.append({"after": "opening"}).ids
        elif isinstance(opened, streams.Reader):
            assert opened.poll(timeout=0) is None  # caught up (the stream is empty)
        elif isinstance(opened, streams.Client):
            assert opened.streams()
        else:
            assert opened  # the asyncio client's first call, the async writer's first ID


def test_an_opening_that_cannot_pass_its_checks_fails_with_their_error(
    client: streams.Client, streams_url: str, stream: str
) -> None:
    """Past ``connect_timeout``, the checks' own error, as a single attempt raises it."""
    with _incarnation_locked(streams_url):
        stop = threading.Event()

        def end_every_opener() -> None:
            while not stop.is_set():
                for pid in _waiting_openers(streams_url):
                    terminate(streams_url, pid)
                time.sleep(0.05)

        ender = threading.Thread(target=end_every_opener, daemon=True)
        ender.start()
        started = time.monotonic()
        try:
            with pytest.raises(ConnectionLost):
                streams.connect(streams_url, connect_timeout=2)
        finally:
            stop.set()
            ender.join(10)
        assert 1.5 < time.monotonic() - started < 15
