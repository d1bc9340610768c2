"""Writer rows, sequences and their repair: who may still complete IDs.

``streams_writers`` has one row per (stream, writer instance): its generation, its persisted
per-writer position (forward-only) and its lease. This module reads and retires those rows,
compares each stream's sequence with every ID known to be used (and repairs a sequence set
back by a restore), and finds the sessions that hold a stream's reservation locks. The
statements of a writer's own transactions are in `streams.store.writer_core`.

Why PostgreSQL judges dead writers (the fencing argument)
---------------------------------------------------------
Every writing transaction starts with one statement that takes ``FOR KEY SHARE`` on its
writer's row *where the generation is still the writer's own and the row is not retired*, and
reserves its IDs in the same statement. Retiring a writer takes ``FOR UPDATE`` on that row,
which conflicts with ``FOR KEY SHARE``: the retirement therefore waits until every open
transaction of that writer has ended (committed or rolled back), and every later transaction
of the retired writer finds no row, reserves nothing and stops with `WriterFenced`. So once a
retirement commits, no ID reserved by that writer can still complete: it is safe to treat the
writer as caught up and let the linear position pass its pending IDs. A writer killed with
``kill -9`` loses its connection, the server aborts its transaction, and the retirement goes
through as soon as the lease has expired. Position heartbeats are plain ``UPDATE``s of
non-key columns, which do not conflict with ``FOR KEY SHARE``, so they never wait for appends.
A wedged-but-connected writer cannot hold a transaction open forever either: each writing
transaction sets ``idle_in_transaction_session_timeout`` to the lease.

Why no stream stalls past a writer's lease (the liveness argument)
-----------------------------------------------------------------
Fencing waits for a writer's open transactions; liveness needs each of them to end within a
bound, whatever the writer's process does. Every writing transaction sets, for itself, the
server's ``idle_in_transaction_session_timeout`` and ``statement_timeout`` to the lease, so a
transaction that sits idle, runs a statement (ours or the caller's, inside ``fact()``) or
waits for a lock longer than that is aborted by the server. What neither timer ends is a
backend waiting for the client in the middle of a ``COPY ... FROM STDIN``: the server does not
act on a timeout while it reads from the client. That is what a frozen process (SIGSTOP, a VM
pause) or a network partition leaves behind during a batch or a ``fact.add``. So every writing
transaction also holds its writer's own lock (`streams.core.constants.WRITER_LOCK`, keyed by
stream and instance), and `end_expired_sessions` ends, with ``pg_terminate_backend``, every
session that holds the lock of a writer whose lease has expired: its transaction aborts (its
IDs are gaps: nothing of it was committed, since it still held its locks), the retirement that
follows goes through, and the linear position passes. A live writer renews its lease every
``lease / 4``, so this only ever ends the sessions of a writer that has not been heard from
for a whole lease (a frozen process, or one cut off from the database); if it wakes up, its
connection is gone and its next transaction is fenced.

Who ends them: every writer's heartbeat retires expired peers (every `RETIRE_EVERY` beats),
and so does every reader, the elected prover and the Spark source when a probe finds the
stream held below max allocated for `streams.core.stalls.CHECK_AFTER` (then at most
once a second). So a stream with a reader stalls behind a frozen or partitioned writer for at
most the lease (from the writer's last heartbeat), plus about a second to notice, plus the
time the server takes to end the session (up to a second is waited for). Ending another
session needs the right to: the sessions of one role may end each other's (PostgreSQL lets a
role signal its own backends, and members of ``pg_signal_backend`` any non-superuser's);
sessions the caller may not end are left alone, and doctor names them.

Why no session holds a stream back past the lease (the holding argument)
-----------------------------------------------------------------------
The liveness argument finds a writer's sessions by its writer lock. But advisory locks have no
privileges: any login may take a stream's reservation lock, hold it as long as it likes, and
every reader stops below its key (issue 37); it may forge a live writer's writer lock as
easily. The probe cannot tell such a lock from a writer's, and must not ignore it (a lock it
ignored could be a writer's, about to commit an ID below what it proves), so the defence is
to *end* the session, and the rule is about sessions, whoever they are: **no session holds a
stream's reservation lock past the bound**, where the bound is the longest lease of the
stream's writers that are not retired (``lease_expires_at - heartbeat_at``: registration and
every heartbeat set both in one statement), and at least the observer's own lease
(``Settings.lease_seconds``). The probe keeps counting every lock; its soundness is untouched.

Which sessions are overdue. A library transaction takes key ``L`` in the statement that reads
the sequence at ``L - 1`` and then calls ``nextval`` ("the probe argument"), and the sequence
only moves forward (an observer that sees it lower, after a restore, forgets what it had
recorded). So once some probe has read the sequence at or past ``L`` (its max allocated),
every library transaction holding ``L`` had read it at ``L - 1`` before, hence had begun
before that probe. (Keys are ``L mod 2**32``, read back as the probe reads them,
`streams.core.stalls.reservation_floor`: exact for any transaction less than 2**31 IDs old.)
Each observer (`streams.core.stalls.HeldStreams`) records, after each probe returns, when
(its own monotonic clock) it saw which max allocated; at a stall check at
``now`` it reads ``pg_locks`` (`holding_state`, later than ``now``) and ends every session
holding, or waiting for, a key ``L <=`` the max allocated of a probe recorded at or before
``now - bound`` (`end_overdue_holders`). A library transaction so ended would have been open
for longer than the bound, which none may: its statements and idle gaps are bounded by the
lease (the liveness argument), and so must the transaction as a whole be, from its first
reservation to its end (a batch, a ``fact()`` block, a Spark sink task: a transaction that
long holds every reader of its stream back for as long anyway). Whatever else holds such a
key holds the stream back for no writer: no library transaction takes it any more.

This catches one session holding one key for as long as it likes (ended one bound after the
sequence passed its key), a session-level lock held while idle or across any number of short
transactions (no transaction age is looked at), many keys in many sessions (all ended at
once), and sessions taking turns on one key (each is overdue the moment it takes it). The
design first considered judged each ``(pid, backend_start, key)`` by how long this observer
had seen it hold: two sessions taking turns on one key, each for less than the bound, would
have held the stream for ever under it, none of them ever ended nor named. Judging the *key*
by when the sequence passed it ends each of them within a check of taking it, and never ends
a session holding a key above max allocated (which holds nothing back), such as a writer that
took ``L`` and has not reserved yet. The stall behind such sessions is then at most the bound
from the first probe that saw the sequence past their key, plus up to `CHECK_EVERY` to the
next check, plus up to a second for the server to end them.

What it does not end: a session this role may not signal (a superuser's, or any other role's
without ``pg_signal_backend``): it is named in one warning per stream, and by `streams
doctor`. Under the role model the prover may (`streams.store.roles`), a plain reader warns. A
prepared transaction (no session) holding a key. And no rule of this kind stops a login that
keeps opening sessions and taking the key again as fast as they are ended: each lasts about a
check and is logged by name, but the stream stays held while it goes on (revoke its
``CONNECT``). An exclusive lock on the *next* key holds no reader back (no ID is reserved at
it) but makes every writer of the stream wait for it, and nothing bounds that wait yet (the
lease's ``statement_timeout`` is set inside the reserving statement, too late for it): not
handled here.

Ending is one statement (`_END_HOLDERS_SQL`) that re-checks, for each session to end, in its
own reading of ``pg_locks``, that the pid still holds that key of that stream, that its
``backend_start`` is the one seen (pid reuse; NULL to a role that may not see it) and that this
role may signal it; ``pg_terminate_backend`` is called only on the rows those joins and filters
leave, whatever order PostgreSQL evaluates them in (a pid that holds such a key in that reading
is overdue, whoever it is).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from psycopg import sql

from ..core.constants import (
    REGISTRATION_LOCK,
    RESERVATION_LOCK_SPAN,
    WRITER_LOCK,
    reservation_lock_class,
)
from ..core.positions import sequence_repair_target
from ..core.stalls import HeldStreams, Hold, reservation_floor
from ..errors import StoreError
from ._common import MAY_END_SESSION, RESERVATION_LOCKS
from .driver import Commit, Gen, Query
from .registry import FactTable, StreamInfo


def max_allocated_sql(info: StreamInfo) -> sql.Composed:
    """``pg_sequence_last_value`` is NULL before the first nextval: that means 0 allocated."""
    return sql.SQL("COALESCE(pg_sequence_last_value({}::regclass), 0)").format(
        sql.Literal(info.sequence_name)
    )


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A stream's sequence beside every ID known to be used: what repair compares."""

    last_value: int | None
    #: The largest stream ID found in ``streams_facts`` and every declared table.
    max_stored: int | None
    #: The largest position any writer persisted or any reader group committed.
    max_position: int | None
    #: Declared tables that do not exist (any more): their IDs cannot be seen.
    missing_tables: tuple[FactTable, ...] = ()

    @property
    def max_used(self) -> int | None:
        known = [v for v in (self.max_stored, self.max_position) if v is not None]
        return max(known) if known else None

    @property
    def repair_target(self) -> int | None:
        return sequence_repair_target(self.last_value, self.max_used)


