"""The read sequence of `streams.store.reads`, step by step, without a server: every plan runs
incarnation -> probe -> rows -> retention in that order, each step in a later statement than the
one before, and the plans' users take that order from it (the reader core, the prober, the Spark
executor) rather than writing their own."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO_ROOT

from streams import TimestampMode
from streams.errors import DatabaseChanged, FactsPruned, StandbyBehind, StoreError
from streams.store import reads
from streams.store.driver import Commit, Pipeline, Query, Receive, Row, Send
from streams.store.identity import INCARNATION_SQL
from streams.store.probe import PROBE_STATEMENTS, probe_queries, probe_texts
from streams.store.rows import pruned_through_sql
from streams.store.standby import REPLAY_SQL
from streams.types import StreamInfo


def _info(key: int, name: str) -> StreamInfo:
    return StreamInfo(key, name, f"streams_seq_{key}", TimestampMode.ARRIVAL, False, None)


INFO = _info(7, "s")
TOKEN = "id/1/2/3/1"
#: A row of INCARNATION_SQL whose token is `TOKEN` (a primary's, flushed to 0/1000000).
SAME_HISTORY = ("id", 1, 2, 3, 1, 16777216)


def _drive(
    plan: reads.RangeGen[list[Row]],
    *,
    complete: int,
    pruned: int = 0,
    history: tuple[object, ...] = SAME_HISTORY,
    streamed: list[str] | None = None,
) -> tuple[list[str], list[Row]]:
    """Run a `read_range` plan on a fake driver; the statements it ran, in order, and what it
    returned. ``complete``: what the probe proves; ``pruned``: the stream's pruned_through;
    ``streamed``: where the rows statements go."""
    log: list[str] = []
    answer: list[Row] | None = None
    while True:
        try:
            op = next(plan) if answer is None else plan.send(answer)
        except StopIteration as stop:
            return log, stop.value
        answer = []
        if isinstance(op, Commit):
            log.append("commit")
        elif isinstance(op, reads.StreamRows):
            log.append("rows")
            if streamed is not None:
                streamed.append(op.statement)
            answer = [(1, 0, "w", 10, "{}")]  # what a driver kept (a streaming one: none)
        elif op.statement == INCARNATION_SQL:
            log.append("incarnation")
            answer = [history]
        elif op.statement == pruned_through_sql(INFO.id):
            log.append("retention")
            answer = [(pruned,)]
        else:
            index = probe_texts([INFO.id]).index(str(op.statement))
            log.append(f"probe {index + 1}")
            if index == 1:
                answer = [("s", complete, complete, str(complete))]


def _plan(through: int = 5, **options: Any) -> reads.RangeGen[list[Row]]:
    return reads.read_range("s", INFO.id, 0, through, incarnation=TOKEN, who="test", **options)


STEPS = ["incarnation", "commit", "probe 1", "probe 2", "probe 3", "commit", "rows"]


def test_a_range_is_read_in_the_order_of_the_proof() -> None:
    log, kept = _drive(_plan(), complete=9)
    assert log == [*STEPS, "retention", "commit"]
    assert kept == [(1, 0, "w", 10, "{}")]


def test_no_incarnation_no_check() -> None:
    log, _ = _drive(reads.read_range("s", INFO.id, 0, 5), complete=9)
    assert log[:4] == ["probe 1", "probe 2", "probe 3", "commit"]


def test_another_history_stops_before_the_probe() -> None:
    plan = _plan()
    with pytest.raises(DatabaseChanged, match=r"test reading 's' \(0, 5\]"):
        _drive(plan, complete=9, history=("other", 1, 2, 3, 1, 16777216))


def test_retention_is_checked_after_the_rows() -> None:
    with pytest.raises(FactsPruned):
        _drive(_plan(), complete=9, pruned=1)
    told: list[FactsPruned] = []
    log, _ = _drive(_plan(lost=told.append), complete=9, pruned=1)
    assert log == [*STEPS, "retention", "commit"]
    assert [(e.stream, e.position, e.pruned_through) for e in told] == [("s", 0, 1)]


def test_a_range_beyond_the_probe_is_read_only_up_to_it() -> None:
    with pytest.raises(StoreError, match="proves only 3"):
        _drive(_plan(), complete=3)
    told: list[int] = []
    statements: list[str] = []
    _drive(_plan(went_backwards=told.append), complete=3, streamed=statements)
    assert told == [3]
    (rows,) = statements
    assert "stream_id <= 3 " in rows  # never past what this probe proved
    # Nothing complete beyond ``after``: no rows and no retention check at all.
    log, kept = _drive(_plan(went_backwards=told.append), complete=0)
    assert log == STEPS[:-1] and kept == []


def test_fetch_all_runs_the_rows_statement_as_a_query() -> None:
    plan = reads.fetch_all(_plan())
    ops: list[object] = []
    answer: list[Row] | None = None
    while True:
        try:
            op = next(plan) if answer is None else plan.send(answer)
        except StopIteration as stop:
            assert stop.value == [("row",)]
            break
        ops.append(op)
        answer = []
        if isinstance(op, Query) and op.statement == INCARNATION_SQL:
            answer = [SAME_HISTORY]
        elif isinstance(op, Query) and op.statement == probe_texts([INFO.id])[1]:
            answer = [("s", 9, 9, "9")]
        elif isinstance(op, Query) and str(op.statement).startswith("SELECT stream_id, row_no"):
            answer = [("row",)]
    assert not any(isinstance(op, reads.StreamRows) for op in ops)


def _pipeline(gen: Any) -> list[Query]:
    op = next(gen)
    assert isinstance(op, Pipeline)
    return list(op.queries)


def test_a_probed_read_is_one_pipeline_probe_rows_retention() -> None:
    other = _info(8, "t")
    queries = _pipeline(reads.probe_and_read([INFO, other], {"s": 0, "t": 4}, 100))
    assert queries[:PROBE_STATEMENTS] == probe_queries([INFO, other])
    rows, retention = queries[PROBE_STATEMENTS:-1], queries[-1]
    assert [q.params for q in rows] == [(0, 100), (4, 100)]
    assert b"pruned_through" in bytes(retention.statement)  # type: ignore[arg-type]


def test_the_prover_records_its_proof_between_the_probe_and_the_rows() -> None:
    queries = _pipeline(reads.prove_with_rows([INFO], {"s": 3}, 10))
    assert queries[:PROBE_STATEMENTS] == probe_queries([INFO])
    assert "streams_proofs" in str(queries[PROBE_STATEMENTS].statement)
    assert queries[PROBE_STATEMENTS + 1].params == (3, 10)
    assert b"pruned_through" in bytes(queries[-1].statement)  # type: ignore[arg-type]
    # Nothing to sign: the proof alone, no rows and no retention check.
    assert len(_pipeline(reads.prove_with_rows([INFO], {}, 10))) == PROBE_STATEMENTS + 1


def test_on_a_standby_the_fence_replaces_the_probe() -> None:
    """With ``proof_lsn`` (a read URL): incarnation, then the replay position, then the rows
    and retention, all on the standby's session; nothing read while it is behind."""

    def drive(replayed: int, history: tuple[object, ...] = SAME_HISTORY) -> list[str]:
        plan = _plan(proof_lsn=100)
        log: list[str] = []
        answer: list[Row] | None = None
        while True:
            try:
                op = next(plan) if answer is None else plan.send(answer)
            except StopIteration:
                return log
            answer = []
            if isinstance(op, Commit):
                log.append("commit")
            elif isinstance(op, reads.StreamRows):
                log.append("rows")
            elif op.statement == INCARNATION_SQL:
                log.append("incarnation")
                answer = [history]
            elif op.statement == REPLAY_SQL:
                log.append("fence")
                answer = [(replayed,)]
            else:
                assert op.statement == pruned_through_sql(INFO.id)
                log.append("retention")
                answer = [(0,)]

    assert drive(100) == [
        "incarnation", "commit", "fence", "commit", "rows", "retention", "commit",
    ]  # fmt: skip
    with pytest.raises(StandbyBehind) as behind:
        drive(99)
    assert (behind.value.replayed, behind.value.proof_lsn, behind.value.timeline) == (
        99,
        100,
        False,
    )
    with pytest.raises(StandbyBehind) as other:
        drive(100, history=("id", 1, 2, 3, 2, 16777216))
    assert other.value.timeline
    with pytest.raises(DatabaseChanged, match="read URL"):
        drive(100, history=("other", 1, 2, 3, 1, 16777216))


