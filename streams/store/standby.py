"""A hot standby's side of a read: its incarnation, and the fence (`streams.core.standby_fence`).

Two statements, run on the session of a read URL and nowhere else:

* `check_standby` (when the session opens, before it reads anything): is the standby a copy of
  the reader's database, in the reader's history? It reads the incarnation as every session
  does (`streams.store.identity.read_incarnation`; a streaming standby shares its primary's
  system identifier, database OID, incarnation table and id) and compares it with the
  reader's without recording anything. Another database behind the read URL is
  `DatabaseChanged`. Another *timeline* alone is `StandbyBehind` (``timeline``): a standby reads
  its timeline from its last restartpoint, which lags a promotion of the primary it follows
  by up to a checkpoint interval, and one that still follows a primary that was failed over
  may hold facts the new primary never had (asynchronous replication) and an LSN that is not
  comparable with the new primary's. Neither is read from: the reader reads from the primary
  until the standby's timeline is the reader's again (`streams.core.standby_fence.StandbyRoute`).
  The primary's own session keeps its check (`streams.store.identity.verify`): a reader whose
  primary changed history stops there, before any standby read.
* `replayed_to` (before the rows of each read): the standby's replay position, read in a
  statement *before* the rows statement, so the rows statement's snapshot is taken after the
  replay position was seen (a snapshot taken by the statement that reads the position itself
  could predate it). The position only grows while the standby runs, and a restarted standby
  ends the session, so a look that passed stays passed for the session's later statements.
  On a server that is not in recovery (a read URL that names the primary, or a standby
  promoted since, whose incarnation still matched) the position is its WAL insert position:
  everything committed there is visible.

Why the retention check may run on the standby (step 4 of `streams.store.reads`, "the retention
argument" of `streams.store.retention`): a prune commits its deletes and its ``pruned_through``
in one transaction, and a standby applies a transaction's commit as one record: no snapshot of
the standby shows the deletes without the new ``pruned_through``. The standby's snapshots only
grow (replay goes forward), so a prune that removed rows of the range before the rows statement's
snapshot shows in the later retention statement's snapshot on the same standby, as on the
primary. The primary's state is not needed: a prune the standby has not replayed yet removed
nothing the standby's rows statement could miss.
"""

from __future__ import annotations

from collections.abc import Generator

from ..core.incarnation import Incarnation
from ..core.standby_fence import format_lsn, standby_mismatch
from ..errors import DatabaseChanged, StandbyBehind
from .driver import Commit, Query, Row
from .identity import read_incarnation

__all__ = ["REPLAY_SQL", "check_standby", "replay_position", "replayed_to"]

#: One row, one column: the standby's replay position as an int (the WAL insert position on a
#: server that is not in recovery). Plain text, no parameters: any driver runs it (ADBC too).
REPLAY_SQL = """
SELECT CASE WHEN pg_is_in_recovery()
            THEN (COALESCE(pg_last_wal_replay_lsn(), '0/0') - '0/0'::pg_lsn)::bigint
            ELSE (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint
       END
"""

_Plan = Generator[Query | Commit, list[Row], "Incarnation"]


def check_standby(expected: Incarnation | str, where: str) -> _Plan:
    """The standby's incarnation, checked against ``expected`` (the reader's, or a token):
    `DatabaseChanged` for another database, `StandbyBehind` (``timeline``) for another
    timeline only. Plain statements: any driver runs it."""
    found = yield from read_incarnation()
    if isinstance(expected, str):
        expected = Incarnation.from_token(expected)
    mismatch = standby_mismatch(expected, found)
    if mismatch == "timeline":
        raise StandbyBehind(
            f"{where}: the standby is on timeline {found.timeline}, the primary on "
            f"{expected.timeline}: reading from the primary until it follows",
            timeline=True,
        )
    if mismatch is not None:
        raise DatabaseChanged(f"{where} (the read URL's standby)", mismatch)
    return found


def replay_position() -> Generator[Query | Commit, list[Row], int]:
    """The standby's replay position (`REPLAY_SQL`), as an int."""
    rows = yield Query(REPLAY_SQL)
    yield Commit()
    return int(rows[0][0]) if rows and rows[0][0] is not None else 0


def replayed_to(proof_lsn: int, where: str) -> Generator[Query | Commit, list[Row], int]:
    """The fence: the standby's replay position if it is at or past ``proof_lsn``, else
    `StandbyBehind` (nothing is read)."""
    replayed = yield from replay_position()
    if replayed < proof_lsn:
        raise StandbyBehind(
            f"{where}: the standby has replayed to {format_lsn(replayed)}, the proof needs "
            f"{format_lsn(proof_lsn)}",
            replayed=replayed,
            proof_lsn=proof_lsn,
        )
    return replayed
