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
* A **command** is the parsed form of a line: one frozen dataclass per name `streams` uses
  (``COMMANDS`` maps names to classes). Every other command Synapse defines
  (`SYNAPSE_ONLY_COMMANDS`: ``LOCK_RELEASED``, ``USER_SYNC``, ``USER_IP``, ...) parses to one
  class, `ForeignCommand`, which keeps the argument string verbatim after checking its shape as
  Synapse would (field counts, integers, JSON). Constructing a command validates it, so every
  command object that exists can be serialized, and ``parse(serialize(cmd)) == cmd``. One
  command is `streams`' own, not Synapse's: ``KEYS <key_id>`` (`KeysCommand`: the replication
  keys changed), published only on a `streams` deployment's control channel.
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

Everything malformed — a name neither `streams` nor Synapse defines, wrong field count,
non-canonical or out-of-range token, bad JSON, invalid UTF-8, an empty or oversized line, a line
break — raises `ProtocolError` and nothing else: readers count and drop such lines (Redis is only
the fast path; PostgreSQL is the truth), so a hostile or buggy publisher must not be able to
crash them with an unexpected exception type.

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
    "SYNAPSE_ONLY_COMMANDS",
    "Command",
    "ErrorCommand",
    "ForeignCommand",
    "JsonValue",
    "KeysCommand",
    "NameCommand",
    "PingCommand",
    "PositionCommand",
    "ProtocolError",
    "RdataCommand",
    "ReplicateCommand",
    "ServerCommand",
    "TypedCommand",
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
    ``reason`` is a short message that does not depend on the input's content beyond a bounded
    set of values (no quoted names, offsets or numbers), so a link can log each *kind* of
    malformed line once without a hostile publisher flooding the log with distinct reasons.
    """

    def __init__(self, message: str, line: object = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        self.line: str = _safe_repr(line)
        self.reason: str = message if reason is None else reason


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
class KeysCommand:
    """``KEYS <key_id>``: the replication keys changed (``streams keys rotate``); ``key_id`` is
    the newest live key. `streams` only: every reader and prover reads the key table again
    (`streams.core.signing`, "retired keys"). Only a hint: the key table is the truth."""

    NAME: ClassVar[str] = "KEYS"
    key_id: int

    def __post_init__(self) -> None:
        _check_token(self.key_id, "key id")


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


# --- Synapse's other commands -----------------------------------------------------------------

#: Every command Synapse defines (``synapse/replication/tcp/commands.py``, current and earlier
#: releases with Redis support) that `streams` never sends. Hearing one on a channel means a
#: Synapse deployment publishes there (see `streams.core.replication`). Over Redis, Synapse sends
#: ``REPLICATE``, ``POSITION``, ``RDATA`` and these; ``SERVER`` and ``NAME`` belong to its old
#: TCP protocol only, and its keep-alive is the Redis ``PING``, not the ``PING`` command.
SYNAPSE_ONLY_COMMANDS: Final[frozenset[str]] = frozenset(
    {
        "USER_SYNC",  # <instance_id> <user_id> [<device_id>] start|end <last_sync_ms>
        "CLEAR_USER_SYNC",  # <instance_id>
        "FEDERATION_ACK",  # <instance_name> <token>
        "USER_IP",  # <user_id> <json [access_token, ip, user_agent, device_id, last_seen]>
        "REMOTE_SERVER_UP",  # <server>
        "LOCK_RELEASED",  # <json [instance_name, lock_name, lock_key]>
        "NEW_ACTIVE_TASK",  # <task_id>
        "USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES",  # arbitrary data (Synapse <1.99)
    }
)

_INT_RE: Final = re.compile(r"-?[0-9]{1,19}")


def _check_int(text: str, what: str) -> None:
    # Synapse writes str(int); accept exactly that form (it also accepts what int() takes, but a
    # genuine Synapse line never has it).
    if _INT_RE.fullmatch(text) is None:
        raise ProtocolError(f"{what} is not a decimal integer", text)


def _check_json_array(text: str, length: int, what: str) -> None:
    value = _decode_json(text)
    if not isinstance(value, list) or len(value) != length:
        raise ProtocolError(f"{what} must be a JSON array of {length} values", text)


def _check_user_sync(args: str) -> None:
    # Synapse >= 1.95 sends the device ID ("None" when absent), earlier releases did not.
    fields = args.split(" ")
    if len(fields) not in (4, 5):
        raise ProtocolError("USER_SYNC takes 4 or 5 arguments")
    for field in fields[:-2]:
        _check_name(field, "USER_SYNC field")
    if fields[-2] not in ("start", "end"):
        raise ProtocolError("USER_SYNC state must be start or end", fields[-2])
    _check_int(fields[-1], "USER_SYNC last_sync_ms")


def _check_federation_ack(args: str) -> None:
    fields = args.split(" ")
    if len(fields) != 2:
        raise ProtocolError("FEDERATION_ACK takes 2 arguments")
    _check_name(fields[0], "FEDERATION_ACK instance name")
    _check_int(fields[1], "FEDERATION_ACK token")


def _check_user_ip(args: str) -> None:
    user_id, space, json_text = args.partition(" ")
    if not space:
        raise ProtocolError("USER_IP takes 2 arguments")
    _check_name(user_id, "USER_IP user ID")
    _check_json_array(json_text, 5, "USER_IP data")


def _check_one_name(what: str) -> Callable[[str], None]:
    def check(args: str) -> None:
        _check_name(args, what)

    return check


def _check_any(args: str) -> None:
    """A free-form ``_SimpleCommand`` argument: any text (checked by the caller)."""


_FOREIGN_CHECKS: Final[Mapping[str, Callable[[str], None]]] = MappingProxyType(
    {
        "USER_SYNC": _check_user_sync,
        "CLEAR_USER_SYNC": _check_one_name("CLEAR_USER_SYNC instance ID"),
        "FEDERATION_ACK": _check_federation_ack,
        "USER_IP": _check_user_ip,
        "REMOTE_SERVER_UP": _check_one_name("REMOTE_SERVER_UP server name"),
        "LOCK_RELEASED": lambda args: _check_json_array(args, 3, "LOCK_RELEASED data"),
        "NEW_ACTIVE_TASK": _check_one_name("NEW_ACTIVE_TASK task ID"),
        "USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES": _check_any,
    }
)
assert set(_FOREIGN_CHECKS) == SYNAPSE_ONLY_COMMANDS


@dataclass(frozen=True, slots=True)
class ForeignCommand:
    """A command Synapse defines and `streams` never sends (``name`` in `SYNAPSE_ONLY_COMMANDS`).

    ``args`` is the argument string, verbatim (so it round-trips byte for byte); construction
    checks its shape the way Synapse's parser would: field counts, integers, JSON arrays.
    Serialized like Synapse does, as ``NAME + " " + args`` (a trailing space when empty).
    """

    name: str
    args: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in SYNAPSE_ONLY_COMMANDS:
            raise ProtocolError("not a Synapse-only command name", self.name)
        _check_text(self.args, f"{self.name} arguments")
        _FOREIGN_CHECKS[self.name](self.args)


#: The commands `streams` uses, one class each (``COMMANDS``).
TypedCommand: TypeAlias = (
    ReplicateCommand
    | PositionCommand
    | RdataCommand
    | KeysCommand
    | PingCommand
    | ErrorCommand
    | ServerCommand
    | NameCommand
)
Command: TypeAlias = TypedCommand | ForeignCommand

#: Wire name -> command class, for every command this module understands.
COMMANDS: Final[Mapping[str, type[TypedCommand]]] = MappingProxyType(
    {
        ReplicateCommand.NAME: ReplicateCommand,
        PositionCommand.NAME: PositionCommand,
        RdataCommand.NAME: RdataCommand,
        KeysCommand.NAME: KeysCommand,
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
    raise ProtocolError(f"non-finite number {name} in JSON", reason="non-finite number in JSON")


def _parse_float(text: str) -> float:
    # parse_constant only sees the literals NaN/Infinity; "1e400" overflows to inf via float()
    # and would then fail to re-encode, so it is rejected here too.
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"non-finite number {text} in JSON", reason="non-finite number in JSON")
    return value


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_parse_float)


def _decode_json(text: str) -> JsonValue:
    try:
        value: JsonValue = _DECODER.decode(text)
    except ProtocolError:
        raise
    except ValueError as exc:
        raise ProtocolError(f"malformed JSON: {exc}", text, reason="malformed JSON") from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply", text) from None
    return value


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
    row = _decode_json(row_json)
    return RdataCommand(stream, instance, parsed_token, row)


def _parse_keys(args: str) -> KeysCommand:
    return KeysCommand(_parse_token(args, "key id"))


_PARSERS: Final[Mapping[str, Callable[[str], Command]]] = MappingProxyType(
    {
        ReplicateCommand.NAME: _parse_replicate,
        PositionCommand.NAME: _parse_position,
        RdataCommand.NAME: _parse_rdata,
        KeysCommand.NAME: _parse_keys,
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
        if parser is not None:
            return parser(args)
        if name in SYNAPSE_ONLY_COMMANDS:
            return ForeignCommand(name, args)
        raise ProtocolError(f"unknown command {name[:50]!r}", reason="unknown command")
    except ProtocolError as exc:
        # Re-raise with the whole line attached, whichever field the check was looking at.
        raise ProtocolError(str(exc), data, reason=exc.reason) from None
    except (ValueError, RecursionError) as exc:  # defensive: every check raises ProtocolError
        raise ProtocolError(f"malformed line: {exc}", data, reason="malformed line") from None


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
        case KeysCommand():
            line = f"{cmd.NAME} {int(cmd.key_id)}"
        case PingCommand():
            line = f"{cmd.NAME} {cmd.data}"
        case ErrorCommand():
            line = f"{cmd.NAME} {cmd.message}"
        case ServerCommand() | NameCommand():
            line = f"{cmd.NAME} {cmd.name}"
        case ForeignCommand():
            line = f"{cmd.name} {cmd.args}"
        case _:
            raise TypeError(f"not a replication command: {type(cmd).__name__}")
    encoded = line.encode("utf-8")
    if len(encoded) > MAX_LINE_BYTES:
        raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes", encoded)
    return encoded
