"""`streams.core.resp`: the pure RESP2 parser agrees with hiredis's, whatever the chunking."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core import resp

hiredis = pytest.importorskip("hiredis")

_simple = st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b)
_leaf = st.one_of(
    st.tuples(st.just("bulk"), st.binary(max_size=40)),
    st.tuples(st.just("simple"), _simple),
    st.tuples(st.just("error"), _simple.map(lambda b: b"ERR " + b)),
    st.tuples(st.just("int"), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("nil"), st.none()),
)
_reply = st.recursive(
    _leaf, lambda inner: st.tuples(st.just("array"), st.lists(inner, max_size=5)), max_leaves=20
)


def _wire(reply: tuple[str, Any]) -> bytes:
    kind, value = reply
    if kind == "bulk":
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if kind == "simple":
        return b"+%s\r\n" % value
    if kind == "error":
        return b"-%s\r\n" % value
    if kind == "int":
        return b":%d\r\n" % value
    if kind == "nil":
        return b"$-1\r\n"
    return b"*%d\r\n" % len(value) + b"".join(_wire(item) for item in value)


def _comparable(value: Any) -> Any:
    if isinstance(value, resp.ReplyError):  # exceptions compare by identity
        return ("error", str(value))
    if isinstance(value, list):
        return [_comparable(item) for item in value]
    return value


def _drain(parser: Any) -> list[Any]:
    out = []
    while (value := parser.gets()) is not resp.NOT_READY:
        out.append(_comparable(value))
    return out


@given(st.lists(_reply, min_size=1, max_size=6), st.lists(st.integers(1, 50), max_size=20))
def test_the_pure_parser_reads_what_hiredis_reads_in_any_chunks(
    replies: list[tuple[str, Any]], cuts: list[int]
) -> None:
    data = b"".join(_wire(r) for r in replies)
    pure, fast = resp.PyParser(), resp.new_parser()
    got_pure: list[Any] = []
    got_fast: list[Any] = []
    pos = 0
    for size in [*cuts, len(data)]:
        chunk = data[pos : pos + size]
        pos += len(chunk)
        pure.feed(chunk)
        fast.feed(chunk)
        got_pure += _drain(pure)
        got_fast += _drain(fast)
    assert got_pure == got_fast
    assert len(got_pure) == len(replies)


def test_a_message_as_the_subscriber_sees_it() -> None:
    parser = resp.PyParser()
    parser.feed(b"*3\r\n$7\r\nmessage\r\n$7\r\nstreams\r\n$5\r\nRDATA\r\n*2\r\n$4\r")
    assert parser.gets() == [b"message", b"streams", b"RDATA"]
    assert parser.gets() is resp.NOT_READY
    parser.feed(b"\npong\r\n$0\r\n\r\n")
    assert parser.gets() == [b"pong", b""]


@pytest.mark.parametrize("pure", [True, False])
def test_garbage_is_a_protocol_error(pure: bool) -> None:
    parser = resp.new_parser(pure=pure)
    parser.feed(b"?what\r\n")
    with pytest.raises(resp.ProtocolError):
        parser.gets()


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert resp.encode("SUBSCRIBE", b"a", "é") == (
        b"*3\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n$2\r\n\xc3\xa9\r\n"
    )
    parser = resp.PyParser()
    parser.feed(resp.encode("PING", 3))
    assert parser.gets() == [b"PING", b"3"]
