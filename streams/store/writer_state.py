"""A writer's state, and the steps every reservation shares (appends, keyed appends, facts in
a caller's transaction): the checks before it, the reserving statement with its refusals, the
floor check, and the completion of its IDs whatever happens (docs/design/durability.md).
`WriterCore` (`streams.store.writer_core`) is this state with its operations.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..config import validate_instance_name
from ..core.incarnation import Guard
from ..core.payloads import encode_payload
from ..core.positions import PositionTracker, ReservationToken
from ..core.sightings import Sighting
from ..core.timestamps import resolve_timestamps
from ..errors import ReservationBlocked, SequenceRewound, StoreError, UsageError, WriterFenced
from ..types import Ack, StreamInfo
from .driver import Autocommit, Gen, Pipeline, Query, Row
from .holders import exclusive_holders
from .idempotency import FENCED
from .writer_sql import (
    BLOCKED,
    INVALID_TEXT,
    REWOUND,
    UNIQUE_VIOLATION,
    WriterStatements,
    tcp_settings,
)


class DatabaseClock:
    """Arrival time in ms on the database's clock, estimated locally between samples.

    Every writer timestamps with the same clock (PostgreSQL's ``clock_timestamp()``), so hosts
    with skewed clocks cannot reorder time. The offset is re-sampled at every heartbeat; the
    estimate uses the round trip's midpoint.
    """

    def __init__(self) -> None:
        self._offset_ms = 0.0

    def sample(self, db_ms: int, sent: float, received: float) -> None:
        self._offset_ms = db_ms - (sent + received) / 2 * 1000

    def now_ms(self) -> int:
        return math.floor(time.time() * 1000 + self._offset_ms)


@dataclass(slots=True)
class Reservation:
    """An append under way: its timestamps, its payload encoded if it is one fact, its token,
    and the IDs it reserved (completed whatever happens next: as gaps if it rolls back)."""

    stamps: list[int]
    single: str | None
    token: ReservationToken
    ids: list[int] = field(default_factory=list)


class WriterState:
    """One writer instance on one stream: what it knows, and the steps its operations share."""

    def __init__(
        self, stream: str, instance: str, *, lease_seconds: float, max_payload_bytes: int
    ) -> None:
        self.stream_name = stream
        self.instance = validate_instance_name(instance)
        self.lease_seconds = lease_seconds
        #: The database history this writer's state belongs to (shared with its client's).
        self.guard = Guard()
        #: The facts acknowledged lately, checked after a failover (`streams.core.sightings`).
        self.sighting = Sighting()
        self.max_payload_bytes = max_payload_bytes
        self.clock = DatabaseClock()
        self.generation = 0
        self.fenced = False
        self._info: StreamInfo | None = None
        self._tracker: PositionTracker | None = None
        self._ts_floor = 0
        self._persisted = 0
        self._statements: WriterStatements | None = None
        #: An append found the stream's reservation lock held exclusively (`_refused`).
        self.blocked = False
        #: IDs reserved in transactions of callers that this writer joined (``fact()`` on a
        #: connection already in a transaction), by transaction ID, with their timestamps:
        #: pending until `resolve_joined` finds the transaction ended.
        self._joined: dict[int, list[tuple[int, int]]] = {}
        self._joined_lock = threading.Lock()
        self._beats = 0
        #: Facts this writer committed (for metrics).
        self.appended = 0

    # ------------------------------------------------------------------ accessors

    @property
    def info(self) -> StreamInfo:
        if self._info is None:
            raise UsageError("writer is not registered yet")
        return self._info

    @property
    def tracker(self) -> PositionTracker:
        if self._tracker is None:
            raise UsageError("writer is not registered yet")
        return self._tracker

    @property
    def statements(self) -> WriterStatements:
        assert self._statements is not None
        return self._statements

    @property
    def needs_persist(self) -> bool:
        return self._tracker is not None and self._tracker.local_position > self._persisted

    def _tcp_settings(self) -> dict[str, str]:
        return tcp_settings(self.lease_seconds)

    def _where(self) -> str:
        return f"writer {self.instance!r} of {self.stream_name!r}"

    def _lease_params(self, **extra: Any) -> dict[str, Any]:
        return {
            "lease_ms": str(int(self.lease_seconds * 1000)),
            "stream": self.info.id,
            "instance": self.instance,
            "generation": self.generation,
            **extra,
        }

    # ------------------------------------------------------------------ checks

    def _ready(self) -> None:
        """Before anything is reserved: the writer is not fenced, and a loss is told."""
        self._check_usable()
        self._report_failover()

    def _check_usable(self) -> None:
        if self.fenced:
            # A failover that lost acknowledged facts may also have fenced the writer (its
            # lease renewals lost, its name retired or taken over on the new primary): the
            # loss is named first, or no one would ever be told of it.
            self._report_failover()
            raise WriterFenced(
                f"writer {self.instance!r} on stream {self.stream_name!r} was retired "
                "(lease expired or name taken over); create a new writer"
            )

    def _report_failover(self) -> None:
        """A failover lost facts acknowledged to this writer (found by whichever of its
        sessions reached the new primary first: `streams.store.identity.verify`): raise
        `FailoverLoss` from this call, once; the writer goes on after it."""
        loss = self.sighting.take_loss()
        if loss is not None:
            raise loss

    def _lost(self) -> NoReturn:
        """The lease check found no row of this writer's generation: it is fenced."""
        self.fenced = True
        self._check_usable()
        raise AssertionError("unreachable: a fenced writer is not usable")

    def _check_floor(self, rows: Sequence[Row]) -> list[int]:
        """The reserved IDs, each checked to be >= the reservation lock's L (`writer_sql`)."""
        ids = sorted(int(row[0]) for row in rows)
        floor = int(rows[0][1])
        if ids[0] < floor:
            raise SequenceRewound(
                f"stream {self.stream_name!r}: ID {ids[0]} below the reservation floor {floor}: "
                "the sequence was set back during the reservation; nothing was written"
            )
        return ids

    def _stamps(self, timestamps: Sequence[int | None], floor: int | None = None) -> list[int]:
        """The timestamps of facts written now, above ``floor`` (default: the last written)."""
        info = self.info
        return resolve_timestamps(
            timestamps,
            mode=info.timestamping,
            uncapped=info.uncapped,
            arrival_ms=self.clock.now_ms(),
            floor=self._ts_floor if floor is None else floor,
        )

    # ------------------------------------------------------------------ reserving

    def _reserving(
        self,
        payloads: Sequence[Any],
        timestamps: Sequence[int | None],
        write: Callable[[Reservation], Gen[Ack]],
    ) -> Gen[Ack]:
        """An append: its timestamps and token, then ``write``, then its IDs completed whatever
        happened; the facts written (all but ``Ack.duplicates``) move the timestamp floor.

        A batch encodes its payloads while COPY streams them (the server stores the first
        rows while the client encodes the next: ~15% of a 1000-fact batch at 1 writer); a
        bad payload then aborts the COPY, and its transaction with it: nothing is written,
        and the reserved IDs complete as gaps. A single fact is encoded before anything is
        reserved."""
        tracker = self.tracker
        single = encode_payload(payloads[0], self.max_payload_bytes) if len(payloads) == 1 else None
        stamps = self._stamps(timestamps)
        reservation = Reservation(stamps, single, tracker.begin_reservation())
        try:
            ack = yield from write(reservation)
        finally:
            self._complete(reservation.token, reservation.ids)
        if reservation.ids:
            # Timestamps never decrease: the last fact written has the highest.
            last = next(n for n in reversed(range(len(stamps))) if n not in ack.duplicates)
            self._wrote(len(reservation.ids), stamps[last])
        return ack

    def _reserve(self, step: Query | Autocommit | Pipeline) -> Gen[list[Row]]:
        """Run a reserving statement; its refusals are raised as what they mean."""
        try:
            return (yield step)
        except StoreError as exc:
            yield from self._refused(exc)
            raise

    def _took(self, reservation: Reservation, ids: list[int]) -> None:
        """``ids`` are reserved (checked): the tracker holds them until `_complete`."""
        reservation.ids = ids
        self.tracker.reserved(reservation.token, ids)

    def _complete(self, token: ReservationToken, ids: Sequence[int]) -> None:
        if ids:
            self.tracker.complete(ids)
        else:
            self.tracker.abandon(token)

    def _wrote(self, count: int, last_stamp: int) -> None:
        """``count`` facts committed, the last at ``last_stamp``."""
        self._ts_floor = max(self._ts_floor, last_stamp)
        self.appended += count

    # ------------------------------------------------------------------ refusals

    def _refused(self, exc: StoreError) -> Gen[None]:
        """`_raise_refusal`, and for a reservation blocked by an exclusive lock, who holds it
        (read after the failed transaction, where the connection still serves), in the
        `ReservationBlocked` raised."""
        if exc.sqlstate == INVALID_TEXT and BLOCKED in str(exc):
            self.blocked = True
            try:
                holders = yield from exclusive_holders(self.info)
            except StoreError:  # a caller's transaction (`fact(conn=...)`) failed with it, or
                holders = []  # a pipeline's failure closed the connection

            who = "; ".join(h.who() for h in holders) or "a session not named here"
            raise ReservationBlocked(
                f"stream {self.stream_name!r}: another session holds its reservation lock "
                f"exclusively ({who}); no writer of this library ever does, and nothing can "
                "be reserved behind it: nothing was written. This writer's next heartbeat "
                "ends that session if this role may (a member of its role or of "
                "pg_signal_backend); `streams doctor` names it and `streams doctor --repair` "
                "ends it"
            ) from None
        self._raise_refusal(exc)

    def _raise_refusal(self, exc: StoreError) -> None:
        """Raise what a reservation statement's own refusal means (the text casts by which it
        fails its transaction, a stored ID); return for any other error."""
        if exc.sqlstate == INVALID_TEXT and REWOUND in str(exc):
            raise SequenceRewound(
                f"stream {self.stream_name!r}: the sequence was set back during the "
                "reservation; nothing was written. Open a new writer (it repairs the "
                "sequence) or run `streams doctor --repair`"
            ) from None
        if exc.sqlstate == INVALID_TEXT and FENCED in str(exc):
            self.fenced = True
            self._check_usable()
        if exc.sqlstate == UNIQUE_VIOLATION and "streams_idempotency" not in str(exc):
            raise SequenceRewound(
                f"stream {self.stream_name!r}: the sequence handed out an ID that "
                "is stored already: it was set back; nothing was written. Open a "
                "new writer (it repairs the sequence) or run `streams doctor --repair`"
            ) from None
