"""The reader's state without a database (`streams.core.reader_state`,
`streams.store.membership`, `streams.store.read_ahead`): counters, probe targets, start
filters, the signed-range inbox, following shared proofs, the group as the reader holds it,
and the pages it read ahead."""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streams.core.constants import PROOF_GRACE
from streams.core.epochs import Fact, Row
from streams.core.reader_state import (
    KEY_RETRY,
    MAX_WAITING_RANGES,
    ProofFollowing,
    Proven,
    ReaderCounters,
    SignedRangeInbox,
    StartFilters,
)
from streams.core.replication import Hint
from streams.core.signing import KEY_REFRESH, SignedRange, SigningKey, sign_range
from streams.errors import DatabaseChanged, FactsPruned, UsageError
from streams.store.membership import GroupMembership
from streams.store.read_ahead import ReadAhead
from streams.store.reads import PagesAhead

INC_A = "0b6c/7300000000000000001/16384/24601/1"
INC_B = "0b6c/7300000000000000002/16384/24601/1"
KEY_A = SigningKey(7, b"a" * 32, b"c" * 32, INC_A)
KEY_B = SigningKey(8, b"b" * 32, b"d" * 32, INC_B)
KEYS = {7: KEY_A.public(), 8: KEY_B.public()}
PROVER = "_proof:host-1"


def signed(after: int, through: int, key: SigningKey = KEY_A, stream: str = "s") -> Hint:
    """A prober's line for ``(after, through]`` with one fact at ``through``."""
    rows = [(through, 0, "w", 1000 + through, "1")]
    return Hint(stream, through, PROVER, sign_range(stream, PROVER, after, through, rows, key))


def fact(stream_id: int, timestamp: int = 0) -> Fact:
    return Fact("s", stream_id, "w", timestamp, ())


# ---------------------------------------------------------------- counters

counter_ops = st.lists(
    st.one_of(
        st.tuples(st.just("page"), st.integers(0, 10_000)),
        st.tuples(st.just("reject"), st.sampled_from(["malformed", "unknown-key", "no-keys"])),
    ),
    max_size=30,
)


@given(counter_ops)
def test_counters_only_grow(ops: list[tuple[str, object]]) -> None:
    counters = ReaderCounters()
    rows = 0
    for op, arg in ops:
        before = (counters.pages, counters.rows, dict(counters.rejected_ranges))
        if op == "page":
            assert isinstance(arg, int)
            counters.page(arg)
            rows += arg
            assert counters.pages == before[0] + 1
        else:
            assert isinstance(arg, str)
            assert counters.reject(arg) == before[2].get(arg, 0) + 1
        assert counters.rows >= before[1]
        assert all(counters.rejected_ranges[r] >= n for r, n in before[2].items())
    assert counters.rows == rows
    assert counters.pages == sum(op == "page" for op, _ in ops)


# ---------------------------------------------------------------- what probes proved


def test_a_sequence_that_goes_back_is_a_changed_database() -> None:
    proven = Proven()
    proven.note("s", 5, 9)
    with pytest.raises(DatabaseChanged, match="went back from 9 to 4"):
        proven.note("s", 3, 4, position=5)
    assert proven.allocated == {"s": 9} and proven.targets == {"s": 5}
    proven.note("s", 3, None)  # a shared proof: says nothing of what is allocated
    assert proven.allocated == {"s": 9} and proven.target("s") == 5


@given(st.lists(st.tuples(st.integers(0, 100), st.booleans()), max_size=20))
def test_targets_only_grow(notes: list[tuple[int, bool]]) -> None:
    proven = Proven()
    for complete, shared in notes:
        before = proven.target("s")
        proven.note("s", complete, None if shared else 10**6)
        assert proven.target("s") == max(before, complete)


def test_live_only_after_a_probe_since_the_link_came_up() -> None:
    proven = Proven()
    assert not proven.live and proven.reconcile
    proven.set_link_state(True)
    assert not proven.live
    proven.reconcile = False  # what a probe does
    assert proven.live
    proven.set_link_state(True)  # a reconnect: reconcile again
    assert not proven.live
    proven.note("a", 4, 4)
    assert proven.behind(["a", "b"], {"a": 3, "b": 0})
    assert not proven.behind(["a", "b"], {"a": 4, "b": 0})


# ---------------------------------------------------------------- start filters


def test_a_live_start_drops_what_was_allocated_at_join() -> None:
    filters = StartFilters()
    filters.join_live("s", 3, 3)  # nothing pending: no filter
    assert filters.live == {}
    filters.join_live("s", 3, 6)
    assert [f.stream_id for f in filters.admit("s", 8, [fact(4), fact(7), fact(8)])] == [7, 8]
    assert filters.live == {}  # the position passed every ID allocated at join


def test_a_start_by_time_drops_until_the_first_fact_at_or_after_it() -> None:
    filters = StartFilters(start_ms={"s": 100})
    assert filters.admit("s", 2, [fact(1, 50), fact(2, 99)]) == []
    assert "s" in filters.start_ms
    assert [f.stream_id for f in filters.admit("s", 4, [fact(3, 100), fact(4, 100)])] == [3, 4]
    assert filters.start_ms == {}
    assert filters.admit("s", 5, [fact(5, 1)]) == [fact(5, 1)]  # done for good


