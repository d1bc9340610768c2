"""Tests for the replication state machines (streams.core.replication), against simple models.

* `Announcer`: the Synapse rule. When the per-writer position moves from ``a`` to ``b``: one RDATA
  per recorded append whose last ID is in ``(a, b]`` (increasing token = last ID), then
  ``POSITION a' b`` iff ``b`` is beyond the last RDATA token ``a'`` (or ``a``). Histories
  interleave commits (in any order) with position updates (moving up, or not).
* `LinkCore`: a model of which lines are malformed (`parse` raises), echoes (from a registered
  local writer), hints (from anyone else) or ``REPLICATE`` requests; membership as a dict of
  writers and a reader count that never goes below zero.
* `backoff_delay`: capped exponential, jitter scaling into ``[0.5, 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.protocol import (
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
from streams.core.replication import (
    LISTENERS_INTERVAL,
    REFRESH_INTERVAL,
    Announcer,
    ForeignDeployment,
    Hint,
    LinkCore,
    backoff_delay,
    foreign_verdict,
    is_keys_hint,
    is_proof_hint,
)

S, W = "events", "w1"
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"

# --- Announcer --------------------------------------------------------------------------------


@dataclass
class AnnouncerModel:
    announced: int
    pending: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)  # last -> ...

    def update(self, position: int) -> list[Command]:
        if position <= self.announced:
            return []
        out: list[Command] = []
        for last in sorted(self.pending):
            ids, ts = self.pending[last]
            if self.announced < last <= position:
                out.append(RdataCommand(S, W, last, {"first": ids[0], "count": len(ids), "ts": ts}))
        self.pending = {k: v for k, v in self.pending.items() if k > position}
        prev = out[-1].token if out and isinstance(out[-1], RdataCommand) else self.announced
        assert prev is not None
        if position > prev:
            out.append(PositionCommand(S, W, prev, position))
        self.announced = position
        return out


@st.composite
def appends(draw: st.DrawFn) -> tuple[int, list[tuple[int, ...]], int]:
    """(initial position, ID ranges of the appends, max allocated), gaps being rollbacks."""
    start = draw(st.integers(0, 20))
    ranges: list[tuple[int, ...]] = []
    nxt = start + 1
    for _ in range(draw(st.integers(0, 8))):
        nxt += draw(st.integers(0, 3))
        size = draw(st.integers(1, 4))
        ranges.append(tuple(range(nxt, nxt + size)))
        nxt += size
    return start, ranges, nxt - 1 + draw(st.integers(0, 3))


def check_round_trip(commands: list[Command]) -> None:
    for cmd in commands:
        assert parse(serialize(cmd)) == cmd


def check_shape(commands: list[Command], before: int, position: int) -> None:
    """RDATA only, then at most one POSITION ending at ``position``, contiguous tokens."""
    *rdata, last = commands
    assert all(isinstance(c, RdataCommand) for c in rdata)
    prev = before
    for cmd in commands:
        if isinstance(cmd, RdataCommand):
            assert cmd.token is not None and prev < cmd.token <= position
            prev = cmd.token
        else:
            assert cmd is last
            assert cmd == PositionCommand(S, W, prev, position)
            prev = position
    assert prev == position


@given(appends(), st.data())
def test_announcer_realistic_history(
    history: tuple[int, list[tuple[int, ...]], int], data: st.DataObject
) -> None:
    """Positions never pass an uncommitted append nor stop inside one: each append is announced
    exactly once, when the position reaches its last ID, and POSITION ranges hold none of ours."""
    start, ranges, end = history
    announcer = Announcer(S, W, start)
    committed: dict[int, int] = {}  # append index -> timestamp
    announced = start
    tokens: list[int] = []
    for commit in data.draw(st.lists(st.booleans(), max_size=25)):
        left = [i for i in range(len(ranges)) if i not in committed]
        if commit and left:
            i = data.draw(st.sampled_from(left))
            committed[i] = data.draw(st.integers(0, 2**45))
            announcer.committed(ranges[i], committed[i])
            continue
        frontier = ranges[min(left)][0] - 1 if left else end
        inside = {p for ids in ranges for p in ids[:-1]}
        position = data.draw(st.sampled_from([p for p in range(start - 2, frontier + 1)
                                              if p not in inside]))  # fmt: skip
        commands = announcer.update(position)
        check_round_trip(commands)
        if position <= announced:
            assert commands == []
        else:
            check_shape(commands, announced, position)
            for cmd in commands:
                if isinstance(cmd, RdataCommand):
                    assert cmd.token is not None
                    i = next(i for i, ids in enumerate(ranges) if ids[-1] == cmd.token)
                    ids = ranges[i]
                    assert cmd.row == {"first": ids[0], "count": len(ids), "ts": committed[i]}
                    tokens.append(cmd.token)
                elif isinstance(cmd, PositionCommand):  # none of our rows in (prev, new]
                    assert not any(cmd.prev_token < x <= cmd.new_token for r in ranges for x in r)
            announced = position
        assert announcer.announced == announced
        assert announcer.announce() == PositionCommand(S, W, announced, announced)
    # Finish: commit the rest, move to max allocated.
    for i in range(len(ranges)):
        if i not in committed:
            committed[i] = 0
            announcer.committed(ranges[i], 0)
    commands = announcer.update(end)
    check_round_trip(commands)
    tokens.extend(c.token for c in commands if isinstance(c, RdataCommand) and c.token is not None)
    assert tokens == sorted(set(tokens))  # strictly increasing across the whole history
    assert tokens == [ids[-1] for ids in ranges]  # each append exactly once
    assert announcer.update(end) == []
    assert announcer.announce() == PositionCommand(S, W, end, end)


@given(st.integers(0, 20), st.data())
def test_announcer_arbitrary_history(start: int, data: st.DataObject) -> None:
    """Commits at any time (even after the position passed them) and any updates: exactly the
    model's commands; late commits are never announced; tokens strictly increase."""
    announcer = Announcer(S, W, start)
    model = AnnouncerModel(start)
    starts = data.draw(
        st.lists(st.integers(max(1, start - 3), start + 40), unique=True, max_size=8)
    )
    sizes = [data.draw(st.integers(1, 3)) for _ in starts]
    ranges = [tuple(range(a, a + n)) for a, n in zip(starts, sizes, strict=True)]
    ranges = [r for r in ranges if not any(set(r) & set(q) for q in ranges if q is not r)]
    order = data.draw(st.permutations(ranges))
    rdata: list[int] = []
    late: set[int] = set()
    for ids in [*order, None, None, None]:
        for position in data.draw(st.lists(st.integers(start - 3, start + 45), max_size=3)):
            before = announcer.announced
            commands = announcer.update(position)
            assert commands == model.update(position)
            check_round_trip(commands)
            if commands:
                check_shape(commands, before, position)
            rdata.extend(
                c.token for c in commands if isinstance(c, RdataCommand) and c.token is not None
            )
            assert announcer.announced == max(before, position)
        if ids is not None:
            if ids[-1] <= announcer.announced:
                late.add(ids[-1])
            announcer.committed(ids, ids[0] * 10)
            model.pending[ids[-1]] = (ids, ids[0] * 10)
    assert rdata == sorted(set(rdata))
    assert not late & set(rdata)
    assert announcer.announce() == PositionCommand(S, W, model.announced, model.announced)