def _existing_fact_tables(
    info: StreamInfo,
) -> Gen[tuple[list[FactTable], list[FactTable]]]:
    """The stream's declared tables split into (existing, missing): a dropped table must not
    fail repair, only be reported."""
    present: list[FactTable] = []
    missing: list[FactTable] = []
    for table in info.fact_tables:
        rows = yield Query("SELECT to_regclass(%s) IS NOT NULL", (table.table,))
        (present if rows[0][0] else missing).append(table)
    return present, missing


def _filter_params(tables: list[FactTable], params: dict[str, object]) -> dict[str, object]:
    """``params`` and the value of each declared table's filter, as ``where_<i>`` for the
    ``i``-th table (`FactTable.max_sql`, `FactTable.ids_sql`): a parameter, never SQL text."""
    for i, table in enumerate(tables):
        params.update(table.params(f"where_{i}"))
    return params


def sequence_state(info: StreamInfo, *, commit: bool = True) -> Gen[SequenceState]:
    """Read everything sequence repair needs, in one statement: the sequence, the largest ID in
    ``streams_facts`` and in each declared table, and the largest writer and group position (a
    writer persists positions up to max allocated; a group commits up to the linear position;
    both mean those IDs were handed out) or ``pruned_through`` (retention removed facts up to
    it: they existed even when no row is left).

    A declared table gives ``max(column) FROM table``, or, declared with a filter (a table
    shared by several streams), ``max(column) FROM table WHERE where_column = %(where_<i>)s``
    with the value as a parameter: only this stream's rows, so another stream's IDs in the
    same table do not move this stream's sequence. Index ``(where_column, column)`` (or
    ``(column)`` without a filter) so that each is one index probe.

    What stays invisible: facts in a table the stream does not declare (or rows its filter
    leaves out). `streams doctor` reports how many IDs have no row anywhere it can see
    (rollbacks, or such a table).
    """
    present, missing = yield from _existing_fact_tables(info)
    params = _filter_params(present, {"stream": info.id})
    maxima = [
        sql.SQL("(SELECT max(stream_id) FROM streams_facts WHERE stream = %(stream)s)"),
        *(t.max_sql(f"where_{i}") for i, t in enumerate(present)),
    ]
    rows = yield Query(
        sql.SQL(
            "SELECT pg_sequence_last_value({seq}::regclass), GREATEST({maxima})::bigint, "
            "GREATEST((SELECT max(position) FROM streams_writers WHERE stream = %(stream)s), "
            "(SELECT max(position) FROM streams_reader_groups WHERE stream = %(stream)s), "
            "(SELECT NULLIF(pruned_through, 0) FROM streams_registry WHERE id = %(stream)s))"
        ).format(seq=sql.Literal(info.sequence_name), maxima=sql.SQL(", ").join(maxima)),
        params,
    )
    if commit:
        yield Commit()
    last, stored, position = rows[0]
    return SequenceState(
        None if last is None else int(last),
        None if stored is None else int(stored),
        None if position is None else int(position),
        tuple(missing),
    )


