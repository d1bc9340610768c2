"""Logic written once for threads and asyncio: *plans*, and the operations they yield.

A plan is a generator, like the store's (`streams.store.driver`) one level up: it decides what
to do and yields each step that needs I/O or waiting, and a driver performs the step and sends
back its result (or throws its exception in, where the plan's ``try`` sees it). The writers
(`streams.writer`, with `streams.heartbeat` and `streams.fact_blocks`) are written so: one
plan, and two small drivers, a synchronous one and an asyncio one.

A plan yields one of two things:

* a store generator (`streams.store.driver.Gen`): run on the writer's own connection (an
  append's work; nothing is allocated for it on the way);
* an `Io`: a step with its twin in each world. The synchronous driver calls ``op.call()``,
  the asyncio driver awaits ``op.acall()``. The subclasses below name the common ones, so that
  a test driving a plan by hand can tell them apart (``tests/unit/test_writer_plans.py``).

What is synchronous in both worlds stays in the plan: setting and clearing an event, releasing
a lock (``release`` never waits, in threading or asyncio), reading a connection's state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol, TypeAlias, TypeVar

from . import _aio
from .store import sessions
from .store.driver import Gen, afail_joined, arun, asettle, fail_joined, run, settle

__all__ = [
    "Acquire",
    "Call",
    "Connect",
    "FailJoined",
    "Flag",
    "Io",
    "Lock",
    "Plan",
    "Run",
    "Settle",
    "Wait",
    "resume",
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


Op: TypeAlias = "Io | Gen[Any]"
#: A plan returning ``T``: it yields `Op` and is sent each one's result.
Plan: TypeAlias = Generator[Op, Any, T]


def resume(plan: Plan[Any], value: Any, error: BaseException | None) -> Any:
    """The plan's next step after it is sent ``value`` (or ``error`` is thrown into it); the
    `StopIteration` that carries its result once it returns (the drivers check for it)."""
    try:
        return plan.throw(error) if error is not None else plan.send(value)
    except StopIteration as stop:
        return stop


class Call(Io):
    """A method of a connection of either world (``conn.commit``, ``conn.close``, ...)."""

    def __init__(self, method: Callable[..., Any], *args: Any) -> None:
        super().__init__(method, method, *args)


def _wait(flag: threading.Event, seconds: float) -> bool:
    return flag.wait(seconds)


class Wait(Io):
    """Wait up to ``seconds`` for ``flag`` (an event); the result: whether it is set."""

    def __init__(self, flag: Flag, seconds: float) -> None:
        super().__init__(_wait, _aio.wait_event, flag, seconds)


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


class Run(Io):
    """Run a store generator on a connection other than the writer's own (the spare, the
    caller's); ``joined``: in a transaction of the caller's (`streams.store.driver.run`)."""

    def __init__(self, conn: Any, gen: Gen[Any], *, joined: bool = False) -> None:
        super().__init__(run, arun, conn, gen, joined=joined)


class Connect(Io):
    """A new connection, not in autocommit, checked by ``opening``
    (`streams.store.sessions.connect`)."""

    def __init__(
        self,
        url: str,
        connect_timeout: float | None,
        purpose: str,
        opening: sessions.Opening | None = None,
    ) -> None:
        super().__init__(
            sessions.connect,
            sessions.aconnect,
            url,
            autocommit=False,
            connect_timeout=connect_timeout,
            purpose=purpose,
            opening=opening,
        )


class Settle(Io):
    """Leave a connection clean or closed (`streams.store.driver.settle`)."""

    def __init__(self, conn: Any, autocommit: bool) -> None:
        super().__init__(settle, asettle, conn, autocommit)


class FailJoined(Io):
    """Leave a caller's transaction able only to roll back (`streams.store.driver.fail_joined`)."""

    def __init__(self, conn: Any) -> None:
        super().__init__(fail_joined, afail_joined, conn)
