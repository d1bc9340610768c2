"""Signed ranges: facts a reader may take from Redis without asking PostgreSQL. Pure: no I/O.

The elected prober seals a proven range's rows (ChaCha20-Poly1305) and signs the sealed line
(Ed25519) with a key only the prover role can read; a reader verifies it with the public keys
of its own database incarnation (`PublicKeys`) and applies it only where it fits its position.

The line's format, why encrypt-then-sign, and the trust argument: docs/design/trust.md.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .epochs import Row

__all__ = [
    "KEY_REFRESH",
    "MAX_SIGNED_BYTES",
    "MAX_SIGNED_ROWS",
    "NONCE_BYTES",
    "PublicKeys",
    "Rejected",
    "SignedRange",
    "SigningKey",
    "public_key_of",
    "sign_range",
    "split_for_signing",
    "verify_range",
]

#: Seconds between two reads of the key table by a reader or prover that hears no ``KEYS``
#: line (retirement takes effect within this long for those).
KEY_REFRESH: Final = 30.0
#: Most rows the prober puts in one signed line; a longer range is signed in part (the rest is
#: read from PostgreSQL by the readers that need it).
MAX_SIGNED_ROWS: Final = 2000
#: Most bytes of payload text in one signed line (lines stay well below the protocol's 1 MiB,
#: base64 and escapes included).
MAX_SIGNED_BYTES: Final = 256 * 1024
#: The seal's nonce: random per line (2**32 lines under one key keep the chance of a repeated
#: nonce below 2**-32; keys rotate long before).
NONCE_BYTES: Final = 12

_FORMAT: Final = b"streams-signed-range-v2"
_SEAL: Final = b"streams-sealed-rows-v2"
_PROOF_FIELDS: Final = frozenset({"key", "after", "nonce", "sealed"})
_LINE_FIELDS: Final = frozenset({"sig", "proof"})

Rejected = Literal[
    "malformed", "unknown-key", "other-history", "bad-signature", "undecryptable", "inconsistent"
]


def public_key_of(seed: bytes) -> bytes:
    """The raw Ed25519 public key (32 bytes) of a private key's 32-byte seed."""
    return (
        Ed25519PrivateKey.from_private_bytes(seed)
        .public_key()
        .public_bytes(Encoding.Raw, PublicFormat.Raw)
    )


class PublicKeys:
    """What a reader holds of one key: verify its signatures, open its seals."""

    __slots__ = ("_cipher", "_verifier", "cipher_key", "incarnation", "key_id", "public_key")

    def __init__(
        self, key_id: int, public_key: bytes, cipher_key: bytes, incarnation: str | None
    ) -> None:
        self.key_id = key_id
        self.public_key = public_key
        self.cipher_key = cipher_key
        #: The database incarnation the key was made in (None: unknown, verifies nowhere).
        self.incarnation = incarnation
        self._verifier = Ed25519PublicKey.from_public_bytes(public_key)
        self._cipher = ChaCha20Poly1305(cipher_key)

    def __repr__(self) -> str:
        return f"<PublicKeys {self.key_id} of {self.incarnation}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PublicKeys):
            return NotImplemented
        return (self.key_id, self.public_key, self.cipher_key, self.incarnation) == (
            other.key_id,
            other.public_key,
            other.cipher_key,
            other.incarnation,
        )

    def __hash__(self) -> int:
        return hash((self.key_id, self.public_key))


class SigningKey:
    """What the prover holds of the key it signs with (never printed: no seed in a repr)."""

    __slots__ = ("_cipher", "_private", "cipher_key", "incarnation", "key_id", "public_key")

    def __init__(
        self, key_id: int, seed: bytes, cipher_key: bytes, incarnation: str | None
    ) -> None:
        self.key_id = key_id
        self.incarnation = incarnation
        self.cipher_key = cipher_key
        self._private = Ed25519PrivateKey.from_private_bytes(seed)
        self.public_key = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._cipher = ChaCha20Poly1305(cipher_key)

    def __repr__(self) -> str:
        return f"<SigningKey {self.key_id} of {self.incarnation}>"

    def public(self) -> PublicKeys:
        """The reader's half of this key."""
        return PublicKeys(self.key_id, self.public_key, self.cipher_key, self.incarnation)


