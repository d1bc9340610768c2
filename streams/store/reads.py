"""The read sequence: how every reader reads facts, written once.

Every reader (`streams.store.reader_core`, the prober, the Spark source's driver and executors,
any connector through `streams.connector`) runs these plans, in this order: 1. incarnation
(`streams.store.identity`), 2. probe (`streams.store.probe`), 3. rows, by a later statement,
4. retention, by a later one still (`FactsPruned`). The forms: `probe_and_read` (2-4, one
pipeline) and `prove_with_rows` (the prober's), `read_proven` / `send_proven` /
`receive_proven` (3-4 behind an earlier probe), `read_after_proof` (a follower of shared
proofs), `read_range` (1-4 for a planned range, any driver; `fetch_all` on psycopg); on a hot
standby steps 3-4 run behind the fence (`streams.store.standby`).

Why the order is the proof: docs/design/probe.md ("The read sequence").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias, TypeVar

from ..errors import FactsPruned, StoreError
from ..types import StreamInfo
from .driver import Commit, Gen, Op, Pipeline, Query, Receive, Row, Send
from .identity import check_history
from .probe import (
    COMPLETE_STATEMENT,
    PROBE_STATEMENTS,
    READER_SESSION_SETUP,
    Probe,
    probe,
    probe_queries,
    probe_texts,
    probes_from_results,
    record_proof_query,
    statement_timeout_setup,
    wal_position_query,
)
from .rows import (
    check_retained,
    fetch_rows_after_probe,
    fetch_rows_after_proof,
    pruned_positions,
    pruned_through_sql,
    range_query,
    range_rows_sql,
    retention_query,
)
from .standby import check_standby, replayed_to

__all__ = [
    "READER_SESSION_SETUP",
    "PagesAhead",
    "Probe",
    "ProbedRead",
    "RangeGen",
    "StreamRows",
    "fetch_all",
    "probe",
    "probe_and_read",
    "prove_with_rows",
    "pruned_positions",
    "read_after_proof",
    "read_proofs",
    "read_proven",
    "read_proven_range",
    "read_range",
    "receive_proven",
    "send_proven",
    "standby_fence",
    "statement_timeout_setup",
]

T = TypeVar("T")


class ProbedRead(NamedTuple):
    """What `probe_and_read` found: every stream's `Probe`, the rows read behind it (one page
    per stream read, in the order given) and every read stream's ``pruned_through``."""

    probes: dict[str, Probe]
    pages: Sequence[Sequence[Row]]
    pruned: dict[str, int]


def _probed_reads(
    infos: Sequence[StreamInfo],
    read: Sequence[StreamInfo],
    after: Mapping[str, int],
    limit: int,
    between: Sequence[Query] = (),
) -> list[Query]:
    """Steps 2-4 as one pipeline: the probe of ``infos``, then ``between`` (statements that use
    what the probe proved), then up to ``limit`` rows of each of ``read`` after ``after[name]``
    and ``<=`` its complete position, then (if any rows are read) the retention check."""
    queries = probe_queries(infos)
    queries += between
    queries += [fetch_rows_after_probe(info, after[info.name], limit) for info in read]
    if read:
        queries.append(retention_query(read))  # after the rows (step 4)
    return queries


def probe_and_read(
    infos: Sequence[StreamInfo], after: Mapping[str, int], limit: int
) -> Gen[ProbedRead]:
    """Steps 2-4 for every stream of ``infos`` in one round trip: probe them, then read up to
    ``limit`` rows of each after ``after[name]`` (a page may end inside a fact), then check
    retention: `FactsPruned` if facts after ``after[name]`` were removed. Leaves no transaction
    open on a session in autocommit (a pipeline commits at its sync)."""
    results = yield Pipeline(_probed_reads(infos, infos, after, limit))
    pruned = check_retained(results[-1], after)
    return ProbedRead(probes_from_results(results), results[PROBE_STATEMENTS:-1], pruned)


