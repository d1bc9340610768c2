"""Signed ranges (`streams.core.signing`): what verifies, what never does, and how ranges split.

Each property stands for one attack of a party with access to Redis and to everything a reader
may read (public keys, cipher keys): it can publish any line, alter a signed one, seal rows of
its own, or move one to another stream, range, key or database incarnation; none of those
verify. And what Redis sees of a line carries no payload."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hypothesis import given
from hypothesis import strategies as st

from streams.core.epochs import Row
from streams.core.protocol import RdataCommand, parse, serialize
from streams.core.signing import (
    MAX_SIGNED_BYTES,
    MAX_SIGNED_ROWS,
    PublicKeys,
    SignedRange,
    SigningKey,
    public_key_of,
    sign_range,
    split_for_signing,
    verify_range,
)

INC = "0b6c/7300000000000000001/16384/24601/1"
KEY = SigningKey(7, b"k" * 32, b"c" * 32, INC)
KEYS = {7: KEY.public()}
INSTANCE = "_proof:host-1"

payload_texts = st.one_of(
    st.none(),
    st.recursive(
        st.one_of(st.integers(-(2**60), 2**60), st.text(max_size=20), st.booleans(), st.none()),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=8,
    ).map(lambda v: json.dumps(v, ensure_ascii=False)),
)


@st.composite
def ranges(draw: st.DrawFn) -> tuple[int, int, list[Row]]:
    """A range ``(after, through]`` and rows of facts in it (some with several rows)."""
    after = draw(st.integers(0, 10**6))
    ids = sorted(draw(st.sets(st.integers(after + 1, after + 200), max_size=12)))
    rows: list[Row] = []
    for stream_id in ids:
        for row_no in range(draw(st.integers(1, 3))):
            ts = draw(st.integers(0, 2**41))
            rows.append((stream_id, row_no, draw(st.sampled_from(["w1", "w-2"])), ts,
                         draw(payload_texts)))  # fmt: skip
    through = draw(st.integers(max([after + 1, *ids]), after + 300))
    return after, through, rows


def over_the_wire(stream: str, token: int, row: Any) -> Any:
    """The row as a remote reader parses it from the serialized line."""
    cmd = parse(serialize(RdataCommand(stream, INSTANCE, token, row)))
    assert isinstance(cmd, RdataCommand)
    return cmd.row


@given(ranges())
def test_a_signed_range_verifies_over_the_wire(case: tuple[int, int, list[Row]]) -> None:
    after, through, rows = case
    row = sign_range("orders", INSTANCE, after, through, rows, KEY)
    wire = over_the_wire("orders", through, row)
    found = verify_range("orders", INSTANCE, through, wire, KEYS, INC)
    assert found == SignedRange("orders", after, through, tuple(rows), 7)
    # The local echo (the prober's own readers get the dict itself) verifies the same.
    assert verify_range("orders", INSTANCE, through, row, KEYS, INC) == found
    # What Redis sees: no payload, writer or timestamp in clear text.
    line = serialize(RdataCommand("orders", INSTANCE, through, row))
    for r in rows:
        if r[4] is not None and len(r[4]) >= 8:
            assert r[4].encode() not in line and json.dumps(r[4]).encode() not in line
        assert f'"{r[2]}"'.encode() not in line


def _mutations(row: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every way of altering one field of a signed row."""
    proof = row["proof"]
    sig = base64.b64decode(row["sig"])
    sealed = base64.b64decode(proof["sealed"])
    nonce = base64.b64decode(proof["nonce"])

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    def flip(data: bytes, at: int) -> bytes:
        return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]

    out: list[tuple[str, Any]] = []
    out.append(("sig", {**row, "sig": b64(flip(sig, 0))}))
    out.append(("key", {**row, "proof": {**proof, "key": proof["key"] + 1}}))
    out.append(("after", {**row, "proof": {**proof, "after": proof["after"] + 1}}))
    out.append(("nonce", {**row, "proof": {**proof, "nonce": b64(flip(nonce, 3))}}))
    out.append(("sealed", {**row, "proof": {**proof, "sealed": b64(flip(sealed, 0))}}))
    out.append(("truncate", {**row, "proof": {**proof, "sealed": b64(sealed[:-1])}}))
    out.append(("extend", {**row, "proof": {**proof, "sealed": b64(sealed + b"x")}}))
    out.append(("extra field", {**row, "x": 1}))
    out.append(("extra proof field", {**row, "proof": {**proof, "rows": []}}))
    out.append(("not base64", {**row, "sig": "!" * 88}))
    out.append(("not a dict", [row]))
    return out


@given(ranges())
def test_no_alteration_of_a_signed_line_verifies(case: tuple[int, int, list[Row]]) -> None:
    after, through, rows = case
    row = sign_range("orders", INSTANCE, after, through, rows, KEY)
    other = SigningKey(8, b"o" * 32, b"c" * 32, INC)
    for what, bad in _mutations(row):
        found = verify_range("orders", INSTANCE, through, bad, {**KEYS, 8: other.public()}, INC)
        assert isinstance(found, str), what


@given(ranges())
def test_a_line_moved_to_another_stream_range_or_prober_does_not_verify(
    case: tuple[int, int, list[Row]],
) -> None:
    after, through, rows = case
    row = sign_range("orders", INSTANCE, after, through, rows, KEY)
    assert verify_range("orders2", INSTANCE, through, row, KEYS, INC) == "bad-signature"
    assert verify_range("orders", "_proof:other", through, row, KEYS, INC) == "bad-signature"
    assert verify_range("orders", INSTANCE, through + 1, row, KEYS, INC) == "bad-signature"


