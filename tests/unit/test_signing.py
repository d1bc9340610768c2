"""Signed ranges (`streams.core.signing`): what verifies, what never does, and how ranges split.

Each property stands for one attack of a party with access to Redis alone: it can publish any
line, alter a signed one, or move one to another stream, range or key; none of those verify."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.epochs import Row
from streams.core.protocol import RdataCommand, parse, serialize
from streams.core.signing import (
    MAX_SIGNED_BYTES,
    MAX_SIGNED_ROWS,
    SignedRange,
    sign_range,
    split_for_signing,
    verify_range,
)

KEY = b"k" * 32
KEYS = {7: KEY}
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
    row = sign_range("orders", INSTANCE, after, through, rows, 7, KEY)
    found = verify_range("orders", INSTANCE, through, over_the_wire("orders", through, row), KEYS)
    assert found == SignedRange("orders", after, through, tuple(rows), 7)
    # The local echo (the prober's own readers get the dict itself) verifies the same.
    assert verify_range("orders", INSTANCE, through, row, KEYS) == found


def _mutations(row: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every way of altering one field of a signed row."""
    proof = row["proof"]
    out: list[tuple[str, Any]] = []
    out.append(("mac", {**row, "mac": ("0" if row["mac"][0] != "0" else "1") + row["mac"][1:]}))
    out.append(("key", {**row, "proof": {**proof, "key": proof["key"] + 1}}))
    out.append(("after", {**row, "proof": {**proof, "after": proof["after"] + 1}}))
    if proof["rows"]:
        out.append(("truncate", {**row, "proof": {**proof, "rows": proof["rows"][:-1]}}))
        first = list(proof["rows"][0])
        first[4] = "[]" if first[4] != "[]" else "{}"
        out.append(("payload", {**row, "proof": {**proof, "rows": [first, *proof["rows"][1:]]}}))
        first = list(proof["rows"][0])
        first[3] += 1
        out.append(("timestamp", {**row, "proof": {**proof, "rows": [first, *proof["rows"][1:]]}}))
        out.append(("duplicate", {**row, "proof": {**proof, "rows": proof["rows"] * 2}}))
        out.append(("reorder", {**row, "proof": {**proof, "rows": proof["rows"][::-1]}}))
    out.append(("extra field", {**row, "x": 1}))
    out.append(("not a dict", [row]))
    return out


@given(ranges())
def test_no_alteration_of_a_signed_line_verifies(case: tuple[int, int, list[Row]]) -> None:
    after, through, rows = case
    row = sign_range("orders", INSTANCE, after, through, rows, 7, KEY)
    for what, bad in _mutations(row):
        if what == "reorder" and len(row["proof"]["rows"]) < 2:
            continue
        found = verify_range("orders", INSTANCE, through, bad, {**KEYS, 8: KEY})
        assert isinstance(found, str), what


@given(ranges())
def test_a_line_moved_to_another_stream_range_or_prober_does_not_verify(
    case: tuple[int, int, list[Row]],
) -> None:
    after, through, rows = case
    row = sign_range("orders", INSTANCE, after, through, rows, 7, KEY)
    assert verify_range("orders2", INSTANCE, through, row, KEYS) == "bad-mac"
    assert verify_range("orders", "_proof:other", through, row, KEYS) == "bad-mac"
    assert verify_range("orders", INSTANCE, through + 1, row, KEYS) == "bad-mac"


def test_forged_and_retired_keys_do_not_verify() -> None:
    rows: list[Row] = [(5, 0, "w", 10, "1")]
    row = sign_range("s", INSTANCE, 4, 5, rows, 7, KEY)
    assert verify_range("s", INSTANCE, 5, row, {}) == "unknown-key"  # retired: not live
    assert verify_range("s", INSTANCE, 5, row, {7: b"x" * 32}) == "bad-mac"  # another database
    forged = sign_range("s", INSTANCE, 4, 5, rows, 7, b"guess" * 8)
    assert verify_range("s", INSTANCE, 5, forged, KEYS) == "bad-mac"
    for junk in (None, 1, "x", {"mac": "zz" * 32, "proof": {"key": 7}}, {"mac": 1, "proof": {}}):
        assert isinstance(verify_range("s", INSTANCE, 5, junk, KEYS), str)


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
        row = sign_range("s", INSTANCE, after, through, rows, 7, KEY)
        assert verify_range("s", INSTANCE, through, row, KEYS) == "inconsistent"


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
    row = sign_range("s", INSTANCE, 0, token, [], 7, KEY)
    line = serialize(RdataCommand("s", INSTANCE, token, row))
    assert line.startswith(f"RDATA s {INSTANCE} {token} {{".encode())
