"""The garbage collector paused while a reader builds a page of facts.

A page of catching up allocates tens of thousands of container objects (a `Fact` per fact, its
payloads tuple, the payloads' dicts) that all live until the caller has consumed the epoch.
CPython's collector counts allocations, not bytes: every 700 it examines the young objects,
finds these alive, and promotes them, and their promotion in turn triggers collections of the
older generations, which walk the whole heap. Measured on a 200,000-fact catch-up: the
collector took about half of the reader's time, none of it finding garbage (a page holds no
cycles). Pausing it while a page is built (microseconds to a few milliseconds of pure Python,
no I/O and no ``await`` inside) leaves one young collection per page instead of dozens.

The switch is the interpreter's, so it is process-wide: another thread that runs during those
milliseconds runs without automatic collection too (it loses nothing; its garbage is
collected once the pause ends). Nested and concurrent pauses are counted, and the collector is
switched on again only by the last one to end, and only if it was on when the first began: a
program that turned it off itself keeps it off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collection_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector paused (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