@dataclass(frozen=True, slots=True)
class UnseenIds:
    """Of the last ``ids`` allocated IDs, ``unseen`` have no row in ``streams_facts`` nor in any
    declared table (only its rows of the stream, for a declaration with a filter): rolled back,
    or facts in a table the stream does not declare."""

    ids: int
    unseen: int


def unseen_ids(info: StreamInfo, window: int) -> Gen[UnseenIds]:
    """Count the most recent ``window`` allocated IDs that no known table holds (`doctor`)."""
    present, _ = yield from _existing_fact_tables(info)
    tables: list[sql.Composable] = [
        sql.SQL("SELECT stream_id FROM streams_facts WHERE stream = %(stream)s"),
        *(t.ids_sql(f"where_{i}") for i, t in enumerate(present)),
    ]
    rows = yield Query(
        sql.SQL(
            """
            WITH a AS (SELECT {allocated} AS top),
            seen AS ({union})
            SELECT LEAST(a.top, %(window)s),
                   LEAST(a.top, %(window)s) - (
                       SELECT count(DISTINCT s.stream_id) FROM seen s
                       WHERE s.stream_id > a.top - %(window)s AND s.stream_id <= a.top)
            FROM a
            """
        ).format(
            allocated=max_allocated_sql(info),
            union=sql.SQL(" UNION ALL ").join(
                sql.SQL("SELECT * FROM ({}) AS t(stream_id)").format(t) for t in tables
            ),
        ),
        _filter_params(present, {"stream": info.id, "window": window}),
    )
    yield Commit()
    return UnseenIds(int(rows[0][0]), int(rows[0][1]))


def expired_writer_count(info: StreamInfo) -> Gen[int]:
    """Writers whose lease expired but that are not retired yet."""
    rows = yield Query(
        "SELECT count(*) FROM streams_writers WHERE stream = %s AND NOT retired "
        "AND lease_expires_at < clock_timestamp()",
        (info.id,),
    )
    yield Commit()
    return int(rows[0][0])


def registration_lock(info: StreamInfo) -> Gen[None]:
    """Take the stream's registration lock for the rest of the transaction: writer registration
    and sequence repair of one stream run one at a time (`streams.core.constants`)."""
    yield Query("SELECT pg_advisory_xact_lock(%s, %s)", (REGISTRATION_LOCK, info.id))


def repair_sequence_now(info: StreamInfo) -> Gen[int | None]:
    """`repair_sequence` in a transaction of its own, under the registration lock (for
    ``streams doctor --repair``); returns the new value, or None."""
    yield from registration_lock(info)
    target = yield from repair_sequence(info)
    yield Commit()
    return target