@dataclass(frozen=True, slots=True)
class SignedRange:
    """A verified range ``(after, through]`` of ``stream`` and every row in it."""

    stream: str
    after: int
    through: int
    rows: tuple[Row, ...]
    key: int


def _header(
    stream: str, instance: str, token: int, incarnation: str, key_id: int, after: int
) -> bytes:
    """What both the signature and the seal bind a line to (see the module doc)."""
    return b" %s %s %d %s %d %d " % (
        stream.encode(),
        instance.encode(),
        token,
        incarnation.encode(),
        key_id,
        after,
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def sign_range(
    stream: str,
    instance: str,
    after: int,
    through: int,
    rows: Sequence[Row],
    key: SigningKey,
    nonce: bytes | None = None,
) -> dict[str, Any]:
    """The row JSON of the signed line for ``(after, through]`` (``rows``: all of its rows),
    sealed, then signed, under ``key`` in its incarnation. ``nonce``: for tests only."""
    if key.incarnation is None:
        raise ValueError("a key without an incarnation signs nothing")
    nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
    header = _header(stream, instance, through, key.incarnation, key.key_id, after)
    sealed = key._cipher.encrypt(nonce, orjson.dumps(rows), _SEAL + header)
    signature = key._private.sign(_FORMAT + header + nonce + sealed)
    return {
        "sig": _b64(signature),
        "proof": {"key": key.key_id, "after": after, "nonce": _b64(nonce), "sealed": _b64(sealed)},
    }


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


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def verify_range(
    stream: str,
    instance: str,
    token: int,
    row: Any,
    keys: Mapping[int, PublicKeys],
    incarnation: str | None,
) -> SignedRange | Rejected:
    """Check a signed line's row JSON against the live ``keys`` and the reader's own
    ``incarnation``; the range, or why it is rejected (see the module doc).

    The signature is checked before anything is decrypted or parsed, so nothing of an unsigned
    line is trusted; the checks after it guard against a prober of another version, never
    against Redis.
    """
    if not isinstance(row, dict) or row.keys() != _LINE_FIELDS:
        return "malformed"
    sig, proof = row["sig"], row["proof"]
    if not isinstance(sig, str) or not isinstance(proof, dict) or proof.keys() != _PROOF_FIELDS:
        return "malformed"
    key_id, after, nonce_text, sealed_text = (
        proof["key"],
        proof["after"],
        proof["nonce"],
        proof["sealed"],
    )
    if not (
        _int(key_id)
        and _int(after)
        and isinstance(nonce_text, str)
        and isinstance(sealed_text, str)
    ):
        return "malformed"
    key = keys.get(key_id)
    if key is None:
        return "unknown-key"
    if incarnation is None or key.incarnation != incarnation:
        return "other-history"
    try:
        signature = base64.b64decode(sig, validate=True)
        nonce = base64.b64decode(nonce_text, validate=True)
        sealed = base64.b64decode(sealed_text, validate=True)
    except (binascii.Error, ValueError):
        return "malformed"
    if len(signature) != 64 or len(nonce) != NONCE_BYTES:
        return "malformed"
    header = _header(stream, instance, token, incarnation, key_id, after)
    try:
        key._verifier.verify(signature, _FORMAT + header + nonce + sealed)
    except InvalidSignature:
        return "bad-signature"
    try:
        plain = key._cipher.decrypt(nonce, sealed, _SEAL + header)
    except InvalidTag:
        return "undecryptable"
    try:
        rows = orjson.loads(plain)
    except orjson.JSONDecodeError:
        return "inconsistent"
    if not isinstance(rows, list) or not 0 <= after < token:
        return "inconsistent"
    checked: list[Row] = []
    last = (after, 2**31)  # rows ascend by (ID, row number), all in (after, token]
    for r in rows:
        if not (isinstance(r, list) and len(r) == 5):
            return "inconsistent"
        stream_id, row_no, writer, ts, payload = r
        if not (
            _int(stream_id)
            and _int(row_no)
            and isinstance(writer, str)
            and _int(ts)
            and (payload is None or isinstance(payload, str))
        ):
            return "inconsistent"
        here = (stream_id, row_no)
        if here <= last or stream_id > token:
            return "inconsistent"
        last = here
        checked.append((stream_id, row_no, writer, ts, payload))
    return SignedRange(stream, after, token, tuple(checked), key_id)
