"""What is complete: the probe, shared proofs and the prober election.

`probe` learns each stream's complete position ``C`` from PostgreSQL alone, in one pipeline of
ordered statements (the sequences, then ``pg_locks``, then a WAL flush); `prove` records it in
``streams_proofs`` for followers, who read it with the rows behind it in one statement.

The arguments: docs/design/probe.md (what is complete; shared proofs; the standby fence) and
docs/design/durability.md (no ID ``<= C`` is handed out again after a crash).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.constants import (
    PROOF_LOCK,
    RESERVATION_LOCK_SPAN,
    STALE_AFTER,
    reservation_lock_class,
)
from ..types import StreamInfo
from ._common import COMPLETE_SETTING, MAY_END_SESSION, RESERVATION_LOCKS, int_array
from .driver import Commit, Gen, Pipeline, Query, Row


@dataclass(frozen=True, slots=True)
class Probe:
    """What PostgreSQL proves about a stream at one moment (docs/design/probe.md).

    ``max_allocated``: the highest ID reserved so far. ``complete``: every ID ``<=`` it has
    completed, so a reader may deliver everything up to it; this is the stream's linear
    position as PostgreSQL alone can vouch for it.
    """

    stream: str
    max_allocated: int
    complete: int
    #: The primary's WAL insert position read with the proof, as an int ("the standby fence";
    #: 0: not known): a standby that has replayed past it shows every fact ``<= complete``.
    wal_lsn: int = 0
    #: The primary's flushed WAL position read with the proof (0: not known): on disk whenever
    #: it was read, so a server on the same timeline is never below it unless its data
    #: directory went back (`streams.core.incarnation`, "A rewind"). The insert position is
    #: not: it may be past what any crash recovery restores.
    flushed_lsn: int = 0


#: Session settings (plus the stream's registry id) where a probe leaves max allocated
#: (statement 1) and the complete position (statement 2, for `fetch_rows_after_probe`).
ALLOCATED_SETTING = "streams.allocated_"

_HALF_SPAN = RESERVATION_LOCK_SPAN // 2

#: Statement 1 of a probe: every sequence's last value, before any lock is read.
_PROBE_ALLOCATED_SQL = f"""
SELECT r.id,
       set_config('{ALLOCATED_SETTING}' || r.id,
                  COALESCE(pg_sequence_last_value(r.sequence_name::regclass), 0)::text, false)
FROM streams_registry r
WHERE r.id = ANY(%(ids)s::int[])
"""

#: Statement 2 of a probe: pg_locks, then ``C`` from statement 1's values. Nothing here depends
#: on the order of evaluation: statement 1 has ended before this statement starts.
_PROBE_COMPLETE_SQL = f"""
SELECT r.name, a.allocated, c.complete,
       set_config('{COMPLETE_SETTING}' || r.id, c.complete::text, false)
FROM unnest(%(ids)s::int[], %(classes)s::bigint[]) AS k(id, lock_class)
JOIN streams_registry r ON r.id = k.id
CROSS JOIN LATERAL (
    SELECT current_setting('{ALLOCATED_SETTING}' || r.id)::bigint AS allocated
) AS a
CROSS JOIN LATERAL (
    -- objid holds L mod 2**32; L is the one value in [allocated + 1 - 2**31, allocated + 1 +
    -- 2**31). Not only <= allocated + 1: a writer that took its lock after statement 1 read
    -- the sequence has an L above it (its IDs are too, so it cannot lower C), and must not
    -- wrap around to a value 2**32 below (that read C as 0 while writers were busy).
    SELECT min(a.allocated + 1
               + ((l.objid::bigint - a.allocated - 1 + {_HALF_SPAN}) %% {RESERVATION_LOCK_SPAN}
                  + {RESERVATION_LOCK_SPAN}) %% {RESERVATION_LOCK_SPAN}
               - {_HALF_SPAN}) AS min_locked
    FROM pg_locks l
    WHERE {RESERVATION_LOCKS} AND l.classid = k.lock_class::oid
) AS m
CROSS JOIN LATERAL (
    SELECT GREATEST(0, LEAST(a.allocated, COALESCE(m.min_locked - 1, a.allocated))) AS complete
) AS c
"""

#: Statement 3 of a probe: make durable every sequence value and commit statements 1 and 2 saw
#: (docs/design/durability.md): flushed already, or flushed by this transaction's commit. Its
#: second column is the probe's LSN, the WAL insert position ("the standby fence").
_PROBE_DURABLE_SQL = """
SELECT CASE
    WHEN pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn() THEN false
    ELSE (SELECT true FROM (SELECT set_config('synchronous_commit', 'on', true),
                                   pg_logical_emit_message(true, 'streams', 'durable')) AS flush)