def repair_sequence(info: StreamInfo) -> Gen[int | None]:
    """Move the sequence past every ID known to be used if it is behind; returns the new
    value (None: it was not behind).

    The database moves it (``streams_repair_sequence``, revision 0015), forward only, to the
    highest ID it holds for the stream (facts, writers' and groups' positions, how far
    retention pruned) or the highest ID of the stream's declared tables, which this session
    reads (they are the application's: the function cannot) and hands over. Roles that may
    not set a sequence themselves (writers, operators: ``UPDATE`` would let them set it back)
    repair through it; it checks that the login may write this stream or is an operator.

    Runs in the caller's transaction under the stream's registration lock, so two starting
    writers do not both repair. ``setval`` is not transactional: the repair stands even if the
    caller's transaction rolls back, which is what it should do.
    """
    present, _ = yield from _existing_fact_tables(info)
    seen: int | None = None
    if present:
        rows = yield Query(
            sql.SQL("SELECT GREATEST({})::bigint").format(
                sql.SQL(", ").join(t.max_sql(f"where_{i}") for i, t in enumerate(present))
            ),
            _filter_params(present, {}),
        )
        seen = None if rows[0][0] is None else int(rows[0][0])
    rows = yield Query("SELECT streams_repair_sequence(%s, %s)", (info.id, seen))
    return None if rows[0][0] is None else int(rows[0][0])


def writer_lock_sql(stream: sql.Composable, instance: sql.Composable) -> sql.Composed:
    """Take the writer's own lock (`WRITER_LOCK`, see "the liveness argument") for the rest of
    the transaction: ``stream`` and ``instance`` are SQL expressions (parameters, columns)."""
    return sql.SQL("pg_advisory_xact_lock_shared({cls}, {key})").format(
        cls=sql.Literal(WRITER_LOCK), key=_writer_lock_key(stream, instance)
    )


def _writer_lock_key(stream: sql.Composable, instance: sql.Composable) -> sql.Composed:
    return sql.SQL("hashtext(({stream})::text || '/' || ({instance}))").format(
        stream=stream, instance=instance
    )


#: Milliseconds `end_expired_sessions` waits for each ended session to be gone.
END_SESSION_WAIT_MS = 1000


def end_expired_sessions(
    info: StreamInfo, instance: str | None = None
) -> Gen[list[tuple[str, int]]]:
    """End the sessions still in a transaction of a writer of ``info`` (or of ``instance``
    only) whose lease has expired, so that its retirement can go through (see "the liveness
    argument"); returns ``(instance, pid)`` of each session ended.

    Reads ``pg_locks`` only when there is an expired writer that is not retired: a nested loop
    over the (usually empty) set of such writers. Skips sessions the caller may not signal.
    """
    rows = yield Query(
        sql.SQL(
            """
            WITH expired AS (
                SELECT w.stream, w.instance FROM streams_writers w
                WHERE w.stream = %(stream)s AND NOT w.retired
                  AND w.lease_expires_at < clock_timestamp()
                  AND (%(instance)s::text IS NULL OR w.instance = %(instance)s)
            )
            SELECT e.instance, h.pid, pg_terminate_backend(h.pid, {wait})
            FROM expired e
            CROSS JOIN LATERAL (
                SELECT l.pid FROM pg_locks l
                JOIN pg_stat_activity a ON a.pid = l.pid
                WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
                  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                  AND l.classid = {cls}::bigint::oid
                  AND l.objid = ({key}::bigint & 4294967295)::oid
                  AND l.pid <> pg_backend_pid()
                  AND {may_end}
            ) h
            """
        ).format(
            wait=sql.Literal(END_SESSION_WAIT_MS),
            may_end=sql.SQL(MAY_END_SESSION),
            cls=sql.Literal(WRITER_LOCK),
            key=_writer_lock_key(sql.SQL("e.stream"), sql.SQL("e.instance")),
        ),
        {"stream": info.id, "instance": instance},
    )
    yield Commit()
    return [(str(name), int(pid)) for name, pid, _ in rows]


def retire_expired_writers(info: StreamInfo) -> Gen[list[str]]:
    """Retire writers whose lease has expired, ending first what they still hold open.

    ``FOR UPDATE SKIP LOCKED`` skips a writer whose transaction is still open (it holds
    ``FOR KEY SHARE`` on its row): that transaction may still commit, so the writer is not
    caught up yet. The server aborts it when the connection dies, when it has been idle or run
    a statement for the lease, and otherwise `end_expired_sessions` ends its session first (see
    "the liveness argument"); a writer whose session could not be ended is retired by a later
    call.
    """
    yield from end_expired_sessions(info)
    rows = yield Query(
        """
        WITH expired AS (
            SELECT stream, instance FROM streams_writers
            WHERE stream = %s AND NOT retired AND lease_expires_at < clock_timestamp()
            FOR UPDATE SKIP LOCKED
        )
        UPDATE streams_writers w
        SET retired = true, generation = w.generation + 1
        FROM expired e
        WHERE w.stream = e.stream AND w.instance = e.instance
        RETURNING w.instance
        """,
        (info.id,),
    )
    yield Commit()
    return sorted(row[0] for row in rows)


