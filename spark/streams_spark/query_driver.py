"""The query's driver side, shared by the batch and the stream reader of the Spark source
(`streams_spark.source`): its lazy PostgreSQL session, retried statements, the database's
history (offsets and group rows checked against it), probes, start resolution and the plan of
a batch's partitions.
"""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from streams.connector import (
    DROPPED_SQLSTATES,
    Gen,
    Guard,
    HeldStreams,
    Incarnation,
    ReaderCore,
    RegistryCursor,
    Subscription,
    backoff_delay,
    compile_pattern,
    group_position,
    holds_across_failover,
    load_listed,
    load_streams,
    open_session,
    probe,
    pruned_positions,
    range_ts_maxima,
    read_incarnation,
    read_incarnation_at,
    registry_after,
    registry_ids,
    retire_where_held,
    rewound,
    run,
    set_up_reader_session,
    split_range,
    statement_timeout_setup,
    transient_sqlstate,
    ts_floor_at,
    verify,
    written_elsewhere,
)
from streams.errors import (
    ConnectionLost,
    DatabaseChanged,
    FactsPruned,
    StoreError,
)

from .executor import (
    RETRY_SECONDS,
    RangePartition,
    StreamWentBackwards,
    went_backwards,
    with_hint,
)
from .offsets import (
    incarnation_of,
    lsn_of,
)
from .options import RETRY_CAP, Position, SourceOptions
from .planning import running_floors

if TYPE_CHECKING:
    from streams import StreamInfo

__all__ = ["DROPPED_SQLSTATES", "QueryDriver", "Resolved"]

log = logging.getLogger("streams.spark")


@dataclass(frozen=True, slots=True)
class Resolved:
    """Where a start or an end resolved to, per stream: positions, the start times still in
    force, timestamp floors, and the streams whose start is beyond what is complete."""

    positions: dict[str, int]
    since: dict[str, int]
    floors: dict[str, int]
    waiting: frozenset[str] = frozenset()


# ------------------------------------------------------------------------------ the driver


