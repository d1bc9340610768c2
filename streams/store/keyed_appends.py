"""Idempotent appends: one statement claims the keys and, for the keys it holds, reserves IDs
and records them; duplicates come back with the original facts (docs/design/claim.md).

What they share with plain appends (the checks, the timestamps, the refusals, completion) is
`streams.store.writer_state`; `WriterCore.append` runs `write_keyed` within it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from ..core.payloads import encode_payload
from ..errors import StoreError
from ..types import Ack
from .driver import Autocommit, Commit, CopyIn, Gen, Pipeline, Query
from .idempotency import ATTEMPTS, held, read_originals
from .writer_state import Reservation, WriterState


def write_keyed(
    core: WriterState, payloads: Sequence[Any], keys: Sequence[str], reservation: Reservation
) -> Gen[Ack]:
    """Write the facts of ``reservation`` with idempotency keys ``keys`` (checked)."""
    params = core._lease_params(known=reservation.token.floor)
    if reservation.single is None:
        return (yield from _write_batch(core, payloads, keys, reservation, params))
    stamp = reservation.stamps[0]
    params.update(key=keys[0], ts=stamp, payload=reservation.single)
    for _ in range(ATTEMPTS):
        params["claim"] = secrets.randbits(63)
        # The whole append when the key is new: one statement in autocommit.
        rows = yield from core._reserve(Autocommit(core.statements.reserve_one_keyed, params))
        stream_id = held(rows)
        if stream_id is not None:
            # Committed: it completes, whatever happens next.
            core._took(reservation, [stream_id])
            return Ack(stream_id, stream_id, stamp, stamp, 1, (stream_id,))
        # A duplicate: its original, read by a statement that sees it.
        (original,) = yield from read_originals(core.info.id, keys, own_transaction=True)
        if original is not None:
            return Ack.of([original[0]], [original[1]], [0])
        # Pruned between the two statements (it expired): claim it again.
    raise StoreError(
        f"idempotency key {keys[0][:40]!r}: its original was pruned "
        f"{ATTEMPTS} times between claim and read: report this"
    )


def _write_batch(
    core: WriterState,
    payloads: Sequence[Any],
    keys: Sequence[str],
    reservation: Reservation,
    params: dict[str, Any],
) -> Gen[Ack]:
    """A keyed batch: ``BEGIN`` and the claiming statement in one round trip, the originals
    of its duplicates if any, ``COPY`` of the rows of the keys it holds, ``COMMIT``."""
    info, limit, stamps = core.info, core.max_payload_bytes, reservation.stamps
    params.update(keys=keys, stamps=stamps, count=len(payloads), claim=secrets.randbits(63))
    # A generic plan is as good as a custom one here: the statement looks nothing up (the
    # claim finds conflicts through the primary key itself), so it may be prepared.
    ((row,),) = yield from core._reserve(
        Pipeline([Query(core.statements.reserve_many_keyed, params)])
    )
    count, ords, reserved, floor, recorded = row
    if count and (reserved is None or recorded != 1):
        if reserved is None:  # held keys, reserved nothing: fenced (rolled back)
            core._lost()
        raise StoreError("an idempotency claim recorded no fact: report this")
    ids: list[int] = []
    if count:
        ids = core._check_floor([(stream_id, floor) for stream_id in reserved])
        core._took(reservation, ids)
    copy_facts = core.statements.copy_facts
    if count == len(payloads):  # every key held (``ords`` is NULL): no duplicate
        yield CopyIn(
            copy_facts,
            zip(
                repeat(info.id),
                ids,
                repeat(0),
                repeat(core.instance),
                stamps,
                (encode_payload(p, limit) for p in payloads),
            ),
        )
        yield Commit()
        return Ack(ids[0], ids[-1], stamps[0], stamps[-1], len(ids), tuple(ids))
    fact_ids: list[int | None] = [None] * len(payloads)
    fact_stamps = list(stamps)
    for pos, stream_id in zip(ords or (), ids, strict=True):
        fact_ids[pos - 1] = stream_id
    duplicates = [n for n, stream_id in enumerate(fact_ids) if stream_id is None]
    if duplicates:
        originals = yield from read_originals(
            info.id, [keys[n] for n in duplicates], own_transaction=False
        )
        for n, original in zip(duplicates, originals, strict=True):
            assert original is not None  # read_originals raises otherwise
            fact_ids[n], fact_stamps[n] = original
    if count:
        yield CopyIn(
            copy_facts,
            (
                (info.id, stream_id, 0, core.instance, stamps[n - 1], encode_payload(p, limit))
                for n, stream_id in zip(ords, ids, strict=True)
                for p in (payloads[n - 1],)
            ),
        )
    yield Commit()
    final = [stream_id for stream_id in fact_ids if stream_id is not None]
    return Ack.of(final, fact_stamps, duplicates)
