"""Replication keys (revision ``0007_replication_keys``): what signs the ranges of facts
readers take from Redis (`streams.core.signing`, where the trust argument is).

A key that is not retired is *live*: readers accept lines signed with any live key, the prober
signs with the newest one. `rotate_keys` adds a key and retires every other one in one
transaction; the secret comes from the operating system's CSPRNG (Python's `secrets`), never
from PostgreSQL's ``random()``. Secrets never leave this module except to the signing code.
"""

from __future__ import annotations

import secrets

from .driver import Commit, Gen, Query

__all__ = ["describe_keys", "live_keys", "newest", "rotate_keys"]


def live_keys() -> Gen[dict[int, bytes]]:
    """Every live key, by id."""
    rows = yield Query("SELECT id, secret FROM streams_keys WHERE retired_at IS NULL")
    yield Commit()
    return {int(key): bytes(secret) for key, secret in rows}


def describe_keys() -> Gen[list[dict[str, object]]]:
    """Every key, newest first, without its secret: id, created and retired (or None)."""
    rows = yield Query("SELECT id, created_at, retired_at FROM streams_keys ORDER BY id DESC")
    yield Commit()
    return [
        {"id": int(key), "created_at": created, "retired_at": retired, "live": retired is None}
        for key, created, retired in rows
    ]


def rotate_keys() -> Gen[int]:
    """Add a key and retire all others; returns the new key's id."""
    rows = yield Query(
        "WITH new AS (INSERT INTO streams_keys (secret) VALUES (%s) RETURNING id) "
        "UPDATE streams_keys SET retired_at = now() "
        "WHERE retired_at IS NULL AND id <> (SELECT id FROM new) "
        "RETURNING (SELECT id FROM new)",
        (secrets.token_bytes(32),),
    )
    if not rows:  # nothing was live to retire: read the new key's id
        rows = yield Query("SELECT max(id) FROM streams_keys WHERE retired_at IS NULL")
    yield Commit()
    return int(rows[0][0])


def newest(keys: dict[int, bytes]) -> tuple[int, bytes] | None:
    """The key a prover signs with: the newest live one (None: no live key, sign nothing)."""
    if not keys:
        return None
    key = max(keys)
    return key, keys[key]