def test_a_followers_proofs_carry_the_lsn_read_after_them() -> None:
    queries = _pipeline(reads.read_proofs([INFO], {"s": 0}, 0))
    assert "streams_proofs" in bytes(queries[0].statement).decode()  # type: ignore[arg-type]
    assert queries[0].params == (0, 0, None)  # the proof alone: no rows on the primary
    assert b"pg_current_wal_insert_lsn" in bytes(queries[1].statement)  # type: ignore[arg-type]
    assert b"pruned_through" in bytes(queries[2].statement)  # type: ignore[arg-type]


def test_the_probe_takes_its_lsn_after_the_locks() -> None:
    queries = probe_queries([INFO])
    assert b"pg_locks" in bytes(queries[1].statement)  # type: ignore[arg-type]
    assert b"pg_current_wal_insert_lsn() - '0/0'" in bytes(queries[2].statement)  # type: ignore[arg-type]


#: The readers: each runs the plans of `streams.store.reads`.
READERS = (
    REPO_ROOT / "streams" / "store" / "reader_core.py",
    REPO_ROOT / "streams" / "proofs.py",
    REPO_ROOT / "spark" / "streams_spark" / "source.py",
    REPO_ROOT / "spark" / "streams_spark" / "executor.py",
)
#: The builders of the statements of the sequence: only `streams.store.reads` orders them.
BUILDERS = frozenset(
    {
        "INCARNATION_SQL",
        "probe_queries",
        "probe_texts",
        "fetch_rows_after_probe",
        "fetch_rows_after_proof",
        "range_query",
        "range_rows_sql",
        "retention_query",
        "pruned_through_sql",
        "check_retained",
        "REPLAY_SQL",
        "replayed_to",
        "check_standby",
        "wal_position_query",
    }
)


