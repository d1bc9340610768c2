"""`streams.plans.Blocking`: both drivers call the function with the step's arguments (the
threaded one in this thread, the asyncio one in a worker thread), and its exception is thrown
into the plan."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from streams.plans import Blocking, Plan, adrive, drive


def _where(*args: Any) -> tuple[tuple[Any, ...], str]:
    return args, threading.current_thread().name


def _plan() -> Plan[tuple[tuple[Any, ...], str]]:
    result: tuple[tuple[Any, ...], str] = yield Blocking(_where, 1, "two")
    return result


def test_drive_calls_it_here_with_the_arguments() -> None:
    assert drive(_plan()) == ((1, "two"), threading.current_thread().name)


def test_adrive_calls_it_in_a_worker_thread_with_the_arguments() -> None:
    args, thread = asyncio.run(adrive(_plan()))
    assert args == (1, "two") and thread != threading.current_thread().name


def _fails() -> None:
    raise LookupError("no")


def _catching() -> Plan[str]:
    try:
        yield Blocking(_fails)
    except LookupError as exc:
        return f"caught {exc}"
    return "not raised"


def test_its_exception_is_thrown_into_the_plan() -> None:
    assert drive(_catching()) == "caught no"
    assert asyncio.run(adrive(_catching())) == "caught no"


def test_an_uncaught_one_propagates() -> None:
    def plan() -> Plan[None]:
        yield Blocking(_fails)

    with pytest.raises(LookupError):
        drive(plan())
