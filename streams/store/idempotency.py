"""Idempotency keys: an append named by a key is written once per stream and key window.

Terms. An append's **key** (a string the caller chooses: a request ID, an order number) names
it within its stream for the stream's **key window** (``key_window_ms``, default 24 hours). An
append whose key was written within the window is a **duplicate**: it writes nothing and
returns the original append's `Ack` (same IDs and timestamps), whichever process wrote it and
whether or not that process saw its own outcome. Each key's row in ``streams_idempotency_keys``
(revision 0009) holds the fact its append wrote (``stream_id``, ``ts``), the time it was written,
and ``claim``, a random token of the transaction that wrote it.

How a key is written once (the claim argument)
----------------------------------------------
A keyed append is one transaction whose statements run in this order (the argument rests only
on the order of *statements* in one transaction, never on the order in which PostgreSQL
evaluates the parts of one statement):

1. **the claim** (`claim_sql`): ``INSERT`` the key's row with this transaction's token, ``ON
   CONFLICT DO UPDATE`` only where the existing row is older than the window (its key expired:
   the append is written anew). The primary key ``(stream, key)`` makes this statement wait for
   any other open transaction that inserted the same key, then insert (that transaction rolled
   back) or conflict (it committed). So when the claim statement ends, exactly one of these
   holds: this transaction's row carries its token (it *holds the claim*), or the row that
   committed before, younger than the window, carries another token; and no other transaction
   can hold the key's claim until this one ends. Either way the row is locked until this
   transaction ends (inserted or updated by it; on a conflict, ``DO UPDATE`` locks the row even
   where its ``WHERE`` is false), so nothing deletes it meanwhile (`prune_keys` skips it).
2. **the reservation** (`streams.store.writing`): one statement that reads the key's row and
   reserves an ID, writes the fact and records it in the row *only if the row carries this
   transaction's token*; otherwise it reserves nothing and returns the row's fact, the original
   append's. This statement starts after the claim ended, so its snapshot (READ COMMITTED: one
   per statement) sees this transaction's own row, or the other's *committed* row with its fact
   recorded. The gate is a data dependency: the writer's lease check scans the key's row and
   passes only where its token is ours, and no ``nextval`` is evaluated without a row from it;
   even if one were, the ID would complete as a gap (nothing is written under it).
3. ``COMMIT`` (for one fact, the implicit commit at the pipeline's sync).

Hence: two transactions racing with one key write one fact (the second waits in its claim,
then returns the first's `Ack`), and if the first rolls back (a failure, a kill), the second's
claim succeeds and it writes the fact. The waiting happens in the claim, *before* any ID is
reserved: a duplicate holds no reserved ID and no reservation lock, so it never leaves a pending
ID and never holds the linear position back (it waits at most as long as the first transaction
stays open, which the lease bounds: "the liveness argument" in `streams.store.writers`). A row
committed without its fact is impossible: where this transaction holds the claim but reserved
nothing (its writer was fenced), the reservation statement fails (`FENCED`), and the
transaction with it. Its fact and its key commit together, or neither does; so a caller that
got `streams.CommitUnknown` and retries with the same key gets the original `Ack` if the first
attempt committed, and writes the fact (once) if it did not.

The single-fact append sends the claim and the reservation in one pipeline, in autocommit:
up to the pipeline's sync they are one implicit transaction (`streams.store.driver.Pipeline`),
which commits there, or rolls back whole: one round trip, like an append without a key. A
batch claims all its keys in one statement (in key order, so two batches with common keys
wait for each other rather than deadlock), reserves one ID per key it holds, copies those
payloads' rows and commits. A fact
written in the caller's transaction (``writer.fact(conn, key=...)``) claims and reserves in the
caller's transaction, so the claim, the fact and the caller's own rows commit together.

What a key does not check: the payload. A duplicate returns the original `Ack` even when its
payload differs (as Kafka's idempotent producer and S2's ``match_seq_num`` do); the key, not the
content, names the append.

Expiry: a key older than the stream's window is written anew (the claim's ``DO UPDATE``), and
`prune_keys` deletes such rows (``streams prune``, with the facts' retention): the window is the
one in force when the claim or the prune runs, read from ``streams_registry``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import StoreError, UsageError
from .driver import Commit, Gen, Query, Row
from .registry import StreamInfo

__all__ = [
    "FENCED",
    "MAX_KEY_LENGTH",
    "KeyedFact",
    "check_keys",
    "claim_sql",
    "keyed_fact",
    "prune_keys",
]

#: The longest key accepted, in characters.
MAX_KEY_LENGTH = 512

#: Marker of the text cast by which a reservation statement fails its transaction when this
#: transaction holds a key's claim but its writer was fenced (nothing reserved, nothing to
#: record): the claim must not commit without its fact.
FENCED = "streams-writer-fenced"


def _expired(stream: str, now: str) -> str:
    """The existing row (``k``) of a key is older than the key window of stream ``stream``
    (an SQL expression) at ``now``: the key expired."""
    return f"""k.written_at < {now} - make_interval(secs => (
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


def claim_sql(many: bool) -> str:
    """Statement 1 of a keyed append (see "the claim argument"): claim ``%(key)s`` (or every
    key of ``%(keys)s``, in key order) for token ``%(claim)s`` on stream ``%(stream)s``."""
    rows = (
        "SELECT %(stream)s, key, %(claim)s FROM unnest(%(keys)s::text[]) AS key ORDER BY key"
        if many
        else "VALUES (%(stream)s, %(key)s, %(claim)s)"
    )
    return f"""
        INSERT INTO streams_idempotency_keys AS k (stream, key, claim)
        {rows}
        ON CONFLICT (stream, key) DO UPDATE
        SET claim = EXCLUDED.claim, written_at = clock_timestamp(), stream_id = NULL, ts = NULL
        WHERE {_expired("k.stream", "clock_timestamp()")}
        """


#: The key's row as the reservation statement reads it (``c``): its fact, and whether this
#: transaction holds its claim.
KEY_ROW_CTE = """c AS (
    SELECT k.stream_id, k.ts, k.claim = %(claim)s AS mine
    FROM streams_idempotency_keys k WHERE k.stream = %(stream)s AND k.key = %(key)s
)"""

#: Record the reserved ID (``{id}``, from the CTE ``{source}`` of the reservation) in the
#: key's row.
RECORD_CTE = """u AS (
    UPDATE streams_idempotency_keys k SET stream_id = {id}, ts = %(ts)s FROM {source}
    WHERE k.stream = %(stream)s AND k.key = %(key)s AND k.claim = %(claim)s
    RETURNING k.stream_id
)"""

#: The reservation's one row: whether this transaction wrote the fact, its ID and timestamp
#: (or the original's), L; and the failure that keeps a claim without a fact from committing.
RESULT_SELECT = f"""
SELECT c.mine,
       CASE WHEN NOT c.mine THEN c.stream_id
            WHEN u.stream_id IS NOT NULL THEN u.stream_id
            ELSE ('{FENCED} ' || c.mine)::bigint END,
       CASE WHEN c.mine THEN %(ts)s ELSE c.ts END,
       (SELECT g.floor FROM g){{extra}}
FROM c LEFT JOIN u ON true
"""


@dataclass(frozen=True, slots=True)
class KeyedFact:
    """What the reservation statement of a keyed append found: ``written`` (this transaction
    holds the claim and wrote the fact) or not (a duplicate), and the fact's ID and timestamp
    (the original's for a duplicate)."""

    written: bool
    stream_id: int
    timestamp: int


def keyed_fact(rows: Sequence[Row]) -> KeyedFact:
    """The reservation statement's row (see `RESULT_SELECT`)."""
    # The claim locked the key's row (inserted or updated it, or, on a conflict, locked it:
    # ON CONFLICT DO UPDATE locks the row even where its WHERE is false), so nothing deleted it
    # before the reservation; and a row commits with its fact or not at all.
    if not rows or rows[0][1] is None or rows[0][2] is None:
        raise StoreError("an idempotency key's row was missing or had no fact: report this")
    mine, stream_id, ts = rows[0][0], rows[0][1], rows[0][2]
    return KeyedFact(bool(mine), int(stream_id), int(ts))


def prune_keys(info: StreamInfo, batch: int = 10_000) -> Gen[int]:
    """Delete the stream's key rows older than its key window, ``batch`` at a time (each its
    own short transaction); returns how many. Safe at any time: a key older than the window
    is written anew whether or not its row is still there (the claim's ``DO UPDATE``), and a
    claim in progress holds its row locked, which the ``DELETE`` skips."""
    deleted = 0
    while True:
        rows = yield Query(
            f"""
            WITH old AS (
                SELECT k.ctid FROM streams_idempotency_keys k
                WHERE k.stream = %(stream)s AND {_expired("%(stream)s", "now()")}
                ORDER BY k.written_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED
            ), d AS (
                DELETE FROM streams_idempotency_keys k USING old WHERE k.ctid = old.ctid
                RETURNING 1
            )
            SELECT count(*) FROM d
            """,
            {"stream": info.id, "batch": batch},
        )
        yield Commit()
        count = int(rows[0][0])
        deleted += count
        if count < batch:
            return deleted