log = logging.getLogger("streams.writer")

#: SQLSTATE of "insufficient privilege": a caller that may not retire writers (a read-only
#: role) leaves it to others.
_NOT_ALLOWED = "42501"


def retire_where_held(
    infos: Mapping[str, StreamInfo],
    held: HeldStreams,
    now: float,
    observed: Iterable[tuple[str, int, int]],
) -> Gen[list[str]]:
    """After a probe: on each stream `held` says is due (held below max allocated for a while;
    see `streams.core.stalls`), `retire_expired_writers`, then `end_overdue_holders` ("the
    holding argument"). ``observed`` is ``(stream, complete, max_allocated)`` per stream, from a
    probe that returned before ``now`` (monotonic seconds). Returns the writers retired.

    For readers, the prover and the Spark source, which only read otherwise: a role that may
    not retire writers or end sessions gets one warning per stream and carries on (writers'
    heartbeats, the prover and other readers still do it).
    """
    retired: list[str] = []
    for name in held.observe(now, observed):
        retired += yield from retire_if_allowed(infos[name])
        yield from end_overdue_holders(infos[name], held, now)
    return retired


def retire_if_allowed(info: StreamInfo, who: str = "this role") -> Gen[list[str]]:
    """`retire_expired_writers`, for a caller that only reads otherwise (a reader, the prover,
    the Spark source, ``streams positions``): a role that may not retire writers (a
    ``streams_reader``) gets one warning per stream and carries on, since writers' heartbeats
    and the roles that may (prover, operator) retire them."""
    try:
        return (yield from retire_expired_writers(info))
    except StoreError as exc:
        if exc.sqlstate != _NOT_ALLOWED:
            raise
        if info.name not in _WARNED:
            _WARNED.add(info.name)
            log.warning("stream %r: %s may not retire expired writers: %s", info.name, who, exc)
        return []


_WARNED: set[str] = set()
#: Streams whose overdue holders this process could not end, warned about once each.
_WARNED_HOLDERS: set[str] = set()


def linear_from(live_positions: list[int], max_allocated: int) -> int:
    """The minimum persisted position over writers that are not retired (or max allocated).

    Persisted positions are values that were true when written, so this is a safe but slightly
    old reading; `probe` gives the current one.
    """
    return min([*live_positions, max_allocated])


def reservation_lock_key_sql(floor: sql.Composable) -> sql.Composed:
    """The int4 second key of a reservation lock on ``L`` (an SQL bigint expression): ``L mod
    2**32`` as an int4. For statements executed with parameters (``%%`` is psycopg's ``%``)."""
    return sql.SQL("((({floor} + 2147483648) %% 4294967296) - 2147483648)::int4").format(
        floor=floor
    )


@dataclass(frozen=True, slots=True)
class LockHolder:
    """A session holding (or waiting for) a stream's reservation lock: a writing transaction,
    or whoever else took it ("the holding argument").

    What `pg_stat_activity` shows of another role's session (its state, times and address)
    only a superuser, a member of that role or of ``pg_read_all_stats`` sees: to other roles
    those are unknown (``state`` and ``client`` empty, times None or 0).
    """

    pid: int
    application_name: str
    #: ``active``, ``idle in transaction``, ``idle``... as the server reports it.
    state: str
    transaction_seconds: float
    #: What it waits for, if anything (``Client``/``ClientRead``: the client; ``Lock``...).
    wait_event_type: str = ""
    wait_event: str = ""
    #: Seconds in its current state (the statement running, or idle).
    state_seconds: float = 0.0
    #: The writer instance whose transaction it is (None: not found, e.g. it just ended, or
    #: the session is no writer's).
    instance: str | None = None
    #: Seconds past that writer's lease expiry (negative: still leased).
    lease_expired_seconds: float | None = None
    #: The session's login role.
    role: str = ""
    #: Where it connects from: ``host:port``, ``local`` (a Unix socket), "" (not visible).
    client: str = ""
    #: When its backend started (None: not visible); with ``pid``, it names the session.
    backend_start: dt.datetime | None = None
    #: The lock's second key as ``pg_locks`` shows it (``L mod 2**32``, unsigned), and ``L``.
    key: int = 0
    floor: int = 0
    #: False while it waits for the lock (another session holds it in a conflicting mode).
    granted: bool = True
    #: How long it has held the stream back at least: its transaction's age, or, outside a
    #: transaction (a session-level lock), how long it has been idle (None: not visible). A
    #: session-level lock may be older.
    holding_seconds: float | None = None
    #: Whether this role may end the session (`MAY_END_SESSION`).
    may_end: bool = False

    @property
    def hold(self) -> Hold:
        """The session and key, as `streams.core.stalls` tracks them."""
        return Hold(self.pid, self.backend_start, self.key)

    def who(self) -> str:
        """Who the session is: pid, writer, role, application and address."""
        parts = [f"pid {self.pid}"]
        if self.instance:
            parts.append(f"writer {self.instance!r}")
        parts.append(f"role {self.role or '?'}")
        parts.append(f"application {self.application_name!r}")
        parts.append(f"address {self.client or '(not visible to this role)'}")
        return ", ".join(parts)

    def describe(self) -> str:
        """One line for operators: who, doing what, for how long, and whether leased."""
        waiting = f" waiting on {self.wait_event_type}/{self.wait_event}" if self.wait_event else ""
        if not self.granted:
            waiting += " (for the reservation lock itself)"
        lease = ""
        if self.lease_expired_seconds is not None:
            lease = (
                f", lease expired {self.lease_expired_seconds:.1f} s ago"
                if self.lease_expired_seconds > 0
                else f", lease valid {-self.lease_expired_seconds:.1f} s more"
            )
        if not self.state:
            doing = "its state and times are not visible to this role"
        elif self.state == "idle":
            doing = f"idle (in no transaction: a session-level lock) for {self.state_seconds:.1f} s"
        else:
            doing = (
                f"{self.state}{waiting} for {self.state_seconds:.1f} s, in its transaction for "
                f"{self.transaction_seconds:.1f} s"
            )
        holding = (
            f"holding ID {self.floor} back for at least {self.holding_seconds:.1f} s"
            if self.holding_seconds is not None
            else f"holding ID {self.floor} back"
        )
        return f"{self.who()}: {doing}, {holding}{lease}"


