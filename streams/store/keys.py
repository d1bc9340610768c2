"""Replication keys (revisions ``0007_replication_keys``, ``0012_prover_keys``): what signs and
seals the ranges of facts readers take from Redis (`streams.core.signing`, where the trust
argument is).

Terms. A *key* is a row of ``streams_keys`` (``id``, ``public_key``, ``cipher_key``,
``incarnation``: the database incarnation it was made in) and the row of
``streams_prover.signing_keys`` with its private seed. A key that is not retired is *live*:
readers accept lines signed with any live key of their own incarnation (`live_keys`), the
prover signs with the newest one (`signing_key`), which only a role that may read the prover
schema gets (`may_sign`).

Secrets are made by the server. `rotate_keys` creates a key in one transaction: the seed and
the cipher key come from ``gen_random_uuid()`` (PostgreSQL's ``pg_strong_random``) inside the
``INSERT``; the seed is read back, the public key computed here and written as hex text (no
statement or parameter ever carries a secret, so no ``log_statement`` setting logs one), and
every other key retired. Rotations take a lock (`KEY_ROTATION_LOCK`), so that the provers of
several streams that find a new incarnation at once (`renew_keys`) make one key, not several
that retire one another. The seed never leaves this module except inside a `SigningKey`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.constants import KEY_ROTATION_LOCK
from ..core.signing import PublicKeys, SigningKey, public_key_of
from .driver import Commit, Gen, Query
from .identity import read_incarnation

__all__ = [
    "KeyHealth",
    "PublicKeys",
    "SigningKey",
    "describe_keys",
    "key_health",
    "live_keys",
    "may_sign",
    "renew_keys",
    "rotate_keys",
    "signing_key",
]

#: 32 random bytes made by the server (each UUID carries 122 bits from pg_strong_random).
_RANDOM_32 = (
    "sha256(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()) "
    "|| uuid_send(gen_random_uuid()))"
)

#: Whether this session's role may read the seeds (false, not an error, when the schema or the
#: table does not exist or may not be used).
_MAY_SIGN_SQL = """
SELECT COALESCE((
    SELECT has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT')
       AND has_table_privilege(to_regclass('streams_keys'), 'SELECT')
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'streams_prover' AND c.relname = 'signing_keys'
), false)
"""

_NEW_KEY_SQL = f"""
WITH new AS (
    INSERT INTO streams_keys (cipher_key, incarnation)
    VALUES ({_RANDOM_32}, %(incarnation)s)
    RETURNING id
)
INSERT INTO streams_prover.signing_keys (key_id, seed)
SELECT id, {_RANDOM_32} FROM new
RETURNING key_id, seed
"""


def live_keys() -> Gen[dict[int, PublicKeys]]:
    """Every live key, by id: what readers verify and open lines with (no seed)."""
    rows = yield Query(
        "SELECT id, public_key, cipher_key, incarnation FROM streams_keys "
        "WHERE retired_at IS NULL AND public_key IS NOT NULL AND cipher_key IS NOT NULL"
    )
    yield Commit()
    return {
        int(key): PublicKeys(int(key), bytes(public), bytes(cipher), incarnation)
        for key, public, cipher, incarnation in rows
    }


def may_sign() -> Gen[bool]:
    """Whether this session's role may read the private seeds (the prover role's right)."""
    rows = yield Query(_MAY_SIGN_SQL)
    yield Commit()
    return bool(rows[0][0])


def signing_key() -> Gen[SigningKey | None]:
    """The newest live key with its seed: what the prover signs with. None when this role may
    not read the seeds (`may_sign`), or when no live key has one."""
    if not (yield from may_sign()):
        return None
    rows = yield Query(
        "SELECT k.id, s.seed, k.cipher_key, k.incarnation FROM streams_keys k "
        "JOIN streams_prover.signing_keys s ON s.key_id = k.id "
        "WHERE k.retired_at IS NULL AND k.public_key IS NOT NULL AND k.cipher_key IS NOT NULL "
        "ORDER BY k.id DESC LIMIT 1"
    )
    yield Commit()
    if not rows:
        return None
    key, seed, cipher, incarnation = rows[0]
    return SigningKey(int(key), bytes(seed), bytes(cipher), incarnation)


def describe_keys() -> Gen[list[dict[str, object]]]:
    """Every key, newest first, without any secret: id, created, retired (or None), live, and
    the incarnation it was made in."""
    rows = yield Query(
        "SELECT id, created_at, retired_at, incarnation FROM streams_keys ORDER BY id DESC"
    )
    yield Commit()
    return [
        {
            "id": int(key),
            "created_at": created,
            "retired_at": retired,
            "live": retired is None,
            "incarnation": incarnation,
        }
        for key, created, retired, incarnation in rows
    ]


def _rotate_locked(incarnation: str) -> Gen[int]:
    """In the caller's transaction, holding the rotation lock: make a key of ``incarnation``
    and retire every other one; the new key's id (the caller commits)."""
    rows = yield Query(_NEW_KEY_SQL, {"incarnation": incarnation})
    key_id, seed = int(rows[0][0]), bytes(rows[0][1])
    yield Query(
        "UPDATE streams_keys SET public_key = decode(%(public)s, 'hex') WHERE id = %(id)s",
        {"public": public_key_of(seed).hex(), "id": key_id},
    )
    yield Query(
        "UPDATE streams_keys SET retired_at = now() WHERE retired_at IS NULL AND id <> %(id)s",
        {"id": key_id},
    )
    return key_id


def _lock() -> Query:
    return Query("SELECT pg_advisory_xact_lock(%(lock)s, 0)", {"lock": KEY_ROTATION_LOCK})


def rotate_keys() -> Gen[int]:
    """Add a key (of the database's current incarnation) and retire all others, in one
    transaction; returns the new key's id. Needs the right to write both key tables."""
    found = yield from read_incarnation()
    yield _lock()
    key_id = yield from _rotate_locked(found.token)
    yield Commit()
    return key_id


def renew_keys(incarnation: str) -> Gen[int]:
    """The prover's rotation: unless the newest live key was made in ``incarnation`` (another
    prover renewed it first), rotate to a key of ``incarnation``. Returns the newest key's id."""
    yield _lock()
    rows = yield Query(
        "SELECT id, incarnation FROM streams_keys "
        "WHERE retired_at IS NULL AND public_key IS NOT NULL ORDER BY id DESC LIMIT 1"
    )
    if rows and rows[0][1] == incarnation:
        yield Commit()
        return int(rows[0][0])
    key_id = yield from _rotate_locked(incarnation)
    yield Commit()
    return key_id


@dataclass(frozen=True)
class KeyHealth:
    """What ``streams doctor`` says of the keys: how many are live, and how many of those were
    made in the database's current incarnation (only those verify: `streams.core.signing`)."""

    live: int
    live_here: int
    incarnation: str


def key_health() -> Gen[KeyHealth]:
    """Count the live keys, and those of this history (no secret is read)."""
    here = yield from read_incarnation()
    rows = yield Query(
        "SELECT count(*), count(*) FILTER (WHERE incarnation = %s) FROM streams_keys "
        "WHERE retired_at IS NULL AND public_key IS NOT NULL AND cipher_key IS NOT NULL",
        (here.token,),
    )
    yield Commit()
    return KeyHealth(int(rows[0][0]), int(rows[0][1]), here.token)
