"""The writer's plans driven by hand: no thread, no event loop, no server.

A plan (`streams.plans`) yields each step and is sent its result; here the test is the driver.
It reads each step (`describe`), answers it from a script, and checks what the plan does next
and what it did meanwhile: locks released, the link told, the state of the spare. The clock
of `SPARE_IDLE` is a fake one.
"""

from __future__ import annotations

import logging
import threading
import types
import weakref
from collections.abc import Generator
from typing import Any

import pytest

from streams.errors import CommitUnknown, ConnectionLost, StoreError
from streams.fact_blocks import FactPlans, OpenFact
from streams.heartbeat import (
    BEAT_RETRY_INTERVAL,
    BORROW_WAIT,
    FLUSH_INTERVAL,
    SPARE_IDLE,
    HeartbeatPlans,
)
from streams.plans import Acquire, Call, Plan, Wait
from streams.store.joined_facts import FactHandle
from streams.store.steps import Connect, FailJoined, Run, Settle
from streams.types import Ack
from streams.writer import _WriterShell

LEASE = 4.0  # a scheduled heartbeat every second
INTERVAL = LEASE / 4


class FakeConn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False
        self.autocommit = False
        self.info = types.SimpleNamespace(backend_pid=1)

    def close(self) -> None:
        self.closed = True

    def execute(self, statement: str) -> None:
        raise AssertionError("performed by the driver, never by the plan")

    def commit(self) -> None:
        raise AssertionError("performed by the driver, never by the plan")

    def __repr__(self) -> str:
        return self.name


class FakeLock:
    """Taken by the driver (the test), released by the plan."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.held = False

    def take(self) -> bool:
        assert not self.held, f"{self.name} taken twice"
        self.held = True
        return True

    def release(self) -> None:
        assert self.held, f"{self.name} released while free"
        self.held = False

    def acquire(self) -> bool:  # what `Call(lock.acquire)` names
        raise AssertionError("performed by the driver, never by the plan")


class FakeCore:
    """What the plans ask of `WriterCore`: each store generator is a marker, named as the
    method, that the test answers."""

    lease_seconds = LEASE
    stream_name = "s"
    instance = "w"

    def __init__(self) -> None:
        self.joined_pending = False
        self.fenced = False
        self.needs_persist = False
        self.finished: list[tuple[Any, Any, bool]] = []
        self.joined: list[FactHandle] = []

    def _marker(self, name: str) -> Generator[Any, Any, Any]:
        def gen() -> Generator[Any, Any, Any]:
            yield name

        g = gen()
        g.__name__ = name  # type: ignore[attr-defined]  # named as the method it stands for
        return g

    def resolve_joined(self) -> Generator[Any, Any, Any]:
        return self._marker("resolve_joined")

    def heartbeat(self) -> Generator[Any, Any, Any]:
        return self._marker("heartbeat")

    def beat(self) -> Generator[Any, Any, Any]:
        return self._marker("beat")

    def opening(self, *, first: bool = False) -> Generator[Any, Any, Any]:
        return self._marker("opening")

    def append(self, *args: Any) -> Generator[Any, Any, Any]:
        return self._marker("append")

    def begin_fact(self, timestamp: int | None, key: str | None) -> tuple[str, int]:
        return "token", 1000

    def reserve_fact(
        self, token: str, stamp: int, key: str | None, *, fence: bool = False
    ) -> Generator[Any, Any, Any]:
        return self._marker("reserve_fact")

    def finish_fact(self, token: Any, handle: Any, ok: bool) -> None:
        self.finished.append((token, handle, ok))

    def join_fact(self, handle: FactHandle) -> None:
        self.joined.append(handle)


class FakeAttached:
    def __init__(self) -> None:
        self.said: list[Any] = []

    def completed(self, ids: tuple[int, ...] = (), timestamp: int = 0) -> None:
        self.said.append(("completed", ids, timestamp))

    def beat(self) -> None:
        self.said.append("beat")


class Beating(HeartbeatPlans[Any]):
    """The state a writer holds for its heartbeat, with fakes."""

    def __init__(self) -> None:
        self._url = "postgresql://fake"
        self._core: Any = FakeCore()
        self._conn = FakeConn("own")
        self._spare = None
        self._spare_used = 0.0
        self._lock = FakeLock("lock")
        self._beat_lock = FakeLock("beat_lock")
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._attached: Any = FakeAttached()
        self.now = 100.0
        self.gone: set[str] = set()

    def _clock(self) -> float:
        return self.now

    def __repr__(self) -> str:
        return "<Beating>"


def describe(op: Any, writer: Any) -> tuple[Any, ...]:
    """A step as the test reads it."""
    if isinstance(op, Wait):
        flag, seconds = op.args
        return ("wait", "wake" if flag is writer._wake else "stopped", seconds)
    if isinstance(op, Acquire):
        lock, timeout = op.args
        return ("acquire", lock.name, timeout)
    if isinstance(op, Run):
        conn, gen = op.args
        return ("run", "own" if conn is getattr(writer, "_conn", None) else conn.name, gen.__name__)
    if isinstance(op, Connect):
        return ("connect",)
    if isinstance(op, Settle | FailJoined):
        return (type(op).__name__.lower(), op.args[0].name)
    if isinstance(op, Call):
        method: Any = op.sync
        return ("call", method.__self__.name, method.__name__)
    raise AssertionError(f"not a step of the kernel: {op!r}")


class Driver:
    """Steps a plan of ``writer``'s: `expect` the next step, answer it with `send` (or
    `throw`); `done` once the plan returned (its result: `value`)."""

    def __init__(self, writer: Any, plan: Plan[Any]) -> None:
        self.writer, self.plan = writer, plan
        self.op: Any = None
        self.done = False
        self.value: Any = None
        self._advance(lambda: next(plan))

    def expect(self, *step: Any) -> None:
        assert not self.done, f"the plan returned; expected {step}"
        assert describe(self.op, self.writer) == step

    def _advance(self, action: Any) -> None:
        try:
            self.op = action()
        except StopIteration as stop:
            self.done, self.value = True, stop.value

    def send(self, value: Any = None) -> None:
        # The driver takes the locks the plan asks for (the plan releases them).
        if isinstance(self.op, Acquire) and value:
            self.op.args[0].take()
        elif isinstance(self.op, Call) and self.op.sync.__name__ == "acquire":
            lock: Any = self.op.sync
            lock.__self__.take()
        self._advance(lambda: self.plan.send(value))

    def throw(self, error: BaseException) -> None:
        self._advance(lambda: self.plan.throw(error))

    def answer(self, *step: Any, value: Any = None) -> None:
        self.expect(*step)
        self.send(value)


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> Beating:
    beating = Beating()
    monkeypatch.setattr("streams.heartbeat.gone", lambda conn: conn.name in beating.gone)
    return beating


def borrowed_beat(d: Driver, work: str) -> None:
    """A heartbeat that borrows the writer's connection and runs ``work`` there."""
    d.answer("acquire", "beat_lock", None, value=True)
    d.answer("acquire", "lock", BORROW_WAIT, value=True)
    d.answer("run", "own", work)


