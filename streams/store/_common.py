"""SQL fragments the store's modules share (no statements of their own)."""

from __future__ import annotations

from collections.abc import Iterable

NOW_MS_SQL = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

#: The server's timeline: the one WAL is written on (a primary), the last checkpoint's (a
#: standby, which writes no WAL).
TIMELINE_SQL = """CASE WHEN pg_is_in_recovery()
            THEN (SELECT c.timeline_id FROM pg_control_checkpoint() c)::bigint
            ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint
       END"""

#: Session setting (plus the stream's registry id) where `probe` leaves the complete position.
COMPLETE_SETTING = "streams.complete_"


def int_array(values: Iterable[int]) -> str:
    """An int array as a SQL literal. Readers look at PostgreSQL on every hint with the same
    arrays of stream ids, and psycopg spent ~20% of a caught-up reader's look adapting them as
    parameters; ints only, so nothing can be injected."""
    return "'{" + ",".join(str(int(value)) for value in values) + "}'"


#: The rows of ``pg_locks l`` that are reservation locks (of some stream) in this database.
RESERVATION_LOCKS = (
    "l.locktype = 'advisory' AND l.objsubid = 2"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


#: Whether this session may end the session of ``pg_stat_activity a`` with
#: ``pg_terminate_backend`` (which would raise otherwise): a member of its role, or of
#: ``pg_signal_backend``; a superuser's session only as a superuser. Sessions it may not end
#: are left alone (and `streams doctor` names them).
MAY_END_SESSION = (
    "(pg_has_role(a.usesysid, 'MEMBER') OR pg_has_role('pg_signal_backend', 'MEMBER'))"
    " AND (NOT (SELECT rolsuper FROM pg_roles WHERE oid = a.usesysid)"
    " OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user))"
)