class QueryDriver:
    """Driver-side state shared by the stream and batch readers: a lazy psycopg connection."""

    def __init__(self, config: SourceOptions) -> None:
        self.config = config
        self._conn: psycopg.Connection[Any] | None = None
        self._infos: dict[str, StreamInfo] = {}
        self._held = HeldStreams()
        self._warned: set[tuple[Any, ...]] = set()
        #: Statements run again after a transient error (for tests and metrics).
        self.retries = 0
        #: The database history this query reads (`streams.store.identity`): every session
        #: of the driver checks it, and offsets and partitions carry it.
        self.guard = Guard()
        #: The highest LSN of the driver's probes ("the standby fence" of the store): what
        #: an executor with a read URL waits for the standby to replay.
        self.proof_lsn = 0
        self._proof_timeline = 0  # the timeline of proof_lsn
        #: The streams read now: the ones named, or (``streamPattern``) the ones the pattern
        #: matched so far and not dropped (sorted), which `follow_pattern` changes.
        self.names: tuple[str, ...] = tuple(config.streams)
        self.subscription = (
            Subscription(compile_pattern(config.pattern)) if config.pattern is not None else None
        )
        self._listed = False  # the registry listed once (a pattern query)

    def __getstate__(self) -> dict[str, Any]:
        # Spark pickles a fresh reader to ship read() to executors: never a connection.
        state = dict(self.__dict__)
        for key in list(state):
            if key in ("_conn", "_link", "_lock", "_hinted"):
                state[key] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def warn_once(self, key: tuple[Any, ...], message: str) -> None:
        """Log a warning the first time only: the same condition is seen at every probe."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            try:
                self._conn = open_session(
                    self.config.database_url,
                    autocommit=True,
                    purpose="Spark source",
                    opening=self._opening,
                )
            except StoreError as exc:
                if self._infos and not isinstance(exc, ConnectionLost):
                    # It was reachable: an outage, which `run` waits out.
                    raise ConnectionLost(str(exc)) from None
                raise
        return self._conn

    def _opening(self) -> Gen[None]:
        """A new session's checks, ridden out across a session lost meanwhile
        (`streams.store.sessions`, "Opening checks"): the readers' settings (the probe's
        argument needs READ COMMITTED whatever the server's default), then the database
        history (`streams.store.identity`)."""
        yield from set_up_reader_session(statement_timeout_setup(self.config.statement_timeout_ms))
        yield from verify(self.guard, self._where())

    def run(self, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)`` (a store generator) on the driver's connection. After a transient
        error (the connection broke, the statement was cancelled or timed out, the server is
        restarting: `streams.store.driver.transient_sqlstate`) it is run again from the start,
        with back-off, for up to `RETRY_SECONDS`: each is a read, or forward-only (a group
        commit), so running it twice is harmless, and Spark does not fail the query for a
        passing outage."""
        deadline = time.monotonic() + RETRY_SECONDS
        attempt = 0
        while True:
            try:
                return run(self._connection(), make(*args))
            except StoreError as exc:
                broken = self._conn is not None and (self._conn.broken or self._conn.closed)
                if isinstance(exc, ConnectionLost) or broken:
                    self._conn = None
                if not (isinstance(exc, ConnectionLost) or transient_sqlstate(exc.sqlstate)):
                    raise
                delay = backoff_delay(attempt, cap=RETRY_CAP, jitter=random.random())
                if time.monotonic() + delay >= deadline:
                    raise
                if attempt == 0:
                    log.warning("streams source: %s; trying again", exc)
                attempt += 1
                self.retries += 1
                time.sleep(delay)

    def _where(self) -> str:
        group = f" (group {self.config.group!r})" if self.config.group else ""
        if self.config.pattern is not None:
            return f"Spark source of pattern {self.config.pattern!r}{group}"
        return f"Spark source of {', '.join(self.config.streams)}{group}"

    def _current(self) -> Incarnation:
        """The database history this query reads (connecting if needed)."""
        if self.guard.expected is None:
            self.run(read_incarnation)  # a session: its setup records the incarnation
        expected = self.guard.expected
        assert expected is not None
        return expected

    def incarnation(self) -> str:
        """The token of `_current`, which offsets, partitions and group rows carry."""
        return self._current().token

    def check_offset(self, offset: dict[str, Any], what: str) -> None:
        """An offset from Spark's log must belong to this database history (offsets logged
        before they carried an incarnation are taken as they are), or to an earlier timeline
        of it whose switch point is past the offset's proof (a failover that lost nothing the
        offset covers: `streams.store.identity.holds_across_failover`): `_written_elsewhere`."""
        token, lsn = incarnation_of(offset), lsn_of(offset)
        self._written_elsewhere(
            token, f"{self._where()}: the {what} offset", "was logged", proof_lsn=lsn
        )
        current = self._current()
        seen = self.guard.seen_lsn
        if lsn and token == current.token and (seen is None or (current.timeline, lsn) > seen):
            # Logged by an earlier run: its proof's WAL position, flushed before Spark logged
            # it (`replicated`), so an intact server on this timeline is at or past it ("A
            # rewind", `streams.core.incarnation`). Asked once per offset beyond what this run
            # saw on disk itself.
            found, flushed = self.run(read_incarnation_at)
            if found == current and flushed is not None:
                if flushed < lsn:
                    raise rewound(
                        f"{self._where()}: the {what} offset", current.timeline, flushed, lsn
                    )
                self.guard.observed(current.timeline, flushed)

    def check_group_row(self, stream: str, token: str | None, position: int) -> None:
        """The group's committed position, where a start takes it, must have been committed in
        this database history, as for Python group readers (rows from before incarnations
        existed are taken as they are): `_written_elsewhere`."""
        what = f"group {self.config.group!r} on stream {stream!r}"
        self._written_elsewhere(token, what, f"at {position} was committed", in_database=True)

    def _written_elsewhere(
        self,
        token: str | None,
        what: str,
        how: str,
        *,
        proof_lsn: int | None = None,
        in_database: bool = False,
    ) -> None:
        """`DatabaseChanged` if ``what`` (read back with incarnation ``token``) belongs to
        another database history; with ``failOnDataLoss=false``, a warning (once), and the
        query goes on from it. ``in_database``: a group row, which a failover keeps consistent
        with the facts (`written_elsewhere`'s ``across_failover``); otherwise a later timeline
        holds when ``proof_lsn`` is at or below its switch point."""
        current = self._current()
        changed = written_elsewhere(token, current, across_failover=in_database)
        if changed is None:
            return
        assert token is not None
        try:
            self.run(holds_across_failover, token, current, what, proof_lsn)
        except DatabaseChanged as exc:
            changed = exc.changed
            if self.config.fail_on_data_loss:
                raise DatabaseChanged(what, f"it {how} in another incarnation: {changed}") from None
        else:
            log.warning("%s %s on an earlier timeline; it holds after the failover", what, how)
            return
        self.warn_once(
            ("incarnation", what, token),
            f"{what} {how} in another database history ({changed}); failOnDataLoss=false: "
            "going on from it",
        )

    def infos(self) -> dict[str, StreamInfo]:
        if self.subscription is not None:
            if not self._listed:
                self.follow_pattern()  # the first listing of a pattern query
        elif not self._infos:
            loaded = self.run(load_streams, list(self.config.streams))
            self._infos = {info.name: info for info in loaded}
        return self._infos

    # ------------------------------------------------------------------ a pattern's streams

    def follow_pattern(self) -> tuple[list[str], list[str]]:
        """``streamPattern``: list the registry above the ids seen (when the subscription is
        due: `Subscription.poll_started`) and follow the streams created since whose names
        match; a followed name under a new id (dropped and created again) is another stream,
        the old one leaves. Returns the streams that ``(joined, left)``. The joins are decided
        by `streams.core.stream_patterns`, as for Python pattern readers."""
        sub = self.subscription
        if sub is None or (not sub.due and self._listed):
            return [], []
        cursor = RegistryCursor(sub.cursor.top, dict(sub.cursor.holes))
        try:
            rows = self.run(registry_after, sub.cursor.low())
            followed = {n: self._infos[n].id for n in self.names}
            changes = sub.listed(rows, followed, time.monotonic())
            joined = self.run(load_listed, changes.joins) if changes.joins else []
        except BaseException:
            sub.cursor, sub.due = cursor, True  # listed again next time
            raise
        self._listed = True
        self.leave(changes.leaves)
        for info in joined:
            self._infos[info.name] = info
        names = [info.name for info in joined]
        self.names = tuple(sorted({*self.names, *names}))
        if names:
            log.info("%s: %d stream(s) joined: %s", self._where(), len(names), names[:10])
            self.joined(names)
        return names, list(changes.leaves)

    def joined(self, names: list[str]) -> None:
        """Streams that just joined a pattern query (the stream reader takes the group's
        generation on them and watches their Redis channels)."""

    def leave(self, names: Sequence[str]) -> None:
        """Stop reading ``names`` (dropped): they leave the offsets from the next one on."""
        if not names:
            return
        gone = set(names)
        self.names = tuple(n for n in self.names if n not in gone)
        for name in gone:
            self._infos.pop(name, None)
            self._held.forget(name)
        log.info("%s: %d stream(s) left (dropped): %s", self._where(), len(gone), sorted(gone)[:10])

    def leave_dropped(self, failure: BaseException) -> None:
        """A statement of a pattern query failed as one does on a stream dropped under it: the
        streams whose registry rows are gone leave; ``failure`` is raised if none is (or if the
        query names its streams)."""
        if not (
            self.subscription is not None
            and isinstance(failure, StoreError)
            and failure.sqlstate in DROPPED_SQLSTATES
        ):
            raise failure
        if not self.drop_gone():
            raise failure

    def drop_gone(self) -> list[str]:
        """A pattern query's streams whose registry rows are gone (dropped) leave."""
        infos = [self._infos[n] for n in self.names]
        present = self.run(registry_ids, [info.id for info in infos]) if infos else set()
        gone = [info.name for info in infos if info.id not in present]
        self.leave(gone)
        return gone

    def probe(self) -> dict[str, int]:
        """What PostgreSQL proves complete, per stream; a stream held back for a while by an
        expired writer gets that writer's sessions ended, and so does any session that has held
        it back past the lease (the liveness and holding arguments: `streams.store.leases`,
        `streams.store.holders`). A pattern query's stream the probe does not find was
        dropped: it leaves."""
        infos = self.infos()
        if not self.names:  # a pattern that matches nothing yet
            return {}
        try:
            found = self.run(probe, [infos[n] for n in self.names])
        except StoreError as exc:
            self.leave_dropped(exc)
            return self.probe()
        if self.subscription is not None and len(found) < len(self.names):
            self.leave(Subscription.gone(self.names, found))
            if not self.names:
                return {}
        # The proofs' LSN, for executors that read on a standby (the highest: replay passes
        # the lower ones first).
        timeline = self._current().timeline
        if timeline != self._proof_timeline:  # a failover: the old timeline's LSNs mean nothing
            self.proof_lsn, self._proof_timeline = 0, timeline
        self.proof_lsn = max([self.proof_lsn, *(p.wal_lsn for p in found.values())])
        flushed = max(p.flushed_lsn for p in found.values())
        if flushed:  # on disk: what a rewind would take back ("A rewind" of the guard)
            self.guard.observed(timeline, flushed)
        observed = [(n, found[n].complete, found[n].max_allocated) for n in self.names]
        self.run(retire_where_held, infos, self._held, time.monotonic(), observed)
        return {n: found[n].complete for n in self.names}

    def floors_at(self, positions: dict[str, int]) -> dict[str, int]:
        """Timestamp floors at ``positions`` from the facts before them (`ts_floor_at`): for a
        start the reader core did not resolve, and for offsets logged without floors."""
        infos = self.infos()
        return {n: int(self.run(ts_floor_at, infos[n], p)) for n, p in positions.items()}

    def floors_after(
        self, lower: dict[str, int], upper: dict[str, int], floors: dict[str, int]
    ) -> dict[str, int]:
        """The exact timestamp floors at ``upper``, from those at ``lower`` and the facts
        in between."""
        infos = self.infos()
        out = dict(floors)
        for name, low in lower.items():
            if upper[name] > low:
                maxima = self.run(range_ts_maxima, infos[name], [low, upper[name]])
                out[name] = running_floors(floors[name], maxima)[-1]
        return out

    def resolve(self, where: Position, complete: dict[str, int], *, start: bool = True) -> Resolved:
        """Positions for a start or an end, with the start times in force and the floors (see
        `streams_spark.offsets`). For a start, an explicit ``group``'s committed position (and
        floor) wins over the option, stream by stream, as for Python readers."""

        names = self.names
        committed: dict[str, int] = {}
        floors: dict[str, int] = {}
        if start and self.config.group_explicit:
            infos = self.infos()
            for n in names:
                found = self.run(group_position, infos[n], self.config.group)
                if found is not None:
                    self.check_group_row(n, found.incarnation, found.position)
                    committed[n], floors[n] = int(found[0]), int(found[1])
        if committed:
            committed = self.retained(committed)
        rest = [n for n in names if n not in committed]
        positions: dict[str, int] = dict(committed)
        since: dict[str, int] = {}
        waiting: frozenset[str] = frozenset()
        if where.kind in ("frontier", "latest", "id") and rest:
            if where.kind == "frontier":
                given = self.retained({n: int(where.frontier[n]) for n in rest})
            elif where.kind == "latest":
                given = {n: complete[n] for n in rest}
            else:  # the first fact >= the ID, as the Python reader does
                given = self.retained({n: where.id - 1 for n in rest})
            positions.update(given)
            if start:
                floors.update(self.floors_at(given))
            # Beyond what is complete: the query waits there (the Python reader does too).
            waiting = frozenset(n for n in rest if given[n] > complete[n])
        elif where.kind == "timestamps":
            for n in rest:
                moment = _EPOCH + dt.timedelta(milliseconds=where.timestamps[n])
                self._open_core([n], moment, positions, since, floors)
        elif rest:
            begin: Any
            if where.kind == "earliest":
                begin = "earliest"
            elif where.kind == "timestamp":
                begin = _EPOCH + dt.timedelta(milliseconds=where.timestamp_ms)
            else:
                begin = dt.timedelta(seconds=where.ago_seconds)
            self._open_core(rest, begin, positions, since, floors)
        return Resolved(positions, since, floors, waiting)

    def _open_core(
        self,
        names: list[str],
        begin: Any,
        positions: dict[str, int],
        since: dict[str, int],
        floors: dict[str, int],
    ) -> None:
        """Resolve ``names`` with the Python reader's own start logic (on the database's
        clock for a relative start) and keep exactly its positions, filters and floors."""
        core = ReaderCore(names, start=begin)
        try:
            self.run(core.open)
        except FactsPruned as lost:  # a start below what retention kept
            self.lost_facts(lost)
            core = ReaderCore(names, start="earliest")
            self.run(core.open)
        positions.update({n: int(core.positions[n]) for n in names})
        floors.update({n: int(core.ts_floors[n]) for n in names})
        since.update(core.start_times())

    def lost_facts(self, lost: FactsPruned) -> None:
        """Retention removed facts this query needed: fail (``failOnDataLoss``, the default),
        or say so (once) and go on."""
        if self.config.fail_on_data_loss:
            raise with_hint(lost) from None
        self.warn_once(
            ("pruned", lost.stream, lost.pruned_through),
            f"{lost}; failOnDataLoss=false: continuing after them",
        )

    def retained(self, positions: dict[str, int]) -> dict[str, int]:
        """``positions``, each raised to what retention kept (`lost_facts` for any below)."""

        infos = self.infos()
        pruned = self.run(pruned_positions, [infos[n] for n in positions])
        for name, position in positions.items():
            if pruned[name] > position:
                self.lost_facts(FactsPruned(name, position, pruned[name]))
        return {n: max(p, pruned[n]) for n, p in positions.items()}

    def backwards(self, lost: Sequence[str], query: dict[str, int], found: dict[str, int]) -> None:
        """Streams whose complete position is below the query's: fail, or warn (once)."""
        for name in lost:
            if self.config.fail_on_data_loss:
                raise StreamWentBackwards(
                    went_backwards(name, query[name], found[name], strict=True)
                )
            self.warn_once(
                ("backwards", name, query[name], found[name]),
                went_backwards(name, query[name], found[name], strict=False)
                + f"; failOnDataLoss=false: continuing from {query[name]}",
            )

    def plan(
        self,
        lower: dict[str, int],
        upper: dict[str, int],
        since: dict[str, int],
        floors: dict[str, int],
        planned_lsn: int | None = None,
    ) -> list[RangePartition]:
        """Partitions of every stream's ``(lower, upper]`` (deterministic for complete ranges),
        each with the exact timestamp floor at its start; ``since``: start times in force;
        ``planned_lsn``: the WAL position of the proof of ``upper`` (the end offset's), which
        executors wait for on a standby and which makes a partition hold across a failover
        (default: this driver's last probe's)."""

        infos = self.infos()
        parts: list[RangePartition] = []
        # A pattern query's streams in offset order; one dropped since is not read (its
        # facts are gone with it).
        for name in self.config.streams or sorted(upper):
            after, through = lower.get(name, upper[name]), upper[name]
            if through <= after or name not in infos:
                continue
            info = infos[name]
            cuts = self.run(split_range, info, after, through, self.config.partitions)
            bounds = [after, *cuts, through]
            starts = [floors[name]]
            if cuts:
                maxima = self.run(range_ts_maxima, info, bounds[:-1])
                starts += running_floors(floors[name], maxima)
            for (low, high), floor in zip(itertools.pairwise(bounds), starts, strict=True):
                parts.append(
                    RangePartition(
                        stream=name,
                        stream_key=info.id,
                        after=low,
                        through=high,
                        ts_floor=floor,
                        epoch_upper=through,
                        database_url=self.config.database_url,
                        timestamp_in=self.config.timestamp_in,
                        since_ms=since.get(name),
                        fail_on_data_loss=self.config.fail_on_data_loss,
                        statement_timeout_ms=self.config.statement_timeout_ms,
                        prefetch=self.config.prefetch,
                        incarnation=self.incarnation(),
                        read_database_url=self.config.read_database_url,
                        proof_lsn=planned_lsn or self.proof_lsn,
                        standby_max_wait=self.config.standby_max_wait,
                        payload_schema=self.config.payload_schema,
                        by_pattern=self.subscription is not None,
                    )
                )
        return parts

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
