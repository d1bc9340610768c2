"""What one PostgreSQL server says about its place in a replicated deployment.

`server_state`: whether the server is a primary or a standby (in recovery), its timeline, its
WAL position (a primary's insert position; a standby's last replayed one), how long ago a
standby replayed its last transaction, and whether replay is paused. `standbys`: on a primary,
the standbys streaming from it (``pg_stat_replication``; the LSN and lag columns are NULL to a
role without ``pg_monitor``, which is then said, not guessed) and the
``synchronous_standby_names`` setting: a primary configured for a synchronous standby with none
connected makes every commit wait. `streams doctor` shows both (`streams.ops.pg_topology`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .driver import Commit, Gen, Query
from .identity import TIMELINE_SQL

__all__ = ["ServerState", "StandbyState", "server_state", "standbys"]


@dataclass(frozen=True, slots=True)
class ServerState:
    in_recovery: bool
    timeline: int
    #: A primary's current WAL position, a standby's last replayed one (``X/Y``).
    lsn: str | None
    #: A standby: seconds since the last replayed transaction's commit (None: none yet).
    replay_age: float | None
    replay_paused: bool
    synchronous_standby_names: str


@dataclass(frozen=True, slots=True)
class StandbyState:
    name: str
    client: str | None
    state: str | None
    sync_state: str | None
    #: Bytes of WAL the standby has not replayed yet (None: not visible to this role).
    replay_lag_bytes: int | None
    replay_lag_seconds: float | None


def server_state() -> Gen[ServerState]:
    """The state of the server this session is on."""
    rows = yield Query(
        f"""
        SELECT pg_is_in_recovery(),
               {TIMELINE_SQL},
               CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()::text
                    ELSE pg_current_wal_lsn()::text END,
               CASE WHEN pg_is_in_recovery()
                    THEN extract(epoch FROM now() - pg_last_xact_replay_timestamp())::float8
               END,
               CASE WHEN pg_is_in_recovery() THEN pg_get_wal_replay_pause_state() <> 'not paused'
                    ELSE false END,
               current_setting('synchronous_standby_names')
        """
    )
    yield Commit()
    recovery, timeline, lsn, age, paused, sync_names = rows[0]
    return ServerState(
        bool(recovery),
        int(timeline),
        None if lsn is None else str(lsn),
        None if age is None else float(age),
        bool(paused),
        str(sync_names or ""),
    )


def standbys() -> Gen[list[StandbyState]]:
    """The standbys streaming from this primary (empty on a standby, or with none)."""
    rows = yield Query(
        """
        SELECT application_name, client_addr::text, state, sync_state,
               pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint,
               extract(epoch FROM replay_lag)::float8
        FROM pg_stat_replication
        WHERE NOT pg_is_in_recovery()
        ORDER BY application_name
        """
    )
    yield Commit()
    return [
        StandbyState(
            str(name),
            None if client is None else str(client),
            None if state is None else str(state),
            None if sync is None else str(sync),
            None if lag is None else int(lag),
            None if seconds is None else float(seconds),
        )
        for name, client, state, sync, lag, seconds in rows
    ]