def test_announcer_examples() -> None:
    a = Announcer(S, W, 10)
    a.committed((), 5)  # nothing
    a.committed((14, 15), 7)
    a.committed((11,), 6)
    assert a.update(12) == [RdataCommand(S, W, 11, {"first": 11, "count": 1, "ts": 6}),
                            PositionCommand(S, W, 11, 12)]  # fmt: skip
    assert a.update(12) == a.update(3) == []
    assert a.update(15) == [RdataCommand(S, W, 15, {"first": 14, "count": 2, "ts": 7})]
    assert a.update(20) == [PositionCommand(S, W, 15, 20)]
    assert a.announce() == PositionCommand(S, W, 20, 20)


# --- LinkCore ---------------------------------------------------------------------------------

STREAMS = st.sampled_from(["s1", "s2"])
INSTANCES = st.sampled_from(["w1", "w2", "w3"])
TOKENS = st.integers(0, 50) | st.integers(0, MAX_TOKEN)
TEXT = st.text(st.characters(codec="utf-8", exclude_characters=LINE_BREAKS), max_size=8)
NAMES = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=6)
ROWS: st.SearchStrategy[JsonValue] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | TEXT
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
COMMANDS: st.SearchStrategy[Command] = st.one_of(
    st.just(ReplicateCommand()),
    st.builds(PositionCommand, STREAMS, INSTANCES, TOKENS, TOKENS),
    st.builds(RdataCommand, STREAMS, INSTANCES, st.none() | TOKENS, ROWS),
    st.builds(PingCommand, TEXT),
    st.builds(ErrorCommand, TEXT),
    st.builds(ServerCommand, NAMES),
    st.builds(NameCommand, NAMES),
    st.builds(
        ForeignCommand,
        st.sampled_from(["CLEAR_USER_SYNC", "REMOTE_SERVER_UP", "NEW_ACTIVE_TASK"]),
        NAMES,
    ),
    st.builds(ForeignCommand, st.just("LOCK_RELEASED"), st.just('["w1","lock","key"]')),
)
WRITERS = st.dictionaries(st.tuples(STREAMS, INSTANCES), st.integers(0, 100), max_size=4)