#: When ``pg_stat_activity a``'s session has held its locks since at least: its transaction's
#: start, or, idle in no transaction (so its lock is session-level), since it went idle.
_HOLDING_SINCE = "CASE WHEN a.state = 'idle' THEN a.state_change ELSE a.xact_start END"

#: ``host:port`` of ``pg_stat_activity a``'s client, ``local`` for a Unix socket, NULL when
#: not visible to this role.
_CLIENT = (
    "CASE WHEN a.client_addr IS NOT NULL THEN host(a.client_addr) || ':' || a.client_port"
    " WHEN a.client_port = -1 THEN 'local' END"
)

#: The longest lease of a stream's writers that are not retired (NULL: none).
_WRITERS_LEASE = (
    "(SELECT max(extract(epoch FROM w.lease_expires_at - w.heartbeat_at))::float8"
    " FROM streams_writers w WHERE w.stream = %(stream)s AND NOT w.retired)"
)


@dataclass(frozen=True, slots=True)
class HoldingState:
    """What a stall check reads in one statement (`holding_state`)."""

    #: The longest lease of the stream's writers that are not retired (None: none).
    writers_lease: float | None
    #: The sequence's last value, as read by that statement.
    allocated: int
    #: Every session holding or waiting for one of the stream's reservation locks, oldest
    #: transaction first.
    holders: list[LockHolder]


