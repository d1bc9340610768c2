"""The ``streams`` Spark data source: micro-batches that are epochs, read as Arrow batches.

Theory of operation
===================

Driver (one `StreamsStreamReader` per query, in a Python planner process of its own that
Spark starts for the query):

* ``initialOffset`` resolves where a new query starts with the Python reader's own logic
  (`streams.store.reader_core.ReaderCore.open`: a group's committed position, earliest, latest, an
  ID, a time, a time per stream), or takes a given frontier JSON as is; with each stream's
  timestamp floor there (`streams_spark.offsets`).
* ``latestOffset(start, limit)`` returns, per stream, at most the position the *latest* probe
  proved complete (`streams.store.probe.probe`): every ID ``<=`` it has completed, so a fact
  that commits later always has a higher ID and can never be skipped. A stream whose proven
  position went below the query's (a database restored from an older backup) is the
  ``failOnDataLoss`` case; one whose start was set beyond what was complete waits for it.
  ``maxFactsPerTrigger`` cuts the range after the N-th *fact* (`streams.store.rows.
  count_facts`; gaps and extra rows do not count), shared between streams by
  `streams_spark.planning.share_budget`; ``minFactsPerTrigger`` returns ``start`` (no batch)
  until N facts are there or ``maxTriggerDelay`` passed, counting once per probe. Spark calls
  this in a tight loop: the source probes only when a Redis hint arrived since the last probe,
  or once per poll interval (1 s while the Redis link is up, 0.1 s without; option
  ``pollInterval``); otherwise it answers from the last probe. The end offset carries each
  stream's exact timestamp floor (`streams.store.rows.range_ts_maxima` over the batch).
* ``partitions(start, end)`` cuts every stream's epoch ``(start, end]`` at stream IDs into
  ranges of about equal row counts (`streams.store.rows.split_range`), each carrying the
  running maximum timestamp at its start (from the offset's floor). Same offsets, same
  partitions: a batch replayed after a crash reads exactly the same facts.
* ``commit(end)`` records ``end`` as the reader group (`streams.store.reader_groups.commit_group`,
  forward-only, so Spark repeating the last commit after a restart is harmless). Each run of
  the query is the group's consumer: its first ``initialOffset`` or ``latestOffset`` takes the
  group's next generation (`streams.store.reader_groups.take_generations`, before the group's
  position is read), so an older run still alive is fenced. A fenced run's commit fails the query
  with `GroupFenced` when ``group`` is explicit; on the default group (shared by queries with the
  same options) it logs a warning and commits no more: its checkpoint, not the group, is where
  it resumes.

With ``streamPattern`` the query's streams change while it runs (`QueryDriver.follow_pattern`,
deciding with the Python pattern reader's `streams.core.stream_patterns`): the driver lists the
registry at most once per poll interval, when it probes; a stream created since enters the next
offset at the position retention kept (0 for a new stream), with nothing of it in that batch, and
is read from there by the next (its group generation taken, its Redis channels watched); a
stream dropped leaves the next offset (the probe misses it, or a statement on it fails as on a
dropped stream: `leave_dropped`; an executor's task on it ends with what it read). Offsets carry
each stream's registry id (``ids``), so a stream dropped and created again under its name is
read from its first fact, across restarts too; a checkpoint's offset is taken for the streams it
names that still exist under those ids.

Every driver statement has a timeout (``statementTimeout``) and is run again, with back-off,
after a transient error (a broken connection, a cancelled statement, a restart:
`streams.store.driver.transient_sqlstate`) for up to `RETRY_SECONDS`. Executors run
`streams_spark.executor.read_partition`.

The read sequence (incarnation, probe, rows, retention; `streams.store.reads` says why its
order is the proof) is the store's, taken through `streams.connector` like everything else of
the library beyond its public API: the driver runs its probe (``latestOffset``,
``partitions``) and its retention check (`QueryDriver.retained`, in
`streams_spark.query_driver`) to plan positions, and every executor runs the whole sequence
for its range (`streams.store.reads.read_range`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from streams.connector import (
    Generation,
    Incarnation,
    RedisLink,
    commit_group,
    count_facts,
    default_instance_name,
    deliverable,
    first_fact_since,
    pruned_positions,
    replicated,
    take_generations,
)
from streams.errors import (
    ConfigurationError,
    GroupFenced,
    StoreError,
)

from .executor import (
    RETRY_SECONDS,
    SCHEMA,
    RangePartition,
    read_partition,
    source_schema,
)
from .offsets import (
    floors_of,
    frontier_offset,
    ids_of,
    lsn_of,
    offset_streams,
    positions_of,
    since_of,
    waiting_of,
)
from .options import Position, SourceOptions, parse_options
from .planning import lost_streams, share_budget
from .query_driver import DROPPED_SQLSTATES, QueryDriver

if TYPE_CHECKING:
    import pyarrow as pa

    from streams.connector import Hint

__all__ = [
    "RETRY_SECONDS",
    "SCHEMA",
    "RangePartition",
    "StreamsBatchReader",
    "StreamsDataSource",
    "StreamsStreamReader",
    "read_partition",
]

log = logging.getLogger("streams.spark")

#: Seconds between probes while the Redis link is up / without it (the Python reader's).
LIVE_POLL_INTERVAL = 1.0
FALLBACK_POLL_INTERVAL = 0.1


class StreamsDataSource(DataSource):
    """``spark.readStream.format("streams")`` / ``spark.read.format("streams")``."""

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        # Checked here, when the query is defined: one clear error, never one from an executor.
        self.config: SourceOptions = parse_options(dict(options))

    @classmethod
    def name(cls) -> str:
        return "streams"

    def schema(self) -> StructType:
        return source_schema(self.config.payload_schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        bad = [
            name
            for name, value in (
                ("maxFactsPerTrigger", self.config.max_facts),
                ("minFactsPerTrigger", self.config.min_facts),
            )
            if value is not None
        ]
        if bad:
            raise ConfigurationError(
                f"option {bad[0]} applies to streaming reads (spark.readStream) only"
            )
        return StreamsBatchReader(self.config)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if self.config.end is not None:
            raise ConfigurationError(
                f"option {self.config.end_option} applies to batch reads (spark.read) only; a "
                "streaming query with an end is trigger(availableNow=True)"
            )
        return StreamsStreamReader(self.config)


class StreamsBatchReader(QueryDriver, DataSourceReader):
    """``spark.read.format("streams")``: facts in (start, end]; the end is the complete
    position, or ``endingPosition``, or the last fact before ``endingTimestamp`` (its
    timestamp as readers report it, the running maximum), each capped at what is complete."""

    def partitions(self) -> Sequence[InputPartition]:
        try:
            complete = self.probe()
            start = self.resolve(self.config.start, complete)
            lower = start.positions
            end = self.config.end or Position("latest")
            if end.kind == "id":
                upper = {n: end.id for n in self.names}
            else:
                upper = self.resolve(end, complete, start=False).positions
            for name in self.names:
                if upper[name] > complete[name]:
                    if end.kind in ("id", "frontier"):
                        log.warning(
                            "stream %r: %s %d is beyond the complete position %d; reading up "
                            "to %d",
                            name, self.config.end_option, upper[name], complete[name],
                            complete[name],
                        )  # fmt: skip
                    upper[name] = complete[name]
                upper[name] = max(upper[name], lower[name])
            parts = self.plan(lower, upper, start.since, start.floors)
        finally:
            self.close()
        return parts or [_EMPTY]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, RangePartition):
            yield from read_partition(partition)


class _Empty(InputPartition):
    def __init__(self) -> None:
        super().__init__(None)


_EMPTY = _Empty()


class StreamsStreamReader(QueryDriver, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("streams")``: one micro-batch = one epoch of every stream."""

    def __init__(self, config: SourceOptions) -> None:
        super().__init__(config)
        #: What the latest probe proved complete (never a maximum over earlier probes: after a
        #: restore that would plan batches beyond what PostgreSQL proves).
        self._complete: dict[str, int] = {}
        self._last_probe = 0.0
        self._probed = False
        self._hinted: threading.Event | None = None
        self._link: RedisLink | None = None
        self._link_up = False
        self._target: dict[str, int] | None = None
        self._last_batch = time.monotonic()
        #: Batches admitted under a budget so far: rotates who gets the rounding remainder.
        self._turn = 0
        #: The last fact count (minFactsPerTrigger): counted again only after a new probe.
        self._counted: tuple[tuple[Any, ...], dict[str, tuple[int, int]]] | None = None
        self.probes = 0
        #: The group's generations this run took (`own_group`); fenced: another run took it.
        self._generations: dict[str, Generation] | None = None
        self._fenced = False
        #: The end offset (canonical JSON) of the batch this run planned last, until the group
        #: holds it (`_commit_completed`).
        self._planned_end: str | None = None

    # ------------------------------------------------------------------ Redis (lazy)

    def _follow_redis(self) -> None:
        if self._hinted is None:
            self._hinted = threading.Event()
        if self._link is not None or self.config.redis_url is None:
            return

        try:
            self._link = RedisLink(
                self.config.redis_url, self.config.prefix, f"spark-{default_instance_name()}"
            )
            self._link.add_listener(self, self.names)
            # It may have connected before we listened: take its state now (as readers do).
            self._link_up = bool(self._link.connected)
        except Exception:
            log.warning("cannot follow Redis; polling PostgreSQL instead", exc_info=True)
            self._link = None

    def on_hint(self, hint: Hint) -> None:
        wanted = hint.stream in self._complete and hint.token > self._complete[hint.stream]
        if wanted and self._hinted is not None:
            self._hinted.set()

    def on_link_state(self, connected: bool) -> None:
        self._link_up = connected
        if self._hinted is not None:
            self._hinted.set()  # reconcile with PostgreSQL at the next call

    def _interval(self) -> float:
        if self.config.poll_interval is not None:
            return self.config.poll_interval
        return LIVE_POLL_INTERVAL if self._link_up else FALLBACK_POLL_INTERVAL

    def _refresh(self, force: bool = False) -> dict[str, int]:
        """The complete positions the latest probe proved, probing only when a hint came or
        the interval passed."""
        self._follow_redis()
        assert self._hinted is not None
        now = time.monotonic()
        due = now - self._last_probe >= self._interval()
        if force or not self._probed or due or self._hinted.is_set():
            self._hinted.clear()
            self._last_probe = now
            if self.subscription is not None:  # streams created since join (`follow_pattern`)
                self.subscription.poll_started(now, 0.0 if force else self._interval())
                self.follow_pattern()
            self._complete = self.probe()
            self.probes += 1
            self._probed = True
        return dict(self._complete)

    # ------------------------------------------------------------------ offsets

    def _proof_flushed(self, token: str) -> None:
        """After `replicated` on the history ``token``: the proof's WAL position is on disk,
        what this run saw there ("A rewind" of the guard; an offset carrying it then needs no
        new reading in `check_offset`)."""
        timeline = Incarnation.from_token(token).timeline
        if self.proof_lsn and self._proof_timeline == timeline:
            self.guard.observed(timeline, self.proof_lsn)

    def own_group(self) -> dict[str, Generation]:
        """Take the group's next generation on every stream, once per run of the query (as a
        Python reader does when it opens its group: before its position is read); a pattern
        query's streams created later get theirs as they join (`joined`)."""
        if self._generations is None:
            infos = self.infos()
            self._generations = self._take_generations([infos[n] for n in self.names])
        return self._generations

    def _take_generations(self, infos: list[Any]) -> dict[str, Generation]:
        if not infos:
            return {}
        owner = f"spark {socket.gethostname()}:{os.getpid()}"
        return dict(self.run(take_generations, self.config.group, infos, owner))

    def joined(self, names: list[str]) -> None:
        """Streams that joined a pattern query: the group's generation on them (this run is
        their consumer too), and their Redis hints."""
        if self._generations is not None:
            infos = self.infos()
            self._generations.update(self._take_generations([infos[n] for n in names]))
        if self._link is not None:  # as Python pattern readers do (`streams.reader_plans`)
            self._link.watch(names, writers=False)
            self._link.watch(names, writers=True)

    def leave(self, names: Sequence[str]) -> None:
        super().leave(names)
        for name in names:
            self._complete.pop(name, None)
            if self._generations is not None:
                self._generations.pop(name, None)
        if self._link is not None and names:
            try:
                self._link.unwatch(names, writers=False)
                self._link.unwatch(names, writers=True)
            except Exception:
                log.debug("unlistening to dropped streams failed", exc_info=True)

    # ------------------------------------------------------------------ offsets of a pattern

    def _carried(self, offset: dict[str, Any]) -> tuple[str, ...]:
        """The streams of ``offset`` this query reads now: all of them, checked to be exactly
        the streams named; with ``streamPattern``, the ones it names that are still followed
        under the same registry id (a stream dropped since leaves the offsets). A stream it
        names that the pattern does not match means the checkpoint is another query's."""
        if self.subscription is None:
            positions_of(offset, self.names)  # exactly the streams read
            return self.names
        keys = offset_streams(offset)
        foreign = [n for n in keys if not self.subscription.matches(n)]
        if foreign:
            raise ConfigurationError(
                f"the checkpoint's offset covers streams {foreign[:10]} that option "
                f"streamPattern {self.config.pattern!r} does not match: the streams of a query "
                "cannot change across restarts (start a new checkpoint)"
            )
        infos, ids = self.infos(), ids_of(offset)
        return tuple(n for n in keys if n in infos and ids.get(n, infos[n].id) == infos[n].id)

    def _state(
        self, offset: dict[str, Any], names: tuple[str, ...]
    ) -> tuple[dict[str, int], dict[str, int], dict[str, int] | None, frozenset[str]]:
        """Positions, start times, floors (None: an offset without) and waiting streams of
        ``offset``, for ``names`` (`_carried`) only."""
        keys = names if self.subscription is None else offset_streams(offset)
        lower, since = positions_of(offset, keys), since_of(offset, keys)
        floors, waiting = floors_of(offset, keys), waiting_of(offset, keys)
        if self.subscription is None:
            return lower, since, floors, waiting
        kept = set(names)
        return (
            {n: p for n, p in lower.items() if n in kept},
            {n: t for n, t in since.items() if n in kept},
            None if floors is None else {n: f for n, f in floors.items() if n in kept},
            frozenset(n for n in waiting if n in kept),
        )

    def _ids(self, names: Any) -> dict[str, int] | None:
        """The registry ids a pattern query's offset carries (None otherwise)."""
        if self.subscription is None:
            return None
        infos = self.infos()
        return {n: infos[n].id for n in names}

    def _entries(self, names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Where streams that joined a pattern query enter its offsets: the position retention
        kept (0 if it never pruned), so the next batch reads from their first fact; and their
        timestamp floors there."""
        if not names:
            return {}, {}
        infos = self.infos()
        entry = dict(self.run(pruned_positions, [infos[n] for n in names]))
        return entry, self.floors_at(entry)

    def initialOffset(self) -> dict[str, Any]:
        self.own_group()
        complete = self._refresh(force=True)
        start = self.resolve(self.config.start, complete)
        token = self.incarnation()
        self.run(replicated)  # as for every offset (`latestOffset`)
        if self.incarnation() != token:  # it ran on a new primary: start there
            return self.initialOffset()
        self._proof_flushed(token)
        log.info("streams source starts at %s (group %s)", start.positions, self.config.group)
        if start.waiting:
            log.info(
                "streams %s start beyond what is complete: waiting for it", sorted(start.waiting)
            )
        return frontier_offset(
            start.positions,
            start.since,
            floors=start.floors,
            waiting=start.waiting,
            incarnation=self.incarnation(),
            lsn=self.proof_lsn,
            ids=self._ids(start.positions),
        )

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.config.max_facts is not None:
            return ReadMaxRows(self.config.max_facts)
        if self.config.min_facts is not None:
            return ReadMinRows(self.config.min_facts)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._refresh(force=True)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        try:
            offset = self._latest_offset(start, limit)
        except StoreError as exc:  # a pattern query's stream dropped under a statement
            self.leave_dropped(exc)
            return self.latestOffset(start, limit)
        # Only now: every check of ``start`` passed (a failover that lost facts raised).
        self._commit_completed(start)
        return offset

    def _latest_offset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        self.own_group()  # a run restarted from its checkpoint calls this first
        self.check_offset(start, "start")
        token = self.incarnation()
        had_probes = self.probes
        complete = self._refresh()
        names = self._carried(start)
        lower, since, floors, waiting = self._state(start, names)
        entry, entry_floors = self._entries([n for n in self.names if n not in lower])
        if self.probes != had_probes:
            self.backwards(lost_streams(lower, complete, waiting), lower, complete)
            self.retained(lower)  # retention passed this query (its group was deleted)
        target = self._target
        if target is not None:  # streams that joined since have none: not read this run
            target = {n: target.get(n, lower[n]) for n in lower}
        upper = deliverable(lower, complete, target)  # as every reader decides it
        use_options = not (
            isinstance(limit, ReadAllAvailable)
            and not isinstance(self.getDefaultReadLimit(), ReadAllAvailable)
        )
        max_facts = None
        if isinstance(limit, ReadMaxRows):
            max_facts = limit.max_rows
        elif use_options:
            max_facts = self.config.max_facts
        min_facts = self.config.min_facts if use_options and self._target is None else None
        waiting_delay = time.monotonic() - self._last_batch < self.config.max_trigger_delay
        if min_facts is not None and waiting_delay and upper != lower:
            have = self._count_once_per_probe(lower, upper, min_facts)
            if sum(c for c, _ in have.values()) < min_facts:
                upper = lower
        if max_facts is not None and upper != lower:
            upper = self._admit(lower, upper, max_facts)
        same_streams = self.subscription is None or sorted(lower) == list(offset_streams(start))
        if upper == lower and not entry and same_streams:
            # The start's proof still stands for it (see `lsn_of`).
            return frontier_offset(
                lower, since, floors=floors, waiting=waiting, incarnation=token,
                lsn=lsn_of(start), ids=self._ids(lower),
            )  # fmt: skip
        self._last_batch = time.monotonic()
        # The offset's proof on every synchronous standby before Spark logs it, so that it
        # holds after a failover to one (`lsn_of`; one WAL flush per batch).
        self.run(replicated)
        if self.incarnation() != token:  # it ran on a new primary: prove again there
            return self.latestOffset(start, limit)
        self._proof_flushed(token)
        moved = {n for n in lower if upper[n] > lower[n]}
        end_floors = self.floors_after(lower, upper, floors or self.floors_at(lower))
        end_since = self._since_after(since, lower, upper)
        upper.update(entry)  # joined: nothing of them in this batch, from their start next
        end_floors.update(entry_floors)
        return frontier_offset(
            upper,
            end_since,
            floors=end_floors,
            waiting=waiting - moved,
            incarnation=token,
            lsn=self.proof_lsn,
            ids=self._ids(upper),
        )

    def _since_after(
        self, since: dict[str, int], lower: dict[str, int], upper: dict[str, int]
    ) -> dict[str, int]:
        """The start times still in force after ``(lower, upper]``: a stream's is dropped
        once the batch holds a fact at or after it (every later fact's timestamp is then
        at least as late)."""

        infos = self.infos()
        return {
            n: ms
            for n, ms in since.items()
            if upper[n] <= lower[n]
            or self.run(first_fact_since, infos[n], ms, lower[n], upper[n]) is None
        }

    def _count(
        self, lower: dict[str, int], upper: dict[str, int], limit: int
    ) -> dict[str, tuple[int, int]]:

        infos = self.infos()
        return {
            n: self.run(count_facts, infos[n], lower[n], upper[n], limit)
            if upper[n] > lower[n]
            else (0, lower[n])
            for n in lower
        }

    def _count_once_per_probe(
        self, lower: dict[str, int], upper: dict[str, int], limit: int
    ) -> dict[str, tuple[int, int]]:
        """`_count`, again only after a new probe: while fewer than ``minFactsPerTrigger``
        facts are there, Spark asks about a hundred times a second, and nothing can have
        changed between two probes (``upper`` comes from the latest one)."""
        key = (self.probes, tuple(sorted(lower.items())), tuple(sorted(upper.items())), limit)
        if self._counted is None or self._counted[0] != key:
            self._counted = (key, self._count(lower, upper, limit))
        return self._counted[1]

    def _admit(self, lower: dict[str, int], upper: dict[str, int], budget: int) -> dict[str, int]:
        """At most ``budget`` facts over all streams, shared in proportion to what each has,
        the rounding remainder rotating between streams (`planning.share_budget`)."""

        have = self._count(lower, upper, budget)
        counts = {n: c for n, (c, _) in have.items()}
        result = dict(upper)
        if sum(counts.values()) <= budget:
            for n, (count, last) in have.items():
                if count == budget:  # exactly budget facts seen: there may be more beyond
                    result[n] = last
            return result
        shares = share_budget(counts, budget, self._turn)
        self._turn += 1
        infos = self.infos()
        for n, (count, last) in have.items():
            share = shares[n]
            if count == 0:
                result[n] = upper[n]
            elif share == 0:
                result[n] = lower[n]
            elif share == count:
                result[n] = upper[n] if count < budget else last
            else:
                _, result[n] = self.run(count_facts, infos[n], lower[n], upper[n], share)
        return result

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """The positions the latest probe proved complete: Spark shows them as the source's
        ``latestOffset`` in each batch's progress, so `streams_spark.LagListener` (or anyone
        reading the progress) sees how far each stream is behind the linear position."""
        if not self._complete:
            return None
        return frontier_offset(self._complete)

    def _commit_completed(self, start: dict[str, Any]) -> None:
        """Move the group to the end of the batch this run planned last, once Spark asks for
        the offset after it. Spark runs one batch at a time and asks for the next offset only
        after the last batch completed (its sink wrote it and the commit log holds it; a batch
        replayed after a restart is planned again, without this call first). Spark's own
        ``commit`` of that end comes only when it plans the next batch: never after the last
        batch of an ``availableNow`` run or of a run stopped while idle, so the group would
        trail the query by that batch (docs/spark.md, "Groups and lag")."""
        key = json.dumps(start, sort_keys=True)
        if self._planned_end != key:
            return
        self._planned_end = None
        self.commit(start)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        self.check_offset(end, "end")
        self._planned_end = json.dumps(end, sort_keys=True)
        # A batch replayed after a restart is planned without a latestOffset call first: the
        # database may have been restored meanwhile. The executors check again as they read.
        complete = self._refresh() if self._probed else self._refresh(force=True)
        lower, upper, since, floors = self._batch(start, end)
        if lower == upper:
            return []
        moving = {n: upper[n] for n in lower if upper[n] > lower[n]}
        lost = lost_streams(moving, complete, ())
        self.backwards(lost, upper, complete)
        for name in lost:  # failOnDataLoss=false: read what is still proven
            upper[name] = max(lower[name], complete[name])
        try:
            floors = floors or self.floors_at(lower)
            parts = self.plan(lower, upper, since, floors, lsn_of(end))
        except StoreError as exc:  # a pattern query's stream dropped under a statement
            self.leave_dropped(exc)
            return self.partitions(start, end)
        return parts or [
            RangePartition(
                stream=next(iter(upper), ""),
                stream_key=0,
                after=0,
                through=0,
                ts_floor=0,
                epoch_upper=0,
                database_url=self.config.database_url,
            )
        ]

    def _batch(
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int] | None]:
        """The batch ``(start, end]``: ``(lower, upper, since, floors at lower)`` of the
        streams read now. A pattern query's stream that entered with ``end`` (or under another
        registry id) has nothing in it: its lower is its upper."""
        if self.subscription is None:
            names = self.names
            lower, since, floors, _ = self._state(start, names)
            return lower, positions_of(end, names), since, floors
        names = self._carried(end)
        upper = self._state(end, names)[0]
        ids_end = ids_of(end)
        ids_start = ids_of(start)
        before = self._carried(start)
        lower_all, since, floors, _ = self._state(start, before)
        same = [n for n in names if n in lower_all and ids_start.get(n) == ids_end.get(n)]
        lower = {n: lower_all[n] if n in same else upper[n] for n in names}
        floors_kept = None if floors is None else {n: f for n, f in floors.items() if n in same}
        if floors_kept is not None and len(floors_kept) < len(same):
            floors_kept = None
        if floors_kept is not None:  # nothing is read of the entering ones: any floor does
            floors_kept.update({n: 0 for n in names if n not in same})
        return lower, upper, {n: t for n, t in since.items() if n in same}, floors_kept

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(partition)

    def commit(self, end: dict[str, Any]) -> None:
        if self._fenced:
            return
        self.check_offset(end, "committed")
        names = self._carried(end)
        positions, _, floors, _ = self._state(end, names)
        floors = floors or self.floors_at(positions)
        if not names:
            return
        infos = self.infos()
        commits = [(infos[n], positions[n], floors[n]) for n in names]
        try:
            self.run(
                functools.partial(commit_group, incarnation=self.incarnation()),
                self.config.group,
                commits,
                self.own_group(),
            )
        except (GroupFenced, StoreError) as exc:
            if self._dropped_under(exc):  # they leave; the others are committed
                return self.commit(end)
            if not isinstance(exc, GroupFenced):
                raise
            fenced = exc
            if self.config.group_explicit:
                raise
            self._fenced = True
            log.warning("%s; this query no longer commits its progress to the group", fenced)

    def _dropped_under(self, failure: BaseException) -> bool:
        """A pattern query's group commit failed as one does on a stream dropped under it (its
        group row deleted with it, or its tables gone): did streams leave for it?"""
        if self.subscription is None:
            return False
        if isinstance(failure, GroupFenced):
            dropped = failure.current is None
        else:
            dropped = isinstance(failure, StoreError) and failure.sqlstate in DROPPED_SQLSTATES
        return dropped and bool(self.drop_gone())

    def stop(self) -> None:
        if self._link is not None:
            try:
                self._link.remove_listener(self, self.names)
                self._link.close()
            except Exception:
                log.debug("closing the Redis link failed", exc_info=True)
            self._link = None
        self.close()
