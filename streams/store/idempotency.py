"""Idempotency keys: an append named by a key is written once per stream and key window.

A keyed append claims its keys, reserves its IDs and records them in one statement
(`claim_ctes`, `GATE`, `record_cte`, assembled by `streams.store.writer_sql`); a duplicate
writes nothing and returns the original `Ack` (`ORIGINALS`); `prune_keys` deletes expired
keys. Tables ``streams_idempotency_keys`` and ``streams_idempotency_claims`` (revisions 0010,
0014).

The argument: docs/design/claim.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import StoreError, UsageError
from ..types import StreamInfo
from .driver import Autocommit, Commit, Gen, Query, Row

__all__ = [
    "ATTEMPTS",
    "FACT_ID",
    "FENCED",
    "GATE",
    "MAX_KEY_LENGTH",
    "ORIGINALS",
    "SINGLE_RESULT",
    "check_keys",
    "claim_ctes",
    "held",
    "prune_keys",
    "read_originals",
    "record_cte",
]

#: The longest key accepted, in characters.
MAX_KEY_LENGTH = 512

#: Marker of the text cast by which an appending statement fails when it holds a key's claim
#: but its writer was fenced (nothing reserved, nothing recorded): the key must not commit
#: without its fact.
FENCED = "streams-writer-fenced"

#: How many times one keyed fact starts over when the originals it found written were pruned
#: before it could read them (step 4 of docs/design/claim.md): each start over needs a prune
#: between two statements of it.
ATTEMPTS = 3


def _expired(stream: str, column: str, now: str) -> str:
    """Time ``column`` (a key's or claim's ``written_at``) is older than the key window of
    stream ``stream`` at ``now`` (an SQL expression): the key expired."""
    return f"""{column} < {now} - make_interval(secs => (
        SELECT r.key_window_ms / 1000.0 FROM streams_registry r WHERE r.id = {stream}))"""


def check_keys(keys: Sequence[object], count: int) -> list[str]:
    """The keys of an append of ``count`` payloads: one per payload, non-empty strings of at
    most `MAX_KEY_LENGTH` characters without NUL, distinct within the append; `UsageError`
    otherwise (nothing is written)."""
    if isinstance(keys, str | bytes):
        raise UsageError("keys is a list with one key per payload (not a single string)")
    found = list(keys)
    if len(found) != count:
        raise UsageError(f"keys must have one entry per payload: {len(found)} for {count}")
    for key in found:
        if not isinstance(key, str) or not key:
            raise UsageError(f"an idempotency key is a non-empty string, not {key!r}")
        if len(key) > MAX_KEY_LENGTH or "\x00" in key:
            raise UsageError(
                f"an idempotency key has at most {MAX_KEY_LENGTH} characters and no NUL "
                f"character: {key[:40]!r}..."
            )
    if len(set(found)) != len(found):
        raise UsageError("the keys of one append must be distinct")
    return found  # type: ignore[return-value]


def claim_ctes(many: bool) -> str:
    """Steps 1 and 2 of docs/design/claim.md, as the leading CTEs of an appending statement:
    ``q`` claims key ``%(key)s`` with timestamp ``%(ts)s`` (or every key of ``%(keys)s``, with
    ``%(stamps)s``, in key order) for token ``%(claim)s`` on stream ``%(stream)s``; ``n`` is
    one row: ``count`` (keys held), ``ords`` (their positions, ascending) and ``at`` (their
    ``written_at``). Ends with a comma."""
    if many:
        # One written_at for every key (a CTE is computed once): the claim's row has it too.
        rows = """
            SELECT %(stream)s, p.key, %(claim)s, t.at, p.ts, p.ord
            FROM t, unnest(%(keys)b::text[], %(stamps)b::bigint[])
                    WITH ORDINALITY AS p(key, ts, ord)
            ORDER BY p.key COLLATE "C"
            """
        head = "t AS (SELECT clock_timestamp() AS at),"
    else:
        rows = "VALUES (%(stream)s, %(key)s, %(claim)s, clock_timestamp(), %(ts)s, 1)"
        head = ""
    return f"""{head} q AS (
        INSERT INTO streams_idempotency_keys AS k (stream, key, claim, written_at, ts, ord)
        {rows}
        ON CONFLICT (stream, key) DO UPDATE
        SET claim = EXCLUDED.claim, written_at = EXCLUDED.written_at, ts = EXCLUDED.ts,
            ord = EXCLUDED.ord
        WHERE {_expired("k.stream", "k.written_at", "clock_timestamp()")}
        RETURNING k.ord, k.written_at, k.key
    ), n AS (
        SELECT count(*) AS count, array_agg(q.ord ORDER BY q.ord) AS ords,
               array_agg(q.key) AS keys, min(q.written_at) AS at
        FROM q
    ),"""


#: Step 2: the further condition of the lease check (``w``) of a keyed append.
GATE = "AND (SELECT n.count FROM n) > 0"


def record_cte(ids: str, source: str, ords: str = "NULL", where: str = "") -> str:
    """Step 3: ``x``, the claim's row, with IDs ``ids`` (an SQL array, ascending) and
    positions ``ords`` computed from ``source`` (rows derived from the reservation); returns
    its ``ids``."""
    return f"""x AS (
        INSERT INTO streams_idempotency_claims (stream, written_at, claim, ords, ids, keys)
        SELECT %(stream)s, n.at, %(claim)s, {ords}, {ids}, n.keys FROM n, {source} {where}
        RETURNING ids
    )"""


#: The one row of a one-fact statement (after `record_cte`): keys held (0 or 1), the fact's
#: ID (NULL for a duplicate) and L (the reservation floor); the cast fails the statement where
#: it holds the key but recorded no ID (`FENCED`).
SINGLE_RESULT = f"""
SELECT n.count,
       CASE WHEN n.count = 0 THEN NULL
            WHEN x.ids IS NOT NULL THEN x.ids[1]
            ELSE ('{FENCED} ' || n.count)::bigint END,
       (SELECT g.floor FROM g){{extra}}
