"""RESP2, the Redis wire format, for the link's pub/sub connection: pure, no I/O.

Terms. A *reply* is one RESP2 value: a simple string (``+OK``), an error (``-ERR ...``), an
integer (``:3``), a bulk string (``$5 hello``, or ``$-1`` for nil) or an array of replies
(``*3 ...``, ``*-1`` for nil). On a subscribed connection the server sends every message as an
array push, ``[b"message", channel, data]``, and answers ``SUBSCRIBE`` and ``PING`` with arrays
of the same shape (``[b"subscribe", channel, count]``, ``[b"pong", b""]``).

Why not redis-py's ``PubSub.get_message``: it costs ~22 us of CPU per message here (a readiness
poll, retry wrappers, a dict, channel decoding), and every process of a deployment hears every
writer's ``RDATA``, so with N writer processes each append costs N of them (the listener thread
of each of 4 writers spent ~150 us per append). Parsing the socket's bytes in bulk costs ~3 us
a message. The link still lets redis-py open the connection (TLS, AUTH, ``CLIENT SETNAME``,
every URL option), then reads and writes that socket itself with `Parser` and `encode`.

`Parser` is hiredis's ``Reader`` when hiredis is installed (the ``hiredis`` extra), and
`PyParser`, below, otherwise; both return `NOT_READY` while a reply is incomplete and an
`ReplyError` *value* (not raised) for an error reply, so the caller decides what it means.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

__all__ = ["NOT_READY", "Parser", "ProtocolError", "PyParser", "ReplyError", "encode", "new_parser"]

#: What `Parser.gets` returns while the buffered bytes hold no complete reply (hiredis's value).
NOT_READY: Final = False


class ReplyError(Exception):
    """An error reply (``-ERR ...``) from the server, returned as a value by `Parser.gets`."""


class ProtocolError(Exception):
    """Bytes that are not RESP2: the connection is out of step and must be dropped."""


def encode(*args: str | bytes | int) -> bytes:
    """One command as a RESP2 array of bulk strings (what every Redis command is sent as)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode("utf-8")
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Incomplete(Exception):
    pass


class PyParser:
    """A RESP2 reply parser in pure Python: `feed` bytes, then `gets` replies until NOT_READY.

    Bulk strings come back as ``bytes``, simple strings as ``bytes`` too (as hiredis gives
    them), integers as ``int``, nil as ``None``, arrays as ``list``, errors as `ReplyError`.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos > 65536:  # compact now and then, not on every reply
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def gets(self) -> Any:
        try:
            value, end = self._parse(self._pos)
        except _Incomplete:
            return NOT_READY
        self._pos = end
        return value

    def _line(self, pos: int) -> tuple[bytes, int]:
        end = self._buf.find(b"\r\n", pos)
        if end < 0:
            raise _Incomplete
        return bytes(self._buf[pos:end]), end + 2

    def _parse(self, pos: int) -> tuple[Any, int]:
        if pos >= len(self._buf):
            raise _Incomplete
        kind = self._buf[pos]
        line, pos = self._line(pos + 1)
        if kind == 0x2B:  # +
            return line, pos
        if kind == 0x2D:  # -
            return ReplyError(line.decode("utf-8", "replace")), pos
        if kind == 0x3A:  # :
            return _integer(line), pos
        if kind == 0x24:  # $
            size = _integer(line)
            if size < 0:
                return None, pos
            if len(self._buf) < pos + size + 2:
                raise _Incomplete
            if self._buf[pos + size : pos + size + 2] != b"\r\n":
                raise ProtocolError("bulk string not followed by CRLF")
            return bytes(self._buf[pos : pos + size]), pos + size + 2
        if kind == 0x2A:  # *
            count = _integer(line)
            if count < 0:
                return None, pos
            items = []
            for _ in range(count):
                item, pos = self._parse(pos)
                items.append(item)
            return items, pos
        raise ProtocolError(f"unknown RESP2 type byte {bytes([kind])!r}")


def _integer(line: bytes) -> int:
    try:
        return int(line)
    except ValueError:
        raise ProtocolError(f"not an integer: {line[:32]!r}") from None


Parser = Any  # hiredis.Reader or PyParser: feed(bytes) and gets() -> reply | NOT_READY


def _hiredis_factory() -> Callable[[], Any] | None:
    try:
        import hiredis
    except ImportError:
        return None

    def make() -> Any:
        return hiredis.Reader(protocolError=ProtocolError, replyError=ReplyError)

    return make


_FAST: Final = _hiredis_factory()


def new_parser(*, pure: bool = False) -> Parser:
    """A parser: hiredis's when installed (and not ``pure``), else `PyParser`."""
    return PyParser() if pure or _FAST is None else _FAST()