@st.composite
def mutated_lines(draw: st.DrawFn) -> bytes:
    line = bytearray(serialize(draw(COMMANDS)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(line)))
        match draw(st.sampled_from(["insert", "delete", "replace", "truncate", "double"])):
            case "insert":
                line[i:i] = draw(
                    st.binary(min_size=1, max_size=3)
                    | st.sampled_from(
                        [b" ", b"\n", b"\r", b"\xff", b"\xc2\x85", b"-", b"0", b"batch", b"{"]
                    )
                )
            case "delete":
                del line[i : i + draw(st.integers(1, 3))]
            case "replace" if i < len(line):
                line[i] = draw(st.integers(0, 255))
            case "truncate":
                del line[i:]
            case _:
                line[i:i] = line[:i]
    return bytes(line)


def surrogates() -> st.SearchStrategy[str]:
    return st.text(st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))


def make_core(writers: dict[tuple[str, str], int], readers: int = 0) -> LinkCore:
    core = LinkCore("pfx", "me")
    for (stream, instance), position in writers.items():
        core.add_writer(Announcer(stream, instance, position))
    for _ in range(readers):
        core.add_reader()
    return core


def expected_outcome(
    cmd: Command, writers: dict[tuple[str, str], int], foreign: bool = False
) -> tuple[list[Hint], list[bytes], bool]:
    """(hints, replies, is an echo) for a well-formed command; ``foreign``: the channel was
    found to be another deployment's before (or by) this command."""
    if isinstance(cmd, ReplicateCommand):
        if foreign:
            return [], [], False
        return [], [serialize(PositionCommand(s, i, p, p)) for (s, i), p in writers.items()], False
    if isinstance(cmd, PositionCommand | RdataCommand):
        if (cmd.stream_name, cmd.instance_name) in writers:
            return [], [], True
        token = cmd.new_token if isinstance(cmd, PositionCommand) else cmd.token
        hints = [] if token is None else [Hint(cmd.stream_name, token, cmd.instance_name)]
        return hints, [], False
    return [], [], False


@given(WRITERS, st.binary() | surrogates() | mutated_lines() | COMMANDS.map(serialize))
def test_on_message_any_input(writers: dict[tuple[str, str], int], data: bytes | str) -> None:
    core = make_core(writers)
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    try:
        cmd: Command | None = parse(raw)
    except ProtocolError:
        cmd = None
    hints, replies = core.on_message(data, 0.0)  # never raises
    stats = core.stats
    assert stats.received == 1
    if cmd is None:
        assert (hints, replies) == ([], [])
        assert (stats.malformed, stats.hints, stats.replicate_requests) == (1, 0, 0)
        return
    want_hints, want_replies, echo = expected_outcome(cmd, writers)
    assert (hints, replies) == (want_hints, want_replies)
    assert stats.malformed == 0
    if echo:  # our own line: nothing to do, nobody to hint
        assert (hints, replies, stats.hints) == ([], [], 0)
    assert stats.hints == len(hints)
    assert stats.replicate_requests == int(isinstance(cmd, ReplicateCommand))
    foreign = isinstance(cmd, ForeignCommand)
    assert stats.foreign == int(foreign)
    assert (core.foreign is not None) == foreign
    if isinstance(data, bytes) and raw.isascii():
        assert make_core(writers).on_message(raw.decode(), 0.0) == (hints, replies)