FROM n LEFT JOIN x ON true
"""

#: The fact of a key's row ``k`` in its claim's row ``c``.
FACT_ID = "c.ids[CASE WHEN c.ords IS NULL THEN k.ord ELSE array_position(c.ords, k.ord) END]"

#: Step 4: the originals of keys ``%(keys)s`` on stream ``%(stream)s``: (position in
#: ``keys`` from 1, ID, timestamp) for each key written. One primary-key probe per key (a
#: LATERAL subquery with LIMIT is never turned into a join that scans the stream's keys).
ORIGINALS = f"""
SELECT p.pos, {FACT_ID}, k.ts
FROM unnest(%(keys)b::text[]) WITH ORDINALITY AS p(key, pos)
CROSS JOIN LATERAL (
    SELECT k.written_at, k.claim, k.ord, k.ts FROM streams_idempotency_keys k
    WHERE k.stream = %(stream)s AND k.key = p.key LIMIT 1
) k
JOIN streams_idempotency_claims c
  ON c.stream = %(stream)s AND c.written_at = k.written_at AND c.claim = k.claim
"""


def held(rows: Sequence[Row]) -> int | None:
    """The ID of a one-fact statement's fact (`SINGLE_RESULT`), or None: a duplicate."""
    if not rows:
        raise StoreError("a keyed append's statement returned nothing: report this")
    return None if not rows[0][0] else int(rows[0][1])


def read_originals(
    stream: int, keys: Sequence[str], *, own_transaction: bool
) -> Gen[list[tuple[int, int] | None]]:
    """Step 4: the (ID, timestamp) of each key's original, None where its row is gone (pruned
    since the claim: only possible with ``own_transaction``, a statement of its own after the
    claim's transaction; otherwise it is an error). In the claim's transaction when not
    ``own_transaction``."""
    params = {"stream": stream, "keys": list(keys)}
    if own_transaction:
        rows = yield Autocommit(ORIGINALS, params)
    else:
        rows = yield Query(ORIGINALS, params, prepare=False)
    found: list[tuple[int, int] | None] = [None] * len(keys)
    for pos, stream_id, ts in rows:
        if stream_id is None or ts is None:
            raise StoreError("an idempotency key's claim had no fact: report this")
        found[int(pos) - 1] = (int(stream_id), int(ts))
    if not own_transaction and None in found:
        raise StoreError("a claimed idempotency key's row was missing: report this")
    return found


