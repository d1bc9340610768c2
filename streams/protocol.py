"""Sans-IO codec for the replication commands, byte-compatible with Matrix Synapse.

Theory of operation
===================

Terms, in the order they build on each other:

* A **line** is one replication message: the payload of one Redis pub/sub message (or one line of
  Synapse's old TCP protocol, without its terminating ``\\n``). It is UTF-8 text, at most
  `MAX_LINE_BYTES` bytes, and never contains ``\\n`` or ``\\r``.
* A line is ``NAME`` optionally followed by one space and an **argument string**. The name picks the
  command; how the argument string splits is up to the command, exactly as in Synapse's
  ``synapse/replication/tcp/commands.py``.
* A **command** is the parsed form of a line: one frozen dataclass per name (``COMMANDS`` maps
  names to classes). Constructing a command validates it, so every command object that exists can
  be serialized, and ``parse(serialize(cmd)) == cmd``.
* A **name** (a stream, instance or server name) is non-empty printable text without spaces. It
  must not contain spaces because the argument string is split on single spaces.
* A **text** (``PING`` data, ``ERROR`` message) is the whole rest of the line, so it may contain
  spaces, but no line break of any kind (everything ``str.splitlines`` splits on).
* A **token** is a stream ID: an ``int`` in ``0 .. 2**63 - 1`` (PostgreSQL ``bigint``), written in
  canonical decimal. ``RDATA`` uses the literal ``batch`` instead of a token (``token=None``) for
  all but the last of several rows sharing one stream ID; the last row carries the number, and a
  reader buffers ``batch`` rows per stream until that number arrives.
* A **row** is the ``RDATA`` payload: one JSON value, encoded like Synapse's ``json_encoder``
  (compact separators, ASCII escapes, no NaN/Infinity). Because it is the last of at most four
  space-separated fields (``split(" ", 3)``) it may itself contain spaces.

Everything malformed — unknown name, wrong field count, non-canonical or out-of-range token, bad
JSON, invalid UTF-8, an empty or oversized line, a line break — raises `ProtocolError` and nothing
else: readers log and drop such lines (Redis is only the fast path; PostgreSQL is the truth), so a
hostile or buggy publisher must not be able to crash them with an unexpected exception type.

This module does no I/O; the caller moves bytes.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Final, NoReturn, TypeAlias

__all__ = [
    "COMMANDS",
    "MAX_LINE_BYTES",
    "MAX_TOKEN",
    "Command",
    "ErrorCommand",
    "JsonValue",
    "NameCommand",
    "PingCommand",
    "PositionCommand",
    "ProtocolError",
    "RdataCommand",
    "ReplicateCommand",
    "ServerCommand",
    "parse",
    "serialize",
]

#: Largest accepted line, in UTF-8 bytes. Checked before decoding so a huge message costs nothing.
MAX_LINE_BYTES: Final = 1024 * 1024

#: Largest token: stream IDs come from a PostgreSQL ``bigint`` sequence.
MAX_TOKEN: Final = 2**63 - 1

JsonValue: TypeAlias = "dict[str, JsonValue] | list[JsonValue] | str | int | float | bool | None"

# Every character `str.splitlines` treats as a line boundary. Text fields reject all of them, not
# just \n and \r, so that no consumer (log line splitter, TCP framing) can ever see two lines.
_LINE_BREAKS: Final = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")

# Canonical decimal only (no sign, no leading zeros, no "_" or non-ASCII digits that int() would
# accept) and at most 19 digits, so int() is cheap and the text round-trips byte for byte.
_TOKEN_RE: Final = re.compile(r"0|[1-9][0-9]{0,18}")

# The RDATA token of every row but the last sharing one stream ID.
_BATCH: Final = "batch"

_REPR_LIMIT: Final = 200
_reprlib = reprlib.Repr()
_reprlib.maxstring = _REPR_LIMIT
_reprlib.maxother = _REPR_LIMIT


def _safe_repr(value: object) -> str:
    """A short repr (<= 200 chars) of untrusted input, safe to put in a log line."""
    if isinstance(value, str | bytes | bytearray):
        # Slice first: repr() of a 1 MiB line would be wasted work.
        text = repr(value[: _REPR_LIMIT + 1])
        truncated = len(value) > _REPR_LIMIT
    else:
        text = _reprlib.repr(value)
        truncated = False
    if truncated or len(text) > _REPR_LIMIT:
        text = text[: _REPR_LIMIT - 3] + "..."
    return text


class ProtocolError(ValueError):
    """A line or command that is not valid replication protocol.

    ``line`` is a truncated, escaped repr of the offending input (<= 200 characters), for logging.
    """

    def __init__(self, message: str, line: object = "") -> None:
        super().__init__(message)
        self.line: str = _safe_repr(line)


def _check_name(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a str, not {type(value).__name__}", value)
    # isprintable() is False for control, format, separator (other than " ") and surrogate
    # characters, so a valid name is also always UTF-8 encodable.
    if not value or " " in value or not value.isprintable():
        raise ProtocolError(f"{what} must be non-empty printable text without spaces", value)


def _check_text(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a str, not {type(value).__name__}", value)
    if not _LINE_BREAKS.isdisjoint(value):
        raise ProtocolError(f"{what} must not contain a line break", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        raise ProtocolError(f"{what} is not encodable as UTF-8", value) from None


def _check_token(value: object, what: str) -> None:
    # bool is an int subclass; True as a stream ID is certainly a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} must be an int, not {type(value).__name__}", value)
    if not 0 <= value <= MAX_TOKEN:
        raise ProtocolError(f"{what} must be in 0..2**63-1", value)


@dataclass(frozen=True, slots=True)
class ReplicateCommand:
    """``REPLICATE``: a reader asks every writer to announce its positions (with ``POSITION``)."""

    NAME: ClassVar[str] = "REPLICATE"


@dataclass(frozen=True, slots=True)
class PositionCommand:
    """``POSITION <stream> <instance> <prev_token> <new_token>``.

    The writer ``instance`` wrote no rows in ``(prev_token, new_token]``; a reader whose view of the
    writer is behind ``prev_token`` has missed something and must catch up from the database.
    """

    NAME: ClassVar[str] = "POSITION"
    stream_name: str
    instance_name: str
    prev_token: int
    new_token: int

    def __post_init__(self) -> None:
        _check_name(self.stream_name, "stream name")
        _check_name(self.instance_name, "instance name")
        _check_token(self.prev_token, "prev_token")
        _check_token(self.new_token, "new_token")


@dataclass(frozen=True, slots=True)
class RdataCommand:
    """``RDATA <stream> <instance> <token|batch> <row_json>``: one row of a new fact.

    ``token is None`` is sent as ``batch``: more rows with the same stream ID follow, and the last
    one carries the number. The row must be JSON-encodable; that is checked by `serialize` (not
    here: the row may be a mutable dict or list, so a check at construction could go stale).
    """

    NAME: ClassVar[str] = "RDATA"
    stream_name: str
    instance_name: str
    token: int | None
    row: JsonValue

    def __post_init__(self) -> None:
        _check_name(self.stream_name, "stream name")
        _check_name(self.instance_name, "instance name")
        if self.token is not None:
            _check_token(self.token, "token")


@dataclass(frozen=True, slots=True)
class PingCommand:
    """``PING <data>``: keep-alive; Synapse sends the current time in ms as the data."""

    NAME: ClassVar[str] = "PING"
    data: str

    def __post_init__(self) -> None:
        _check_text(self.data, "PING data")


@dataclass(frozen=True, slots=True)
class ErrorCommand:
    """``ERROR <message>``: the sender saw something wrong; informational only."""

    NAME: ClassVar[str] = "ERROR"
    message: str

    def __post_init__(self) -> None:
        _check_text(self.message, "ERROR message")


@dataclass(frozen=True, slots=True)
class ServerCommand:
    """``SERVER <name>``: the sender's server name (sent by Synapse on a new TCP connection)."""

    NAME: ClassVar[str] = "SERVER"
    name: str

    def __post_init__(self) -> None:
        _check_name(self.name, "server name")