@pytest.mark.parametrize("path", READERS, ids=lambda p: p.name)
def test_readers_take_the_order_from_the_face(path: Path) -> None:
    """The readers build no read of their own from the statements' builders: the plans of
    `streams.store.reads` are the only place that orders incarnation, probe, rows and
    retention."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {
        a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names
    }
    assert names & BUILDERS == set()


def test_a_page_sent_ahead_is_rows_then_retention_in_one_query() -> None:
    """`send_proven`: the same statements as `read_proven` (rows of each range, then the
    retention check after them), inlined, in one `Send`; `receive_proven` takes them back."""
    other = _info(8, "t")
    plan = reads.send_proven([(INFO, 3, 9), (other, 0, 4)], 100)
    op = next(plan)
    assert isinstance(op, Send)
    rows_s, rows_t, retention = op.statements
    assert b"stream = 7 AND stream_id > 3 AND stream_id <= 9" in rows_s
    assert b"LIMIT 100" in rows_s
    assert b"stream = 8 AND stream_id > 0 AND stream_id <= 4" in rows_t
    assert b"pruned_through" in retention
    with pytest.raises(StopIteration) as stop:
        plan.send([])
    ahead = stop.value.value
    assert ahead.ranges == (("s", 3, 9), ("t", 0, 4))
    receive = reads.receive_proven(ahead)
    assert isinstance(next(receive), Receive)
    page_s: tuple[Row, ...] = ((4, 0, "w", 1, "{}"),)
    with pytest.raises(StopIteration) as stop:
        receive.send([page_s, (), (("s", 5), ("t", 0))])
    pages, pruned = stop.value.value
    assert pages == [[(4, 0, "w", 1, "{}")], []]
    assert pruned == {"s": 5, "t": 0}  # checked by the caller when it uses a page


def test_a_page_sent_on_a_closed_session_is_not_received() -> None:
    receive = reads.receive_proven(reads.PagesAhead((("s", 3, 9),)))
    next(receive)
    with pytest.raises(StopIteration) as stop:
        receive.send([])
    assert stop.value.value is None