@given(WRITERS, st.lists(COMMANDS, max_size=10))
def test_message_sequence_counts(
    writers: dict[tuple[str, str], int], commands: list[Command]
) -> None:
    core = make_core(writers)
    all_hints: list[Hint] = []
    replicates = 0
    foreign = False
    for cmd in commands:
        foreign = foreign or isinstance(cmd, ForeignCommand)
        want_hints, want_replies, echo = expected_outcome(cmd, writers, foreign)
        assert core.on_message(serialize(cmd), 0.0) == (want_hints, want_replies)
        assert core.on_command(cmd, 0.0) == (want_hints, want_replies)
        all_hints += want_hints
        if echo:
            assert (want_hints, want_replies) == ([], [])
        replicates += 2 * isinstance(cmd, ReplicateCommand)
        assert (core.foreign is not None) == foreign
        assert core.on_connected() == ([] if foreign else core.on_connected())
    assert core.stats.foreign == 2 * sum(isinstance(c, ForeignCommand) for c in commands)
    assert core.stats.received == len(commands)
    assert core.stats.hints == 2 * len(all_hints)
    assert core.stats.replicate_requests == replicates
    assert core.stats.malformed == 0


MEMBERSHIP = st.lists(
    st.tuples(st.sampled_from(["add_writer", "remove_writer", "add_reader", "remove_reader"]),
              STREAMS, INSTANCES, st.integers(0, 100)),
    max_size=15,
)  # fmt: skip


@given(MEMBERSHIP)
def test_membership_connect_and_channels(ops: list[tuple[str, str, str, int]]) -> None:
    core = LinkCore("pfx", "me")
    writers: dict[tuple[str, str], int] = {}
    registered: dict[tuple[str, str], Announcer] = {}
    readers = 0
    for op, stream, instance, position in ops:
        if op == "add_writer":
            announcer = Announcer(stream, instance, position)
            core.add_writer(announcer)
            writers[(stream, instance)] = position
            registered[(stream, instance)] = announcer
        elif op == "remove_writer":
            # A stale Announcer under the same name (an old writer detaching after a new one
            # took the name) must not unregister the current one.
            core.remove_writer(Announcer(stream, instance, position))
            current = registered.pop((stream, instance), None)
            if current is not None:
                core.remove_writer(current)
            writers.pop((stream, instance), None)
        elif op == "add_reader":
            core.add_reader()
            readers += 1
        else:
            core.remove_reader()
            readers = max(0, readers - 1)
        lines = [serialize(PositionCommand(s, i, p, p)) for (s, i), p in writers.items()]
        assert core.on_connected() == lines + ([b"REPLICATE"] * (readers > 0))
        instances = sorted({i for _, i in writers} | {"me"})
        channels = core.channels()
        assert channels == ["pfx", *(f"pfx/{i}" for i in instances)]
        assert len(set(channels)) == len(channels)
        assert core.channel == "pfx"
        assert core.on_message(b"REPLICATE ", 0.0) == ([], lines)


@given(WRITERS, st.lists(st.binary(max_size=20) | COMMANDS.map(serialize), max_size=10))
def test_discard_hook(writers: dict[tuple[str, str], int], messages: list[bytes]) -> None:
    core = make_core(writers)
    seen: list[bytes] = []

    def discard(raw: bytes) -> bool:
        seen.append(raw)
        return True

    core.discard = discard
    for message in messages:
        assert core.on_message(message, 0.0) == ([], [])
        assert core.on_message(message.decode("latin-1"), 0.0) == ([], [])
    assert seen == [raw for m in messages for raw in (m, m.decode("latin-1").encode())]
    stats = core.stats
    assert stats.received == 2 * len(messages)
    assert (stats.malformed, stats.hints, stats.replicate_requests) == (0, 0, 0)
    core.discard = lambda raw: not raw.startswith(b"POSITION")
    assert core.on_message(b"POSITION zz w9 1 2", 0.0) == ([Hint("zz", 2, "w9")], [])


