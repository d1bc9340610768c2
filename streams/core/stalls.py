"""When a stream is held back, and when to look for an expired writer holding it (no I/O).

A stream is *held* while PostgreSQL proves it complete only up to a position below max
allocated: some reserved ID has not completed. That is normal for as long as a writer's
transaction runs, and wrong once that writer is gone: a process frozen (SIGSTOP, a VM pause) or
cut off from the database in the middle of a transaction keeps its locks until its session is
ended, which `streams.store.leases.retire_expired_writers` does once its lease has expired
("the liveness argument" there). Readers, the elected prover and the Spark source see every
probe, so they run it; `HeldStreams` tells them when: after a stream has been held at the same
position for `CHECK_AFTER` seconds, then at most every `CHECK_EVERY` seconds while it stays
held. Times are passed in (monotonic seconds), so this is tested without clocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CHECK_AFTER", "CHECK_EVERY", "HeldStreams"]

#: Seconds a stream must stay held at one position before anyone looks for an expired writer.
CHECK_AFTER = 1.0
#: Least seconds between two looks at one stream while it stays held.
CHECK_EVERY = 1.0


@dataclass(slots=True)
class _Held:
    position: int
    since: float
    checked: float | None = None


class HeldStreams:
    """Per stream: held since when, at which position, and when it was last checked."""

    def __init__(self, check_after: float = CHECK_AFTER, check_every: float = CHECK_EVERY) -> None:
        self.check_after = check_after
        self.check_every = check_every
        self._held: dict[str, _Held] = {}

    def observe(self, now: float, probes: Iterable[tuple[str, int, int]]) -> list[str]:
        """``(stream, complete, max_allocated)`` from a probe at ``now``: the streams to check
        now (held for `check_after` at one position, not checked for `check_every`)."""
        due = []
        for stream, complete, max_allocated in probes:
            if complete >= max_allocated:
                self._held.pop(stream, None)
                continue
            held = self._held.get(stream)
            if held is None or held.position != complete:
                self._held[stream] = _Held(complete, now)
                continue
            if now - held.since < self.check_after:
                continue
            if held.checked is not None and now - held.checked < self.check_every:
                continue
            held.checked = now
            due.append(stream)
        return due

    def held_for(self, stream: str, now: float) -> float:
        """Seconds ``stream`` has been held at its position (0 if it is not held)."""
        held = self._held.get(stream)
        return 0.0 if held is None else now - held.since
