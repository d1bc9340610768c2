"""Two asyncio helpers that keep cancellation exact (no I/O of their own).

A cancelled task must either stop at once or, for a few short steps that must not stop half-way
(settling a connection, rolling back a caller's transaction), finish them and *then* stop. Two
things in the standard library get in the way on Python 3.11:

* ``asyncio.wait_for`` swallows a cancellation that arrives in the same loop iteration as the
  awaited result (CPython gh-86296, fixed in 3.12 by re-implementing it on ``asyncio.timeout``):
  the caller goes on as if it had not been cancelled. `wait_event` waits with
  ``asyncio.timeout`` instead, which re-raises such a cancellation.
* ``asyncio.shield`` protects the inner work but lets the caller resume at once, beside work
  that is still running (a rollback still in flight on a connection the caller then reuses).
  `uninterrupted` waits for the inner work to finish, then raises the cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["uninterrupted", "wait_event"]

T = TypeVar("T")


async def uninterrupted(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to completion in a task of its own, even if the caller is cancelled meanwhile;
    such a cancellation is raised after `work` has finished (its result is then dropped).

    Only for short steps: the caller cannot stop before `work` does.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.cancelled():  # the work itself was cancelled (the loop is shutting down)
                raise
            cancelled = True  # keep waiting for the work; raise once it is done
    if cancelled:
        raise asyncio.CancelledError
    return result


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `event`; True if it is set (see the module doc)."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(0.0, timeout)):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