@given(st.lists(COMMANDS, max_size=10))
def test_hints_for(commands: list[Command]) -> None:
    expected = []
    for cmd in commands:
        if isinstance(cmd, PositionCommand):
            expected.append(Hint(cmd.stream_name, cmd.new_token, cmd.instance_name))
        elif isinstance(cmd, RdataCommand) and cmd.token is not None:
            expected.append(Hint(cmd.stream_name, cmd.token, cmd.instance_name))
    assert LinkCore.hints_for(commands) == expected
    # What a local writer publishes hints local readers exactly as a remote peer hearing it would.
    remote = make_core({})
    assert [h for c in commands for h in remote.on_command(c, 0.0)[0]] == expected


def test_link_examples() -> None:
    core = make_core({("events", "w1"): 7}, readers=1)
    assert core.on_connected() == [b"POSITION events w1 7 7", b"REPLICATE"]
    assert core.on_message(b"POSITION events w1 7 9", 0.0) == ([], [])  # echo
    assert core.on_message(b"POSITION events w2 7 9", 0.0) == ([Hint("events", 9, "w2")], [])
    assert core.on_message(b'RDATA events w2 batch {"a":1}', 0.0) == ([], [])
    assert core.on_message(b'RDATA events w2 12 {"a":1}', 0.0) == ([Hint("events", 12, "w2")], [])
    assert core.on_message("RDATA events w2 12 {}\n", 0.0) == ([], [])  # malformed
    assert core.on_message(b"\xff", 0.0) == ([], [])
    assert core.on_message("PING \ud800", 0.0) == ([], [])
    assert core.on_message(b"ERROR boom", 0.0) == ([], [])
    assert core.stats.hints == 2
    assert core.stats.malformed == 3
    assert core.channels() == ["pfx", "pfx/me", "pfx/w1"]


def test_channels_follow_what_local_readers_and_provers_need() -> None:
    """Proof channels for every stream a local reader follows, data channels (writers' hints)
    only while someone here uses them; counted, so two readers of a stream need two unwatches.
    A prover's lines go on the proof channel, a writer's on the data channel, the rest on the
    replication channel."""
    core = make_core({("s1", "w1"): 3})
    assert core.channels() == ["pfx", "pfx/me", "pfx/w1"]
    assert core.watch(["s1", "s2"]) and not core.watch(["s1"])
    assert core.watch(["s2"], writers=True)
    assert core.channels() == [
        "pfx", "pfx:proof:s1", "pfx:proof:s2", "pfx:data:s2", "pfx/me", "pfx/w1",
    ]  # fmt: skip
    assert not core.unwatch(["s1"])  # one reader of s1 is left
    assert core.unwatch(["s1", "s2"]) and core.unwatch(["s2"], writers=True)
    assert core.channels() == ["pfx", "pfx/me", "pfx/w1"]
    assert not core.unwatch(["never"])
    assert core.route(PositionCommand("s1", "w1", 1, 2)) == "pfx:data:s1"
    assert core.route(RdataCommand("s1", "w1", 2, {})) == "pfx:data:s1"
    assert core.route(PositionCommand("s1", "_proof:me", 1, 2)) == "pfx:proof:s1"
    assert core.route(RdataCommand("s1", "_proof:me", 2, {})) == "pfx:proof:s1"
    assert core.route(ReplicateCommand()) == "pfx"


