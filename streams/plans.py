"""The kernel: logic written once for threads and asyncio as *plans*, and its two drivers.

A plan is a generator: it decides what to do and yields each step that needs I/O or waiting
(an `Io`); a driver performs the step and sends back its result, or throws its exception into
the plan, where the plan's ``try`` sees it. Every component that does I/O in both worlds (the
client, writers, readers, Arrow batches, the Redis link, the Spark executor) is written as
plans over this one vocabulary, and run by exactly two drivers: `drive` (the calling thread)
and `adrive` (the running event loop). psycopg is built the same way (``generators.py`` and
``waiting.py``); the store's statement generators (`streams.store.driver`) are the level below,
run on a session by one step, `streams.store.steps.Run`.

The error policy, written once here: every exception a step raises is thrown into the plan, a
cancellation or a ``KeyboardInterrupt`` included, so the plan's ``finally`` (closing what it
opened, settling a connection) runs before the error goes on. The plan decides what to catch:
try again, fall back, or let it propagate out of the driver.

A step is an `Io`: a pair of twins, one per world. The synchronous driver calls
``op.call()``, the asyncio driver awaits ``op.acall()``. The subclasses name the common ones,
so that a test driving a plan by hand can tell them apart (``tests/unit/test_writer_plans.py``,
``tests/unit/test_plans.py``). What is synchronous in both worlds stays in the plan: setting an
event, releasing a lock, reading a connection's state. A method each world's class implements
with the same name (sync in one, ``async def`` in the other) is one step: `Call`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol, TypeAlias, TypeVar

from . import _aio

__all__ = [
    "Acquire",
    "Blocking",
    "Call",
    "Flag",
    "Io",
    "Lock",
    "Locked",
    "Plan",
    "Sleep",
    "Wait",
    "adrive",
    "drive",
]

T = TypeVar("T")


class Flag(Protocol):
    """What plans do with an event themselves (threading's and asyncio's both have it)."""

    def is_set(self) -> bool: ...
    def set(self) -> None: ...
    def clear(self) -> None: ...


class Lock(Protocol):
    """What plans do with a lock themselves: release it (taken through `Acquire`)."""

    def release(self) -> None: ...


class Io:
    """One step of a plan, with its twin in each world: ``sync(*args, **kwargs)`` for the
    synchronous driver, ``aio(*args, **kwargs)`` awaited by the asyncio one."""

    __slots__ = ("aio", "args", "kwargs", "sync")

    def __init__(
        self,
        sync: Callable[..., Any],
        aio: Callable[..., Awaitable[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.sync, self.aio, self.args, self.kwargs = sync, aio, args, kwargs

    def call(self) -> Any:
        return self.sync(*self.args, **self.kwargs)

    def acall(self) -> Awaitable[Any]:
        return self.aio(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args!r}"


#: A plan returning ``T``: it yields `Io` steps and is sent each one's result.
Plan: TypeAlias = Generator[Io, Any, T]


# --------------------------------------------------------------------------------------------
# The two drivers


def drive(plan: Plan[T]) -> T:
    """Run ``plan`` to its end in this thread; return what it returns, or raise what it
    raises. Each step's exception is thrown into the plan (see the module docstring)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, error = op.call(), None
        except BaseException as exc:  # the plan's to handle (its finally, at the least)
            value, error = None, exc


async def adrive(plan: Plan[T]) -> T:
    """The asyncio twin of `drive`: each step awaited on the running loop. A cancellation is
    thrown into the plan like any other exception: the plan cleans up, then it goes on."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, error = await op.acall(), None
        except BaseException as exc:
            value, error = None, exc


# --------------------------------------------------------------------------------------------
# The common steps


class Call(Io):
    """A method that is synchronous in one world and a coroutine in the other under one name
    (``conn.commit``, ``conn.close``, a shell's ``_connection``): called, or awaited."""

    def __init__(self, method: Callable[..., Any], *args: Any) -> None:
        super().__init__(method, method, *args)


def _here(function: Callable[..., T], *args: Any) -> T:
    return function(*args)


async def _athread(function: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(function, *args)


class Blocking(Io):
    """A blocking function of no world (asking the Sentinels, a user's callback): called in
    this thread, or in a worker thread under asyncio, so the loop goes on meanwhile."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        # Both twins take the function as their first argument (the args are shared).
        super().__init__(_here, _athread, function, *args)


class Sleep(Io):
    """Sleep ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__(time.sleep, asyncio.sleep, max(0.0, seconds))


def _wait(flag: threading.Event, seconds: float) -> bool:
    return flag.wait(seconds)


class Wait(Io):
    """Wait up to ``seconds`` for ``flag`` (an event); the result: whether it is set. Also
    a sleep that a closing object cuts short (``Wait(stopped, seconds)``)."""

    def __init__(self, flag: Flag, seconds: float) -> None:
        super().__init__(_wait, _aio.wait_event, flag, max(0.0, seconds))


def _acquire(lock: threading.Lock, timeout: float | None) -> bool:
    return lock.acquire() if timeout is None else lock.acquire(timeout=timeout)


async def _aacquire(lock: asyncio.Lock, timeout: float | None) -> bool:
    if timeout is None:
        return await lock.acquire()
    acquired = False
    try:
        async with asyncio.timeout(timeout):
            acquired = await lock.acquire()  # a cancelled acquire leaves the lock free
    except TimeoutError:
        pass
    return acquired


class Acquire(Io):
    """Take ``lock``, waiting at most ``timeout`` seconds (None: as long as it takes); the
    result: whether it was taken. The plan releases it itself (`Lock`)."""

    def __init__(self, lock: Lock, timeout: float | None) -> None:
        super().__init__(_acquire, _aacquire, lock, timeout)


def _locked(lock: threading.Lock, plan: Plan[T]) -> T:
    with lock:
        return drive(plan)


async def _alocked(lock: asyncio.Lock, plan: Plan[T]) -> T:
    async with lock:
        return await adrive(plan)


class Locked(Io):
    """Run ``plan`` (by the same world's driver) while holding ``lock``: the part of a call
    that uses a connection shared by the object's callers (a client's)."""

    def __init__(self, lock: Lock, plan: Plan[Any]) -> None:
        super().__init__(_locked, _alocked, lock, plan)
