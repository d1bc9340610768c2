"""Facts written in the caller's own transaction (`Writer.fact`), and the transactions of
callers that a writer joined, whose IDs stay pending until they end (`resolve_joined`).

Why a joined transaction's IDs are safe to hold pending: docs/design/durability.md; the
timeline fence on a caller's session: docs/design/fencing.md.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.payloads import encode_payload
from ..core.positions import ReservationToken
from ..core.timestamps import validate_client_timestamp
from ..errors import FailoverLoss
from ..types import Ack
from .driver import Commit, CopyIn, Gen, Query
from .failover import FAILOVER_SKIP, check_sighting, fence_stream
from .idempotency import check_keys, held, read_originals
from .identity import TIMELINE_SQL
from .writer_state import WriterState

log = logging.getLogger("streams.writer")


@dataclass(slots=True)
class FactHandle:
    """A fact being written in the caller's own transaction (see `Writer.fact`).

    ``duplicate``: its idempotency key had been written already; ``stream_id`` and
    ``timestamp`` are then the original fact's, and nothing may be written. ``xid``: the
    caller's transaction (``txid_current()``), by which a writer learns when a transaction it
    joined has ended (`WriterCore.resolve_joined`).
    """

    stream_id: int
    timestamp: int
    rows: int = 0
    duplicate: bool = False
    xid: int = 0

    @property
    def ack(self) -> Ack:
        return Ack(
            self.stream_id,
            self.stream_id,
            self.timestamp,
            self.timestamp,
            1,
            (self.stream_id,),
            (0,) if self.duplicate else (),
        )


def begin_fact(
    core: WriterState, timestamp: int | None, key: str | None = None
) -> tuple[ReservationToken, int]:
    """Pure first half of `reserve_fact`: validate, resolve the timestamp, go in flight."""
    core._ready()
    validate_client_timestamp(timestamp)
    if key is not None:
        check_keys([key], 1)
    (stamp,) = core._stamps([timestamp])
    return core.tracker.begin_reservation(), stamp


def reserve_fact(
    core: WriterState,
    token: ReservationToken,
    stamp: int,
    key: str | None = None,
    *,
    fence: bool = False,
) -> Gen[FactHandle]:
    """Reserve one ID inside the caller's transaction (open, or begun by this statement).

    With ``key``: claim it first, then reserve and record the ID only if this transaction
    holds the claim (two statements: docs/design/claim.md);
    otherwise the handle is a duplicate carrying the original fact's ID and timestamp.

    ``fence``: the caller's session is new to this writer, and may be the first on a new
    timeline (a failover), before any session of the writer's own: fence the timeline
    first (`streams.store.failover.fence_stream`), in the caller's transaction, so no ID
    the old timeline may have handed out is handed out again here. Its ``setval`` took
    effect before the reservation's statement began, which therefore draws past it.
    """
    statements = core.statements
    if fence:
        yield from _fence_callers_session(core)
    params = core._lease_params(**core._tcp_settings(), count=1)
    if key is None:
        rows = yield from core._reserve(Query(statements.reserve_fact, params))
        if not rows:
            core._lost()
        (stream_id,) = core._check_floor(rows)
        core.tracker.reserved(token, [stream_id])
        return FactHandle(stream_id=stream_id, timestamp=stamp, xid=int(rows[0][2]))
    params.update(key=key, claim=secrets.randbits(63), ts=stamp, known=token.floor)
    rows = yield from core._reserve(Query(statements.reserve_fact_keyed, params))
    fact_id = held(rows)
    if fact_id is None:
        # In the claim's transaction, which locks the key's row: it is there (or raises).
        (original,) = yield from read_originals(core.info.id, [key], own_transaction=False)
        assert original is not None
        return FactHandle(original[0], original[1], duplicate=True)
    core.tracker.reserved(token, [fact_id])
    return FactHandle(fact_id, stamp, xid=int(rows[0][3]))


def _fence_callers_session(core: WriterState) -> Gen[None]:
    """On a caller's session new to this writer (`reserve_fact`'s ``fence``), in its
    transaction: fence the timeline, and on a timeline the writer's own sessions have not
    verified yet (a failover), check what the writer saw acknowledged first, so a loss is
    named (`FailoverLoss`, failing the caller's transaction) before anything is
    acknowledged there. The writer's own next session checks again: its timeline is left
    as it was."""
    moved = yield from fence_stream(core.info.id, commit=False)
    if moved:
        log.warning(
            "a new timeline (a failover), first seen on a caller's session: moved stream %r's "
            "sequence %d IDs forward (to %d)", core.info.name, FAILOVER_SKIP, moved,
        )  # fmt: skip
    rows = yield Query(f"SELECT {TIMELINE_SQL}")
    seen = core.sighting.timeline
    if seen is not None and int(rows[0][0]) != seen:
        try:
            yield from check_sighting(
                core.sighting, core._where(), "facts acknowledged to this writer", joined=True
            )
        except FailoverLoss:
            core._report_failover()
            raise


def add_rows(core: WriterState, handle: FactHandle, payloads: Sequence[Any]) -> Gen[None]:
    """Add rows of the fact to the built-in facts table (same transaction)."""
    encoded = [encode_payload(p, core.max_payload_bytes) for p in payloads]
    if not encoded:
        return
    first = handle.rows
    handle.rows += len(encoded)
    yield CopyIn(
        core.statements.copy_facts,
        [
            (core.info.id, handle.stream_id, first + n, core.instance, handle.timestamp, text)
            for n, text in enumerate(encoded)
        ],
    )


def finish_fact(
    core: WriterState, token: ReservationToken, handle: FactHandle | None, ok: bool
) -> None:
    """The caller's transaction ended (committed if `ok`), or can only roll back: complete
    the ID either way (a duplicate reserved none)."""
    written = handle is not None and not handle.duplicate
    core._complete(token, [handle.stream_id] if handle is not None and written else [])
    if ok and handle is not None and written:
        core._wrote(1, handle.timestamp)


def join_fact(core: WriterState, handle: FactHandle) -> None:
    """A fact written in a transaction of the caller's that this writer joined (and does
    not end): its ID stays pending until `resolve_joined` finds that transaction ended."""
    with core._joined_lock:
        core._joined.setdefault(handle.xid, []).append((handle.stream_id, handle.timestamp))


def resolve_joined(core: WriterState) -> Gen[list[tuple[int, int]]]:
    """Complete the IDs of joined transactions that have ended, committed or not (by
    ``txid_status``: the server's commit log, which keeps each outcome; NULL only for a
    transaction so old that it ended long ago); returns ``(ID, timestamp)`` of the facts
    that committed. A writer's per-writer position thus never passes an ID whose
    transaction is still open, though nobody tells it when a joined transaction ends."""
    with core._joined_lock:
        xids = list(core._joined)
    if not xids:
        return []
    rows = yield Query("SELECT x, txid_status(x) FROM unnest(%s::bigint[]) AS x", (xids,))
    yield Commit()
    committed: list[tuple[int, int]] = []
    for xid, status in rows:
        if status == "in progress":
            continue
        with core._joined_lock:
            facts = core._joined.pop(int(xid), [])
        core.tracker.complete([stream_id for stream_id, _ in facts])
        if status == "committed" and facts:
            committed += facts
            core._wrote(len(facts), max(ts for _, ts in facts))
    return committed