@given(
    st.integers(0, 20),
    st.integers(0, 40),
    st.one_of(st.none(), st.integers(0, 50)),
    st.lists(st.integers(0, 60), max_size=20),
)
def test_columns_keep_what_facts_keep(
    position: int, allocated: int, start_ms: int | None, timestamps: list[int]
) -> None:
    ids = list(range(position + 1, position + 1 + len(timestamps)))
    facts = [fact(i, t) for i, t in zip(ids, timestamps, strict=True)]
    end = ids[-1] if ids else position

    def made() -> StartFilters:
        filters = StartFilters(start_ms={} if start_ms is None else {"s": start_ms})
        filters.join_live("s", position, allocated)
        return filters

    as_facts, as_columns = made(), made()
    kept = as_facts.admit("s", end, facts)
    keep = as_columns.admit_columns("s", end, ids, timestamps)
    assert kept == (facts if keep is None else [f for f, k in zip(facts, keep, strict=True) if k])
    assert as_facts.start_ms == as_columns.start_ms
    assert as_facts.live.keys() == as_columns.live.keys()


# ---------------------------------------------------------------- the signed-range inbox


def inbox_with_keys() -> SignedRangeInbox:
    inbox = SignedRangeInbox(ReaderCounters())
    inbox.reading_keys(0.0)
    inbox.keys_read(dict(KEYS))
    return inbox


def test_a_verified_range_is_delivered_where_it_fits() -> None:
    inbox = inbox_with_keys()
    assert inbox.offer(signed(0, 3), INC_A, 1.0)
    assert inbox.offer(signed(0, 5), INC_A, 1.0)
    assert inbox.offer(signed(5, 6), INC_A, 1.0)
    assert inbox.counters.verified_ranges == 3 and inbox.pending
    inbox.accept(INC_A)
    taken = inbox.take("s", 0)
    assert taken is not None and (taken.after, taken.through) == (0, 5)  # goes furthest
    assert inbox.take("s", 1) is None  # (0, 3] is passed now
    taken = inbox.take("s", 5)
    assert taken is not None and taken.through == 6
    assert not inbox.pending


def test_lines_that_do_not_verify_are_counted_and_dropped() -> None:
    inbox = inbox_with_keys()
    assert not inbox.offer(signed(0, 3, KEY_B), INC_A, 1.0)  # another incarnation's line
    assert not inbox.offer(Hint("s", 3, PROVER, {"x": 1}), INC_A, 1.0)
    assert inbox.counters.rejected_ranges["malformed"] == 1
    assert not inbox.verified and not inbox.keys_wanted
    unknown = SigningKey(9, b"u" * 32, b"c" * 32, INC_A)
    assert inbox.offer(signed(0, 3, unknown), INC_A, KEY_RETRY)  # wake: read the keys
    assert inbox.keys_wanted and inbox.counters.rejected_ranges["unknown-key"] == 1
    assert not inbox.offer(signed(0, 3, unknown), INC_A, KEY_RETRY / 2)  # not again so soon
    assert inbox.keys_retry_due(KEY_RETRY) and not inbox.keys_retry_due(KEY_RETRY / 2)


def test_after_a_keys_line_nothing_verifies_until_the_keys_are_read() -> None:
    inbox = inbox_with_keys()
    assert not inbox.keys_changed(KEY_RETRY / 2)
    assert inbox.keys_stale and inbox.keys_wanted
    assert not inbox.offer(signed(0, 3), INC_A, KEY_RETRY / 2)
    assert inbox.counters.rejected_ranges == {"keys-changed": 1}
    inbox.reading_keys(KEY_RETRY)
    assert not inbox.keys_stale and not inbox.keys_wanted
    assert inbox.keys_due(KEY_RETRY + KEY_REFRESH) and not inbox.keys_due(KEY_RETRY + 1)
    inbox.keys_read({7: KEYS[7]})
    assert inbox.offer(signed(0, 3), INC_A, 2.0)


def test_a_retired_key_takes_its_ranges_along() -> None:
    inbox = inbox_with_keys()
    assert inbox.offer(signed(0, 3), INC_A, 1.0)
    inbox.keys_read({})
    inbox.accept(INC_A)
    assert inbox.counters.rejected_ranges == {"retired-key": 1} and inbox.ranges == {}
    inbox.keys_read(dict(KEYS))
    assert inbox.offer(signed(0, 3), INC_A, 1.0)
    inbox.accept(INC_A)
    inbox.keys_read({})
    assert inbox.take("s", 0) is None and inbox.ranges == {"s": {}}
    assert inbox.keys_unreadable() == 1 and inbox.keys == {}


def test_at_most_max_waiting_ranges_wait_per_stream() -> None:
    inbox = inbox_with_keys()
    for after in range(MAX_WAITING_RANGES + 2):
        inbox.verified.append(SignedRange("s", after, after + 1, (), 7))
        inbox.accept(INC_A)
    waiting = inbox.ranges["s"]
    assert len(waiting) == MAX_WAITING_RANGES and min(waiting) == 2  # the lowest went first