def test_writers_lines_stop_where_nobody_listens() -> None:
    """A data channel nobody listened on at the last check gets no more writer lines until a
    check finds a listener; checks are at most every LISTENERS_INTERVAL; other channels are
    never dropped."""
    core = make_core({})
    data, proof = "pfx:data:s1", "pfx:proof:s1"
    lines = [(data, b"RDATA s1 w 1 {}"), (proof, b"POSITION s1 _proof:p 0 1"), ("pfx", b"x")]
    assert core.listeners_due(0.0) == []  # nothing published yet: nothing to ask about
    assert core.drop_unheard(lines) == lines  # not checked yet: published
    assert core.listeners_due(0.0) == [data]
    assert core.listeners_due(0.5) == []  # not again before the interval
    core.on_listeners({data: 0, "pfx:data:other": 3})
    assert core.drop_unheard(lines) == lines[1:]
    assert core.stats.unheard == 1
    assert core.listeners_due(LISTENERS_INTERVAL) == [data]
    core.on_listeners({data: 1})
    assert core.drop_unheard(lines) == lines
    # A REPLICATE (someone starts to listen): everything goes out for an interval, unasked.
    core.on_listeners({data: 0})
    assert core.drop_unheard(lines) == lines[1:]
    core.on_command(ReplicateCommand(), 0.0)
    assert core.drop_unheard(lines) == lines
    assert core.listeners_due(2 * LISTENERS_INTERVAL) == []  # the interval starts now
    assert core.drop_unheard(lines) == lines
    assert core.listeners_due(2.5 * LISTENERS_INTERVAL) == []
    assert core.listeners_due(3 * LISTENERS_INTERVAL) == [data]


def test_a_proof_rdata_hint_carries_its_row() -> None:
    core = make_core({})
    row: JsonValue = {"sig": "ab", "proof": {"key": 1}}
    (hint,), _ = core.on_command(RdataCommand("s1", "_proof:p", 9, row), 0.0)
    assert hint == Hint("s1", 9, "_proof:p", row)
    (plain,), _ = core.on_command(RdataCommand("s1", "w2", 9, row), 0.0)
    assert plain.proof is None  # a writer's row is only a hint


def test_a_keys_line_hints_every_listener_and_is_not_foreign() -> None:
    core = LinkCore("pfx", "me", check_streams=True)
    (hint,), replies = core.on_message(b"KEYS 12", 0.0)
    assert replies == [] and is_keys_hint(hint) and not is_proof_hint(hint)
    assert hint.token == 12 and hint.stream == ""
    assert core.foreign is None and not core.refresh_due(10**6)  # no stream name to suspect
    assert core.route(KeysCommand(12)) == core.channel  # published on the control channel
    (local,) = LinkCore.hints_for([KeysCommand(12)])
    assert is_keys_hint(local)


# --- LinkCore: REPLICATE when a reader attaches ---------------------------------------------


def test_add_reader_replicates_only_when_live() -> None:
    core = make_core({("s1", "w1"): 3})
    assert core.add_reader() == []  # not connected yet: on_connected will send it
    assert core.on_connected() == [b"POSITION s1 w1 3 3", b"REPLICATE"]
    assert core.add_reader() == [b"REPLICATE"]  # connected: this reader asks for itself
    core.on_disconnected()
    assert core.add_reader() == []
    assert core.on_connected() == [b"POSITION s1 w1 3 3", b"REPLICATE"]
    core.on_message(b"REMOTE_SERVER_UP matrix.org", 0.0)  # quarantined: not live
    assert core.add_reader() == []
    assert core.on_connected() == []


@given(st.lists(st.sampled_from(["add", "remove", "connect", "disconnect"]), max_size=20))
def test_every_reader_is_covered_by_a_replicate(ops: list[str]) -> None:
    """Whenever a reader is attached and the link is connected, a REPLICATE went out after the
    later of the two events (so its writers' answers reach it)."""
    core = LinkCore("pfx", "me")
    connected = False
    readers = 0
    for op in ops:
        if op == "add":
            readers += 1
            assert core.add_reader() == ([b"REPLICATE"] if connected else [])
        elif op == "remove":
            readers = max(0, readers - 1)
            core.remove_reader()
        elif op == "connect":
            connected = True
            assert core.on_connected() == ([b"REPLICATE"] if readers else [])
        else:
            connected = False
            core.on_disconnected()


# --- LinkCore: foreign deployments ------------------------------------------------------------

SYNAPSE_LINES = [
    b'LOCK_RELEASED ["master","lock","key"]',
    b"USER_SYNC sync1 @a:x None start 17",
    b"CLEAR_USER_SYNC sync1",
    b"FEDERATION_ACK fed1 5",
    b'USER_IP @a:x ["t","1.2.3.4","ua","D",1]',
    b"REMOTE_SERVER_UP other.org",
    b"NEW_ACTIVE_TASK abc",
    b"USER_DIRECTORY_READY_TO_REFRESH_STALE_REMOTE_PROFILES ",
]


