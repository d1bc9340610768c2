"""The database's incarnation: which history of which database a process is talking to.

An `Incarnation` names a history by what PostgreSQL keeps (system identifier, database and
table OIDs, the id `streams migrate` writes, the WAL timeline); a `Guard` holds the first one
a process saw and checks every later session against it, including a rewind (the durable WAL
position going down on one timeline) and a failover (a higher timeline: `same_history`). The
argument: docs/design/history.md. This module is pure: `streams.store.identity` reads the
numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import DatabaseChanged, UsageError

__all__ = [
    "Guard",
    "Incarnation",
    "changes",
    "format_lsn",
    "rewound",
    "same_history",
    "token_changes",
    "written_elsewhere",
]


@dataclass(frozen=True, slots=True)
class Incarnation:
    """One database history (see the module docstring)."""

    id: str
    system_identifier: int
    database_oid: int
    table_oid: int
    timeline: int

    @property
    def token(self) -> str:
        """The compact form group rows and Spark offsets carry: ``id/system/database/table/tl``."""
        return (
            f"{self.id}/{self.system_identifier}/{self.database_oid}/{self.table_oid}"
            f"/{self.timeline}"
        )

    @classmethod
    def from_token(cls, token: str) -> Incarnation:
        """The incarnation a `token` names; `UsageError` if it is not one."""
        parts = token.split("/")
        try:
            if len(parts) != 5 or not parts[0]:
                raise ValueError(token)
            return cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]))
        except ValueError:
            raise UsageError(f"not a database incarnation: {token!r}") from None

    def as_dict(self) -> dict[str, str | int]:
        return {
            "id": self.id,
            "system_identifier": self.system_identifier,
            "database_oid": self.database_oid,
            "table_oid": self.table_oid,
            "timeline": self.timeline,
            "token": self.token,
        }


def same_history(old: Incarnation, new: Incarnation) -> bool:
    """The same database and schema, on the same or a later timeline (a failover or a
    point-in-time recovery of it: `streams.core.sightings` says what that may lose)."""
    return (
        old.id == new.id
        and old.system_identifier == new.system_identifier
        and old.database_oid == new.database_oid
        and old.table_oid == new.table_oid
        and old.timeline <= new.timeline
    )


def changes(old: Incarnation, new: Incarnation) -> list[str]:
    """What differs between two incarnations, in words an operator acts on (empty: the same
    history). The most telling first: another cluster explains every other difference."""
    found = []
    if old.system_identifier != new.system_identifier:
        found.append(
            f"another cluster: system identifier {old.system_identifier} -> "
            f"{new.system_identifier} (a restore into another server, pg_upgrade, or another "
            "server behind the same address)"
        )
    if old.database_oid != new.database_oid:
        found.append(
            f"another database: OID {old.database_oid} -> {new.database_oid} (dropped and "
            "recreated, or restored from a dump)"
        )
    if old.table_oid != new.table_oid or old.id != new.id:
        found.append(
            f"the streams schema was recreated: incarnation {old.id} -> {new.id} (a restore "
            "with pg_restore --clean, or the tables dropped and migrated again)"
        )
    if old.timeline > new.timeline:
        found.append(
            f"timeline {old.timeline} -> {new.timeline}: back to an earlier timeline, another "
            "branch of the history (a former primary writable again after a failover, split "
            "brain: fence it, or a restore of an older backup)"
        )
    elif old.timeline != new.timeline:
        found.append(
            f"timeline {old.timeline} -> {new.timeline} (a failover to a standby, or a "
            "point-in-time recovery: what the old timeline acknowledged may be missing)"
        )
    return found


def token_changes(old_token: str, new: Incarnation) -> list[str]:
    """`changes` from a token read back (a group row, a Spark offset) to ``new``; a token that
    is not one counts as a change of everything."""
    try:
        old = Incarnation.from_token(old_token)
    except UsageError:
        return [f"an unreadable incarnation {old_token!r}"]
    return changes(old, new)


def written_elsewhere(
    token: str | None, current: Incarnation, *, across_failover: bool = False
) -> str | None:
    """For something read back with the incarnation it was written in (a group row, a Spark
    offset or partition): what changed since, in words (None: the same history, or written
    before incarnations existed, ``token`` None, which is taken as it is).

    ``across_failover``: a token of an earlier timeline of the same history counts as the
    same, for state kept *in* the database (a group row): the new primary's prefix holds the
    row and every fact committed before it, so the row is consistent with what is there."""
    if token is None or token == current.token:
        return None
    if across_failover:
        try:
            if same_history(Incarnation.from_token(token), current):
                return None
        except UsageError:
            pass
    return "; ".join(token_changes(token, current))


def format_lsn(lsn: int) -> str:
    """A WAL position as PostgreSQL writes it (``0/3000060``)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def rewound(where: str, timeline: int, found: int, seen: int) -> DatabaseChanged:
    """The `DatabaseChanged` of a durable WAL position that went back on one timeline."""
    return DatabaseChanged(
        where,
        f"the WAL went back on timeline {timeline}: the server's durable position is "
        f"{format_lsn(found)}, below {format_lsn(seen)} seen there before (the data directory "
        "was restored in place from a file-system snapshot or an older copy; what was written "
        "after it is gone, and IDs above it may be handed out again)",
    )