# What happens to an inbox: a line for ``(after, after + length]`` offered (under key A or B,
# checked against the reader's incarnation or, as the link's thread may just before a
# failover, the previous one), the reader's session moving to an incarnation, the reader
# taking what fits where it is.
inbox_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("offer"),
            st.sampled_from([KEY_A, KEY_B]),
            st.booleans(),
            st.integers(0, 4),
            st.integers(1, 2),
        ),
        st.tuples(st.just("session"), st.sampled_from([INC_A, INC_B])),
        st.tuples(st.just("take")),
    ),
    max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(inbox_ops)
@example(  # a range waiting in one history, reached in the next
    [
        ("session", INC_A),
        ("offer", KEY_A, False, 2, 1),
        ("take",),
        ("session", INC_B),
        ("offer", KEY_B, False, 0, 2),
        ("take",),
    ]
)
def test_the_inbox_never_delivers_a_range_of_another_incarnation(
    ops: list[tuple[object, ...]],
) -> None:
    inbox = inbox_with_keys()
    incarnation: str | None = None
    previous: str | None = None
    position = 0
    for op, *args in ops:
        if op == "session":
            (token,) = args
            assert isinstance(token, str)
            inbox.on_incarnation(incarnation, token)
            if token != incarnation:
                previous, incarnation = incarnation, token
            if inbox.keys_stale:  # the reader reads the keys before it takes anything
                inbox.reading_keys(0.0)
                inbox.keys_read(dict(KEYS))
        elif op == "offer":
            key, stale, after, length = args
            assert isinstance(key, SigningKey) and isinstance(after, int)
            assert isinstance(length, int)
            checked = previous if stale else incarnation
            inbox.offer(signed(after, after + length, key), checked, 0.0)
        else:
            inbox.accept(incarnation)
            while (found := inbox.take("s", position)) is not None:
                assert KEYS[found.key].incarnation == incarnation
                position = found.through


# ---------------------------------------------------------------- following shared proofs


def test_a_writers_token_moves_the_deadline_once() -> None:
    following = ProofFollowing(shared_proofs=True, fresh=True)
    assert following.following(True) and not following.following(False)
    following.await_token("s", 5, 10.0)
    assert following.deadline_moved and following.deadline() == 10.0 + PROOF_GRACE
    following.deadline_moved = False
    following.await_token("s", 3, 11.0)
    assert not following.deadline_moved and following.awaited == {"s": 5}
    assert following.deadline() == 10.0 + PROOF_GRACE


def test_proofs_end_the_wait_when_they_cover_it_or_are_late() -> None:
    following = ProofFollowing(shared_proofs=True, fresh=True)
    following.await_token("s", 5, 10.0)
    assert not following.late({"s": 4}, 10.0)  # behind, within the grace: still awaited
    assert following.awaited == {"s": 5}
    assert following.late({"s": 4}, 10.0 + PROOF_GRACE)  # the prober is late
    assert following.awaited == {} and following.deadline() is None
    following.await_token("s", 5, 20.0)
    assert not following.late({"s": 5}, 20.0) and following.deadline() is None
    following.await_token("s", 5, 30.0)
    following.covered({"s": 4})
    assert following.deadline() is not None
    following.covered({"s": 5})
    assert following.deadline() is None
    following.await_token("s", 5, 40.0)
    assert not following.read(False) and not following.fresh and following.awaited == {}


# ---------------------------------------------------------------- the group


def test_a_commit_may_not_move_the_group_back() -> None:
    membership = GroupMembership()
    assert membership.owner.endswith(f":{os.getpid()}")
    membership.took({"a": 5, "b": None})
    membership.check_forward("g", [("a", 5), ("b", 1), ("c", 0)])
    with pytest.raises(UsageError, match="group 'g' is at 5 on 'a'"):
        membership.check_forward("g", [("a", 4)])
    membership.took({"a": 7})
    assert membership.committed == {"a": 7, "b": None}


# ---------------------------------------------------------------- pages read ahead


def test_a_page_read_ahead_serves_only_its_own_range_and_once() -> None:
    ahead = ReadAhead()
    sent = PagesAhead((("a", 10, 20), ("b", 0, 5)))
    ahead.sent = sent
    rows_a: list[Row] = [(11, 0, "w", 1, "1")]
    ahead.took_in(sent, [rows_a, []], {"b": 3})
    received = ahead.take_received()
    assert ahead.received == {}  # the next step reads afresh what this one does not use
    assert received["a"].rows_for("a", 10, 20) == rows_a
    assert received["a"].rows_for("a", 10, 21) is None  # the target moved: read anew
    assert received["a"].rows_for("a", 11, 20) is None
    with pytest.raises(FactsPruned):
        received["b"].rows_for("b", 0, 5)  # retention passed it while it was read
    ahead.took_in(sent, [rows_a, []], {})
    ahead.forget()
    assert ahead.sent is None and ahead.received == {}