def test_synapse_lines_cover_every_synapse_only_command() -> None:
    assert {line.split(b" ")[0].decode() for line in SYNAPSE_LINES} == SYNAPSE_ONLY_COMMANDS


@pytest.mark.parametrize("line", SYNAPSE_LINES)
def test_synapse_command_makes_the_channel_foreign(
    line: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    core = make_core({("s1", "w1"): 4}, readers=1)
    assert core.on_connected() == [b"POSITION s1 w1 4 4", b"REPLICATE"]
    with caplog.at_level("DEBUG", logger="streams.replication"):
        for _ in range(3):
            assert core.on_message(line, 0.0) == ([], [])
        assert core.on_message(b"REPLICATE", 0.0) == ([], [])  # no answer any more
        assert core.on_connected() == []
        assert core.outgoing([b"POSITION s1 w1 4 5"]) == []
    name = line.split(b" ")[0].decode()
    assert core.foreign == ForeignDeployment("synapse-commands", (name,), repr(line))
    assert core.stats.foreign == 3
    assert core.stats.foreign_by_name == {name: 3}
    assert core.stats.malformed == 0
    assert core.stats.suppressed == 1 + 2 + 1  # the REPLICATE answer, on_connected, outgoing
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    message = errors[0].getMessage()
    assert "'pfx'" in message and "STREAMS_PREFIX" in message and name in message
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_our_own_traffic_never_looks_foreign() -> None:
    core = make_core({("s1", "w1"): 4, ("s2", "w2"): 0}, readers=2)
    lines = [
        *core.on_connected(),
        b"REPLICATE",
        b"PING 1700000000000",
        b"SERVER example.com",  # Synapse sends SERVER and NAME over TCP only
        b"NAME me",
        b"ERROR oops",
        b"POSITION s1 w9 0 7",
        b'RDATA s2 w9 3 {"first":3,"count":1,"ts":0}',
    ]
    for line in lines:
        core.on_message(line, 0.0)
    assert core.foreign is None
    assert not core.refresh_due(0.0)  # check_streams is off: rule (b) does not apply


def test_unknown_stream_needs_a_fresh_registry_read() -> None:
    core = LinkCore("pfx", "me", check_streams=True)
    core.add_writer(Announcer("mine", "w1", 0))
    assert not core.refresh_due(0.0)
    core.on_message(b"POSITION mine w2 0 3", 0.0)  # a local writer's stream is known
    assert not core.refresh_due(0.0)
    core.on_message(b"POSITION new1 w2 0 3", 0.0)
    assert core.refresh_due(0.0)
    assert core.on_known_streams({"mine", "new1"}, 0.0) is None  # created meanwhile: fine
    core.on_message(b"POSITION new1 w2 3 4", 0.0)  # known now: no new read
    assert not core.refresh_due(100.0)
    core.on_message(b"POSITION new2 w2 0 1", 0.0)
    assert not core.refresh_due(REFRESH_INTERVAL - 0.1)  # rate-limited
    assert core.refresh_due(REFRESH_INTERVAL)
    core.on_refresh_failed(REFRESH_INTERVAL, OSError("db down"))
    assert core.foreign is None
    assert not core.refresh_due(REFRESH_INTERVAL + 1)
    assert core.refresh_due(2 * REFRESH_INTERVAL)
    assert core.on_known_streams({"new2"}, 2 * REFRESH_INTERVAL) is None
    core.on_message(b'RDATA events master 12 ["ev",[]]', 0.0)
    core.on_message(b"POSITION typing master 5 5", 0.0)
    verdict = core.on_known_streams({"mine"}, 3 * REFRESH_INTERVAL)
    assert verdict is not None and verdict == core.foreign
    assert verdict.reason == "unknown-streams"
    assert verdict.evidence == ("events", "typing")
    assert "RDATA events" in verdict.line
    assert "does not have: events, typing" in verdict.describe("pfx")
    assert core.stats.refresh_errors == 1
    assert not core.refresh_due(3 * REFRESH_INTERVAL)  # the read above was recorded
    core.on_message(b"POSITION other master 5 5", 0.0)
    assert not core.refresh_due(100.0)  # quarantined: nothing more to decide meanwhile


@given(
    st.lists(
        st.tuples(st.sampled_from(["create", "hear", "refresh", "tick"]), st.integers(0, 7)),
        max_size=40,
    )
)
def test_default_path_never_trips(ops: list[tuple[str, int]]) -> None:
    """Streams are created at any time; a name is only ever heard after its stream exists; the
    registry is read whenever the core asks: never foreign."""
    core = LinkCore("streams", "me", check_streams=True)
    registry: set[str] = set()
    now = 0.0
    for op, n in ops:
        name = f"s{n}"
        if op == "create":
            registry.add(name)
        elif op == "hear" and name in registry:
            core.on_message(f"POSITION {name} w{n} 0 {n}".encode(), 0.0)
        elif op == "tick":
            now += n
        if core.refresh_due(now):
            core.on_known_streams(frozenset(registry), now)
    assert core.foreign is None


@given(st.lists(st.sampled_from(sorted(SYNAPSE_ONLY_COMMANDS)), min_size=1), st.data())
def test_foreign_verdict(names: list[str], data: st.DataObject) -> None:
    streams = data.draw(st.sets(STREAMS))
    known = data.draw(st.none() | st.sets(STREAMS))
    verdict = foreign_verdict(commands=names, streams=streams, known_streams=known)
    assert verdict is not None and verdict.reason == "synapse-commands"
    assert verdict.evidence == tuple(sorted(set(names)))
    plain = foreign_verdict(
        commands=["POSITION", "REPLICATE"], streams=streams, known_streams=known
    )
    if known is None or streams <= known:
        assert plain is None
    else:
        assert plain is not None and plain.evidence == tuple(sorted(streams - known))


def test_malformed_lines_warn_once_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    core = LinkCore("pfx", "me")
    with caplog.at_level("WARNING", logger="streams.replication"):
        for i in range(200):
            core.on_message(f"HOSTILE{i} spam".encode(), 0.0)
            core.on_message(f"POSITION s w 0 {i}x".encode(), 0.0)
            core.on_message(f"ERROR boom {i}".encode(), 0.0)
    assert core.stats.malformed == 400
    assert core.foreign is None  # unknown commands are not Synapse's
    assert len(caplog.records) == 3, [r.getMessage() for r in caplog.records]


# --- backoff_delay ----------------------------------------------------------------------------

FINITE = st.floats(0, 10, allow_nan=False)
ATTEMPTS = st.integers(0, 200)


@given(ATTEMPTS, FINITE, st.floats(0, 100), st.floats(0, 1, exclude_max=True))
def test_backoff_bounds(attempt: int, base: float, cap: float, jitter: float) -> None:
    delay = backoff_delay(attempt, base=base, cap=cap, jitter=jitter)
    full = backoff_delay(attempt, base=base, cap=cap)
    assert 0 <= delay <= full <= cap
    assert full == min(cap, base * 2 ** min(attempt, 30))
    if jitter:
        assert 0.5 * full <= delay <= full  # == full only by rounding when jitter ~ 1
        if jitter <= 0.99:
            assert delay < full or full < 1e-300  # (subnormals round back up)


@given(ATTEMPTS, ATTEMPTS, FINITE, st.floats(0, 100), st.floats(0, 1, exclude_max=True))
def test_backoff_monotone(a: int, b: int, base: float, cap: float, jitter: float) -> None:
    lo, hi = sorted((a, b))
    assert backoff_delay(lo, base=base, cap=cap) <= backoff_delay(hi, base=base, cap=cap)
    with_j = [backoff_delay(n, base=base, cap=cap, jitter=jitter) for n in (lo, hi)]
    assert with_j[0] <= with_j[1]


def test_backoff_examples() -> None:
    assert [backoff_delay(n) for n in range(4)] == [0.05, 0.1, 0.2, 0.4]
    assert backoff_delay(10**6) == 5.0
    assert backoff_delay(3, jitter=0.5) == pytest.approx(0.4 * 0.75)