class Guard:
    """The incarnation a process started on, checked against every later one, and the highest
    durable WAL position it saw on that timeline (see "A rewind"; thread-safe: a client's
    readers, writers and prover share one)."""

    def __init__(self, expected: Incarnation | None = None) -> None:
        self._expected = expected
        self._lock = threading.Lock()
        #: (timeline, the highest durable WAL position seen on it), or None.
        self._seen: tuple[int, int] | None = None

    @property
    def expected(self) -> Incarnation | None:
        return self._expected

    @property
    def seen_lsn(self) -> tuple[int, int] | None:
        """(timeline, the highest durable WAL position seen on it), or None."""
        return self._seen

    def __getstate__(self) -> dict[str, Incarnation | None]:
        # Picklable (Spark ships its source to executors): the lock is the process's own.
        return {"expected": self._expected}

    def __setstate__(self, state: dict[str, Incarnation | None]) -> None:
        self._expected = state["expected"]
        self._lock = threading.Lock()
        self._seen = None

    def check(
        self,
        found: Incarnation,
        where: str,
        flushed: int | None = None,
        floor: tuple[int, int] | None = None,
    ) -> Incarnation:
        """Take ``found`` as the process's incarnation if it has none yet, or if it is a later
        timeline of the same history (a failover: the caller checks what its role saw,
        `streams.store.identity.verify`); else raise `DatabaseChanged` (naming ``where`` and
        what changed) unless it is the same.

        ``flushed``: the server's durable WAL position with ``found`` (None from a standby);
        ``floor``: `seen_lsn` taken *before* that reading (readings of several threads arrive
        in any order, so only what was seen before a reading was taken bounds it). On the
        same timeline, a reading below its floor is a rewind: `DatabaseChanged`."""
        with self._lock:
            expected = self._expected
            if expected is None or (expected != found and same_history(expected, found)):
                self._expected = found
                expected = None
            if expected is None or not changes(expected, found):
                if (
                    flushed is not None
                    and floor is not None
                    and floor[0] == found.timeline
                    and flushed < floor[1]
                ):
                    raise rewound(where, found.timeline, flushed, floor[1])
                self._observe(found.timeline, flushed)
                return found
        raise DatabaseChanged(where, "; ".join(changes(expected, found)))

    def observed(self, timeline: int, lsn: int) -> None:
        """A durable WAL position read from a server on ``timeline`` (a probe's, a
        heartbeat's): the next connect's reading must not be below it (`check`)."""
        with self._lock:
            self._observe(timeline, lsn)

    def _observe(self, timeline: int, lsn: int | None) -> None:
        if lsn is None:
            return
        seen = self._seen
        if seen is None or timeline > seen[0]:  # a failover starts counting again
            self._seen = (timeline, lsn)
        elif timeline == seen[0]:
            self._seen = (timeline, max(lsn, seen[1]))
        # A lower timeline's position (a late answer from a former primary) says nothing.