def assert_free(w: Beating) -> None:
    assert not w._lock.held and not w._beat_lock.held  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- the loop


def test_a_scheduled_beat_borrows_the_connection_and_announces(writer: Beating) -> None:
    d = Driver(writer, writer._beat_loop_plan())
    d.expect("wait", "wake", INTERVAL)
    d.send(False)  # nobody woke it: a scheduled heartbeat
    borrowed_beat(d, "beat")
    assert_free(writer)
    assert writer._attached.said == ["beat"]  # POSITION p p at least
    d.expect("wait", "wake", INTERVAL)


def test_an_append_wakes_a_heartbeat_that_only_persists_then_coalesces(writer: Beating) -> None:
    writer._wake.set()
    d = Driver(writer, writer._beat_loop_plan())
    d.expect("wait", "wake", INTERVAL)
    d.send(True)
    assert not writer._wake.is_set()  # cleared for the next append
    borrowed_beat(d, "heartbeat")  # not `beat`: no retirement of peers
    assert writer._attached.said == [("completed", (), 0)]  # what moved, if anything
    # At most one early heartbeat per FLUSH_INTERVAL: it pauses (a close cuts the pause short).
    d.answer("wait", "stopped", FLUSH_INTERVAL, value=False)
    d.expect("wait", "wake", INTERVAL)


def test_joined_facts_are_resolved_every_flush_interval(writer: Beating) -> None:
    writer._core.joined_pending = True
    d = Driver(writer, writer._beat_loop_plan())
    d.expect("wait", "wake", FLUSH_INTERVAL)
    d.send(False)
    d.answer("acquire", "beat_lock", None, value=True)
    d.answer("acquire", "lock", BORROW_WAIT, value=True)
    writer._core.joined_pending = False  # (resolving found every one of them ended)
    d.answer("run", "own", "resolve_joined", value=[(5, 50), (7, 70)])
    # Each committed one is announced as a completion of its own.
    assert writer._attached.said == [("completed", (5,), 50), ("completed", (7,), 70)]
    d.answer("run", "own", "beat")
    d.expect("wait", "wake", INTERVAL)


