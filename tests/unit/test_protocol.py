"""Tests for the sans-IO replication protocol codec (streams.core.protocol)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.protocol import (
    COMMANDS,
    MAX_LINE_BYTES,
    MAX_TOKEN,
    SYNAPSE_ONLY_COMMANDS,
    Command,
    ErrorCommand,
    ForeignCommand,
    JsonValue,
    KeysCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    ProtocolError,
    RdataCommand,
    ReplicateCommand,
    ServerCommand,
    parse,
    serialize,
)

LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"

# --- exact bytes ------------------------------------------------------------------------------

EXAMPLES: list[tuple[bytes, Command]] = [
    (b"REPLICATE", ReplicateCommand()),
    (b"POSITION events master 1 2", PositionCommand("events", "master", 1, 2)),
    (b'RDATA events master batch {"a":1}', RdataCommand("events", "master", None, {"a": 1})),
    (
        b'RDATA events master 12 {"event_id":"$x","room":"!r"}',
        RdataCommand("events", "master", 12, {"event_id": "$x", "room": "!r"}),
    ),
    (
        b'RDATA presence master 59 ["@baz:example.com","online",null]',
        RdataCommand("presence", "master", 59, ["@baz:example.com", "online", None]),
    ),
    (b"PING 1700000000000", PingCommand("1700000000000")),
    (b"ERROR something went wrong", ErrorCommand("something went wrong")),
    (b"SERVER example.com", ServerCommand("example.com")),
    (b"NAME event_persister-1", NameCommand("event_persister-1")),
    (b"KEYS 42", KeysCommand(42)),
    (b"POSITION events w 0 9223372036854775807", PositionCommand("events", "w", 0, MAX_TOKEN)),
    (
        b'LOCK_RELEASED ["master","purge_lock","!r:example.com"]',
        ForeignCommand("LOCK_RELEASED", '["master","purge_lock","!r:example.com"]'),
    ),
    (
        b"USER_SYNC sync1 @a:example.com DEV start 1700000000000",
        ForeignCommand("USER_SYNC", "sync1 @a:example.com DEV start 1700000000000"),
    ),
    (b"USER_SYNC sync1 @a:x end 5", ForeignCommand("USER_SYNC", "sync1 @a:x end 5")),
    (b"CLEAR_USER_SYNC sync1", ForeignCommand("CLEAR_USER_SYNC", "sync1")),
    (b"FEDERATION_ACK fed1 2219", ForeignCommand("FEDERATION_ACK", "fed1 2219")),
    (
        b'USER_IP @a:x ["tok","10.0.0.1","Mozilla/5.0 (X11)","DEV",17]',
        ForeignCommand("USER_IP", '@a:x ["tok","10.0.0.1","Mozilla/5.0 (X11)","DEV",17]'),
    ),
    (b"REMOTE_SERVER_UP matrix.org", ForeignCommand("REMOTE_SERVER_UP", "matrix.org")),
    (b"NEW_ACTIVE_TASK AbCdEf", ForeignCommand("NEW_ACTIVE_TASK", "AbCdEf")),
    (
        b"USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES ",
        ForeignCommand("USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES", ""),
    ),
]


@pytest.mark.parametrize(("line", "cmd"), EXAMPLES)
def test_exact_bytes(line: bytes, cmd: Command) -> None:
    assert serialize(cmd) == line
    assert parse(line) == cmd
    assert parse(line.decode("utf-8")) == cmd


def test_commands_mapping() -> None:
    assert set(COMMANDS) == {
        "REPLICATE", "POSITION", "RDATA", "KEYS", "PING", "ERROR", "SERVER", "NAME"
    }  # fmt: skip
    for name, cls in COMMANDS.items():
        assert name == cls.NAME
    # Every other command Synapse defines (synapse/replication/tcp/commands.py).
    assert {
        "USER_SYNC",
        "CLEAR_USER_SYNC",
        "FEDERATION_ACK",
        "USER_IP",
        "REMOTE_SERVER_UP",
        "LOCK_RELEASED",
        "NEW_ACTIVE_TASK",
    } <= SYNAPSE_ONLY_COMMANDS
    assert not SYNAPSE_ONLY_COMMANDS & set(COMMANDS)


def test_foreign_forms() -> None:
    # A free-form command with empty data arrives as NAME + " " (Synapse) or bare NAME.
    name = "USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES"
    assert parse(name) == parse(name + " ") == ForeignCommand(name, "")
    # JSON with spaces from another encoder is kept verbatim (it round-trips byte for byte).
    line = b'LOCK_RELEASED ["a", "b", "c"]'
    assert serialize(parse(line)) == line
    assert parse(b"NEW_ACTIVE_TASK x").name == "NEW_ACTIVE_TASK"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("FOO", ""),
        ("lock_released", "[1,2,3]"),
        ("POSITION", "s i 1 2"),  # ours: typed, never foreign
        (1, ""),
    ],
)
def test_foreign_command_names(name: Any, args: str) -> None:
    with pytest.raises(ProtocolError):
        ForeignCommand(name, args)


def test_json_is_synapse_compatible() -> None:
    # Synapse's json_encoder: compact separators, ensure_ascii (the default), no NaN.
    row: JsonValue = {"body": "héllo ☃ 😀", "n": [1, 2.5, None, True]}
    line = serialize(RdataCommand("events", "master", 3, row))
    expected = json.dumps(row, separators=(",", ":"), allow_nan=False)
    assert line == b"RDATA events master 3 " + expected.encode("ascii")
    assert parse(line) == RdataCommand("events", "master", 3, row)


def test_synapse_forms_accepted() -> None:
    # Synapse publishes NAME + " " + to_line(), so REPLICATE arrives with a trailing space.
    assert parse(b"REPLICATE ") == ReplicateCommand()
    # JSON with spaces (split(" ", 3) keeps them) and non-ASCII UTF-8 from other encoders.
    assert parse('RDATA s i 5 {"a": [1, 2], "b": "x y"}') == RdataCommand(
        "s", "i", 5, {"a": [1, 2], "b": "x y"}
    )
    assert parse('RDATA s i 5 "☃"'.encode()) == RdataCommand("s", "i", 5, "☃")
    assert parse(b"PING") == PingCommand("")
    assert parse(b"ERROR a  b ") == ErrorCommand("a  b ")


def test_batch_semantics() -> None:
    rows: list[JsonValue] = [["@foo", "online"], ["@bar", "online"], ["@baz", "offline"]]
    lines = [
        serialize(RdataCommand("presence", "master", None if i < 2 else 59, row))
        for i, row in enumerate(rows)
    ]
    assert lines[0] == b'RDATA presence master batch ["@foo","online"]'
    assert lines[2] == b'RDATA presence master 59 ["@baz","offline"]'
    # A reader buffers "batch" rows until the numbered one, then the whole batch has that token.
    pending: list[JsonValue] = []
    delivered: list[tuple[int, JsonValue]] = []
    for line in lines:
        cmd = parse(line)
        assert isinstance(cmd, RdataCommand)
        pending.append(cmd.row)
        if cmd.token is not None:
            delivered.extend((cmd.token, row) for row in pending)
            pending.clear()
    assert delivered == [(59, row) for row in rows]
    # The word is case-sensitive and exact, like Synapse.
    for bad in (b"RDATA s i Batch []", b"RDATA s i BATCH []", b"RDATA s i batch2 []"):
        with pytest.raises(ProtocolError):
            parse(bad)


# --- rejection --------------------------------------------------------------------------------

MALFORMED: list[bytes | str] = [
    b"",
    "",
    b" ",
    b"FOO bar",
    b"position events master 1 2",  # names are case-sensitive
    b"REPLICATE x",
    b"POSITION events master 1",
    b"POSITION events master 1 2 3",
    b"POSITION events  master 1 2",  # empty name
    b"POSITION events master -1 2",
    b"POSITION events master +1 2",
    b"POSITION events master 01 2",
    b"POSITION events master 1_0 2",
    b"POSITION events master 1 9223372036854775808",
    b"POSITION events master 1 99999999999999999999",
    "POSITION events master \u0661 2",  # Arabic-Indic digit: int() would accept it
    b"POSITION events master 1 2\n",
    b"POSITION events master 1 2\r",
    b"POSITION events\nmaster 1 2",
    b"RDATA events master 1",
    b"RDATA events master 1 ",
    b"RDATA events master 1 {bad json}",
    b"RDATA events master 1 [1,2",
    b"RDATA events master 1 NaN",
    b"RDATA events master 1 [Infinity]",
    b'RDATA events master 1 {"x":-Infinity}',
    b"RDATA events master 1 1e400",
    b"RDATA events master 1 [] []",
    b"RDATA events master x []",
    b"RDATA events master 1 " + b"[" * 100_000 + b"]" * 100_000,
    b"RDATA ev\x00ents master 1 []",
    b"SERVER",
    b"SERVER two words",
    b"NAME ",
    b"NAME tab\there",
    b"PING a\x85b",
    "PING a\u2028b",
    b"ERROR two\nlines",
    b"PING \xff",  # invalid UTF-8
    b"PING \xed\xa0\x80",  # UTF-8-encoded surrogate: invalid
    "PING \ud800",  # lone surrogate: not encodable
    b"\xef\xbb\xbfPING 1",  # a BOM is not part of the name
    # Synapse-only commands with the wrong shape:
    b"LOCK_RELEASED",
    b"LOCK_RELEASED []",
    b'LOCK_RELEASED ["a","b"]',
    b'LOCK_RELEASED {"a":1}',
    b"LOCK_RELEASED [NaN,1,2]",
    b'LOCK_RELEASED ["a","b","c"',
    b"USER_SYNC a b start",
    b"USER_SYNC a b c d start 1",
    b"USER_SYNC a b going 1",
    b"USER_SYNC a b c start x",
    b"USER_SYNC a  start 1",
    b"CLEAR_USER_SYNC",
    b"CLEAR_USER_SYNC a b",
    b"FEDERATION_ACK a",
    b"FEDERATION_ACK a 1 2",
    b"FEDERATION_ACK a one",
    b"USER_IP @a:x",
    b"USER_IP @a:x [1,2,3,4]",
    b"USER_IP @a:x nope",
    b"REMOTE_SERVER_UP",
    b"REMOTE_SERVER_UP a b",
    b"NEW_ACTIVE_TASK",
    "USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES a\u2028b",
    b"Lock_Released [1,2,3]",
]


@pytest.mark.parametrize("line", MALFORMED)
def test_malformed_lines_raise_protocol_error(line: bytes | str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(line)
    assert isinstance(info.value, ValueError)
    assert len(info.value.line) <= 200
    assert info.value.reason


def test_reasons_do_not_depend_on_content() -> None:
    """A link logs each reason once: a publisher varying names, offsets or numbers must not
    be able to make up new reasons."""
    families = [
        [f"FOO{i} x".encode() for i in range(5)],
        [b"RDATA s i 1 " + b"[" * i + b"x" for i in range(1, 6)],
        [f"RDATA s i 1 [1e{400 + i}]".encode() for i in range(5)],
        [f"LOCK_RELEASED [{',' * i}]".encode() for i in range(1, 6)],
    ]
    for family in families:
        reasons = set()
        for line in family:
            with pytest.raises(ProtocolError) as info:
                parse(line)
            reasons.add(info.value.reason)
        assert len(reasons) == 1, reasons


def test_oversized_line() -> None:
    big = b"PING " + b"1" * MAX_LINE_BYTES
    with pytest.raises(ProtocolError, match="longer"):
        parse(big)
    with pytest.raises(ProtocolError, match="longer"):
        parse(big.decode())
    # Multi-byte characters count as bytes, not characters.
    with pytest.raises(ProtocolError, match="longer"):
        parse("PING " + "☃" * (MAX_LINE_BYTES // 3 + 1))
    just_fits = b"PING " + b"1" * (MAX_LINE_BYTES - 5)
    assert parse(just_fits) == PingCommand("1" * (MAX_LINE_BYTES - 5))
    with pytest.raises(ProtocolError, match="longer"):
        serialize(RdataCommand("s", "i", 1, "x" * MAX_LINE_BYTES))


def test_error_line_is_short_and_safe() -> None:
    with pytest.raises(ProtocolError) as info:
        parse(b"BOGUS " + b"\n\x00" * 10_000)
    line = info.value.line
    assert len(line) <= 200
    assert "\n" not in line
    assert line.startswith("b'BOGUS")


def test_non_line_input() -> None:
    with pytest.raises(ProtocolError):
        parse(123)  # type: ignore[arg-type]
    assert parse(bytearray(b"REPLICATE")) == ReplicateCommand()  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_rejected_on_serialize(value: float) -> None:
    with pytest.raises(ProtocolError):
        serialize(RdataCommand("s", "i", 1, {"x": [value]}))


def test_unencodable_rows_rejected_on_serialize() -> None:
    circular: list[Any] = []
    circular.append(circular)
    rows: list[Any] = [circular, {"x": {1, 2}}, object()]
    for row in rows:
        with pytest.raises(ProtocolError):
            serialize(RdataCommand("s", "i", 1, row))


@pytest.mark.parametrize("bad", ["", "a b", "a\nb", "a\rb", "a\tb", "a\x00b", "a\u2028b", "\ud800"])
def test_bad_names_rejected_on_construction(bad: str) -> None:
    with pytest.raises(ProtocolError):
        PositionCommand(bad, "master", 1, 2)
    with pytest.raises(ProtocolError):
        RdataCommand("events", bad, None, [])
    with pytest.raises(ProtocolError):
        ServerCommand(bad)
    with pytest.raises(ProtocolError):
        NameCommand(bad)


@pytest.mark.parametrize("bad", [*LINE_BREAKS, "\ud800"])
def test_bad_text_rejected_on_construction(bad: str) -> None:
    with pytest.raises(ProtocolError):
        ErrorCommand(f"oops{bad}more")
    with pytest.raises(ProtocolError):
        PingCommand(bad)


@pytest.mark.parametrize("bad", [-1, MAX_TOKEN + 1, True, 1.0, "1", None])
def test_bad_tokens_rejected(bad: Any) -> None:
    with pytest.raises(ProtocolError):
        PositionCommand("s", "i", bad, 2)
    with pytest.raises(ProtocolError):
        PositionCommand("s", "i", 1, bad)
    if bad is not None:
        with pytest.raises(ProtocolError):
            RdataCommand("s", "i", bad, [])


def test_serialize_rejects_non_commands() -> None:
    with pytest.raises(TypeError):
        serialize("REPLICATE")  # type: ignore[arg-type]


# --- properties -------------------------------------------------------------------------------

names = st.text(st.characters(categories=("L", "M", "N", "P", "S")), min_size=1, max_size=20)
# codec="utf-8" leaves out lone surrogates, which cannot be sent.
texts = st.text(st.characters(codec="utf-8", exclude_characters=LINE_BREAKS))
tokens = st.integers(min_value=0, max_value=MAX_TOKEN)
json_values: st.SearchStrategy[JsonValue] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=12,
)

commands: st.SearchStrategy[Command] = st.one_of(
    st.just(ReplicateCommand()),
    st.builds(PositionCommand, names, names, tokens, tokens),
    st.builds(RdataCommand, names, names, st.none() | tokens, json_values),
    st.builds(PingCommand, texts),
    st.builds(ErrorCommand, texts),
    st.builds(ServerCommand, names),
    st.builds(NameCommand, names),
    st.builds(KeysCommand, tokens),
    st.builds(
        ForeignCommand,
        st.just("LOCK_RELEASED"),
        st.lists(json_values, min_size=3, max_size=3).map(json.dumps),
    ),
    st.builds(
        ForeignCommand,
        st.just("USER_SYNC"),
        st.builds(
            lambda i, u, d, state, ms: " ".join([i, u, *d, state, str(ms)]),
            names,
            names,
            st.lists(names, max_size=1),
            st.sampled_from(["start", "end"]),
            st.integers(-(2**62), 2**62),
        ),
    ),
    st.builds(
        ForeignCommand,
        st.just("FEDERATION_ACK"),
        st.builds(lambda n, t: f"{n} {t}", names, tokens),
    ),
    st.builds(
        ForeignCommand,
        st.just("USER_IP"),
        st.builds(
            lambda u, v: f"{u} {json.dumps(v, separators=(',', ':'))}",
            names,
            st.lists(json_values, min_size=5, max_size=5),
        ),
    ),
    st.builds(
        ForeignCommand,
        st.sampled_from(["CLEAR_USER_SYNC", "REMOTE_SERVER_UP", "NEW_ACTIVE_TASK"]),
        names,
    ),
    st.builds(
        ForeignCommand, st.just("USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES"), texts
    ),
)


@given(commands)
def test_round_trip(cmd: Command) -> None:
    line = serialize(cmd)
    assert b"\n" not in line
    assert b"\r" not in line
    assert parse(line) == cmd
    assert parse(line.decode("utf-8")) == cmd
    # Serialization is canonical: a second trip gives the same bytes.
    assert serialize(parse(line)) == line


def _parse_total(data: bytes | str) -> None:
    """parse() returns a command that re-serializes, or raises ProtocolError; nothing else."""
    try:
        cmd = parse(data)
    except ProtocolError as exc:
        assert len(exc.line) <= 200
        return
    assert type(cmd) in {*COMMANDS.values(), ForeignCommand}
    assert parse(serialize(cmd)) == cmd


@given(st.binary(max_size=200))
def test_arbitrary_bytes(data: bytes) -> None:
    _parse_total(data)


@given(st.text(max_size=200))
def test_arbitrary_text(data: str) -> None:
    _parse_total(data)


@given(
    st.sampled_from(sorted({*COMMANDS, *SYNAPSE_ONLY_COMMANDS})),
    st.text(st.sampled_from(' 0123456789-batch{}[]":,.eE\nNaInfy\u2028éstd'), max_size=60),
)
def test_arbitrary_arguments(name: str, args: str) -> None:
    # Plausible names with junk arguments reach the per-command parsers, not just the dispatcher.
    _parse_total(f"{name} {args}")
    _parse_total(f"{name} {args}".encode(errors="surrogatepass"))


@given(commands, st.binary(min_size=1, max_size=8), st.integers(min_value=0))
def test_corrupted_lines(cmd: Command, junk: bytes, where: int) -> None:
    line = serialize(cmd)
    where %= len(line) + 1
    _parse_total(line[:where] + junk + line[where:])
    _parse_total(line[:where])


@pytest.mark.parametrize("bad", [b"KEYS", b"KEYS ", b"KEYS -1", b"KEYS 01", b"KEYS 1 2", b"KEYS x"])
def test_keys_takes_one_canonical_id(bad: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse(bad)
