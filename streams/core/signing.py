"""Signed ranges: facts a reader may take from Redis without asking PostgreSQL. Pure: no I/O.

Terms. A *range* of a stream is ``(after, through]``: every fact with ``after < ID <=
through``. A *proven range* is one whose every ID has completed (committed or rolled back) as
PostgreSQL proved it (`streams.store.probe`), read whole by the prober in the snapshot that
followed its probe. A *signed range* is the line the elected prober publishes for it on the
stream's data channel::

    RDATA <stream> _proof:<prober> <through> {"mac":"<hex>","proof":{"key":K,"after":A,"rows":R}}

``R`` is every row of the range as PostgreSQL returned it, ``[stream_id, row_no, instance,
ts, payload_text]`` in (ID, row) order, ``payload_text`` the ``jsonb`` column's text (decoded
by the reader exactly as a row read from PostgreSQL). ``mac`` is HMAC-SHA256, under key ``K`` of
``streams_keys`` (a table only database users can read), of `signed_message`: the format tag,
the stream, the instance, the token and the ``proof`` object serialized by orjson (which both
sides compute from the same parsed values: strings and integers round-trip exactly).

The trust argument
==================

Claim: whatever a party with access to Redis alone publishes, a reader delivers only facts of
its streams that PostgreSQL proved committed, each whole, each once, in ID order, and no fact
is skipped. Such a party can make a reader slower, nothing more.

1. *Only the prober can sign.* Producing a valid ``mac`` for a new message needs the key;
   HMAC-SHA256 is unforgeable without it. The keys are in PostgreSQL, not in Redis, so a
   Redis-only party can only forge (rejected), alter a signed line (rejected: the stream, the
   instance, the token and every byte of every row are signed), or *replay* a line a prober
   signed.
2. *Every signed line is true for ever.* The prober signs ``(after, through]`` only with the
   rows it read after proving ``through`` complete (the store's proof: the same probe that
   readers run themselves, `streams.store.probe`), and only if retention had removed none of
   them (checked after the read, as every read does), so the rows are exactly the facts of the
   range. Facts are immutable and IDs never reused, so a replayed line, however old, still
   says the truth about its range. The stream, instance and token are signed, so a line
   cannot be moved to another stream or another range.
3. *A reader applies a range only where it fits.* A reader at position ``p`` (every fact ``<=
   p`` delivered, none after) applies a verified range only if ``after <= p < through``, and
   then delivers exactly the facts with ``p < ID <= through``, whole (a fact's rows share its
   ID, and the range holds all of them), then moves to ``through``. Nothing below ``p`` is
   delivered again; nothing in ``(p, through]`` is missing, by 2. A range that does not fit
   (a gap: lines dropped, truncated, reordered, or never sent) is not applied; the reader reads
   PostgreSQL as it did before signed ranges, which is correct on its own.
4. *Retired keys.* ``streams keys rotate`` adds a key and retires the others. Readers drop
   retired keys when they next read the key table (at most `KEY_REFRESH` seconds later, and
   whenever a line names a key they do not know); from then on lines signed with a retired key
   are rejected like forgeries. So rotating after a key leaked bounds how long the leaked key
   is accepted. (Per 2, a line genuinely signed with a retired key is still true; retirement
   matters only if the key leaked.)
5. *Proofs beyond the truth.* A Redis-only party cannot sign a claim that a range is complete
   (1.), and unsigned ``POSITION`` lines, forged or not, are only hints: a reader that follows
   one reads PostgreSQL, which proves completeness itself.

What is *not* covered: a database restored to an earlier state re-issues IDs; lines signed
before the restore describe facts the restored database no longer has. Rotate the keys after a
restore (``streams keys rotate``), which makes every earlier line unverifiable.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from .epochs import Row
from .payloads import signed_text

__all__ = [
    "KEY_REFRESH",
    "MAX_SIGNED_BYTES",
    "MAX_SIGNED_ROWS",
    "Rejected",
    "SignedRange",
    "sign_range",
    "signed_message",
    "split_for_signing",
    "verify_range",
]

#: Seconds between two reads of the key table by a reader or prover (retirement takes effect
#: within this long).
KEY_REFRESH: Final = 30.0
#: Most rows the prober puts in one signed line; a longer range is signed in part (the rest is
#: read from PostgreSQL by the readers that need it).
MAX_SIGNED_ROWS: Final = 2000
#: Most bytes of payload text in one signed line (lines stay well below the protocol's 1 MiB).
MAX_SIGNED_BYTES: Final = 256 * 1024

_FORMAT: Final = b"streams-signed-range-v1"

Rejected = Literal["malformed", "unknown-key", "bad-mac", "inconsistent"]


@dataclass(frozen=True, slots=True)
class SignedRange:
    """A verified range ``(after, through]`` of ``stream`` and every row in it."""

    stream: str
    after: int
    through: int
    rows: tuple[Row, ...]
    key: int


def signed_message(stream: str, instance: str, token: int, proof: Any) -> bytes:
    """The bytes a range's MAC covers."""
    head = b"%s %s %s %d " % (_FORMAT, stream.encode(), instance.encode(), token)
    return head + signed_text(proof)