def prove_with_rows(
    infos: Sequence[StreamInfo],
    after: Mapping[str, int],
    limit: int,
    incarnation: str | None = None,
) -> Gen[tuple[dict[str, Probe], dict[str, list[Row]]]]:
    """The prober's read: `streams.store.probe.prove` (steps 2 and the proof recorded), and for
    each stream named in ``after`` the first ``limit`` rows after ``after[name]`` up to what
    this probe proved (steps 3-4), in the same round trip (the proof recorded under the
    prover's database ``incarnation``): the rows the prober signs for
    readers that take them from Redis (`streams.core.signing`). A stream whose retention passed
    ``after[name]`` may miss facts of the range: none of its rows are given (the prober signs
    nothing for it; its readers read PostgreSQL, and learn of the loss there)."""
    read = [info for info in infos if info.name in after]
    results = yield Pipeline(
        _probed_reads(infos, read, after, limit, between=[record_proof_query(infos, incarnation)])
    )
    yield Commit()
    rows: dict[str, list[Row]] = {}
    if read:
        *pages, retained = results[PROBE_STATEMENTS + 1 :]
        pruned = check_retained(retained, {})
        for info, page in zip(read, pages, strict=True):
            if pruned.get(info.name, 0) <= after[info.name]:
                rows[info.name] = list(page)
    return probes_from_results(results), rows


def read_proven(info: StreamInfo, after: int, through: int, limit: int) -> Gen[list[Row]]:
    """Steps 3-4 for ``(after, through]``, where ``through`` is at or below what an earlier
    probe proved: rows ``(stream_id, row_no, instance, ts, payload)`` in (stream ID, row) order,
    at most ``limit`` (a page may end inside a fact: `streams.core.epochs`), ``payload`` as
    JSON text; `FactsPruned` if retention removed facts after ``after``. One round trip."""
    rows, pruned = yield Pipeline(
        [range_query(info, after, through, limit), retention_query([info])]  # rows, then step 4
    )
    yield Commit()
    check_retained(pruned, {info.name: after})
    return list(rows)


class PagesAhead(NamedTuple):
    """The pages `send_proven` asked for: ``(name, after, through)`` of each, in order."""

    ranges: tuple[tuple[str, int, int], ...]


def send_proven(requests: Sequence[tuple[StreamInfo, int, int]], limit: int) -> Gen[PagesAhead]:
    """`read_proven` for each ``(info, after, through)`` of ``requests``, *sent* only: the
    rows statements, then one retention check after them (steps 3-4, in this order, in one
    simple-protocol query: `streams.store.driver.Send`), left on the connection for
    `receive_proven`, which the next operation on the session must be. Each range is at or
    below what an earlier probe proved, so it reads the same rows whenever the server runs it:
    a reader catching up sends its next page before it plans the one it has."""
    queries = [range_query(info, after, through, limit) for info, after, through in requests]
    queries.append(retention_query([info for info, _, _ in requests]))
    yield Send([_text(query) for query in queries])
    return PagesAhead(tuple((info.name, after, through) for info, after, through in requests))


def receive_proven(
    ahead: PagesAhead,
) -> Gen[tuple[list[list[Row]], dict[str, int]] | None]:
    """What `send_proven` asked for: a page of rows per range, in order, and every stream's
    ``pruned_through`` read after them (None if the session has nothing in flight: it was
    reopened since). The caller checks retention (as `read_proven` does before returning a
    page) when it uses a page: one abandoned unused raises nothing."""
    results = yield Receive()
    if not results:
        return None
    *pages, retained = results
    if len(pages) != len(ahead.ranges):
        raise StoreError(f"read ahead: {len(pages)} pages received, {len(ahead.ranges)} sent")
    return [list(page) for page in pages], check_retained(retained, {})


def _text(query: Query) -> bytes:
    """A statement without parameters as the bytes `Send` sends."""
    if query.params is not None:
        raise ValueError("a statement sent ahead has its values inlined")
    statement = query.statement
    if isinstance(statement, bytes):
        return statement
    if isinstance(statement, str):
        return statement.encode()
    return statement.as_bytes(None)


