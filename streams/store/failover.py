"""After a failover: does the new primary hold what a role saw (`streams.core.sightings`)?

`check_sighting` runs on a role's first session on a new timeline, before anything else, and
reads which of the fact IDs the role remembers are still there; `fence_stream` moves a
stream's sequence forward once per timeline; `failover_report` and `repair_sequences` are the
operator's ``streams failover check|repair``.

The argument: docs/design/fencing.md ("After a failover: the timeline fence").
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from psycopg import sql

from ..core.constants import facts_partition
from ..core.sightings import Sighting, assess
from ..core.standby_fence import parse_lsn
from ..errors import FailoverLoss, StoreError, UnknownStream
from .driver import Commit, Gen, Query, Row
from .registry import load_stream
from .rows import pruned_through_sql

__all__ = [
    "FailoverStream",
    "check_sighting",
    "failover_report",
    "fence_stream",
    "repair_sequences",
    "replicated",
    "switchpoint",
]

log = logging.getLogger("streams.failover")


def check_sighting(sighting: Sighting, where: str, what: str, *, joined: bool = False) -> Gen[None]:
    """Raise `streams.FailoverLoss` (naming ``where``, the stream, the range, and ``what``
    the IDs were: "facts acknowledged", "facts delivered") if the new primary lacks facts the
    role saw; the first such stream is named. It is kept in `Sighting.failed`: a sticky role (a
    reader) raises it from then on, a non-sticky one (a writer) once more, from its next call
    (`Sighting.take_loss`), and forgets what it saw.

    ``joined``: in a transaction of a caller's (a ``fact(conn=...)`` on a session that reached
    a new timeline first, `WriterCore.reserve_fact`): nothing is committed, and IDs missing
    from the facts table of a stream with declared tables are left to the writer's own next
    session, which checks again (a failing read of a declared table would fail the caller's
    transaction)."""
    if sighting.sticky and sighting.failed is not None:
        raise sighting.failed
    losses = []
    for stream, (key, ids) in sorted(sighting.snapshot().items()):
        if not ids:
            continue
        # The stream's partition, named: a writer may read its own streams' rows only.
        present = yield Query(
            sql.SQL(
                "SELECT DISTINCT stream_id FROM {facts} "
                "WHERE stream = {key} AND stream_id = ANY(%s)"
            ).format(facts=sql.Identifier(facts_partition(int(key))), key=sql.Literal(int(key))),
            (ids,),
        )
        pruned = yield Query(pruned_through_sql(key))
        found = {int(r[0]) for r in present}
        if not joined:
            yield Commit()
            if len(found) < len(set(ids)):
                found |= yield from _in_declared_tables(stream, [i for i in ids if i not in found])
        elif len(found) < len(set(ids)):
            info = yield from load_stream(stream)
            if info.fact_tables:
                continue
        loss = assess(stream, ids, found, int(pruned[0][0]) if pruned else 0)
        if loss is not None:
            losses.append(loss)
    if not losses:
        return
    error: FailoverLoss = losses[0].error(where, what)
    sighting.failed = error
    if not sighting.sticky:
        sighting.forget()
    raise error


def _in_declared_tables(stream: str, ids: list[int]) -> Gen[set[int]]:
    """Which of ``ids`` the stream's declared tables hold (`streams.types.FactTable`): a fact
    written there has no row in the facts table. A table this session may not read, or that
    is gone, cannot tell: its IDs count as present, so a failover check never reports as lost
    a fact that may have committed (the warning says which table went unchecked)."""
    try:
        info = yield from load_stream(stream)
    except UnknownStream:
        return set(ids)  # dropped since: nothing of it to lose
    found: set[int] = set()
    for table in info.fact_tables:
        try:
            params = {"ids": ids, **table.params("where")}
            rows = yield Query(table.present_sql("where", "ids"), params)
            yield Commit()
        except StoreError as exc:
            log.warning(
                "failover check of %r: cannot read its declared table %s (%s): its facts are "
                "taken as present", stream, table, exc.sqlstate,
            )  # fmt: skip
            return set(ids)
        found.update(int(r[0]) for r in rows)
    return found


@dataclass(frozen=True, slots=True)
class FailoverStream:
    """One stream as `streams failover check` shows it."""

    name: str
    #: The sequence's last value (the highest ID it handed out, logged ahead: see below).
    sequence: int
    #: The highest fact ID stored (0: none).
    max_fact: int
    #: Group rows committed beyond ``sequence``: ``(group, position)``.
    groups_beyond: tuple[tuple[str, int], ...]


#: Streams per transaction of `failover_report`: each locks its streams' partitions, primary
#: keys and sequences until it ends, and the lock table is shared by the whole server (about
#: 6,400 locks at PostgreSQL's defaults; one statement over 10^4 partitions overflows it).
REPORT_CHUNK = 500


def failover_report() -> Gen[list[FailoverStream]]:
    """Every stream's sequence, highest fact and the group rows beyond its sequence, in
    transactions of `REPORT_CHUNK` streams (each reads its streams' partitions by name)."""
    registry = yield Query(
        "SELECT id, name, sequence_name FROM streams_registry "
        "WHERE to_regclass('streams_facts_' || id) IS NOT NULL ORDER BY name"
    )
    yield Commit()
    found = []
    for start in range(0, len(registry), REPORT_CHUNK):
        chunk = registry[start : start + REPORT_CHUNK]
        maxima = sql.SQL(" UNION ALL ").join(
            sql.SQL("SELECT {key}::int, (SELECT max(stream_id) FROM {facts})").format(
                key=sql.Literal(int(key)), facts=sql.Identifier(facts_partition(int(key)))
            )
            for key, _, _ in chunk
        )
        rows = yield Query(
            sql.SQL(
                """
                SELECT r.name, s.value, COALESCE(m.top, 0),
                       ARRAY(SELECT g.group_name || '=' || g.position
                             FROM streams_reader_groups g
                             WHERE g.stream = r.id AND g.position > s.value
                             ORDER BY g.group_name)
                FROM ({maxima}) AS m(id, top)
                JOIN streams_registry r ON r.id = m.id
                CROSS JOIN LATERAL (SELECT COALESCE(
                    pg_sequence_last_value(r.sequence_name::regclass), 0) AS value) s
                ORDER BY r.name
                """
            ).format(maxima=maxima)
        )
        yield Commit()
        for name, sequence, max_fact, groups in rows:
            beyond = tuple((g.rsplit("=", 1)[0], int(g.rsplit("=", 1)[1])) for g in groups or ())
            found.append(FailoverStream(str(name), int(sequence), int(max_fact), beyond))
    return found


def repair_sequences(skip: int, streams: Sequence[str] | None) -> Gen[list[tuple[str, int, int]]]:
    """Move each stream's sequence (every stream if ``streams`` is None) to ``skip`` IDs past
    the highest of its last value, its highest fact and its groups' positions, so that IDs
    handed out on the old timeline and lost with it are not handed out again (a reader that
    passed them would skip the new facts under them). Returns ``(stream, old, new)``."""
    if skip < 0:
        raise ValueError("skip must not be negative")
    report = yield from failover_report()
    moved = []
    for stream in report:
        if streams is not None and stream.name not in streams:
            continue
        highest = max([stream.sequence, stream.max_fact, *(p for _, p in stream.groups_beyond)])
        target = highest + skip
        if target <= stream.sequence:
            continue
        # The database moves it (revision 0015: forward only, never below a writer that moved
        # it further meanwhile), for an operator or a writer of the stream.
        rows = yield Query(
            "SELECT streams_repair_sequence(r.id, %s) FROM streams_registry r WHERE r.name = %s",
            (target, stream.name),
        )
        if rows and rows[0][0] is not None:
            moved.append((stream.name, stream.sequence, int(rows[0][0])))
    yield Commit()
    return moved


def switchpoint(old_timeline: int) -> Generator[Query | Commit, list[Row], int | None]:
    """Where the current timeline left ``old_timeline`` (revision
    ``0013_timeline_switchpoint``), as an integer WAL position; None when it cannot be known
    here (the function's owner may not read the timeline history, or ``old_timeline`` is not
    an ancestor of the current one): callers then take the safe side."""
    try:
        # A plain text (no parameters): a Spark task's ADBC session runs it too.
        rows = yield Query(f"SELECT streams_timeline_switchpoint({int(old_timeline)})::text")
    except StoreError as exc:
        # 42501: the owner may not read the file; 58P01: no history file (restored elsewhere);
        # 42883: the function is missing (schema older than 0013).
        if exc.sqlstate not in ("42501", "58P01", "42883"):
            raise
        return None  # (the driver rolled the failed statement's transaction back)
    yield Commit()
    text = rows[0][0] if rows else None
    return None if text is None else parse_lsn(str(text))


def replicated() -> Gen[None]:
    """Return once every WAL record written before it is on the synchronous standbys (those
    of ``synchronous_standby_names``; at once without any). Before storing a position outside
    the database (a Spark offset) with its proof's WAL position: docs/design/fencing.md."""
    yield Query(
        "SELECT set_config('synchronous_commit', 'on', true), "
        "pg_logical_emit_message(true, 'streams', 'replicated')"
    )
    yield Commit()


#: IDs a stream's sequence moves forward on a new timeline (`fence_stream`): more than an
#: old primary hands out in any replication lag seen in practice (10 minutes at 1,600 IDs/s).
FAILOVER_SKIP = 1_000_000


def fence_stream(stream_key: int, skip: int = FAILOVER_SKIP, *, commit: bool = True) -> Gen[int]:
    """On a writer's new session: if the stream was last fenced on an older timeline (a
    failover since), move its sequence ``skip`` IDs forward, once per timeline (revision
    0019: the stream's own row and sequence, whatever the number of streams). Returns the
    sequence's new value (0: nothing to do). ``commit=False``: inside the caller's
    transaction (`streams.store.joined_facts`). Why: docs/design/fencing.md ("The timeline
    fence")."""
    rows = yield Query("SELECT streams_fence_stream(%s, %s)", (int(stream_key), int(skip)))
    if commit:
        yield Commit()
    return int(rows[0][0]) if rows and rows[0][0] is not None else 0
