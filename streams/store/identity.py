"""Reading the database's incarnation (`streams.core.incarnation` says what it is and why).

Every connection the library opens for a long-lived role (a client's own, a reader's, a
writer's, the prover's, the Spark source's) runs `verify` right after it connects, on the same
session, before any other statement: the first one a process makes records the incarnation in
its `Guard`, every later one (a reconnect after a restart, a failover, a recreated database)
must find the same, or `DatabaseChanged` stops the role before it reads or writes anything in
another history. A session that reads a range planned elsewhere (a Spark task's) checks the
history the range was planned in instead (`check_history`, step 1 of `streams.store.reads`).

Every number comes from the server the session is on: ``pg_control_system()`` (the system
identifier), ``pg_database`` (the database OID), the incarnation table's OID and row, and the
timeline: the one WAL is written on (``pg_walfile_name`` of the current position) on a primary,
the last checkpoint's on a standby (which writes no WAL). All of it may be read by any role that
may read the table (no superuser, no ``pg_monitor``).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass

from ..core.incarnation import Guard, Incarnation, same_history, written_elsewhere
from ..core.sightings import Sighting
from ..core.standby_fence import format_lsn
from ..errors import DatabaseChanged, FailoverLoss, SchemaNotReady, StoreError, UsageError
from ._common import TIMELINE_SQL
from .driver import Commit, Gen, Query, Row
from .failover import check_sighting, switchpoint

__all__ = [
    "FLUSHED_LSN_SQL",
    "INCARNATION_SQL",
    "TIMELINE_SQL",
    "BoundGroup",
    "accept_groups",
    "bound_groups",
    "check_history",
    "holds_across_failover",
    "incarnation_from_row",
    "read_incarnation",
    "read_incarnation_at",
    "verify",
]


#: The primary's durable WAL position (flushed: a crash recovers at least that far, so only a
#: rewind of the data directory puts it lower on the same timeline: `Guard`); NULL on a standby.
FLUSHED_LSN_SQL = """CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint
       END"""

#: One row: ``(id, system identifier, database OID, table OID, timeline, flushed LSN)``. A
#: plain text (no parameters) so that other drivers (ADBC on Spark executors) run it as it is.
INCARNATION_SQL = f"""
SELECT i.id::text, s.system_identifier, d.oid::bigint,
       'streams_incarnation'::regclass::oid::bigint,
       {TIMELINE_SQL},
       {FLUSHED_LSN_SQL}