#: `prune_keys`, one step: the stream's expired claims after the cursor (``%(at)s``,
#: ``%(claim)s``) in (``written_at``, ``claim``) order, one primary-key probe each (a recursive
#: walk: it reads no claim beyond the step), until they list ``%(batch)s`` keys or more; the
#: rows of those keys that still refer to their claim are locked (skipping any locked already:
#: a claim in progress) and deleted. Back: key rows deleted, claims walked, the last claim
#: walked (``written_at``, ``claim``) and the keys listed up to it (fewer than ``%(batch)s``:
#: the walk ran out of claims).
_PRUNE_KEYS = f"""
WITH RECURSIVE walk (written_at, claim, keys, total) AS (
    (SELECT c.written_at, c.claim, c.keys, cardinality(c.keys)
     FROM streams_idempotency_claims c
     WHERE c.stream = %(stream)s AND {_expired("%(stream)s", "c.written_at", "now()")}
       AND (c.written_at, c.claim) > (%(at)s::timestamptz, %(claim)s::bigint)
     ORDER BY c.written_at, c.claim LIMIT 1)
    UNION ALL
    (SELECT c.written_at, c.claim, c.keys, walk.total + cardinality(c.keys)
     FROM walk CROSS JOIN LATERAL (
         SELECT c.written_at, c.claim, c.keys FROM streams_idempotency_claims c
         WHERE c.stream = %(stream)s AND {_expired("%(stream)s", "c.written_at", "now()")}
           AND (c.written_at, c.claim) > (walk.written_at, walk.claim)
         ORDER BY c.written_at, c.claim LIMIT 1
     ) c
     WHERE walk.total < %(batch)s)
), old AS (
    SELECT k.ctid
    FROM walk CROSS JOIN LATERAL unnest(walk.keys) AS u(key)
    CROSS JOIN LATERAL (
        SELECT k.ctid FROM streams_idempotency_keys k
        WHERE k.stream = %(stream)s AND k.key = u.key
          AND k.written_at = walk.written_at AND k.claim = walk.claim
        FOR UPDATE SKIP LOCKED
    ) k
), d AS (
    DELETE FROM streams_idempotency_keys k USING old WHERE k.ctid = old.ctid RETURNING 1
)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM walk), last.written_at, last.claim,
       last.total
FROM (SELECT 1) one LEFT JOIN LATERAL (
    SELECT walk.written_at, walk.claim, walk.total FROM walk
    ORDER BY walk.written_at DESC, walk.claim DESC LIMIT 1
) last ON true
"""

#: `prune_keys`, after `_PRUNE_KEYS` in the same transaction: the claims it walked (after
#: ``%(at)s``, ``%(claim)s`` up to ``%(end_at)s``, ``%(end_claim)s``) to which none of the key
#: rows they list refers any more.
_PRUNE_CLAIMS = f"""
WITH old AS (
    SELECT c.ctid FROM streams_idempotency_claims c
    WHERE c.stream = %(stream)s
      AND {_expired("%(stream)s", "c.written_at", "now()")}
      AND (c.written_at, c.claim) > (%(at)s::timestamptz, %(claim)s::bigint)
      AND (c.written_at, c.claim) <= (%(end_at)s::timestamptz, %(end_claim)s::bigint)
      AND NOT EXISTS (
          SELECT FROM unnest(c.keys) AS u(key)
          JOIN streams_idempotency_keys k
            ON k.stream = c.stream AND k.key = u.key AND k.written_at = c.written_at
           AND k.claim = c.claim)
    FOR UPDATE SKIP LOCKED
)
DELETE FROM streams_idempotency_claims c USING old WHERE c.ctid = old.ctid
"""


def prune_keys(info: StreamInfo, batch: int = 10_000) -> Gen[int]:
    """Delete the stream's key rows older than its key window, and then the claim rows to
    which no key row refers any more; returns how many key rows.

    It walks the stream's expired claims (older than the window: so are the keys they wrote,
    as each key row shares its claim's ``written_at``) in (``written_at``, ``claim``) order,
    whole claims listing about ``batch`` keys a step, each step its own short transaction: the
    rows of those keys that still refer to their claim go (``FOR UPDATE SKIP LOCKED``: never a
    locked one, which a claim in progress holds), and then, in the same transaction, the claims
    walked that no key row refers to any more (a row skipped keeps its claim for a later
    prune). Safe at any time: a key older than the window is written anew whether or not its
    row is still there (the claim's ``DO UPDATE``), and a key row only ever refers to the claim
    that wrote it, which lists it (see the module doc)."""
    # Before every claim: tokens are >= 0.
    at: object = "-infinity"
    claim: object = -1
    deleted = 0
    while True:
        params: dict[str, Any] = {"stream": info.id, "batch": batch, "at": at, "claim": claim}
        rows = yield Query(_PRUNE_KEYS, params)
        count, walked, end_at, end_claim, listed = rows[0]
        deleted += int(count)
        if walked:
            params.update(end_at=end_at, end_claim=end_claim)
            yield Query(_PRUNE_CLAIMS, params)
        yield Commit()
        if not walked or listed < batch:  # no claim left to walk
            return deleted
        at, claim = end_at, end_claim