@dataclass(frozen=True, slots=True)
class NameCommand:
    """``NAME <name>``: the sender's instance name."""

    NAME: ClassVar[str] = "NAME"
    name: str

    def __post_init__(self) -> None:
        _check_name(self.name, "instance name")


Command: TypeAlias = (
    ReplicateCommand
    | PositionCommand
    | RdataCommand
    | PingCommand
    | ErrorCommand
    | ServerCommand
    | NameCommand
)

#: Wire name -> command class, for every command this module understands.
COMMANDS: Final[Mapping[str, type[Command]]] = MappingProxyType(
    {
        ReplicateCommand.NAME: ReplicateCommand,
        PositionCommand.NAME: PositionCommand,
        RdataCommand.NAME: RdataCommand,
        PingCommand.NAME: PingCommand,
        ErrorCommand.NAME: ErrorCommand,
        ServerCommand.NAME: ServerCommand,
        NameCommand.NAME: NameCommand,
    }
)


# --- JSON -------------------------------------------------------------------------------------

# Same settings as Synapse's `json_encoder`, so our rows are byte-identical to theirs. ensure_ascii
# (the default) also means a row with lone surrogates still encodes as valid UTF-8.
_ENCODER: Final = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _reject_constant(name: str) -> NoReturn:
    raise ProtocolError(f"non-finite number {name} in JSON")


def _parse_float(text: str) -> float:
    # parse_constant only sees the literals NaN/Infinity; "1e400" overflows to inf via float()
    # and would then fail to re-encode, so it is rejected here too.
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"non-finite number {text} in JSON")
    return value


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_parse_float)


def _encode_row(row: JsonValue) -> str:
    try:
        return _ENCODER.encode(row)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"row is not encodable as JSON: {exc}", row) from None


# --- parsing ----------------------------------------------------------------------------------