FROM streams_incarnation i
CROSS JOIN pg_control_system() s
JOIN pg_database d ON d.datname = current_database()
"""


def incarnation_from_row(row: tuple[object, ...]) -> Incarnation:
    """The `Incarnation` of a row of `INCARNATION_SQL` (any driver's)."""
    ident, system, database, table, timeline = row[:5]
    return Incarnation(str(ident), int(str(system)), int(str(database)), int(str(table)),
                       int(str(timeline)))  # fmt: skip


def read_incarnation() -> Generator[Query | Commit, list[Row], Incarnation]:
    """The incarnation of the database this session is on (no transaction is left open).
    Plain statements only (`Query` without parameters, `Commit`): any driver runs it."""
    found, _ = yield from read_incarnation_at()
    return found


def read_incarnation_at() -> Generator[Query | Commit, list[Row], tuple[Incarnation, int | None]]:
    """`read_incarnation`, and the primary's flushed WAL position (None on a standby)."""
    try:
        rows = yield Query(INCARNATION_SQL)
    except StoreError as exc:
        if exc.sqlstate != "42P01":  # undefined_table
            raise
        raise SchemaNotReady(
            "the streams schema has no incarnation table (revision 0011): run `streams migrate`"
        ) from None
    yield Commit()
    if not rows:
        raise SchemaNotReady(
            "the incarnation table is empty (its row was deleted by hand): give this database a "
            "new incarnation with INSERT INTO streams_incarnation DEFAULT VALUES"
        )
    lsn = rows[0][5]
    return incarnation_from_row(rows[0]), None if lsn is None else int(lsn)


def verify(
    guard: Guard, where: str, sighting: Sighting | None = None, seen: str = "facts seen"
) -> Gen[Incarnation]:
    """`read_incarnation` and check it against ``guard`` (recording it if it is the first):
    `streams.errors.DatabaseChanged`, naming ``where``, if the history changed.

    After a failover (a later timeline of the same history, which the guard takes), a role
    with a ``sighting`` checks that the new primary holds what it saw (``seen``: "facts
    acknowledged", "facts delivered"), `streams.store.failover.check_sighting`, before it
    does anything else: `streams.errors.FailoverLoss` otherwise."""
    floor = guard.seen_lsn  # before the reading: what it must not be below
    found, flushed = yield from read_incarnation_at()
    guard.check(found, where, flushed, floor)
    if sighting is not None:
        if sighting.sticky and sighting.failed is not None:
            raise sighting.failed
        previous = sighting.timeline
        if previous is not None and previous != found.timeline:
            try:
                yield from check_sighting(sighting, where, seen)
            except FailoverLoss:
                sighting.timeline = found.timeline
                if sighting.sticky:
                    raise
                # A writer's: its next call reports it (`Sighting.take_loss`), not whichever of
                # its sessions (a heartbeat's) happened to find it.
        sighting.timeline = found.timeline  # (not before: a broken check runs again)
    return found


def check_history(
    token: str, where: str, proof_lsn: int | None = None
) -> Generator[Query | Commit, list[Row], Incarnation]:
    """`read_incarnation` and check that it is the history named ``token`` (the one a range
    was planned in: `streams.store.reads.read_range`): `streams.errors.DatabaseChanged`,
    naming ``where``, otherwise. For a session without a `Guard` of its own (a Spark task's).

    A later timeline of the same history (a failover) holds what was planned before it when
    the plan's proof was taken at a WAL position ``proof_lsn`` at or below the point where the
    new timeline left the old one (`failover.switchpoint`): everything that proof saw complete
    is in the new history, and its sequences are past the range. Otherwise, or when the switch
    point cannot be read, `DatabaseChanged` names the switch point."""
    found = yield from read_incarnation()
    yield from holds_across_failover(token, found, where, proof_lsn)
    return found


def holds_across_failover(
    token: str, found: Incarnation, where: str, proof_lsn: int | None
) -> Generator[Query | Commit, list[Row], None]:
    """`check_history`'s decision for something written in history ``token`` (with the WAL
    position of the proof behind it, if known), on a session of history ``found``."""
    changed = written_elsewhere(token, found)
    if changed is None:
        return
    try:
        old: Incarnation | None = Incarnation.from_token(token)
    except UsageError:  # unreadable: `changed` says so
        old = None
    if old is not None and same_history(old, found) and old.timeline != found.timeline:
        point = yield from switchpoint(old.timeline)
        if proof_lsn is not None and point is not None and proof_lsn <= point:
            return  # proven before the switch point: all of it is in this history
        if proof_lsn is None:
            why = "its proof's WAL position is not known"
        elif point is None:
            why = (
                f"the switch point of timeline {old.timeline} cannot be read here (revision "
                "0013's streams_timeline_switchpoint needs an owner that may read pg_wal)"
            )
        else:
            why = (
                f"it was proven at WAL {format_lsn(proof_lsn)}, after the switch point "
                f"{format_lsn(point)} where timeline {found.timeline} left timeline "
                f"{old.timeline}: facts it covers may be missing from this history"
            )
        raise DatabaseChanged(where, f"{changed}; {why}")
    raise DatabaseChanged(where, changed)


@dataclass(frozen=True, slots=True)
class BoundGroup:
    """A group row and the incarnation its last commit was made in (None: before revision
    0011, or never committed since)."""

    stream: str
    group: str
    position: int
    incarnation: str | None


def bound_groups() -> Gen[list[BoundGroup]]:
    """Every group row with the incarnation it was committed in, by stream and group."""
    rows = yield Query(
        "SELECT r.name, g.group_name, g.position, g.incarnation "
        "FROM streams_reader_groups g JOIN streams_registry r ON r.id = g.stream "
        "ORDER BY r.name, g.group_name"
    )
    yield Commit()
    return [
        BoundGroup(str(s), str(g), int(p), None if i is None else str(i)) for s, g, p, i in rows
    ]


def accept_groups(token: str, groups: Sequence[str] | None) -> Gen[list[tuple[str, str]]]:
    """Bind the rows of ``groups`` (None: every group) committed in another incarnation to the
    one named ``token`` (the current one: an operator's decision that their positions hold in
    this history, `streams incarnation accept`). Returns the ``(stream, group)`` rows bound."""
    rows = yield Query(
        """
        UPDATE streams_reader_groups g SET incarnation = %(token)s
        FROM streams_registry r
        WHERE r.id = g.stream AND g.incarnation IS DISTINCT FROM %(token)s
          AND (%(all)s OR g.group_name = ANY(%(groups)s::text[]))
        RETURNING r.name, g.group_name
        """,
        {"token": token, "all": groups is None, "groups": list(groups or ())},
    )
    yield Commit()
    return sorted((str(s), str(g)) for s, g in rows)
