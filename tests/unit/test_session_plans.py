"""The plan that opens a session (`streams.store.sessions`) driven by hand: no server, the test
answers each step (the kernel's own promises: tests/unit/test_plans.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from streams.errors import StoreError
from streams.plans import Call, Plan, Sleep
from streams.store import sessions

URL = "postgresql://u:secret@127.0.0.1:1/db"


class FakeConn:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _check() -> Any:
    yield "check"


def _open(connect_timeout: float, opening: Any = None) -> Plan[Any]:
    return sessions._open(
        URL,
        autocommit=True,
        connect_timeout=connect_timeout,
        purpose="test",
        opening=opening,
        decode_payloads=False,
    )


def test_a_transient_failure_waits_then_the_next_attempt_connects() -> None:
    plan = _open(5.0)
    step = next(plan)
    assert type(step).__name__ == "_Connect"
    assert step.kwargs["autocommit"] is True and step.kwargs["connect_timeout"] >= 2
    step = plan.throw(psycopg.OperationalError("connection refused"))
    assert isinstance(step, Sleep) and 0 <= step.args[0] <= sessions.RETRY_CAP
    assert type(plan.send(None)).__name__ == "_Connect"
    conn = FakeConn()
    with pytest.raises(StopIteration) as done:
        plan.send(conn)
    assert done.value.value is conn


def test_a_failure_for_good_is_the_redacted_store_error() -> None:
    plan = _open(5.0)
    next(plan)
    with pytest.raises(StoreError, match="password authentication failed") as raised:
        plan.throw(psycopg.OperationalError("password authentication failed for secret"))
    assert "secret" not in str(raised.value)
    assert raised.value.__context__ is None  # no chained driver message


def test_a_failing_or_cancelled_opening_check_closes_the_connection() -> None:
    for error in (StoreError("schema not migrated"), asyncio.CancelledError()):
        plan = _open(0, opening=_check)
        next(plan)
        conn = FakeConn()
        assert type(plan.send(conn)).__name__ == "_Check"
        close = plan.throw(error)
        assert isinstance(close, Call) and close.sync == conn.close
        with pytest.raises(type(error)):
            plan.send(None)