def read_after_proof(
    infos: Sequence[StreamInfo],
    after: Mapping[str, int],
    limit: int,
    incarnation: str | None = None,
) -> Gen[list[tuple[Row, ...]]]:
    """Steps 3-4 for a follower of shared proofs, in one round trip: each stream's proof and up
    to ``limit`` rows behind it (one statement each: `streams.store.rows.fetch_rows_after_proof`
    says what its rows are), then the retention check: `FactsPruned` if facts after
    ``after[name]`` were removed. The results, one per stream of ``infos``; a proof recorded
    in another database ``incarnation`` than the follower's counts as none."""
    results, _ = yield from read_proofs(infos, after, limit, incarnation)
    return results


def read_proofs(
    infos: Sequence[StreamInfo],
    after: Mapping[str, int],
    limit: int,
    incarnation: str | None = None,
) -> Gen[tuple[list[tuple[Row, ...]], int]]:
    """`read_after_proof`, and the proofs' LSN: the primary's WAL insert position read in a
    statement after the ones that read the proofs ("the standby fence" in
    `streams.store.probe`). ``limit`` 0 reads the proofs alone (a reader whose rows come from
    a standby)."""
    *results, lsn, pruned = yield Pipeline(
        [
            *(fetch_rows_after_proof(info, after[info.name], limit, incarnation) for info in infos),
            wal_position_query(),  # after the proofs' snapshot
            retention_query(infos),  # after the rows (step 4)
        ]
    )
    check_retained(pruned, after)
    return results, int(lsn[0][0]) if lsn and lsn[0][0] is not None else 0


def standby_fence(proof_lsn: int, where: str) -> Gen[int]:
    """On a standby's session, before steps 3-4 there: `StandbyBehind` (nothing read) until
    the standby has replayed past ``proof_lsn``; its replay position otherwise
    (`streams.store.standby.replayed_to`)."""
    return (yield from replayed_to(proof_lsn, where))


# --- a range planned earlier, one statement at a time (any driver) ------------------------------


@dataclass(frozen=True, slots=True)
class StreamRows:
    """Run this rows statement (plain text, no parameters) and hand its rows on as they come.

    The plan receives the rows the driver kept for it: none from a driver that streams them on
    (the Spark executor, as Arrow record batches), all of them from `fetch_all`. Either way the
    plan's next operation runs only once the statement's rows have all been read.
    """

    statement: str


#: A plan of `read_range`: `Query` (plain text, no parameters: any driver runs it as it is),
#: `Commit` (nothing to do on a session in autocommit, where each statement commits by itself)
#: and `StreamRows`; each operation receives its rows.
RangeGen: TypeAlias = Generator[Query | Commit | StreamRows, list[Row], T]


def _lost(lost: FactsPruned) -> None:
    raise lost