def holding_state(info: StreamInfo) -> Gen[HoldingState]:
    """The sessions holding the stream's reservation locks, oldest transaction first (what
    holds the stream's linear position back), with who each is (role, application, address),
    what it is doing and, through the writer's own lock, whose transaction it is and whether
    that writer's lease expired; and, from the same statement, the longest lease of the
    stream's writers and the sequence's last value.

    ``pg_locks`` and ``pg_stat_activity`` are read at different instants, and a session may not
    report its activity (``track_activities = off``): its transaction start may be unknown
    (reported as 0 seconds, state as the server gives it, e.g. ``disabled``), and a holder that
    ended in between is left out by the join. A prepared transaction (no session) is left out.
    """
    rows = yield Query(
        sql.SQL(
            """
            SELECT {writers_lease}, {allocated}, h.*
            FROM (SELECT 1) AS one
            LEFT JOIN LATERAL (
                SELECT a.pid, COALESCE(a.application_name, ''), COALESCE(a.state, ''),
                       COALESCE(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8,
                       COALESCE(a.wait_event_type, ''), COALESCE(a.wait_event, ''),
                       COALESCE(extract(epoch FROM clock_timestamp() - a.state_change), 0)::float8,
                       w.instance,
                       extract(epoch FROM clock_timestamp() - w.lease_expires_at)::float8,
                       COALESCE(a.usename::text, ''), COALESCE({client}, ''), a.backend_start,
                       l.objid::bigint, l.granted,
                       extract(epoch FROM clock_timestamp() - ({since}))::float8,
                       {may_end}, a.xact_start
                FROM pg_locks l
                JOIN pg_stat_activity a ON a.pid = l.pid
                LEFT JOIN LATERAL (
                    SELECT w.instance, w.lease_expires_at
                    FROM pg_locks o JOIN streams_writers w ON w.stream = %(stream)s
                     AND o.objid = ({key}::bigint & 4294967295)::oid
                    WHERE o.pid = a.pid AND o.locktype = 'advisory' AND o.objsubid = 2
                      AND o.classid = {cls}::bigint::oid
                    LIMIT 1
                ) w ON true
                WHERE {reservation} AND l.classid = %(reservation_class)s::bigint::oid
                  AND l.pid <> pg_backend_pid()
            ) AS h ON true
            ORDER BY h.xact_start NULLS LAST, h.pid
            """
        ).format(
            writers_lease=sql.SQL(_WRITERS_LEASE),
            allocated=max_allocated_sql(info),
            client=sql.SQL(_CLIENT),
            since=sql.SQL(_HOLDING_SINCE),
            may_end=sql.SQL(MAY_END_SESSION),
            key=_writer_lock_key(sql.SQL("w.stream"), sql.SQL("w.instance")),
            cls=sql.Literal(WRITER_LOCK),
            reservation=sql.SQL(RESERVATION_LOCKS),
        ),
        {
            "stream": info.id,
            "reservation_class": reservation_lock_class(info.id) % RESERVATION_LOCK_SPAN,
        },
    )
    yield Commit()
    writers_lease = None if rows[0][0] is None else float(rows[0][0])
    allocated = int(rows[0][1])
    holders = [
        LockHolder(
            pid=int(pid),
            application_name=app,
            state=state,
            transaction_seconds=float(age),
            wait_event_type=wait_type,
            wait_event=wait,
            state_seconds=float(in_state),
            instance=instance,
            lease_expired_seconds=None if expired is None else float(expired),
            role=role,
            client=client,
            backend_start=started,
            key=int(key),
            floor=reservation_floor(int(key), allocated),
            granted=bool(granted),
            holding_seconds=None if holding is None else max(0.0, float(holding)),
            may_end=bool(may_end),
        )
        for (
            _,
            _,
            pid,
            app,
            state,
            age,
            wait_type,
            wait,
            in_state,
            instance,
            expired,
            role,
            client,
            started,
            key,
            granted,
            holding,
            may_end,
            _,
        ) in rows
        if pid is not None
    ]
    return HoldingState(writers_lease, allocated, holders)


def reservation_lock_holders(info: StreamInfo) -> Gen[list[LockHolder]]:
    """The sessions holding the stream's reservation locks, oldest transaction first (for
    operators: `holding_state`; readers only need `probe`)."""
    state = yield from holding_state(info)
    return state.holders


#: Ends the sessions given as ``(pid, key, backend_start)`` that still hold that key of the
#: stream's reservation locks, are the same sessions and may be ended ("the holding argument").
_END_HOLDERS_SQL = sql.SQL(
    """
    SELECT h.pid, pg_terminate_backend(h.pid, {wait})
    FROM unnest(%(pids)s::int[], %(keys)s::bigint[], %(starts)s::timestamptz[])
         AS h(pid, key, started)
    JOIN pg_stat_activity a ON a.pid = h.pid
    WHERE a.backend_start IS NOT DISTINCT FROM h.started
      AND EXISTS (
          SELECT 1 FROM pg_locks l
          WHERE {reservation} AND l.classid = %(reservation_class)s::bigint::oid
            AND l.objid = h.key::oid AND l.pid = h.pid
      )
      AND h.pid <> pg_backend_pid()
      AND {may_end}
    """
).format(
    wait=sql.Literal(END_SESSION_WAIT_MS),
    reservation=sql.SQL(RESERVATION_LOCKS),
    may_end=sql.SQL(MAY_END_SESSION),
)


def end_overdue_holders(info: StreamInfo, held: HeldStreams, now: float) -> Gen[list[int]]:
    """A stall check of ``info`` at ``now``: end every session that has held the stream back
    past the bound ("the holding argument"; `streams.core.stalls.HeldStreams.overdue` says
    which), each named in a warning; returns their pids. Sessions this role may not end are
    named in one warning per stream (and left to a role that may: the prover, an operator)."""
    try:
        state = yield from holding_state(info)
    except StoreError as exc:
        if exc.sqlstate != _NOT_ALLOWED:
            raise
        _warn_once(info, f"this role may not look for sessions holding it back: {exc}")
        return []
    bound = held.bound(state.writers_lease)
    overdue = held.overdue(info.name, now, bound, state.allocated, (h.hold for h in state.holders))
    if not overdue:
        return []
    by_hold = {h.hold: h for h in state.holders}
    chosen = [(by_hold[o.hold], o) for o in overdue]
    allowed = [(h, o) for h, o in chosen if h.may_end]
    refused = [h for h, _ in chosen if not h.may_end]
    ended: list[int] = []
    if allowed:
        rows = yield Query(
            _END_HOLDERS_SQL,
            {
                "pids": [h.pid for h, _ in allowed],
                "keys": [h.key for h, _ in allowed],
                "starts": [h.backend_start for h, _ in allowed],
                "reservation_class": reservation_lock_class(info.id) % RESERVATION_LOCK_SPAN,
            },
        )
        yield Commit()
        ended = sorted({int(row[0]) for row in rows})
        for holder, found in allowed:
            if holder.pid in ended:
                log.warning(
                    "stream %r: ended session %s, which held it back at ID %d past the bound "
                    "(%.1f s; seen holding for %.1f s): no writer's transaction holds a "
                    "reservation lock that long",
                    info.name, holder.who(), found.floor, bound, found.seen_for,
                )  # fmt: skip
    if refused:
        _warn_once(
            info,
            f"this role may not end session {refused[0].who()} (a superuser's, or another "
            "role's without pg_signal_backend), which holds it back at ID "
            f"{refused[0].floor} past the bound ({bound:.1f} s)"
            + (f", nor {len(refused) - 1} other(s)" if len(refused) > 1 else ""),
        )
    return ended