def test_forged_and_retired_keys_do_not_verify() -> None:
    rows: list[Row] = [(5, 0, "w", 10, "1")]
    row = sign_range("s", INSTANCE, 4, 5, rows, KEY)
    assert verify_range("s", INSTANCE, 5, row, {}, INC) == "unknown-key"  # retired: not live
    elsewhere = SigningKey(7, b"x" * 32, b"c" * 32, INC).public()  # another database's key 7
    assert verify_range("s", INSTANCE, 5, row, {7: elsewhere}, INC) == "bad-signature"
    forged = sign_range("s", INSTANCE, 4, 5, rows, SigningKey(7, b"g" * 32, b"c" * 32, INC))
    assert verify_range("s", INSTANCE, 5, forged, KEYS, INC) == "bad-signature"
    for junk in (None, 1, "x", {"sig": "zz" * 32, "proof": {"key": 7}}, {"sig": 1, "proof": {}}):
        assert isinstance(verify_range("s", INSTANCE, 5, junk, KEYS, INC), str)


def test_a_reader_role_with_every_public_key_cannot_sign() -> None:
    """Everything a reader holds (the public key, the cipher key) seals rows a reader would
    open, but no signature it can make verifies: attack (a) of issue 29, in the small."""
    rows: list[Row] = [(3, 0, "w", 1, '{"order": 914, "refund": 1000000}')]
    public = KEYS[7]
    nonce = os.urandom(12)
    header = b" s %s 3 %s 7 2 " % (INSTANCE.encode(), INC.encode())
    sealed = ChaCha20Poly1305(public.cipher_key).encrypt(
        nonce, json.dumps([list(r) for r in rows]).encode(), b"streams-sealed-rows-v2" + header
    )
    for sig in (bytes(64), public.public_key * 2, os.urandom(64)):
        forged = {
            "sig": base64.b64encode(sig).decode(),
            "proof": {
                "key": 7,
                "after": 2,
                "nonce": base64.b64encode(nonce).decode(),
                "sealed": base64.b64encode(sealed).decode(),
            },
        }
        assert verify_range("s", INSTANCE, 3, forged, KEYS, INC) == "bad-signature"
    assert public_key_of(b"k" * 32) == public.public_key


def test_a_line_of_another_incarnation_never_verifies() -> None:
    """A restore or a failover changes the reader's incarnation: lines signed before it are
    rejected, whether the key is the old one or a key of the same id made again."""
    rows: list[Row] = [(5, 0, "w", 10, "1")]
    row = sign_range("s", INSTANCE, 4, 5, rows, KEY)
    after = INC.replace("/1", "/2")  # a new timeline
    assert verify_range("s", INSTANCE, 5, row, KEYS, after) == "other-history"
    assert verify_range("s", INSTANCE, 5, row, KEYS, None) == "other-history"
    same_key_new_history = {7: PublicKeys(7, KEY.public_key, b"c" * 32, after)}
    assert verify_range("s", INSTANCE, 5, row, same_key_new_history, after) == "bad-signature"
    with pytest.raises(ValueError, match="incarnation"):
        sign_range("s", INSTANCE, 4, 5, rows, SigningKey(7, b"k" * 32, b"c" * 32, None))
    assert "k" * 8 not in repr(KEY)


def test_a_signed_range_must_lie_in_its_bounds() -> None:
    """Even with the key (a prober of another version), rows outside the range are refused."""
    cases: list[tuple[int, int, list[Row]]] = [
        (4, 5, [(6, 0, "w", 1, "1")]),  # beyond the token
        (4, 5, [(4, 0, "w", 1, "1")]),  # at or below after
        (5, 5, []),  # empty range
        (4, 9, [(6, 0, "w", 1, "1"), (6, 0, "w", 1, "1")]),  # a row twice
        (4, 9, [(6, 0, "w", 1, 5)]),  # payload not text
    ]
    for after, through, rows in cases:
        row = sign_range("s", INSTANCE, after, through, rows, KEY)
        assert verify_range("s", INSTANCE, through, row, KEYS, INC) == "inconsistent"


@given(ranges(), st.booleans(), st.integers(1, 40))
def test_split_never_cuts_a_fact(
    case: tuple[int, int, list[Row]], page_full: bool, limit: int
) -> None:
    after, through, rows = case
    page = rows[:limit]
    full = page_full or len(rows) > limit
    end, count = split_for_signing(page, after, through, full)
    assert after <= end <= through
    covered = page[:count]
    assert all(after < r[0] <= end for r in covered)
    # Every row of every fact <= end is in the line (whole facts, nothing missing).
    assert [r for r in rows if r[0] <= end] == covered
    if not full and not rows:
        assert end == through


def test_split_respects_the_line_limits() -> None:
    many: list[Row] = [(n, 0, "w", 0, "1") for n in range(1, MAX_SIGNED_ROWS + 10)]
    end, count = split_for_signing(many, 0, 10**6, False)
    assert count <= MAX_SIGNED_ROWS and end == many[count - 1][0]
    big = "x" * (MAX_SIGNED_BYTES // 3)
    large: list[Row] = [(n, 0, "w", 0, big) for n in range(1, 6)]
    end, count = split_for_signing(large, 0, 10, False)
    assert 1 <= count < 5 and end == count
    huge: list[Row] = [(1, 0, "w", 0, "x" * (MAX_SIGNED_BYTES + 1))]
    assert split_for_signing(huge, 0, 10, False) == (0, 0)  # by reference: readers use PG


@pytest.mark.parametrize("token", [1, 2**62])
def test_signed_lines_are_synapse_rdata(token: int) -> None:
    row = sign_range("s", INSTANCE, 0, token, [], KEY)
    line = serialize(RdataCommand("s", INSTANCE, token, row))
    assert line.startswith(f"RDATA s {INSTANCE} {token} {{".encode())