def sign_range(
    stream: str,
    instance: str,
    after: int,
    through: int,
    rows: Sequence[Row],
    key_id: int,
    secret: bytes,
) -> dict[str, Any]:
    """The row JSON of the signed line for ``(after, through]`` (``rows``: all of its rows)."""
    proof = {"key": key_id, "after": after, "rows": [list(r) for r in rows]}
    mac = hmac.digest(secret, signed_message(stream, instance, through, proof), hashlib.sha256)
    return {"mac": mac.hex(), "proof": proof}


def split_for_signing(
    rows: Sequence[Row], after: int, through: int, page_full: bool
) -> tuple[int, int]:
    """How much of ``(after, through]`` one line may carry: ``(end, count)``, the line covers
    ``(after, end]`` with the first ``count`` rows (``end == after``: nothing to sign).

    ``rows`` are the first rows of the range in (ID, row) order; ``page_full``: there may be
    more (the read hit its limit). A line never cuts a fact: it ends with the last fact that
    fits whole within `MAX_SIGNED_ROWS` and `MAX_SIGNED_BYTES` (and the page).
    """
    size = 0
    end, count = after, 0  # the last cut between two facts so far
    for index, row in enumerate(rows):
        if index and row[0] != rows[index - 1][0]:
            end, count = int(rows[index - 1][0]), index
        payload = row[4]
        size += 64 + (len(payload) if isinstance(payload, str) else 8)
        if index + 1 > MAX_SIGNED_ROWS or size > MAX_SIGNED_BYTES:
            return end, count
    if page_full:
        return end, count  # the page's last fact may go on beyond it
    return through, len(rows)


def verify_range(
    stream: str, instance: str, token: int, row: Any, keys: Mapping[int, bytes]
) -> SignedRange | Rejected:
    """Check a signed line's row JSON; the range, or why it is rejected (see the module doc).

    The MAC is checked first, so nothing of an unsigned line is trusted; the checks after it
    guard against a prober of another version, never against Redis.
    """
    if not isinstance(row, dict) or set(row) != {"mac", "proof"}:
        return "malformed"
    mac, proof = row["mac"], row["proof"]
    if not isinstance(mac, str) or len(mac) != 64 or not isinstance(proof, dict):
        return "malformed"
    key = proof.get("key")
    if not isinstance(key, int) or isinstance(key, bool):
        return "malformed"
    secret = keys.get(key)
    if secret is None:
        return "unknown-key"
    try:
        expected = hmac.digest(
            secret, signed_message(stream, instance, token, proof), hashlib.sha256
        )
        given = bytes.fromhex(mac)
    except (ValueError, TypeError, orjson.JSONEncodeError):
        return "malformed"
    if not hmac.compare_digest(expected, given):
        return "bad-mac"
    after, rows = proof.get("after"), proof.get("rows")
    if not isinstance(after, int) or not isinstance(rows, list) or not 0 <= after < token:
        return "inconsistent"
    checked: list[Row] = []
    last = (after, 2**31)  # rows ascend by (ID, row number), all in (after, token]
    for r in rows:
        if not (isinstance(r, list) and len(r) == 5):
            return "inconsistent"
        stream_id, row_no, writer, ts, payload = r
        if not (
            isinstance(stream_id, int)
            and isinstance(row_no, int)
            and isinstance(writer, str)
            and isinstance(ts, int)
            and (payload is None or isinstance(payload, str))
        ):
            return "inconsistent"
        here = (stream_id, row_no)
        if here <= last or stream_id > token:
            return "inconsistent"
        last = here
        checked.append((stream_id, row_no, writer, ts, payload))
    return SignedRange(stream, after, token, tuple(checked), key)
