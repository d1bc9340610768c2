"""The kernel (`streams.plans`): one plan, both drivers, the same results and exceptions.

Every I/O component is written as plans over these steps, so what the two drivers promise is
checked here once: a step's result is sent back, its exception thrown in (the plan may catch it
and go on), the plan's return value comes out, an exception it lets go propagates, and a
cancellation reaches the plan's ``finally`` before it goes on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from streams.plans import (
    Acquire,
    Blocking,
    Call,
    Io,
    Locked,
    Plan,
    Sleep,
    Wait,
    adrive,
    drive,
)


class Boom(Exception):
    pass


def _fail() -> None:
    raise Boom("step failed")


async def _afail() -> None:
    raise Boom("step failed")


class Fail(Io):
    def __init__(self) -> None:
        super().__init__(_fail, _afail)


def _double(n: int) -> int:
    return 2 * n


async def _adouble(n: int) -> int:
    return 2 * n


class Double(Io):
    def __init__(self, n: int) -> None:
        super().__init__(_double, _adouble, n)


def scenario(log: list[str]) -> Plan[int]:
    """Results come back; a failing step is caught and the plan goes on; its ``finally``
    runs its own step."""
    total = yield Double(3)
    try:
        yield Fail()
    except Boom as exc:
        log.append(f"caught {exc}")
        total += yield Double(1)
    try:
        yield Sleep(0)
    finally:
        log.append("finally")
    return int(total)


def uncaught(log: list[str]) -> Plan[None]:
    try:
        yield Fail()
    finally:
        log.append("cleaned up")
        yield Double(0)  # a step in the finally: still performed


def _both(make: Callable[[list[str]], Plan[Any]]) -> tuple[Any, Any]:
    """``make``'s plan through each driver: (result or exception, log) twice."""

    def outcome(run: Callable[[], Any], log: list[str]) -> tuple[Any, list[str]]:
        try:
            return run(), log
        except Exception as exc:  # compared by type and text
            return (type(exc).__name__, str(exc)), log

    sync_log: list[str] = []
    async_log: list[str] = []
    sync = outcome(lambda: drive(make(sync_log)), sync_log)
    aio = outcome(lambda: asyncio.run(adrive(make(async_log))), async_log)
    return sync, aio


def test_both_drivers_send_results_and_throw_errors_alike() -> None:
    sync, aio = _both(scenario)
    assert sync == aio == (8, ["caught step failed", "finally"])


def test_an_error_the_plan_lets_go_propagates_after_its_finally() -> None:
    sync, aio = _both(uncaught)
    assert sync == aio == (("Boom", "step failed"), ["cleaned up"])


def test_a_cancellation_is_thrown_into_the_plan() -> None:
    log: list[str] = []

    def waits(flag: asyncio.Event) -> Plan[None]:
        try:
            yield Wait(flag, 60)
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        finally:
            yield Sleep(0)  # cleaning up still takes steps
            log.append("closed")

    async def main() -> None:
        task = asyncio.ensure_future(adrive(waits(asyncio.Event())))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["cancelled", "closed"]


def test_wait_returns_whether_the_flag_was_set() -> None:
    flag = threading.Event()
    assert drive(_one(Wait(flag, 0.01))) is False
    flag.set()
    assert drive(_one(Wait(flag, 5))) is True

    async def main() -> tuple[bool, bool]:
        aflag = asyncio.Event()
        unset = await adrive(_one(Wait(aflag, 0.01)))
        aflag.set()
        return unset, await adrive(_one(Wait(aflag, 5)))

    assert asyncio.run(main()) == (False, True)


def _one(step: Io) -> Plan[Any]:
    result = yield step
    return result


def test_acquire_gives_up_after_its_timeout_and_locked_holds_the_lock() -> None:
    lock = threading.Lock()
    seen: list[bool] = []

    def inside() -> Plan[str]:
        seen.append(lock.locked())
        taken = yield Acquire(lock, 0.01)  # already held by `Locked`
        seen.append(taken)
        return "done"

    assert drive(_one(Locked(lock, inside()))) == "done"
    assert seen == [True, False] and not lock.locked()

    async def main() -> tuple[list[bool], bool]:
        alock = asyncio.Lock()
        aseen: list[bool] = []

        def ainside() -> Plan[str]:
            aseen.append(alock.locked())
            aseen.append((yield Acquire(alock, 0.01)))
            return "done"

        assert await adrive(_one(Locked(alock, ainside()))) == "done"
        return aseen, alock.locked()

    assert asyncio.run(main()) == ([True, False], False)


def test_blocking_runs_off_the_loop_under_asyncio() -> None:
    loop_thread: list[int] = []

    def where() -> int:
        time.sleep(0.01)
        return threading.get_ident()

    async def main() -> int:
        loop_thread.append(threading.get_ident())
        return int(await adrive(_one(Blocking(where))))

    assert drive(_one(Blocking(where))) == threading.get_ident()
    assert asyncio.run(main()) != loop_thread[0]


def test_call_calls_or_awaits_the_method_of_its_world() -> None:
    class Sync:
        def name(self, x: str) -> str:
            return f"sync {x}"

    class Async:
        async def name(self, x: str) -> str:
            return f"async {x}"

    assert drive(_one(Call(Sync().name, "a"))) == "sync a"
    assert asyncio.run(adrive(_one(Call(Async().name, "b")))) == "async b"