def test_failures_are_retried_sooner_and_logged_on_change(
    writer: Beating, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "streams.writer")
    d = Driver(writer, writer._beat_loop_plan())
    retry = min(BEAT_RETRY_INTERVAL, LEASE / 8)
    levels = []
    for answer in (StoreError("down"), StoreError("still down"), None):
        d.send(False)
        d.answer("acquire", "beat_lock", None, value=True)
        d.answer("acquire", "lock", BORROW_WAIT, value=True)
        d.expect("run", "own", "beat")
        if answer is None:
            d.send()
        else:
            d.throw(answer)
        assert_free(writer)  # released on the way out of a failure too
        levels.append([r.levelname for r in caplog.records])
        caplog.clear()
        d.expect("wait", "wake", INTERVAL if answer is None else retry)
    assert levels == [["WARNING"], ["DEBUG"], ["INFO"]]
    assert writer._attached.said == ["beat"]  # only the beat that succeeded


def test_a_fenced_writer_stops_beating(writer: Beating, caplog: pytest.LogCaptureFixture) -> None:
    d = Driver(writer, writer._beat_loop_plan())
    d.send(False)
    d.answer("acquire", "beat_lock", None, value=True)
    d.answer("acquire", "lock", BORROW_WAIT, value=True)
    d.expect("run", "own", "beat")
    writer._core.fenced = True  # the heartbeat found its row taken over
    d.send()
    assert d.done
    assert "was fenced" in caplog.text


def test_a_closed_writer_stops_beating(writer: Beating) -> None:
    d = Driver(writer, writer._beat_loop_plan())
    writer._stopped.set()
    d.send(True)  # woken by close
    assert d.done and writer._attached.said == []


# ---------------------------------------------------------------------------- connections


def test_a_slow_append_moves_the_beat_to_the_spare_until_it_idles(writer: Beating) -> None:
    d = Driver(writer, writer._on_beat_connection(writer._persist_work))
    d.answer("acquire", "beat_lock", None, value=True)
    d.answer("acquire", "lock", BORROW_WAIT, value=False)  # an append holds it
    d.answer("connect", value=FakeConn("spare"))
    d.answer("run", "spare", "heartbeat")
    assert d.done and writer._spare is not None and writer._spare_used == 100.0
    assert_free(writer)

    writer.now += SPARE_IDLE / 2  # borrowed again soon: the spare stays
    d = Driver(writer, writer._on_beat_connection(writer._persist_work))
    borrowed_beat(d, "heartbeat")
    assert d.done and writer._spare is not None

    writer.now += SPARE_IDLE  # unused for longer: closed after the beat, the lock released
    d = Driver(writer, writer._on_beat_connection(writer._persist_work))
    borrowed_beat(d, "heartbeat")
    assert not writer._lock.held  # type: ignore[attr-defined]
    d.answer("call", "spare", "close")
    assert d.done and writer._spare is None
    assert_free(writer)


def test_connections_the_server_ended_are_reopened(writer: Beating) -> None:
    writer.gone = {"own"}
    d = Driver(writer, writer._on_beat_connection(writer._persist_work))
    d.answer("acquire", "beat_lock", None, value=True)
    d.answer("acquire", "lock", BORROW_WAIT, value=True)
    d.answer("call", "own", "close")
    d.answer("connect", value=FakeConn("own2"))
    assert writer._conn.name == "own2"
    d.answer("run", "own", "heartbeat")  # a store generator: on the (new) own connection
    assert d.done

    writer._spare, writer.gone = FakeConn("spare"), {"spare"}
    d = Driver(writer, writer._on_beat_connection(writer._persist_work))
    d.answer("acquire", "beat_lock", None, value=True)
    d.answer("acquire", "lock", BORROW_WAIT, value=False)
    d.answer("call", "spare", "close")
    d.answer("connect", value=FakeConn("spare2"))
    d.answer("run", "spare2", "heartbeat")
    assert d.done and writer._spare.name == "spare2"
    assert_free(writer)


def test_a_new_connection_is_opened_with_the_writers_checks(writer: Beating) -> None:
    """The checks run inside the connect step (`streams.store.sessions`, "Opening checks"),
    which waits out a session lost under them; the first connection also registers."""
    d = Driver(writer, writer._connect_plan())
    opening = d.op.kwargs["opening"]
    assert opening.func == writer._core.opening and opening.keywords == {"first": False}
    d.answer("connect", value=FakeConn("new"))
    assert d.done and d.value.name == "new"
    d = Driver(writer, writer._connect_plan(5.0, first=True))
    assert d.op.kwargs["opening"].keywords == {"first": True}
    assert d.op.kwargs["connect_timeout"] == 5.0


# ---------------------------------------------------------------------------- appends