def _parse_token(text: str, what: str) -> int:
    if _TOKEN_RE.fullmatch(text) is None:
        raise ProtocolError(f"{what} is not a canonical decimal integer", text)
    value = int(text)
    _check_token(value, what)
    return value


def _parse_fields(args: str, count: int, command: str) -> list[str]:
    # split(" ", count - 1) like Synapse: the last field keeps any further spaces.
    fields = args.split(" ", count - 1)
    if len(fields) != count:
        raise ProtocolError(f"{command} takes {count} arguments, got {len(fields)}")
    return fields


def _parse_replicate(args: str) -> ReplicateCommand:
    # Synapse sends "REPLICATE " (NAME + space + empty argument string); accept both forms.
    if args:
        raise ProtocolError("REPLICATE takes no arguments")
    return ReplicateCommand()


def _parse_position(args: str) -> PositionCommand:
    stream, instance, prev_token, new_token = _parse_fields(args, 4, "POSITION")
    return PositionCommand(
        stream,
        instance,
        _parse_token(prev_token, "prev_token"),
        _parse_token(new_token, "new_token"),
    )


def _parse_rdata(args: str) -> RdataCommand:
    stream, instance, token, row_json = _parse_fields(args, 4, "RDATA")
    parsed_token = None if token == _BATCH else _parse_token(token, "token")
    row: JsonValue = _DECODER.decode(row_json)
    return RdataCommand(stream, instance, parsed_token, row)


_PARSERS: Final[Mapping[str, Callable[[str], Command]]] = MappingProxyType(
    {
        ReplicateCommand.NAME: _parse_replicate,
        PositionCommand.NAME: _parse_position,
        RdataCommand.NAME: _parse_rdata,
        PingCommand.NAME: PingCommand,
        ErrorCommand.NAME: ErrorCommand,
        ServerCommand.NAME: ServerCommand,
        NameCommand.NAME: NameCommand,
    }
)


def _decode_line(data: object) -> str:
    if isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
        if len(raw) > MAX_LINE_BYTES:
            raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("line is not valid UTF-8") from None
    elif isinstance(data, str):
        # A char is at least one UTF-8 byte: cheap rejection before encoding a huge string.
        if len(data) > MAX_LINE_BYTES:
            raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes")
        try:
            size = len(data.encode("utf-8"))
        except UnicodeEncodeError:
            raise ProtocolError("line is not encodable as UTF-8") from None
        if size > MAX_LINE_BYTES:
            raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes")
        text = data
    else:
        raise ProtocolError(f"expected bytes or str, not {type(data).__name__}")
    if "\n" in text or "\r" in text:
        raise ProtocolError("line contains a newline")
    if not text:
        raise ProtocolError("empty line")
    return text


def parse(data: bytes | str) -> Command:
    """Parse one line into a command.

    Raises `ProtocolError` (and nothing else) if the line is malformed; its ``line`` attribute is a
    short repr of ``data`` for the log.
    """
    try:
        text = _decode_line(data)
        name, _, args = text.partition(" ")
        parser = _PARSERS.get(name)
        if parser is None:
            raise ProtocolError(f"unknown command {name[:50]!r}")
        return parser(args)
    except ProtocolError as exc:
        # Re-raise with the whole line attached, whichever field the check was looking at.
        raise ProtocolError(str(exc), data) from None
    except (ValueError, RecursionError) as exc:  # bad JSON, or JSON nested too deeply
        raise ProtocolError(f"malformed line: {exc}", data) from None


# --- serializing ------------------------------------------------------------------------------


def serialize(cmd: Command) -> bytes:
    """The UTF-8 line for ``cmd`` (no trailing newline).

    Raises `ProtocolError` if an ``RDATA`` row is not JSON-encodable (NaN, infinities, non-JSON
    types) or the line would exceed `MAX_LINE_BYTES`.
    """
    line: str
    match cmd:
        case ReplicateCommand():
            # Synapse writes "REPLICATE " with a trailing space; both parse the same everywhere.
            line = cmd.NAME
        case PositionCommand():
            line = (
                f"{cmd.NAME} {cmd.stream_name} {cmd.instance_name}"
                f" {int(cmd.prev_token)} {int(cmd.new_token)}"
            )
        case RdataCommand():
            token = _BATCH if cmd.token is None else str(int(cmd.token))
            line = (
                f"{cmd.NAME} {cmd.stream_name} {cmd.instance_name} {token} {_encode_row(cmd.row)}"
            )
        case PingCommand():
            line = f"{cmd.NAME} {cmd.data}"
        case ErrorCommand():
            line = f"{cmd.NAME} {cmd.message}"
        case ServerCommand() | NameCommand():
            line = f"{cmd.NAME} {cmd.name}"
        case _:
            raise TypeError(f"not a replication command: {type(cmd).__name__}")
    encoded = line.encode("utf-8")
    if len(encoded) > MAX_LINE_BYTES:
        raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes", encoded)
    return encoded
