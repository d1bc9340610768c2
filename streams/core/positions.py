"""Stream positions: the pure bookkeeping behind writers and readers (no I/O).

Theory of operation
-------------------
Terms, from Matrix Synapse's stream model (its developer documentation, "Streams"; our
summary is ``docs/concepts.md``):

* A **writer** *reserves* a **stream ID** (``nextval`` on the stream's sequence), writes the fact's
  rows in a transaction, and the ID *completes* when that transaction ends, committed or rolled
  back. IDs complete in any order.
* An ID is **pending** from the moment the writer knows it until it completes.
* A reservation is **in flight** between asking PostgreSQL for IDs and learning them. While it is
  in flight the writer cannot know its IDs, only a *floor*: sequences only go up, so every ID it
  will get is larger than every ID that was known to be allocated when it started.
* **Max allocated**: the largest ID known to have been handed out by the sequence, by anyone.
* The **per-writer position** of W is the largest ID such that every ID reserved by W that is
  <= it has completed. It is not unique: if W has nothing pending and nothing in flight, every
  ID up to max allocated qualifies. We keep two forward-only readings of it:

  - the **minimal** position: the largest ID W itself completed with nothing of W's pending
    below it (what a cautious reader of W's own facts wants);
  - the **announceable** position: the largest value the definition allows. With nothing
    pending and nothing in flight it is max allocated, which is how an idle writer keeps from
    pinning the linear position. Otherwise it is ``min(min(pending) - 1, min(floors))``.

* The **linear position** is the largest ID such that every ID reserved by any writer that is
  <= it has completed: the minimum over all known writers' announceable positions. A writer
  that was removed (retired after its lease expired: PostgreSQL has then proven that none of its
  transactions is open) is treated as caught up, i.e. left out of the minimum. A new writer is
  seeded at the current linear position, never above it.

Everything here only moves forward: stale announcements are ignored, never applied backwards.
Memory is proportional to what is pending and in flight, never to what has completed.

One `PositionTracker` describes one stream as seen from one process: optionally one *local*
writer whose reservations it tracks exactly, plus the announced positions of other writers.
Readers use it with no local writer.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import SequenceRewound

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Serialise a mutating method: a writer's appends and its heartbeat run on two threads."""

    @functools.wraps(method)
    def wrapper(self: PositionTracker, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


__all__ = [
    "PositionTracker",
    "ReservationToken",
    "TrackerSnapshot",
    "sequence_repair_target",
]


@dataclass(frozen=True, slots=True)
class ReservationToken:
    """Handle of one in-flight reservation; `floor` is max allocated when it started."""

    number: int
    floor: int


@dataclass(frozen=True, slots=True)
class TrackerSnapshot:
    """A consistent reading of a tracker, for reports and announcements."""

    linear: int
    max_allocated: int
    local_position: int | None
    local_minimal_position: int | None
    pending: int
    in_flight: int
    writers: Mapping[str, int]


class PositionTracker:
    """Positions of one stream: one optional local writer plus announced remote writers."""

    def __init__(
        self,
        *,
        local_instance: str | None = None,
        local_position: int = 0,
        max_allocated: int = 0,
        writers: Mapping[str, int] | None = None,
    ) -> None:
        if local_position < 0 or max_allocated < 0:
            raise ValueError("positions are non-negative")
        self._lock = threading.RLock()
        self._local = local_instance
        self._max_allocated = max(max_allocated, local_position)
        self._pending: set[int] = set()
        self._in_flight: dict[int, int] = {}  # token number -> floor
        self._tokens = itertools.count(1)
        self._local_position = local_position
        self._local_minimal = local_position
        self._max_own_completed = local_position
        self._remote: dict[str, int] = {}
        for instance, position in (writers or {}).items():
            if instance != local_instance:
                self._remote[instance] = position
                self._max_allocated = max(self._max_allocated, position)
        self._linear = 0
        #: Most IDs pending plus reservations in flight at once since `take_peak_pending`.
        self._peak = 0
        # A writer constructed with nothing pending or in flight may announce max allocated
        # at once (e.g. a restarted writer after its predecessor was fenced).
        self._recompute()

    # ------------------------------------------------------------------ local writer

    @_locked
    def begin_reservation(self) -> ReservationToken:
        """Call before asking the sequence for IDs; pass the token to `reserved`/`abandon`."""
        self._require_local()
        token = ReservationToken(next(self._tokens), self._max_allocated)
        self._in_flight[token.number] = token.floor
        self._peak = max(self._peak, len(self._pending) + len(self._in_flight))
        return token

    @_locked
    def reserved(self, token: ReservationToken, ids: Iterable[int]) -> None:
        """The reservation returned these IDs: they are now pending."""
        self._in_flight.pop(token.number, None)
        ids = ids if isinstance(ids, (list, tuple)) else list(ids)
        if not ids:
            self._recompute()
            return
        # Set operations over the whole batch: a per-ID loop cost ~2 us a fact in a batch.
        lowest = min(ids)
        if lowest <= token.floor:
            # A sequence never goes back; an ID at or below the floor means the sequence was
            # set back under us. Refuse rather than corrupt every position derived from it.
            raise SequenceRewound(
                f"stream ID {lowest} is not above max allocated {token.floor} when the "
                "reservation started: the sequence was set back; nothing was written. Open a "
                "new writer (it repairs the sequence) or run `streams doctor --repair`"
            )
        self._pending.update(ids)
        self._max_allocated = max(self._max_allocated, *ids)
        self._recompute()

    @_locked
    def abandon(self, token: ReservationToken) -> None:
        """The reservation failed before returning IDs (the transaction rolled back)."""
        self._in_flight.pop(token.number, None)
        self._recompute()

    @_locked
    def complete(self, ids: Iterable[int]) -> bool:
        """The transaction holding these IDs ended. Returns whether the local position moved."""
        before = self._local_position
        ids = ids if isinstance(ids, (list, tuple)) else list(ids)
        if ids:
            self._pending.difference_update(ids)
            self._max_own_completed = max(self._max_own_completed, *ids)
        self._recompute()
        return self._local_position != before

    # ------------------------------------------------------------------ knowledge from outside

    @_locked
    def note_allocated(self, max_allocated: int) -> None:
        """The sequence was seen at `max_allocated` (e.g. read by an idle writer's heartbeat)."""
        if max_allocated > self._max_allocated:
            self._max_allocated = max_allocated
            self._recompute()

    @_locked
    def advance(self, instance: str, position: int) -> bool:
        """Another writer announced `position`. Stale announcements are ignored.

        Returns whether anything moved. An announcement for the local writer is ignored: this
        process knows its own state better than any echo of it.
        """
        if instance == self._local:
            return False
        current = self._remote.get(instance)
        if current is not None and position <= current:
            return False
        self._remote[instance] = position
        self._max_allocated = max(self._max_allocated, position)
        self._recompute()
        return True

    @_locked
    def add_writer(self, instance: str, position: int | None = None) -> int:
        """Start tracking a writer, seeded at the linear position unless told otherwise."""
        if instance == self._local:
            return self._local_position
        if instance not in self._remote:
            seeded = self._linear if position is None else min(position, self._max_allocated)
            self._remote[instance] = seeded
            self._recompute()
        elif position is not None:
            self.advance(instance, position)
        return self._remote[instance]

    @_locked
    def remove_writer(self, instance: str) -> None:
        """Forget a retired writer: it is treated as caught up from now on."""
        if self._remote.pop(instance, None) is not None:
            self._recompute()

    # ------------------------------------------------------------------ readings

    @property
    def linear_position(self) -> int:
        return self._linear

    @property
    def max_allocated(self) -> int:
        return self._max_allocated

    @property
    def local_position(self) -> int:
        """The local writer's announceable position (see the module docstring)."""
        self._require_local()
        return self._local_position

    @property
    def local_minimal_position(self) -> int:
        """The local writer's minimal position: its own completed IDs only."""
        self._require_local()
        return self._local_minimal

    @_locked
    def take_peak_pending(self) -> int:
        """The most IDs pending plus reservations in flight at any moment since the previous
        call (for operators: a writer that appended since then shows as busy, even if nothing
        is pending at the instant of its heartbeat)."""
        peak = max(self._peak, len(self._pending) + len(self._in_flight))
        self._peak = len(self._pending) + len(self._in_flight)
        return peak

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def in_flight_count(self) -> int:
        return len(self._in_flight)

    def writer_position(self, instance: str) -> int | None:
        if instance == self._local:
            return self._local_position
        return self._remote.get(instance)

    def writers(self) -> dict[str, int]:
        positions = dict(self._remote)
        if self._local is not None:
            positions[self._local] = self._local_position
        return positions

    @_locked
    def snapshot(self) -> TrackerSnapshot:
        return TrackerSnapshot(
            linear=self._linear,
            max_allocated=self._max_allocated,
            local_position=self._local_position if self._local is not None else None,
            local_minimal_position=self._local_minimal if self._local is not None else None,
            pending=len(self._pending),
            in_flight=len(self._in_flight),
            writers=self.writers(),
        )

    # ------------------------------------------------------------------ internals

    def _require_local(self) -> None:
        if self._local is None:
            raise RuntimeError("this tracker has no local writer")

    def _bound(self) -> int | None:
        """Upper bound that pending IDs and in-flight reservations put on the local position."""
        bounds = [min(self._pending) - 1] if self._pending else []
        if self._in_flight:
            bounds.append(min(self._in_flight.values()))
        return min(bounds) if bounds else None

    def _recompute(self) -> None:
        if self._local is not None:
            bound = self._bound()
            announceable = self._max_allocated if bound is None else bound
            self._local_position = max(self._local_position, announceable)
            own = self._max_own_completed
            minimal = own if bound is None else min(own, bound)
            self._local_minimal = max(self._local_minimal, minimal)
        self._linear = max(self._linear, self._compute_linear())

    def _compute_linear(self) -> int:
        candidates = list(self._remote.values())
        if self._local is not None:
            candidates.append(self._local_position)
        if not candidates:
            # Nobody is writing: everything allocated has completed.
            return self._max_allocated
        return min(candidates)


def sequence_repair_target(
    sequence_last_value: int | None, max_stored_id: int | None
) -> int | None:
    """The value to `setval` a stream's sequence to, or None if it is consistent.

    `sequence_last_value` is ``pg_sequence_last_value()``: None until the first ``nextval``
    (Synapse's ``START WITH`` pitfall: the first value is not persisted until called). A
    sequence behind the stored data (restored from a backup, recreated by hand) would hand out
    IDs that already exist, so it must be moved past them before any writer starts.
    """
    if max_stored_id is None or max_stored_id < 1:  # positions start at 0; IDs at 1
        return None
    if sequence_last_value is None or sequence_last_value < max_stored_id:
        return max_stored_id
    return None