def _warn_once(info: StreamInfo, what: str) -> None:
    if info.name not in _WARNED_HOLDERS:
        _WARNED_HOLDERS.add(info.name)
        log.warning("stream %r: %s", info.name, what)


@dataclass(frozen=True, slots=True)
class EndedHolder:
    """A session `end_long_holders` ended."""

    pid: int
    role: str
    application_name: str
    client: str
    holding_seconds: float
    bound: float


def holding_bound(info: StreamInfo, lease_seconds: float) -> Gen[float]:
    """The bound of "the holding argument" for ``info``, with ``lease_seconds`` as the caller's
    own lease."""
    rows = yield Query(f"SELECT {_WRITERS_LEASE}", {"stream": info.id})
    yield Commit()
    return max(lease_seconds, float(rows[0][0] or 0.0))


def end_long_holders(info: StreamInfo, lease_seconds: float) -> Gen[list[EndedHolder]]:
    """End every session holding one of the stream's reservation locks whose current
    transaction (outside a transaction: its idle state, so a session-level lock) has lasted
    longer than the bound of "the holding argument" (``lease_seconds`` the caller's lease),
    and that this role may end (``streams doctor --repair``: one look, where readers compare
    what they saw over time). A session whose times this role may not see is left alone
    (doctor names it), and so is a session-level lock held across short transactions."""
    rows = yield Query(
        sql.SQL(
            """
            WITH b AS (SELECT GREATEST(%(lease)s::float8, COALESCE({writers_lease}, 0)) AS bound)
            SELECT a.pid, COALESCE(a.usename::text, ''), COALESCE(a.application_name, ''),
                   COALESCE({client}, ''),
                   extract(epoch FROM clock_timestamp() - ({since}))::float8, b.bound,
                   pg_terminate_backend(a.pid, {wait})
            FROM (
                SELECT DISTINCT l.pid FROM pg_locks l
                WHERE {reservation} AND l.classid = %(reservation_class)s::bigint::oid
                  AND l.pid <> pg_backend_pid()
            ) AS h
            JOIN pg_stat_activity a ON a.pid = h.pid
            CROSS JOIN b
            WHERE extract(epoch FROM clock_timestamp() - ({since})) > b.bound
              AND {may_end}
            """
        ).format(
            writers_lease=sql.SQL(_WRITERS_LEASE),
            client=sql.SQL(_CLIENT),
            since=sql.SQL(_HOLDING_SINCE),
            wait=sql.Literal(END_SESSION_WAIT_MS),
            reservation=sql.SQL(RESERVATION_LOCKS),
            may_end=sql.SQL(MAY_END_SESSION),
        ),
        {
            "stream": info.id,
            "lease": lease_seconds,
            "reservation_class": reservation_lock_class(info.id) % RESERVATION_LOCK_SPAN,
        },
    )
    yield Commit()
    return [
        EndedHolder(int(pid), role, app, client, float(holding), float(bound))
        for pid, role, app, client, holding, bound, _ in rows
    ]


def persisted_writer_position(info: StreamInfo, instance: str) -> Gen[int | None]:
    """The position writer ``instance`` persisted (None if it never registered)."""
    rows = yield Query(
        "SELECT position FROM streams_writers WHERE stream = %s AND instance = %s",
        (info.id, instance),
    )
    yield Commit()
    return int(rows[0][0]) if rows else None


def prune_writers(info: StreamInfo, older_than_ms: int) -> Gen[list[str]]:
    """Delete the rows of writers retired more than ``older_than_ms`` ago (by their last
    heartbeat). Safe: a retired writer is fenced whether or not its row exists (its
    transactions find no row at their generation), and a process that registers the same
    name again starts a new row at the linear position."""
    rows = yield Query(
        "DELETE FROM streams_writers WHERE stream = %s AND retired "
        "AND heartbeat_at < clock_timestamp() - make_interval(secs => %s) RETURNING instance",
        (info.id, older_than_ms / 1000),
    )
    yield Commit()
    return sorted(row[0] for row in rows)
