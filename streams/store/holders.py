"""Who holds a stream back, and ending them: sessions holding its reservation locks.

Names them for operators (`holding_state`, `streams doctor`, the metrics), ends those that hold
a stream back past the bound (`retire_where_held`, `end_overdue_holders`) and those that hold
the lock exclusively, which blocks every writer (`end_exclusive_holders`).

The argument: docs/design/liveness.md ("the holding argument").
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from psycopg import sql

from ..core.constants import RESERVATION_LOCK_SPAN, WRITER_LOCK, reservation_lock_class
from ..core.stalls import HeldStreams, Hold, reservation_floor
from ..errors import StoreError
from ..types import StreamInfo
from ._common import MAY_END_SESSION, RESERVATION_LOCKS
from .driver import Commit, Gen, Query, Row
from .leases import (
    END_SESSION_WAIT_MS,
    NOT_ALLOWED,
    max_allocated_sql,
    retire_if_allowed,
    writer_lock_key,
)

log = logging.getLogger("streams.writer")

#: Streams whose overdue holders this process could not end, warned about once each.
_WARNED_HOLDERS: set[str] = set()


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
        yield from end_exclusive_holders(infos[name])
    return retired


@dataclass(frozen=True, slots=True)
class LockHolder:
    """A session holding (or waiting for) a stream's reservation lock: a writing transaction,
    or whoever else took it (docs/design/liveness.md).

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
    #: It holds (or waits for) the lock exclusively: never a library session, and every
    #: writer of the stream waits for it ("exclusive holders").
    exclusive: bool = False

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
        if self.exclusive:
            holding += (
                " EXCLUSIVELY (never a writer of this library: every writer of the stream is "
                "blocked behind it)"
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
                       {may_end}, l.mode = 'ExclusiveLock', a.xact_start
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
            key=writer_lock_key(sql.SQL("w.stream"), sql.SQL("w.instance")),
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
            exclusive=bool(exclusive),
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
            exclusive,
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
#: stream's reservation locks, are the same sessions and may be ended (docs/design/liveness.md).
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
    past the bound (docs/design/liveness.md; `streams.core.stalls.HeldStreams.overdue` says
    which), each named in a warning; returns their pids. Sessions this role may not end are
    named in one warning per stream (and left to a role that may: the prover, an operator)."""
    try:
        state = yield from holding_state(info)
    except StoreError as exc:
        if exc.sqlstate != NOT_ALLOWED:
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


def end_long_holders(info: StreamInfo, lease_seconds: float) -> Gen[list[EndedHolder]]:
    """End every session holding one of the stream's reservation locks whose current
    transaction (outside a transaction: its idle state, so a session-level lock) has lasted
    longer than the bound of docs/design/liveness.md (``lease_seconds`` the caller's lease),
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


#: The stream's reservation locks held exclusively (never a library session's), with who holds
#: each and whether this role may end it.
_EXCLUSIVE_SQL = sql.SQL(
    """
    SELECT a.pid, COALESCE(a.usename::text, ''), COALESCE(a.application_name, ''),
           COALESCE({client}, ''), l.objid::bigint, {may_end}
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE {reservation} AND l.classid = %(reservation_class)s::bigint::oid
      AND l.mode = 'ExclusiveLock' AND l.granted AND l.pid <> pg_backend_pid()
    ORDER BY a.pid
    """
).format(
    client=sql.SQL(_CLIENT),
    may_end=sql.SQL(MAY_END_SESSION),
    reservation=sql.SQL(RESERVATION_LOCKS),
)


def exclusive_holders(info: StreamInfo) -> Gen[list[LockHolder]]:
    """The sessions holding one of the stream's reservation locks exclusively ("exclusive
    holders"): each blocks every writer of the stream."""
    rows = yield Query(
        _EXCLUSIVE_SQL,
        {"reservation_class": reservation_lock_class(info.id) % RESERVATION_LOCK_SPAN},
    )
    yield Commit()
    return _exclusive(rows)


def _exclusive(rows: Iterable[Row]) -> list[LockHolder]:
    return [
        LockHolder(
            pid=int(pid),
            application_name=app,
            state="",
            transaction_seconds=0.0,
            role=role,
            client=client,
            key=int(key),
            exclusive=True,
            may_end=bool(may_end),
        )
        for pid, role, app, client, key, may_end, *_ in rows
    ]


#: Which of the given streams' reservation locks are held exclusively: one look at
#: ``pg_locks`` for all of them (the prover's sweep, `exclusive_streams`).
_EXCLUSIVE_ANY_SQL = sql.SQL(
    """
    SELECT DISTINCT k.id FROM pg_locks l
    JOIN unnest(%(ids)s::int[], %(classes)s::bigint[]) AS k(id, cls) ON l.classid = k.cls::oid
    WHERE {reservation} AND l.mode = 'ExclusiveLock' AND l.granted
    """
).format(reservation=sql.SQL(RESERVATION_LOCKS))


def exclusive_streams(infos: Iterable[StreamInfo]) -> Gen[list[StreamInfo]]:
    """Those of ``infos`` whose reservation lock some session holds exclusively (blocking every
    writer), in one statement: the prover sweeps its streams with it once a second, and ends
    the holders (`end_exclusive_holders`) of those it finds, since a blocked writer of the
    role model may not end another role's session."""
    by_id = {info.id: info for info in infos}
    if not by_id:
        return []
    rows = yield Query(
        _EXCLUSIVE_ANY_SQL,
        {
            "ids": list(by_id),
            "classes": [reservation_lock_class(i) % RESERVATION_LOCK_SPAN for i in by_id],
        },
    )
    yield Commit()
    return [by_id[int(row[0])] for row in rows]


def end_exclusive_holders(info: StreamInfo) -> Gen[list[int]]:
    """End every session that holds one of the stream's reservation locks exclusively and that
    this role may end, each named in a warning; the others are named in one warning per
    stream. Returns the pids ended. One statement: the lock is read (held, exclusively, by that
    pid) in the statement that ends the session."""
    holders = yield from exclusive_holders(info)
    refused = [h for h in holders if not h.may_end]
    ended: list[int] = []
    if len(refused) < len(holders):
        rows = yield Query(
            sql.SQL(
                """
                SELECT DISTINCT l.pid, pg_terminate_backend(l.pid, {wait})
                FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                WHERE {reservation} AND l.classid = %(reservation_class)s::bigint::oid
                  AND l.mode = 'ExclusiveLock' AND l.granted AND l.pid <> pg_backend_pid()
                  AND {may_end}
                """
            ).format(
                wait=sql.Literal(END_SESSION_WAIT_MS),
                reservation=sql.SQL(RESERVATION_LOCKS),
                may_end=sql.SQL(MAY_END_SESSION),
            ),
            {"reservation_class": reservation_lock_class(info.id) % RESERVATION_LOCK_SPAN},
        )
        yield Commit()
        ended = sorted({int(row[0]) for row in rows})
        for holder in holders:
            if holder.pid in ended:
                log.warning(
                    "stream %r: ended session %s, which held its reservation lock exclusively "
                    "(no writer's transaction does; every writer of the stream waited for it)",
                    info.name, holder.who(),
                )  # fmt: skip
    if refused:
        _warn_once(
            info,
            f"this role may not end session {refused[0].who()} (a superuser's, or another "
            "role's without pg_signal_backend), which holds its reservation lock exclusively "
            "and blocks every writer",
        )
    return ended