def read_range(
    stream: str,
    stream_key: int,
    after: int,
    through: int,
    *,
    incarnation: str | None = None,
    who: str = "reader",
    running_ts_floor: int | None = None,
    resume_after: tuple[int, int] | None = None,
    went_backwards: Callable[[int], None] | None = None,
    lost: Callable[[FactsPruned], None] = _lost,
    proof_lsn: int | None = None,
    planned_lsn: int | None = None,
) -> RangeGen[list[Row]]:
    """Steps 1-4 for the rows of ``(after, through]`` of the stream ``stream`` (registry id
    ``stream_key``), planned earlier and read now, one statement at a time, so that the range
    is complete *now*, not only when it was planned.

    1. With ``incarnation`` (the history the range was planned in): `DatabaseChanged`, naming
       ``who`` and the range, if the session is on another one.
    2. The probe, committed. The range is read only up to what it proves: when that is below
       ``through`` (a database restored to an older state since the range was planned),
       ``went_backwards(complete)`` is told first (it raises to fail the read, as it does by
       default; a reader allowed to lose facts may log it and return), and the rows read stop
       there (none at all if it is at or below ``after``: the plan ends before step 3).
    3. `StreamRows`: every row of the facts in the range (`streams.store.rows.range_rows_sql`,
       with ``running_ts_floor`` and ``resume_after`` as there: a read that broke off goes on
       after its last row, in a new plan on a fresh session).
    4. Retention: ``lost(FactsPruned(...))`` if facts after ``after`` were removed (by default
       it raises; a reader allowed to lose facts may log it and return).

    With ``proof_lsn`` (the LSN of the probe that planned the range), the session is a hot
    standby's (a read URL: `streams.store.standby`, "the standby fence" in
    `streams.store.probe`), which cannot probe: step 1 checks the standby's incarnation
    (`check_standby`), and step 2 is the fence instead: `StandbyBehind` (nothing read) until the
    standby has replayed past ``proof_lsn``; the range was proven complete on the primary when
    it was planned, and a complete range never changes.

    ``planned_lsn``: the WAL position of the proof the range was planned on, with which a range
    planned before a failover still holds after it (`identity.check_history`).

    Returns the rows the driver kept (see `StreamRows`).
    """
    where = f"{who} reading {stream!r} ({after}, {through}]"
    if proof_lsn is not None:
        if incarnation is not None:
            yield from check_standby(incarnation, where)
        yield from replayed_to(proof_lsn, where)
        if through <= after:
            return []
        return (yield from _rows_and_retention(
            stream, stream_key, after, through, running_ts_floor, resume_after, lost
        ))  # fmt: skip
    if incarnation is not None:
        yield from check_history(incarnation, where, planned_lsn)
    found: list[Row] = []
    for index, text in enumerate(probe_texts([stream_key])):
        rows = yield Query(text)
        if index == COMPLETE_STATEMENT:
            found = rows
    yield Commit()  # step 2 is durable before anything is read behind it
    complete = int(found[0][2]) if found else 0
    if complete < through:
        if went_backwards is None:
            raise StoreError(
                f"stream {stream!r}: ({after}, {through}] was planned, but PostgreSQL proves "
                f"only {complete} complete"
            )
        went_backwards(complete)
        through = max(after, complete)  # never past what this probe proved
    if through <= after:
        return []
    return (yield from _rows_and_retention(
        stream, stream_key, after, through, running_ts_floor, resume_after, lost
    ))  # fmt: skip


def _rows_and_retention(
    stream: str,
    stream_key: int,
    after: int,
    through: int,
    running_ts_floor: int | None,
    resume_after: tuple[int, int] | None,
    lost: Callable[[FactsPruned], None],
) -> RangeGen[list[Row]]:
    """Steps 3 and 4 of `read_range`."""
    kept = yield StreamRows(
        range_rows_sql(
            stream_key,
            after,
            through,
            running_ts_floor=running_ts_floor,
            resume_after=resume_after,
        )
    )
    rows = yield Query(pruned_through_sql(stream_key))
    yield Commit()
    pruned = int(rows[0][0]) if rows else 0
    if pruned > after:
        lost(FactsPruned(stream, after, pruned))
    return kept


def read_proven_range(
    stream: str,
    stream_key: int,
    after: int,
    through: int,
    limit: int | None = None,
    *,
    jsonb: bool = False,
) -> RangeGen[list[Row]]:
    """Steps 3-4 for ``(after, through]`` of the stream ``stream`` (registry id ``stream_key``),
    at or below what an earlier probe proved, as plain statements for any driver: at most
    ``limit`` rows (None: all; a page may end inside a fact: `streams.core.page_cut`) as a
    `StreamRows`, then the retention check: `FactsPruned` if facts after ``after`` were removed.
    ``jsonb``: the payload as stored (`streams.store.rows.range_rows_sql`). Returns the rows
    the driver kept (see `StreamRows`)."""
    kept = yield StreamRows(range_rows_sql(stream_key, after, through, limit=limit, jsonb=jsonb))
    rows = yield Query(pruned_through_sql(stream_key))  # after the rows (step 4)
    yield Commit()
    pruned = int(rows[0][0]) if rows else 0
    if pruned > after:
        raise FactsPruned(stream, after, pruned)
    return kept


def fetch_all(plan: RangeGen[T]) -> Gen[T]:
    """``plan`` as a plan of `streams.store.driver` operations (for `driver.run`, `driver.arun`):
    its `StreamRows` statement is run as a `Query`, whose rows the plan receives whole."""
    try:
        step = next(plan)
        while True:
            op: Op = Query(step.statement) if isinstance(step, StreamRows) else step
            step = plan.send((yield op))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
