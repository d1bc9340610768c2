"""PostgreSQL restarts and ended sessions: what writers report, and what readers, groups and the
prover do, without a restart of their process.

First, one append at a time, at the moment its connection breaks (a proxy in between holds the
server's answer or cuts the connection; ``pg_terminate_backend`` ends the session while the
append waits for a lock):

* broken before its ``COMMIT`` was sent, an append is retried once on a new connection
  (nothing of it committed) and stored once;
* broken while its ``COMMIT`` was in flight (a single append commits by itself), it raises
  `streams.CommitUnknown` and is never retried: stored once if it committed, else not at all;
* a connection the server ended while it was idle is noticed before the next append is sent,
  which then goes through.

Then a private server (durable: an immediate shutdown loses nothing acknowledged) is restarted,
``fast`` and ``immediate``, and random sessions are ended, while single, batch and ``fact()``
writers append, a reader and a reader group follow, and a prover proves (`Load`). Every
acknowledged fact is stored once, every unknown one at most once, no ID is handed out twice,
every error is one of the library's, and the reader and the group deliver each fact exactly once,
in order, then catch up.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from faultkit import (
    Appender,
    Follower,
    RestartablePostgres,
    backend_waits_for_a_lock,
    in_thread,
    partition_locked,
    payload_counts,
    quiet_heartbeat,
    restartable_postgres,
    stored_ids,
    terminate,
)
from helpers import wait_until
from proxy import Proxy
from servers import new_redis_prefix

import streams
from streams.devservers import ensure_database

LEASE = 5.0


# ---------------------------------------------------------------------------- one append


def test_an_append_after_the_server_ended_the_idle_session_goes_through(
    streams_url: str, unique_name: str
) -> None:
    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            first = writer.append({"n": 1}).first_id
            terminate(streams_url, writer._conn.info.backend_pid)
            second = writer.append({"n": 2}).first_id  # no error: noticed before sending
            assert second > first
        with client.reader(unique_name) as reader:
            assert [f.payload for f in reader.facts()] == [{"n": 1}, {"n": 2}]


def test_a_batch_broken_before_its_commit_is_retried_once_and_stored_once(
    streams_url: str, unique_name: str
) -> None:
    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            writer.append({"before": True})
            pid = writer._conn.info.backend_pid
            with partition_locked(streams_url, client, unique_name):
                thread, out = in_thread(lambda: writer.append_batch([{"i": i} for i in range(3)]))
                wait_until(backend_waits_for_a_lock(streams_url, pid), 10, "the COPY to wait")
                terminate(streams_url, pid)  # mid-COPY: the transaction is rolled back
                wait_until(lambda: writer._conn.info.backend_pid != pid, 10, "a new connection")
            thread.join(10)
            (ack,) = out
            assert isinstance(ack, streams.Ack), ack
        with client.reader(unique_name) as reader:
            facts = list(reader.facts())
        assert [f.payload for f in facts] == [{"before": True}, {"i": 0}, {"i": 1}, {"i": 2}]
        assert [f.stream_id for f in facts[1:]] == list(ack.ids)


def test_a_single_append_ended_before_it_committed_is_unknown_and_absent(
    streams_url: str, unique_name: str
) -> None:
    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            pid = writer._conn.info.backend_pid
            with partition_locked(streams_url, client, unique_name):
                thread, out = in_thread(lambda: writer.append({"lost": True}))
                wait_until(backend_waits_for_a_lock(streams_url, pid), 10, "the INSERT to wait")
                terminate(streams_url, pid)
                thread.join(10)
            (error,) = out
            assert isinstance(error, streams.CommitUnknown), error
            assert "may or may not have committed" in str(error)
            after = writer.append({"after": True}).first_id  # the writer goes on
        with client.reader(unique_name) as reader:
            facts = list(reader.facts())
        assert [(f.stream_id, f.payload) for f in facts] == [(after, {"after": True})]


@pytest.mark.parametrize("kind", ["append", "fact"])
def test_an_append_whose_commit_answer_is_lost_is_unknown_and_stored_once(
    streams_url: str, unique_name: str, kind: str
) -> None:
    """The ``COMMIT`` (or the single append) reaches the server and commits; its answer is
    held by the network, then the connection is cut: the outcome is unknown to the writer,
    which says so and does not write it again."""
    with Proxy.for_url(streams_url) as proxy:
        url = proxy.url(streams_url)
        with streams.connect(url, lease_seconds=LEASE) as client:
            client.create_stream(unique_name)
            with client.writer(unique_name) as writer, psycopg.connect(url) as conn:
                quiet_heartbeat(client, unique_name, writer, writer.append({"first": True}))

                def append() -> None:
                    if kind == "append":
                        writer.append({"ours": True})
                    else:
                        with writer.fact(conn) as fact:
                            fact.add({"ours": True})
                            proxy.freeze(replies=True)  # before the COMMIT goes out

                if kind == "append":
                    proxy.freeze(replies=True)
                thread, out = in_thread(append)
                wait_until(
                    lambda: payload_rows(streams_url, unique_name, {"ours": True}) == 1,
                    10,
                    "the commit on the server",
                )
                proxy.cut()
                proxy.thaw()
                thread.join(10)
                (error,) = out
                assert isinstance(error, streams.CommitUnknown), error
                writer.append({"after": True})  # the writer goes on, on a new connection
        assert payload_rows(streams_url, unique_name, {"ours": True}) == 1


def payload_rows(url: str, stream: str, payload: dict[str, Any]) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM streams_facts f JOIN streams_registry r ON r.id = f.stream "
            "WHERE r.name = %s AND f.payload = %s::jsonb",
            (stream, psycopg.types.json.Jsonb(payload)),
        ).fetchone()
    return int(row[0]) if row else 0


# ---------------------------------------------------------------------------- under load


class FactAppender(threading.Thread):
    """``writer.fact(conn)`` in a loop on a connection of its own, reopened when it breaks
    (what a service does); records acks, unknown outcomes and errors as `Appender` does."""

    def __init__(self, writer: streams.Writer, url: str, pace: float) -> None:
        super().__init__(name="fact-appender", daemon=True)
        self.writer, self.url, self.pace = writer, url, pace
        self.acked: list[int] = []
        self.acked_n: list[int] = []
        self.unknown: list[int] = []
        self.errors: list[BaseException] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        n = 0
        while not self.stopped.is_set():
            n += 1
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, connect_timeout=2)
                with self.writer.fact(conn) as fact:
                    fact.add({"w": "fact", "n": n, "row": 0}, {"w": "fact", "n": n, "row": 1})
                self.acked.append(fact.stream_id)
                self.acked_n.append(n)
            except streams.CommitUnknown as exc:
                self.unknown.append(n)
                self.errors.append(exc)
            except psycopg.OperationalError:
                conn = None  # could not (re)connect: the server is down
            except Exception as exc:
                self.errors.append(exc)
            self.stopped.wait(self.pace)
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=60)
        assert not self.is_alive(), "the fact appender is stuck"


class GroupFollower(threading.Thread):
    """A reader of a group, polled on a thread, committing after every epoch."""

    def __init__(self, reader: streams.Reader) -> None:
        super().__init__(name="group-follower", daemon=True)
        self.reader = reader
        self.delivered: list[int] = []
        self.lost = 0
        self.errors: list[BaseException] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                epoch = self.reader.poll(timeout=0.5)
                if epoch is not None:
                    self.delivered.extend(f.stream_id for f in epoch.facts)
                    self.reader.commit()
            except streams.ConnectionLost:
                self.lost += 1
            except Exception as exc:
                self.errors.append(exc)
                return

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=60)
        assert not self.is_alive(), "the group follower is stuck"


class Load:
    """Writers, a reader, a group and a prover on one stream (see the module docstring)."""

    def __init__(self, url: str, redis_url: str, stream: str) -> None:
        self.url, self.stream = url, stream
        self.stack = contextlib.ExitStack()
        prefix = new_redis_prefix()
        options: dict[str, Any] = {
            "redis_url": redis_url,
            "prefix": prefix,
            "lease_seconds": LEASE,
        }
        wc = self.stack.enter_context(streams.connect(url, **options))
        self.rc = self.stack.enter_context(streams.connect(url, **options))
        wc.create_stream(stream)
        self.appenders = [
            Appender(wc.writer(stream, instance="single"), pace=0.005),
            Appender(wc.writer(stream, instance="batch"), pace=0.01, batch=5),
        ]
        self.facts = FactAppender(wc.writer(stream, instance="fact"), url, pace=0.01)
        reader = self.rc.reader(stream, shared_proofs=True, poll_interval=0.2)
        self.follower = self.stack.enter_context(Follower(reader, self.rc, url, tolerate_lost=True))
        self.group = GroupFollower(self.rc.reader(stream, group="g", poll_interval=0.2))
        for thread in (*self.appenders, self.facts, self.group):
            thread.start()

    @property
    def prover(self) -> Any:
        return self.rc._proofs

    def acked(self) -> list[int]:
        return [i for a in self.appenders for i in a.acked] + self.facts.acked

    def wait_for_progress(self, what: str, timeout: float = 60) -> float:
        """Until every role moved: each writer acked, the reader and the group delivered a
        fact appended from now on, and the prover proved again; returns the seconds taken."""
        started = time.monotonic()
        marks = [len(a.acked) for a in self.appenders] + [len(self.facts.acked)]
        proofs = self.prover.proofs
        writers: list[Appender | FactAppender] = [*self.appenders, self.facts]

        def writers_moved() -> bool:
            return all(len(w.acked) > m for w, m in zip(writers, marks, strict=True))

        self.follower.pump_until(writers_moved, timeout, f"every writer to ack ({what})")
        target = max(self.acked())
        self.follower.pump_until(
            lambda: self.follower.position >= target, timeout, f"the reader ({what})", poll=0.5
        )
        wait_until(lambda: self.group.reader.position() >= target, timeout, f"the group ({what})")
        wait_until(lambda: self.prover.proofs > proofs, timeout, f"a proof ({what})")
        assert self.stream in self.prover.proving
        return time.monotonic() - started

    def finish(self) -> dict[str, Any]:
        """Stop the writers, let the readers catch up, check everything; a summary."""
        for appender in self.appenders:
            appender.stop()
        self.facts.stop()
        target = max(self.acked())
        self.follower.pump_until(
            lambda: self.follower.position >= target, 60, "the last acked fact", poll=0.5
        )
        wait_until(lambda: self.group.reader.position() >= target, 60, "the group to catch up")
        self.group.stop()
        self._check()
        return {
            "acked": len(self.acked()),
            "unknown": sum(len(a.unknown) for a in self.appenders) + len(self.facts.unknown),
            "errors": sorted(
                {k for a in self.appenders for k in a.error_kinds()}
                | {type(e).__name__ for e in self.facts.errors}
            ),
            "reader lost": self.follower.lost,
            "group lost": self.group.lost,
        }

    def _check(self) -> None:
        acked = self.acked()
        assert len(acked) == len(set(acked)), "an ID acknowledged twice"
        writers: list[Appender | FactAppender] = [*self.appenders, self.facts]
        for writer in writers:
            for error in writer.errors:
                assert isinstance(error, streams.StreamsError), f"not a library error: {error!r}"
                assert not isinstance(error, streams.WriterFenced), error
        assert not self.group.errors, self.group.errors
        counts = payload_counts(self.url, self.stream)
        rows_per = {"single": 1, "batch": 5, "fact": 2}
        for writer, name in zip(writers, ("single", "batch", "fact"), strict=True):
            for n in writer.acked_n:
                assert counts.get((name, n)) == rows_per[name], f"acked {name} {n} not stored once"
            for n in writer.unknown:
                assert counts.get((name, n), 0) in (0, rows_per[name]), f"unknown {name} {n}"
        stored = self.follower.all_stored()
        assert set(acked) <= set(stored), "an acknowledged fact is missing"
        assert self.follower.delivered == stored, "the reader: each fact exactly once, in order"
        assert self.group.delivered == stored, "the group: each fact exactly once, in order"
        with psycopg.connect(self.url, autocommit=True) as conn:
            key = self.rc.stream(self.stream).id
            assert stored_ids(conn, key) == stored

    def close(self) -> None:
        for appender in self.appenders:
            appender.stopped.set()
        self.facts.stopped.set()
        self.group.stopped.set()
        self.stack.close()


@pytest.fixture
def restartable() -> Iterator[RestartablePostgres]:
    with restartable_postgres() as server:
        yield server


@pytest.fixture
def load_on(
    restartable: RestartablePostgres, redis_url: str, unique_name: str
) -> Iterator[Callable[[], Load]]:
    from streams.migrate import upgrade

    loads: list[Load] = []

    def start() -> Load:
        url = restartable.proxy.url(ensure_database(restartable.server.url, "streams"))
        upgrade(url)
        load = Load(url, redis_url, unique_name)
        loads.append(load)
        return load

    yield start
    for load in loads:
        load.close()


@pytest.mark.slow
def test_postgres_restarts_fast_and_immediate_under_load(
    restartable: RestartablePostgres, load_on: Callable[[], Load]
) -> None:
    load = load_on()
    load.wait_for_progress("warm-up")
    for mode, down_for in (("fast", 0.0), ("immediate", 0.0), ("fast", 2.0)):
        down = restartable.restart(mode, down_for=down_for)
        recovered = load.wait_for_progress(f"after a {mode} restart")
        print(f"{mode} restart: down {down:.2f}s, every role moved again {recovered:.2f}s later")
    summary = load.finish()
    print(summary)
    assert summary["acked"] > 500


@pytest.mark.slow
def test_random_sessions_ended_under_load(
    restartable: RestartablePostgres, load_on: Callable[[], Load]
) -> None:
    load = load_on()
    load.wait_for_progress("warm-up")
    rng = random.Random(18)
    ended = 0
    admin = psycopg.connect(restartable.server.url.rsplit("/", 1)[0] + "/streams", autocommit=True)
    with admin:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            pids = [
                int(row[0])
                for row in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                ).fetchall()
            ]
            if pids:
                admin.execute("SELECT pg_terminate_backend(%s)", (rng.choice(pids),))
                ended += 1
            load.follower.pump_for(rng.uniform(0.02, 0.2), poll=0.05)
    load.wait_for_progress("after the terminations")
    summary = load.finish()
    print(f"ended {ended} sessions: {summary}")
    assert ended >= 20 and summary["acked"] > 500