END, (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint,
    (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint
"""

#: Settings of every session that reads facts behind a probe (readers): READ COMMITTED, which the
#: probe argument needs; the statements that repeat (the probe, the page behind it) are prepared by
#: psycopg, and generic plans halved a caught-up reader's round trip (688 -> 349 us per probe,
#: measured); with statistics older than a stream's growth the planner read a page
#: ``stream_id > a AND stream_id <= b ... LIMIT n`` as a bitmap scan of the whole remaining range
#: plus a sort (100 ms per 5000-row page instead of 2 ms): the ordered primary-key scan is always
#: right for these statements.
READER_SESSION_SETUP = (
    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET plan_cache_mode = force_generic_plan",
    "SET enable_bitmapscan = off",
)


def set_up_reader_session(*extra: str) -> Gen[None]:
    """`READER_SESSION_SETUP`, then ``extra`` settings, on a new autocommit session."""
    for statement in (*READER_SESSION_SETUP, *extra):
        yield Query(statement)


def probe_queries(infos: Sequence[StreamInfo]) -> list[Query]:
    """The statements of `probe`, for pipelining (docs/design/probe.md): the rows of
    statement `COMPLETE_STATEMENT` go to `probes_from_rows`; more statements may follow them
    in the pipeline, in the order `streams.store.reads` gives (`reads.probe_and_read`)."""
    return list(_probe_queries(tuple(info.id for info in infos)))


@functools.lru_cache(maxsize=1024)
def _probe_queries(ids: tuple[int, ...]) -> tuple[Query, ...]:
    # pg_locks shows the int4 key as an unsigned oid.
    classes = [reservation_lock_class(i) % RESERVATION_LOCK_SPAN for i in ids]
    allocated = _PROBE_ALLOCATED_SQL.replace("%(ids)s", int_array(ids))
    complete = _PROBE_COMPLETE_SQL.replace("%(ids)s", int_array(ids)).replace(
        "%(classes)s", int_array(classes)
    )
    # Rendered to bytes once: psycopg caches the conversion of a bytes query (empty parameters
    # still turn ``%%`` into ``%``).
    return (
        Query(allocated.encode(), ()),
        Query(complete.encode(), ()),
        Query(_PROBE_DURABLE_SQL.encode(), ()),
    )


def probe_texts(stream_keys: Sequence[int]) -> tuple[str, ...]:
    """The statements of `probe` for the streams with these registry ids, as plain text, for
    a plan that any driver runs (`streams.store.reads.read_range`: ADBC on Spark executors),
    one statement at a time in this order, then commits (the last one's commit makes them
    durable): the probe and durability arguments hold for it as for `probe`. The statement at
    `COMPLETE_STATEMENT` returns ``(name, max allocated, complete, _)`` per stream. Ints only,
    inlined."""
    texts = []
    for query in _probe_queries(tuple(int(k) for k in stream_keys)):
        statement = query.statement
        assert isinstance(statement, bytes)
        texts.append(statement.decode().replace("%%", "%"))  # psycopg's escape, undone
    return tuple(texts)


def statement_timeout_setup(timeout_ms: int) -> str:
    """The session setting that bounds every statement of a session: a statement stuck behind
    a lock or on a server in trouble is cancelled (SQLSTATE 57014) after ``timeout_ms``, and
    the caller may run it again (`streams.store.driver.transient_sqlstate`)."""
    return f"SET statement_timeout = {int(timeout_ms)}"


#: How many statements `probe_queries` returns (results before the rows behind a probe).
PROBE_STATEMENTS = 3
#: Which of them returns the probe's rows (`probes_from_results`).
COMPLETE_STATEMENT = 1


#: Which of them returns the probe's LSN (second column: "the standby fence").
DURABLE_STATEMENT = 2


def probes_from_rows(
    rows: Sequence[Row], wal_lsn: int = 0, flushed_lsn: int = 0
) -> dict[str, Probe]:
    """The `Probe` of each stream from the rows of statement `COMPLETE_STATEMENT` (and the
    probe's LSNs, from statement `DURABLE_STATEMENT`: `wal_lsn_from_rows`)."""
    return {
        name: Probe(name, int(allocated), int(complete), wal_lsn, flushed_lsn)
        for name, allocated, complete, _ in rows
    }


def wal_lsn_from_rows(rows: Sequence[Row], column: int = 1) -> int:
    """The probe's LSN from the rows of statement `DURABLE_STATEMENT` (0 if absent): the
    insert position (column 1), or the flushed one (2)."""
    if rows and len(rows[0]) > column and rows[0][column] is not None:
        return int(rows[0][column])
    return 0


def probes_from_results(results: Sequence[Sequence[Row]]) -> dict[str, Probe]:
    """The `Probe` of each stream from the results of a pipeline that began with
    `probe_queries`."""
    durable = results[DURABLE_STATEMENT]
    return probes_from_rows(
        results[COMPLETE_STATEMENT], wal_lsn_from_rows(durable), wal_lsn_from_rows(durable, 2)
    )


#: The primary's WAL insert position as an int: pipelined after a statement that read a shared
#: proof (`streams.store.reads.read_after_proof`), the proof's LSN ("the standby fence").
WAL_POSITION_SQL = b"SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint"


def wal_position_query() -> Query:
    """The statement of `WAL_POSITION_SQL`."""
    return Query(WAL_POSITION_SQL, ())


def probe(infos: Sequence[StreamInfo]) -> Gen[dict[str, Probe]]:
    """`Probe` every stream in ``infos`` in one round trip (no transaction is left open)."""
    results = yield Pipeline(probe_queries(infos))
    yield Commit()
    return probes_from_results(results)


#: Streams per probe transaction: the probe reads every sequence, and each sequence read holds
#: a lock until commit in PostgreSQL's shared lock table (6,400 at the defaults, for the whole
#: server: `streams.store.registry.CREATE_CHUNK`).
PROBE_CHUNK = 1000

# Every session holding or waiting for a reservation lock of any stream, by stream: the first
# key is minus the registry id, shown unsigned (`streams.core.constants.reservation_lock_class`).
_HELD_SQL = f"""
SELECT {RESERVATION_LOCK_SPAN} - l.classid::bigint AS stream,
       max(COALESCE(extract(epoch FROM clock_timestamp() - a.xact_start), 0) * 1000)::bigint
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE {RESERVATION_LOCKS} AND l.pid <> pg_backend_pid()
GROUP BY 1
"""

_ALLOCATED_SQL = """
SELECT r.id, COALESCE(pg_sequence_last_value(r.sequence_name::regclass), 0)
FROM streams_registry r WHERE r.id = ANY(%(ids)s::int[])
"""


def probe_many(infos: Sequence[StreamInfo]) -> Gen[dict[int, Probe]]:
    """Each stream's `Probe` by registry id, for views of many streams (``streams positions``,
    the metrics): `probe` for the streams some session holds back, and for the others their
    sequence. The probe's argument (docs/design/probe.md), its statements run apart: every
    sequence is read, then ``pg_locks`` once; an ID allocated by then and not complete has a
    writer's reservation lock held from before its allocation until it completes, so a stream
    without one is complete up to what its sequence showed. Then the durability statement, as
    the probe's third. Not `probe` for all: it leaves two settings per stream in the session,
    and PostgreSQL 15 sorts its settings again for each new one: 49 s for the first probe of
    10,000 streams in a session (0.9 s after). `PROBE_CHUNK` sequences per transaction (each
    read holds a lock until commit)."""
    allocated: dict[int, int] = {}
    ids = [info.id for info in infos]
    for start in range(0, len(ids), PROBE_CHUNK):
        # Each sequence read holds a lock until commit: PROBE_CHUNK per transaction.
        rows = yield Query(_ALLOCATED_SQL, {"ids": ids[start : start + PROBE_CHUNK]})
        yield Commit()
        allocated.update((int(i), int(a)) for i, a in rows)
    held = yield from held_streams()
    found = {
        info.id: Probe(info.name, allocated[info.id], allocated[info.id])
        for info in infos
        if info.id not in held and info.id in allocated
    }
    rest = [info for info in infos if info.id not in found]
    for start in range(0, len(rest), PROBE_CHUNK):
        probed = yield from probe(rest[start : start + PROBE_CHUNK])
        found.update((info.id, probed[info.name]) for info in rest[start : start + PROBE_CHUNK]
                     if info.name in probed)  # fmt: skip
    yield Query(_PROBE_DURABLE_SQL)
    yield Commit()
    return found


def held_streams() -> Gen[dict[int, int]]:
    """Registry ids of the streams some session holds back (a reservation lock held or waited
    for), with the age in ms of the oldest such transaction: one look at ``pg_locks``."""
    rows = yield Query(_HELD_SQL)
    yield Commit()
    # Other advisory locks of two keys (writer, registration) map to no registry id.
    return {int(s): max(0, int(age_ms)) for s, age_ms in rows if 0 < int(s) < 2**31}


#: Statement 3 of `prove`: record what statement 2 proved (forward-only) for every reader. A
#: record above the stream's sequence (no prober wrote it: followers refuse it) is replaced,
#: not kept by ``GREATEST``, so shared proofs work again from the next proof on.
_RECORD_PROOF_SQL = f"""
INSERT INTO streams_proofs (stream, complete, proven_at, incarnation)
SELECT k.id, current_setting('{COMPLETE_SETTING}' || k.id)::bigint, clock_timestamp(),
       %(incarnation)s
FROM unnest(%(ids)s::int[]) AS k(id)
ON CONFLICT (stream) DO UPDATE
SET complete = CASE
        -- A record of another history (restored with the database, or left by a primary
        -- before a failover) says nothing about this one, and one above the sequence was not
        -- written by a prober: both are replaced, not maxed.
        WHEN streams_proofs.incarnation IS DISTINCT FROM EXCLUDED.incarnation
          OR streams_proofs.complete > (
            SELECT COALESCE(pg_sequence_last_value(r.sequence_name::regclass), 0)
            FROM streams_registry r WHERE r.id = streams_proofs.stream)
        THEN EXCLUDED.complete
        ELSE GREATEST(streams_proofs.complete, EXCLUDED.complete)
    END,
    proven_at = EXCLUDED.proven_at,
    incarnation = EXCLUDED.incarnation
RETURNING stream
"""

#: Settings of the prober's session, on top of `READER_SESSION_SETUP`: a proof row that a crash
#: loses is recomputed by the next probe, and what it vouches for is durable before it commits
#: (statement 3 of the probe turns ``synchronous_commit`` on for the transactions that need a
#: flush: docs/design/durability.md), so the others need not wait for the WAL flush.
PROVER_SESSION_SETUP = ("SET synchronous_commit = off",)


def record_proof_query(infos: Sequence[StreamInfo], incarnation: str | None = None) -> Query:
    """The statement that records in ``streams_proofs`` what the probe before it in the same
    session proved for each of ``infos`` (forward-only within one database ``incarnation``,
    the prover's token, which followers compare with theirs; see "shared proofs")."""
    return Query(
        _RECORD_PROOF_SQL, {"ids": [info.id for info in infos], "incarnation": incarnation}
    )


def prove(infos: Sequence[StreamInfo], incarnation: str | None = None) -> Gen[dict[str, Probe]]:
    """`probe` every stream in ``infos`` and record the result in ``streams_proofs`` for the
    readers of other processes (under ``incarnation``: a record without one is followed by
    nobody), in one round trip (see "shared proofs"). The prober reads the rows it signs in
    the same round trip: `streams.store.reads.prove_with_rows`."""
    queries = probe_queries(infos)
    queries.append(record_proof_query(infos, incarnation))
    results = yield Pipeline(queries)
    yield Commit()
    return probes_from_results(results)


def try_become_prover(infos: Sequence[StreamInfo]) -> Gen[list[str]]:
    """Take the prober election lock of each stream that nobody holds (session-scoped: it is
    kept until `resign_prover` or the session ends); returns the names taken. Only a process
    whose role may read the signing seeds calls it (`streams.store.keys.may_sign`: a prover
    that could not sign would only slow its followers down)."""
    by_id = {info.id: info.name for info in infos}
    rows = yield Query(
        "SELECT k.id FROM unnest(%s::int[]) AS k(id) WHERE pg_try_advisory_lock(%s, k.id)",
        (list(by_id), PROOF_LOCK),
    )
    yield Commit()
    return sorted(by_id[int(row[0])] for row in rows)


#: A prover whose proofs are older than this many ms is ended by a process that wants to
#: prove in its place (readers already probe for themselves past `STALE_AFTER`).
REPLACE_PROVER_AFTER = 2 * STALE_AFTER


def end_stale_provers(infos: Sequence[StreamInfo]) -> Gen[list[str]]:
    """End the session holding the election lock of each stream in ``infos`` whose last proof
    is older than `REPLACE_PROVER_AFTER`: a prover frozen or cut off from the database keeps
    its session-scoped lock until its session ends, and no other process could take over.
    Returns the streams whose prover was ended (the next election takes them). Skips sessions
    the caller may not signal, as `streams.store.leases.end_expired_sessions` does."""
    by_id = {info.id: info.name for info in infos}
    rows = yield Query(
        f"""
        SELECT p.stream, pg_terminate_backend(l.pid, 1000)
        FROM streams_proofs p
        JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
         AND l.classid = %(lock)s::bigint::oid AND l.objid = p.stream::bigint::oid
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE p.stream = ANY(%(ids)s::int[])
          AND p.proven_at < clock_timestamp() - make_interval(secs => %(stale)s)
          AND l.pid <> pg_backend_pid()
          AND {MAY_END_SESSION}
        """,
        {"lock": PROOF_LOCK, "ids": list(by_id), "stale": REPLACE_PROVER_AFTER / 1000},
    )
    yield Commit()
    return sorted(by_id[int(stream)] for stream, _ in rows)


def resign_prover(infos: Sequence[StreamInfo]) -> Gen[None]:
    """Release the prober election locks of ``infos`` that this session holds."""
    yield Query(
        "SELECT pg_advisory_unlock(%s, k.id) FROM unnest(%s::int[]) AS k(id)",
        (PROOF_LOCK, [info.id for info in infos]),
    )
    yield Commit()