class Shell(_WriterShell[Any]):
    """The shared part of both writers, with fakes (nothing connects)."""

    def __init__(self) -> None:
        lock, core = FakeLock("lock"), FakeCore()
        super().__init__("postgresql://fake", core, lock, FakeLock("beat"), threading.Event)  # type: ignore[arg-type]
        self._conn = FakeConn("own")
        self.reports: list[Any] = []

    def _completed(
        self, ids: tuple[int, ...] = (), timestamp: int = 0, *, remembered: bool = True
    ) -> None:
        assert not self._lock.held, "reported while holding the connection"  # type: ignore[attr-defined]
        self.reports.append(ids)


ACK = Ack(9, 9, 1, 1, 1, (9,))


@pytest.fixture
def shell(monkeypatch: pytest.MonkeyPatch) -> Shell:
    monkeypatch.setattr("streams.writer.gone", lambda conn: conn.name == "dead")
    return Shell()


def test_an_append_is_retried_once_when_lost_before_its_commit(
    shell: Shell, caplog: pytest.LogCaptureFixture
) -> None:
    d = Driver(shell, shell._append_plan([{}], [None]))
    d.answer("call", "lock", "acquire", value=True)
    d.expect("run", "own", "append")
    shell._conn.name = "dead"  # broken by the failure
    d.throw(ConnectionLost("gone"))
    assert "retrying" in caplog.text
    d.answer("call", "dead", "close")
    d.answer("connect", value=FakeConn("own2"))
    d.answer("run", "own", "append", value=ACK)
    assert d.done and d.value == ACK
    assert shell.reports == [(9,)] and not shell._lock.held  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("first", "second"),
    [(CommitUnknown("maybe"), None), (ConnectionLost("a"), ConnectionLost("b"))],
    ids=["commit-unknown", "lost-twice"],
)
def test_an_append_is_never_retried_after_its_commit_nor_twice(
    shell: Shell, first: Exception, second: Exception | None
) -> None:
    d = Driver(shell, shell._append_plan([{}], [None]))
    d.answer("call", "lock", "acquire", value=True)
    d.expect("run", "own", "append")
    last = first
    if second is not None:
        d.throw(first)
        d.expect("run", "own", "append")  # (the connection was still usable)
        last = second
    with pytest.raises(type(last)):
        d.throw(last)
    assert shell.reports == [()] and not shell._lock.held  # type: ignore[attr-defined]


def test_a_closed_writer_refuses_appends(shell: Shell) -> None:
    shell._stop()
    with pytest.raises(Exception, match="writer is closed"):
        Driver(shell, shell._append_plan([{}], [None]))


# ---------------------------------------------------------------------------- fact blocks


class Facts(FactPlans):
    def __init__(self) -> None:
        self._core: Any = FakeCore()
        self._wake = threading.Event()
        self.reports: list[Any] = []
        self._sessions = weakref.WeakKeyDictionary()

    def _completed(
        self, ids: tuple[int, ...] = (), timestamp: int = 0, *, remembered: bool = True
    ) -> None:
        self.reports.append(ids)


@pytest.mark.parametrize("joined", [False, True], ids=["own", "joined"])
def test_an_interrupted_rollback_still_ends_the_fact(joined: bool) -> None:
    """Whatever interrupts the settling of a failed block (a second Ctrl-C), the ID completes:
    in both flows, in both worlds (the plan is theirs)."""
    facts = Facts()
    conn = FakeConn("caller")
    conn.autocommit = not joined  # the fact's own transaction is begun by a BEGIN
    d = Driver(facts, facts._enter_fact(conn, joined, OpenFact, None, None))
    if not joined:
        d.answer("call", "caller", "execute", value=None)
    handle = FactHandle(stream_id=3, timestamp=1000, xid=77)
    d.answer("run", "caller", "reserve_fact", value=handle)
    assert d.done
    fact = d.value
    d = Driver(facts, facts._exit_fact(fact, raised=True))
    d.expect("failjoined" if joined else "settle", "caller")
    with pytest.raises(KeyboardInterrupt):
        d.throw(KeyboardInterrupt())
    assert facts._core.finished == [("token", handle, False)]
    assert facts.reports == [()] and facts._core.joined == []


def test_a_joined_fact_is_handed_to_the_heartbeat() -> None:
    facts = Facts()
    conn = FakeConn("caller")
    d = Driver(facts, facts._enter_fact(conn, True, OpenFact, None, None))
    handle = FactHandle(stream_id=3, timestamp=1000, xid=77)
    d.answer("run", "caller", "reserve_fact", value=handle)
    d = Driver(facts, facts._exit_fact(d.value, raised=False))
    assert d.done
    assert facts._core.joined == [handle] and facts._wake.is_set()
    assert facts._core.finished == [] and facts.reports == []
