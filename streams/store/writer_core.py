"""What a writer does, written once as generators (run by `streams.store.driver.run` / `arun`).

A `WriterCore` is one writer instance on one stream: it owns the `PositionTracker` of its
process and produces the SQL of each step (registration, appends, keyed appends, joined facts,
heartbeats, retiring); the sync `Writer` and the asyncio `AsyncWriter` only drive these
generators. The life of an append (reservation, commit, completion) and why no ID is lost or
handed out twice: docs/design/durability.md; fencing: docs/design/fencing.md.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

from psycopg import sql

from ..config import validate_instance_name
from ..core.constants import facts_partition, reservation_lock_class
from ..core.fact_columns import STORED_NAMES
from ..core.incarnation import Guard
from ..core.payloads import encode_payload
from ..core.positions import PositionTracker, ReservationToken
from ..core.sightings import Sighting
from ..core.timestamps import resolve_timestamps, validate_client_timestamp
from ..errors import (
    FailoverLoss,
    ReservationBlocked,
    SequenceRewound,
    StoreError,
    UsageError,
    WriterFenced,
)
from ..types import Ack, FactChunk, StreamInfo
from .driver import Autocommit, Commit, CopyIn, Gen, Pipeline, Query, Row
from .failover import FAILOVER_SKIP, check_sighting, fence_timeline
from .holders import end_exclusive_holders, exclusive_holders
from .idempotency import (
    ATTEMPTS,
    FENCED,
    GATE,
    SINGLE_RESULT,
    check_keys,
    claim_ctes,
    held,
    read_originals,
    record_cte,
)
from .identity import FLUSHED_LSN_SQL, TIMELINE_SQL, verify
from .leases import (
    end_expired_sessions,
    max_allocated_sql,
    registration_lock,
    repair_sequence,
    reservation_lock_key_sql,
    retire_expired_writers,
    writer_lock_sql,
)
from .registry import load_stream

log = logging.getLogger("streams.writer")

__all__ = [
    "DatabaseClock",
    "FactHandle",
    "HeartbeatResult",
    "WriterCore",
    "encode_payload",
]


class DatabaseClock:
    """Arrival time in ms on the database's clock, estimated locally between samples.

    Every writer timestamps with the same clock (PostgreSQL's ``clock_timestamp()``), so hosts
    with skewed clocks cannot reorder time. The offset is re-sampled at every heartbeat; the
    estimate uses the round trip's midpoint.
    """

    def __init__(self) -> None:
        self._offset_ms = 0.0

    def sample(self, db_ms: int, sent: float, received: float) -> None:
        self._offset_ms = db_ms - (sent + received) / 2 * 1000

    def now_ms(self) -> int:
        return math.floor(time.time() * 1000 + self._offset_ms)


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    alive: bool
    persisted_position: int
    max_allocated: int


@dataclass(slots=True)
class FactHandle:
    """A fact being written in the caller's own transaction (see `Writer.fact`).

    ``duplicate``: its idempotency key had been written already; ``stream_id`` and
    ``timestamp`` are then the original fact's, and nothing may be written. ``xid``: the
    caller's transaction (``txid_current()``), by which a writer learns when a transaction it
    joined has ended (`WriterCore.resolve_joined`).
    """

    stream_id: int
    timestamp: int
    rows: int = 0
    duplicate: bool = False
    xid: int = 0

    @property
    def ack(self) -> Ack:
        return Ack(
            self.stream_id,
            self.stream_id,
            self.timestamp,
            self.timestamp,
            1,
            (self.stream_id,),
            (0,) if self.duplicate else (),
        )


#: SQLSTATE of a unique violation: a reserved ID that is already stored.
UNIQUE_VIOLATION = "23505"

#: SQLSTATE of a failed text-to-number cast: how the one-statement append refuses an ID below
#: its floor (the message carries `_REWOUND`).
INVALID_TEXT = "22P02"
#: The facts' columns, in the order a written row lists them (COPY, INSERT).
_FACT_COLUMNS = sql.SQL(", ".join(STORED_NAMES))
_REWOUND = "streams-sequence-rewound"
#: The text cast by which a reservation fails at once when another session holds the stream's
#: reservation lock at its floor exclusively (no library session ever does: they share it), so
#: a writer never waits behind it (`ReservationBlocked`).
_BLOCKED = "streams-reservation-blocked"

#: Retire expired peers every this many heartbeats.
RETIRE_EVERY = 4

_NOW_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


class WriterCore:
    """One writer instance on one stream: the shared logic of `Writer` and `AsyncWriter`."""

    def __init__(
        self, stream: str, instance: str, *, lease_seconds: float, max_payload_bytes: int
    ) -> None:
        self.stream_name = stream
        self.instance = validate_instance_name(instance)
        self.lease_seconds = lease_seconds
        #: The database history this writer's state belongs to (shared with its client's).
        self.guard = Guard()
        #: The facts acknowledged lately, checked after a failover (`streams.core.sightings`).
        self.sighting = Sighting()
        self.max_payload_bytes = max_payload_bytes
        self.clock = DatabaseClock()
        self.generation = 0
        self.fenced = False
        self._info: StreamInfo | None = None
        self._tracker: PositionTracker | None = None
        self._ts_floor = 0
        self._persisted = 0
        # Rendered once to bytes: psycopg then caches their conversion, where a `sql.Composed`
        # would be re-rendered on every append (about 30 us of a ~400 us append here).
        self._reserve_one: bytes | None = None
        self._reserve_many: bytes | None = None
        self._copy_facts = ""
        #: An append found the stream's reservation lock held exclusively (`_refused`).
        self.blocked = False
        self._reserve_fact: bytes | None = None
        self._reserve_one_keyed = self._reserve_fact_keyed = self._reserve_many_keyed = b""
        #: IDs reserved in transactions of callers that this writer joined (``fact()`` on a
        #: connection already in a transaction), by transaction ID, with their timestamps:
        #: pending until `resolve_joined` finds the transaction ended.
        self._joined: dict[int, list[tuple[int, int]]] = {}
        self._joined_lock = threading.Lock()
        self._beats = 0
        #: Facts this writer committed (for metrics).
        self.appended = 0

    # ------------------------------------------------------------------ accessors

    @property
    def info(self) -> StreamInfo:
        if self._info is None:
            raise UsageError("writer is not registered yet")
        return self._info

    @property
    def tracker(self) -> PositionTracker:
        if self._tracker is None:
            raise UsageError("writer is not registered yet")
        return self._tracker

    @property
    def needs_persist(self) -> bool:
        return self._tracker is not None and self._tracker.local_position > self._persisted

    # ------------------------------------------------------------------ registration

    def register(self) -> Gen[None]:
        """Register (or take over) this instance name, recovering its position.

        Steps, in one transaction under the stream's registration lock:

        1. repair a sequence that is behind any ID known to be used: ``streams_facts``, every
           declared user table, every persisted writer position and committed group position
           (`streams.store.leases.sequence_state`);
        2. lock this instance's row ``FOR UPDATE``: that waits for every open transaction of a
           previous process with the same name (they hold ``FOR KEY SHARE`` on it; if that
           process's lease has expired, its sessions were ended just before), and the
           generation bump below fences all its later ones;
        3. read max allocated *after* that lock. Nothing reserved under this name can still be
           pending now, so this writer's position is max allocated (the definition allows it):
           a restarted name never pins the linear position below IDs it no longer holds, however
           often it restarts within its lease. A new name is seeded at the linear position.
        """
        info = yield from load_stream(self.stream_name)
        # A previous process of this name that froze in a transaction would make step 2 wait
        # for ever: once its lease has expired, its sessions are ended first.
        yield from end_expired_sessions(info, self.instance)
        sent = time.time()
        rows = yield Query(f"SELECT {_NOW_MS}")
        self.clock.sample(rows[0][0], sent, time.time())
        yield from registration_lock(info)
        yield from repair_sequence(info)
        existing = yield Query(
            "SELECT position FROM streams_writers WHERE stream = %s AND instance = %s FOR UPDATE",
            (info.id, self.instance),
        )
        rows = yield Query(
            sql.SQL(
                """
                SELECT {max_allocated},
                       (SELECT max(ts) FROM {facts} WHERE stream = %(stream)s),
                       (SELECT min(position) FROM streams_writers
                        WHERE stream = %(stream)s AND NOT retired AND instance <> %(instance)s)
                """
            ).format(
                max_allocated=max_allocated_sql(info),
                facts=sql.Identifier(facts_partition(info.id)),
            ),
            {"stream": info.id, "instance": self.instance},
        )
        max_allocated, ts_floor, others_min = int(rows[0][0]), rows[0][1] or 0, rows[0][2]
        if existing:
            recovered = max(int(existing[0][0]), max_allocated)
            rows = yield Query(
                """
                UPDATE streams_writers
                SET generation = generation + 1, retired = false,
                    position = GREATEST(position, %s), pending = 0,
                    lease_expires_at = clock_timestamp() + make_interval(secs => %s),
                    registered_at = clock_timestamp(), heartbeat_at = clock_timestamp()
                WHERE stream = %s AND instance = %s
                RETURNING generation
                """,
                (recovered, self.lease_seconds, info.id, self.instance),
            )
        else:
            # A new writer is seeded at the linear position: never above any pending ID. Its
            # heartbeat_at is set with its lease, as every heartbeat does: ``lease_expires_at -
            # heartbeat_at`` is its lease (docs/design/liveness.md, "holding").
            recovered = max_allocated if others_min is None else min(others_min, max_allocated)
            rows = yield Query(
                """
                INSERT INTO streams_writers
                    (stream, instance, generation, position, lease_expires_at, heartbeat_at)
                VALUES (%s, %s, 1, %s, clock_timestamp() + make_interval(secs => %s),
                        clock_timestamp())
                RETURNING generation
                """,
                (info.id, self.instance, recovered, self.lease_seconds),
            )
        others = yield Query(
            "SELECT instance, position FROM streams_writers "
            "WHERE stream = %s AND NOT retired AND instance <> %s",
            (info.id, self.instance),
        )
        yield Commit()
        self.generation = int(rows[0][0])
        self._info = info
        self._ts_floor = int(ts_floor)
        self._persisted = recovered
        # Any transaction of an earlier process under this name has ended (we waited for its
        # row lock), so nothing of ours is pending or in flight: the tracker may announce max
        # allocated straight away.
        self._tracker = PositionTracker(
            local_instance=self.instance,
            local_position=recovered,
            max_allocated=max_allocated,
            writers={name: int(pos) for name, pos in others},
        )
        self.fenced = False
        self._prepare_statements(info)

    def _prepare_statements(self, info: StreamInfo) -> None:
        # w: the lease check (docs/design/fencing.md); k: L = last value + 1, read once; g: the
        # shared reservation lock on L, taken before nextval, so every ID this transaction
        # reserves is >= L and readers see in pg_locks that it may still complete
        # (docs/design/probe.md). r scans g and returns L beside each ID: the lock is taken
        # before nextval by data dependency, and `_check_floor` verifies ID >= L before anything
        # commits, rather than trusting the order of evaluation. w also bounds the transaction
        # by the lease (docs/design/liveness.md): the server aborts it if it sits idle or runs a
        # statement for longer, and it holds the writer's own lock, by which the sessions of an
        # expired writer are found and ended. A caller's connection (``fact()``) also gets, for
        # this transaction, the TCP settings our own connections have for their whole session.
        def prefix_with(guards: sql.Composable, head: str = "", gate: str = "") -> sql.Composed:
            # head: CTEs before w; gate: a further condition of the lease check (keyed appends
            # reserve only where they hold the key's claim: streams.store.idempotency).
            return sql.SQL(
                """
                WITH {head} w AS (
                    SELECT set_config('idle_in_transaction_session_timeout', %(lease_ms)s, true)
                           || set_config('statement_timeout', %(lease_ms)s, true) {guards}
                           AS bounded,
                           {writer_lock} AS held
                    FROM streams_writers
                    WHERE stream = %(stream)s AND instance = %(instance)s
                      AND generation = %(generation)s AND NOT retired {gate}
                    FOR KEY SHARE
                ), k AS (
                    SELECT {allocated} + 1 AS floor FROM w
                ), g AS (
                    SELECT k.floor,
                           CASE WHEN pg_try_advisory_xact_lock_shared({lock_class}, {lock_key})
                                THEN true
                                ELSE ({blocked} || k.floor)::boolean END AS locked
                    FROM k
                )
                """
            ).format(
                head=sql.SQL(head),
                gate=sql.SQL(gate),
                guards=guards,
                writer_lock=writer_lock_sql(sql.SQL("%(stream)s"), sql.SQL("%(instance)s")),
                allocated=max_allocated_sql(info),
                lock_class=sql.Literal(reservation_lock_class(info.id)),
                blocked=sql.Literal(_BLOCKED + " "),
                lock_key=reservation_lock_key_sql(sql.SQL("k.floor")),
            )

        prefix = prefix_with(sql.SQL(""))
        seq = sql.Literal(info.sequence_name)
        # Facts go to the stream's own partition, named: PostgreSQL checks privileges on the
        # table a statement names, so a role granted one stream's partition writes that stream
        # only (`streams.store.roles`, "streams and groups of one's own").
        facts = sql.Identifier(facts_partition(info.id))
        self._copy_facts = (
            sql.SQL("COPY {} ({}) FROM STDIN").format(facts, _FACT_COLUMNS).as_string(None)
        )
        # One fact in one autocommit statement: nothing can run between the reservation and the
        # commit, so the checks of `_check_floor` and `PositionTracker.reserved` (ID >= L, and
        # above the max allocated this process knew when it began) are made *in* the statement:
        # an ID failing them makes the text cast fail, and the statement, hence the
        # transaction, with it. A CASE with a data-dependent condition evaluates its ELSE only
        # for such a row.
        self._reserve_one = (
            sql.SQL(
                """{prefix}, r AS (SELECT nextval({seq}) AS id, g.floor FROM g)
            INSERT INTO {facts} ({columns})
            SELECT %(stream)s,
                   CASE WHEN r.id >= r.floor AND r.id > %(known)s THEN r.id
                        ELSE ({rewound} || r.id || ' ' || r.floor)::bigint END,
                   0, %(instance)s, %(ts)s, %(payload)s::jsonb
            FROM r
            RETURNING stream_id, (SELECT g.floor FROM g)
            """
            )
            .format(
                prefix=prefix,
                seq=seq,
                facts=facts,
                columns=_FACT_COLUMNS,
                rewound=sql.Literal(_REWOUND + " "),
            )
            .as_bytes(None)
        )
        many = sql.SQL(
            "{prefix} SELECT nextval({seq}), g.floor FROM g, generate_series(1, %(count)s)"
        )
        self._reserve_many = many.format(prefix=prefix, seq=seq).as_bytes(None)
        guards = sql.SQL(" || ").join(
            sql.SQL("set_config({}, {}, true)").format(sql.Literal(name), sql.Placeholder(name))
            for name in self._tcp_settings()
        )
        # For a fact in the caller's transaction, also that transaction's ID (`FactHandle.xid`):
        # free, since the lease check's row lock has given it one.
        self._reserve_fact = (
            sql.SQL(
                "{prefix} SELECT nextval({seq}), g.floor, txid_current() "
                "FROM g, generate_series(1, %(count)s)"
            )
            .format(prefix=prefix_with(sql.SQL("|| ") + guards), seq=seq)
            .as_bytes(None)
        )
        self._prepare_keyed(prefix_with, guards, seq, facts)

    def _prepare_keyed(
        self,
        prefix_with: Callable[..., sql.Composed],
        guards: sql.Composable,
        seq: sql.Literal,
        facts: sql.Identifier,
    ) -> None:
        """The statements of keyed appends (docs/design/claim.md): each claims its keys, then
        (gated on holding one) checks the lease, reserves and records the IDs in the claim's
        row, in one statement. The checks of ``_reserve_one`` (ID >= L, above what this process
        knew) are made in the statement, which fails otherwise; a batch's are made by the
        client before its COPY and COMMIT."""
        checked = sql.SQL(
            "CASE WHEN r.id >= r.floor AND r.id > %(known)s THEN r.id "
            "ELSE ({rewound} || r.id || ' ' || r.floor)::bigint END"
        ).format(rewound=sql.Literal(_REWOUND + " "))
        one = sql.SQL("{prefix}, r AS (SELECT nextval({seq}) AS id, g.floor FROM g)")
        # One fact: its row, and its ID recorded in the claim's row (from the inserted row).
        self._reserve_one_keyed = (
            sql.SQL(
                """{reserve},
                f AS (
                    INSERT INTO {facts} ({columns})
                    SELECT %(stream)s, {checked}, 0, %(instance)s, %(ts)s, %(payload)s::jsonb
                    FROM r RETURNING stream_id
                ), {record} {result}"""
            )
            .format(
                reserve=one.format(
                    prefix=prefix_with(sql.SQL(""), claim_ctes(many=False), GATE), seq=seq
                ),
                checked=checked,
                facts=facts,
                columns=_FACT_COLUMNS,
                record=sql.SQL(record_cte("ARRAY[f.stream_id]", "f")),
                result=sql.SQL(SINGLE_RESULT.format(extra="")),
            )
            .as_bytes(None)
        )
        # A fact in the caller's transaction: its ID recorded at once (its rows come later),
        # and that transaction's ID (`FactHandle.xid`).
        self._reserve_fact_keyed = (
            sql.SQL("{reserve}, {record} {result}")
            .format(
                reserve=one.format(
                    prefix=prefix_with(sql.SQL("|| ") + guards, claim_ctes(many=False), GATE),
                    seq=seq,
                ),
                record=sql.SQL(record_cte("ARRAY[{}]", "r")).format(checked),
                result=sql.SQL(SINGLE_RESULT.format(extra=", txid_current()")),
            )
            .as_bytes(None)
        )
        # A batch: one ID per key held; the IDs (ascending) go to the keys held in the order of
        # their positions (both ordered by value, not by evaluation: the client pairs them).
        # Back: keys held, their positions (NULL: all of them), the IDs, L, and whether the
        # claim's row was written.
        self._reserve_many_keyed = (
            sql.SQL(
                """{prefix}, r AS (
                    SELECT nextval({seq}) AS id, g.floor
                    FROM g, generate_series(1, (SELECT n.count FROM n))
                ), i AS (
                    SELECT array_agg(r.id ORDER BY r.id) AS ids, min(r.floor) AS floor FROM r
                ), {record}
                SELECT n.count, CASE WHEN n.count = %(count)s THEN NULL ELSE n.ords END,
                       i.ids, i.floor, (SELECT count(*) FROM x)
                FROM n, i"""
            )
            .format(
                prefix=prefix_with(sql.SQL(""), claim_ctes(many=True), GATE),
                seq=seq,
                record=sql.SQL(
                    record_cte(
                        "i.ids",
                        "i",
                        ords="CASE WHEN n.count = %(count)s THEN NULL ELSE n.ords END",
                        where="WHERE i.ids IS NOT NULL",
                    )
                ),
            )
            .as_bytes(None)
        )

    def _tcp_settings(self) -> dict[str, str]:
        """Server-side settings that find a client that is gone or cut off within about the
        lease: TCP keepalives (idle lease/2, then 4 probes lease/8 apart) and a limit on
        unacknowledged data. They do not find a frozen process (its kernel still answers):
        ending an expired writer's sessions does (docs/design/liveness.md)."""
        lease = self.lease_seconds
        return {
            "tcp_keepalives_idle": str(max(1, int(lease / 2))),
            "tcp_keepalives_interval": str(max(1, int(lease / 8))),
            "tcp_keepalives_count": "4",
            "tcp_user_timeout": str(int(lease * 1000)),
        }

    def _where(self) -> str:
        return f"writer {self.instance!r} of {self.stream_name!r}"

    def opening(self, *, first: bool = False) -> Gen[None]:
        """What a new session of the writer runs first: `configure_session`; on the writer's
        first, `register` too. Run afresh when the session is lost under it
        (`streams.store.sessions`, "Opening checks"): registering again takes the name over
        again, which only fences this writer's own lost session."""
        yield from self.configure_session()
        if first:
            yield from self.register()

    def configure_session(self) -> Gen[None]:
        """The writer's own connections (appends, heartbeats), first checked to be on the
        database history the writer started on (`guard`: `streams.store.identity`), then
        the TCP settings of `_tcp_settings` for the whole session, and, where the server has it
        (PostgreSQL 14+), a check every second that the client is still connected while a
        statement runs."""
        yield from verify(
            self.guard,
            self._where(),
            self.sighting,
            "facts acknowledged to this writer",
        )
        moved = yield from fence_timeline()
        if moved:
            log.warning(
                "a new timeline (a failover): moved %d stream sequences %d IDs forward, past IDs "
                "the old primary may have handed out",
                moved, FAILOVER_SKIP,
            )  # fmt: skip
        settings = self._tcp_settings()
        yield Query(
            sql.SQL(
                "SELECT {settings}, CASE WHEN current_setting('server_version_num')::int >= 140000"
                " THEN set_config('client_connection_check_interval', '1000', false) END"
            ).format(
                settings=sql.SQL(", ").join(
                    sql.SQL("set_config({}, {}, false)").format(
                        sql.Literal(name), sql.Placeholder(name)
                    )
                    for name in settings
                )
            ),
            settings,
        )
        yield Commit()

    def _check_floor(self, rows: Sequence[Row]) -> list[int]:
        """The reserved IDs, each checked to be >= the reservation lock's L (see above)."""
        ids = sorted(int(row[0]) for row in rows)
        floor = int(rows[0][1])
        if ids[0] < floor:
            raise SequenceRewound(
                f"stream {self.stream_name!r}: ID {ids[0]} below the reservation floor {floor}: "
                "the sequence was set back during the reservation; nothing was written"
            )
        return ids

    def _report_failover(self) -> None:
        """A failover lost facts acknowledged to this writer (found by whichever of its
        sessions reached the new primary first: `streams.store.identity.verify`): raise
        `FailoverLoss` from this call, once; the writer goes on after it."""
        loss = self.sighting.take_loss()
        if loss is not None:
            raise loss

    def _lease_params(self) -> dict[str, Any]:
        return {
            "lease_ms": str(int(self.lease_seconds * 1000)),
            "stream": self.info.id,
            "instance": self.instance,
            "generation": self.generation,
        }

    def _check_usable(self) -> None:
        if self.fenced:
            # A failover that lost acknowledged facts may also have fenced the writer (its
            # lease renewals lost, its name retired or taken over on the new primary): the
            # loss is named first, or no one would ever be told of it.
            self._report_failover()
            raise WriterFenced(
                f"writer {self.instance!r} on stream {self.stream_name!r} was retired "
                "(lease expired or name taken over); create a new writer"
            )

    # ------------------------------------------------------------------ appends

    def append(
        self,
        payloads: Sequence[Any],
        timestamps: Sequence[int | None],
        keys: Sequence[str] | None = None,
    ) -> Gen[Ack]:
        """Append facts (one row each) in one transaction; with ``keys`` (one per payload), an
        idempotent append (`streams.store.idempotency`)."""
        if not payloads:
            raise UsageError("append_batch needs at least one payload")
        self._check_usable()
        self._report_failover()
        if keys is not None:
            return (yield from self._append_keyed(payloads, timestamps, keys))
        info, tracker = self.info, self.tracker
        limit = self.max_payload_bytes
        # A batch encodes its payloads while COPY streams them (the server stores the first
        # rows while the client encodes the next: ~15% of a 1000-fact batch at 1 writer); a
        # bad payload then aborts the COPY, and its transaction with it: nothing is written,
        # and the reserved IDs complete as gaps. A single fact is encoded before anything is
        # reserved.
        single = encode_payload(payloads[0], limit) if len(payloads) == 1 else None
        stamps = resolve_timestamps(
            timestamps,
            mode=info.timestamping,
            uncapped=info.uncapped,
            arrival_ms=self.clock.now_ms(),
            floor=self._ts_floor,
        )
        token = tracker.begin_reservation()
        ids: list[int] = []
        try:
            params = self._lease_params()
            if single is not None:
                assert self._reserve_one is not None
                params["ts"] = stamps[0]
                params["payload"] = single
                params["known"] = token.floor
                try:
                    # The whole append: one statement, its own transaction (see the module doc).
                    rows = yield Autocommit(self._reserve_one, params)
                except StoreError as exc:
                    yield from self._refused(exc)
                    raise
                if not rows:
                    self.fenced = True
                    self._check_usable()
                ids = [int(rows[0][0])]  # committed: it completes, whatever happens next
                tracker.reserved(token, ids)
            else:
                assert self._reserve_many is not None
                params["count"] = len(payloads)
                # BEGIN and the reservation in one round trip.
                try:
                    (reserved,) = yield Pipeline([Query(self._reserve_many, params)])
                except StoreError as exc:
                    yield from self._refused(exc)
                    raise
                if not reserved:
                    self.fenced = True
                    self._check_usable()
                ids = self._check_floor(reserved)
                tracker.reserved(token, ids)
                yield CopyIn(
                    self._copy_facts,
                    (
                        (info.id, stream_id, 0, self.instance, stamp, encode_payload(p, limit))
                        for stream_id, stamp, p in zip(ids, stamps, payloads, strict=True)
                    ),
                )
                yield Commit()
        finally:
            self._complete(token, ids)
        self._ts_floor = max(self._ts_floor, stamps[-1])
        self.appended += len(ids)
        return Ack(ids[0], ids[-1], stamps[0], stamps[-1], len(ids), tuple(ids))

    def append_facts(
        self, chunks: Iterable[FactChunk], *, first: Gen[bool] | None = None
    ) -> Gen[Ack | None]:
        """Append facts of one or more rows each, chunk by chunk, in one transaction.

        Each chunk is reserved and copied as a batch is (``BEGIN``... the reservation, then
        ``COPY``), one after the other in the same transaction, which commits once at the end:
        every fact or none. ``chunks`` may be lazy (facts arrive while earlier ones are copied);
        its payloads are JSON text already (`encode_payload`, or text that PostgreSQL checks as
        it stores it: bad JSON fails the COPY, and the transaction with it). ``first`` runs
        first, in the same transaction: if it returns False, nothing is reserved or written
        (the Spark sink's `streams.store.sinks.claim_task`).

        Each statement is bounded by the lease, as an append's is, and so must the transaction
        as a whole be, from its first reservation to its commit: readers end a session that
        holds a reservation longer (docs/design/liveness.md, "holding"; the
        writer's heartbeats renew its lease meanwhile, which only keeps it from being
        retired). Returns None when nothing was written (``first`` said no, or no facts).
        """
        self._check_usable()
        self._report_failover()
        info, tracker = self.info, self.tracker
        reservations: list[tuple[ReservationToken, list[int]]] = []
        ids: list[int] = []
        stamps: list[int] = []
        try:
            if first is not None and not (yield from first):
                yield Commit()
                return None
            floor = self._ts_floor
            for chunk in chunks:
                if not chunk.count:
                    continue
                chunk_stamps = resolve_timestamps(
                    chunk.timestamps,
                    mode=info.timestamping,
                    uncapped=info.uncapped,
                    arrival_ms=self.clock.now_ms(),
                    floor=floor,
                )
                token = tracker.begin_reservation()
                reservations.append((token, []))
                params = self._lease_params()
                params["count"] = chunk.count
                try:
                    reserved = yield Query(self._reserve_many_bytes(), params)
                except StoreError as exc:
                    yield from self._refused(exc)
                    raise
                if not reserved:
                    self.fenced = True
                    self._check_usable()
                chunk_ids = self._check_floor(reserved)
                tracker.reserved(token, chunk_ids)
                reservations[-1] = (token, chunk_ids)
                ids.extend(chunk_ids)
                stamps.extend(chunk_stamps)
                floor = chunk_stamps[-1]
                yield CopyIn(
                    self._copy_facts,
                    self._copy_rows(chunk, chunk_ids, chunk_stamps),
                )
            yield Commit()
        finally:
            for token, chunk_ids in reservations:
                self._complete(token, chunk_ids)
        if not ids:
            return None
        self._ts_floor = max(self._ts_floor, stamps[-1])
        self.appended += len(ids)
        return Ack(ids[0], ids[-1], stamps[0], stamps[-1], len(ids), tuple(ids))

    def _copy_rows(
        self, chunk: FactChunk, ids: Sequence[int], stamps: Sequence[int]
    ) -> Iterable[Row]:
        """A chunk's rows for COPY, built by `zip` and `itertools` without a Python step per
        row (a generator expression per row cost ~2 us of ~10 us a row)."""
        key, instance = self.info.id, self.instance
        if chunk.sizes is None:
            return zip(repeat(key), ids, repeat(0), repeat(instance), stamps, chunk.rows)
        sizes = chunk.sizes
        return zip(
            repeat(key),
            chain.from_iterable(repeat(i, n) for i, n in zip(ids, sizes, strict=True)),
            chain.from_iterable(range(n) for n in sizes),
            repeat(instance),
            chain.from_iterable(repeat(t, n) for t, n in zip(stamps, sizes, strict=True)),
            chunk.rows,
        )

    def _reserve_many_bytes(self) -> bytes:
        assert self._reserve_many is not None
        return self._reserve_many

    def _refused(self, exc: StoreError) -> Gen[None]:
        """`_raise_refusal`, and for a reservation blocked by an exclusive lock, who holds it
        (read after the failed transaction, where the connection still serves), in the
        `ReservationBlocked` raised."""
        if exc.sqlstate == INVALID_TEXT and _BLOCKED in str(exc):
            self.blocked = True
            try:
                holders = yield from exclusive_holders(self.info)
            except StoreError:  # a caller's transaction (`fact(conn=...)`) failed with it, or
                holders = []  # a pipeline's failure closed the connection

            who = "; ".join(h.who() for h in holders) or "a session not named here"
            raise ReservationBlocked(
                f"stream {self.stream_name!r}: another session holds its reservation lock "
                f"exclusively ({who}); no writer of this library ever does, and nothing can "
                "be reserved behind it: nothing was written. This writer's next heartbeat "
                "ends that session if this role may (a member of its role or of "
                "pg_signal_backend); `streams doctor` names it and `streams doctor --repair` "
                "ends it"
            ) from None
        self._raise_refusal(exc)

    def _raise_refusal(self, exc: StoreError) -> None:
        """Raise what a reservation statement's own refusal means (the text casts by which it
        fails its transaction, a stored ID); return for any other error."""
        if exc.sqlstate == INVALID_TEXT and _REWOUND in str(exc):
            raise SequenceRewound(
                f"stream {self.stream_name!r}: the sequence was set back during the "
                "reservation; nothing was written. Open a new writer (it repairs the "
                "sequence) or run `streams doctor --repair`"
            ) from None
        if exc.sqlstate == INVALID_TEXT and FENCED in str(exc):
            self.fenced = True
            self._check_usable()
        if exc.sqlstate == UNIQUE_VIOLATION and "streams_idempotency" not in str(exc):
            raise SequenceRewound(
                f"stream {self.stream_name!r}: the sequence handed out an ID that "
                "is stored already: it was set back; nothing was written. Open a "
                "new writer (it repairs the sequence) or run `streams doctor --repair`"
            ) from None

    def _append_keyed(
        self, payloads: Sequence[Any], timestamps: Sequence[int | None], keys: Sequence[str]
    ) -> Gen[Ack]:
        """An idempotent append: one statement claims the keys and, for the keys it holds,
        reserves IDs and records them (docs/design/claim.md);
        duplicates come back with the original facts."""
        found_keys = check_keys(keys, len(payloads))
        info, tracker, limit = self.info, self.tracker, self.max_payload_bytes
        single = encode_payload(payloads[0], limit) if len(payloads) == 1 else None
        stamps = resolve_timestamps(
            timestamps,
            mode=info.timestamping,
            uncapped=info.uncapped,
            arrival_ms=self.clock.now_ms(),
            floor=self._ts_floor,
        )
        token = tracker.begin_reservation()
        ids: list[int] = []
        params = {**self._lease_params(), "known": token.floor}
        try:
            if single is not None:
                params.update(key=found_keys[0], ts=stamps[0], payload=single)
                for _ in range(ATTEMPTS):
                    params["claim"] = secrets.randbits(63)
                    try:
                        # The whole append when the key is new: one statement in autocommit.
                        rows = yield Autocommit(self._reserve_one_keyed, params)
                    except StoreError as exc:
                        yield from self._refused(exc)
                        raise
                    stream_id = held(rows)
                    if stream_id is not None:
                        ids = [stream_id]  # committed: it completes, whatever happens next
                        tracker.reserved(token, ids)
                        ack = Ack(stream_id, stream_id, stamps[0], stamps[0], 1, (stream_id,))
                        break
                    # A duplicate: its original, read by a statement that sees it.
                    (original,) = yield from read_originals(
                        info.id, found_keys, own_transaction=True
                    )
                    if original is not None:
                        return Ack.of([original[0]], [original[1]], [0])
                    # Pruned between the two statements (it expired): claim it again.
                else:
                    raise StoreError(
                        f"idempotency key {found_keys[0][:40]!r}: its original was pruned "
                        f"{ATTEMPTS} times between claim and read: report this"
                    )
            else:
                ack = yield from self._append_keyed_batch(
                    payloads, stamps, found_keys, token, params, ids
                )
        finally:
            self._complete(token, ids)
        if ids:
            written = [stamp for n, stamp in enumerate(stamps) if n not in ack.duplicates]
            self._ts_floor = max(self._ts_floor, *written)
            self.appended += len(ids)
        return ack

    def _append_keyed_batch(
        self,
        payloads: Sequence[Any],
        stamps: Sequence[int],
        keys: Sequence[str],
        token: ReservationToken,
        params: dict[str, Any],
        ids: list[int],
    ) -> Gen[Ack]:
        """A keyed batch: ``BEGIN`` and the claiming statement in one round trip, the originals
        of its duplicates if any, ``COPY`` of the rows of the keys it holds, ``COMMIT``. The
        IDs it reserves go into ``ids`` as soon as they are known: the caller completes them
        whatever happens next (as gaps if the transaction rolls back)."""
        info, limit = self.info, self.max_payload_bytes
        params.update(keys=keys, stamps=stamps, count=len(payloads), claim=secrets.randbits(63))
        # A generic plan is as good as a custom one here: the statement looks nothing up (the
        # claim finds conflicts through the primary key itself), so it may be prepared.
        try:
            ((row,),) = yield Pipeline([Query(self._reserve_many_keyed, params)])
        except StoreError as exc:
            yield from self._refused(exc)
            raise
        count, ords, reserved, floor, recorded = row
        if count and (reserved is None or recorded != 1):
            if reserved is None:  # held keys, reserved nothing: fenced (rolled back)
                self.fenced = True
                self._check_usable()
            raise StoreError("an idempotency claim recorded no fact: report this")
        if count:
            ids += self._check_floor([(stream_id, floor) for stream_id in reserved])
            self.tracker.reserved(token, ids)
        if count == len(payloads):  # every key held (``ords`` is NULL): no duplicate
            yield CopyIn(
                self._copy_facts,
                zip(
                    repeat(info.id),
                    ids,
                    repeat(0),
                    repeat(self.instance),
                    stamps,
                    (encode_payload(p, limit) for p in payloads),
                ),
            )
            yield Commit()
            return Ack(ids[0], ids[-1], stamps[0], stamps[-1], len(ids), tuple(ids))
        fact_ids: list[int | None] = [None] * len(payloads)
        fact_stamps = list(stamps)
        for pos, stream_id in zip(ords or (), ids, strict=True):
            fact_ids[pos - 1] = stream_id
        duplicates = [n for n, stream_id in enumerate(fact_ids) if stream_id is None]
        if duplicates:
            originals = yield from read_originals(
                info.id, [keys[n] for n in duplicates], own_transaction=False
            )
            for n, original in zip(duplicates, originals, strict=True):
                assert original is not None  # read_originals raises otherwise
                fact_ids[n], fact_stamps[n] = original
        if count:
            yield CopyIn(
                self._copy_facts,
                (
                    (info.id, stream_id, 0, self.instance, stamps[n - 1], encode_payload(p, limit))
                    for n, stream_id in zip(ords, ids, strict=True)
                    for p in (payloads[n - 1],)
                ),
            )
        yield Commit()
        final = [stream_id for stream_id in fact_ids if stream_id is not None]
        return Ack.of(final, fact_stamps, duplicates)

    def _complete(self, token: ReservationToken, ids: Sequence[int]) -> None:
        if ids:
            self.tracker.complete(ids)
        else:
            self.tracker.abandon(token)

    # ------------------------------------------------------------ facts in the caller's transaction

    def begin_fact(
        self, timestamp: int | None, key: str | None = None
    ) -> tuple[ReservationToken, int]:
        """Pure first half of `reserve_fact`: validate, resolve the timestamp, go in flight."""
        self._check_usable()
        self._report_failover()
        validate_client_timestamp(timestamp)
        if key is not None:
            check_keys([key], 1)
        (stamp,) = resolve_timestamps(
            [timestamp],
            mode=self.info.timestamping,
            uncapped=self.info.uncapped,
            arrival_ms=self.clock.now_ms(),
            floor=self._ts_floor,
        )
        return self.tracker.begin_reservation(), stamp

    def reserve_fact(
        self, token: ReservationToken, stamp: int, key: str | None = None, *, fence: bool = False
    ) -> Gen[FactHandle]:
        """Reserve one ID inside the caller's transaction (open, or begun by this statement).

        With ``key``: claim it first, then reserve and record the ID only if this transaction
        holds the claim (two statements: docs/design/claim.md);
        otherwise the handle is a duplicate carrying the original fact's ID and timestamp.

        ``fence``: the caller's session is new to this writer, and may be the first on a new
        timeline (a failover), before any session of the writer's own: fence the timeline
        first (`streams.store.failover.fence_timeline`), in the caller's transaction, so no ID
        the old timeline may have handed out is handed out again here. Its ``setval`` took
        effect before the reservation's statement began, which therefore draws past it.
        """
        assert self._reserve_fact is not None
        if fence:
            yield from self._fence_callers_session()
        params = {**self._lease_params(), **self._tcp_settings(), "count": 1}
        if key is None:
            try:
                rows = yield Query(self._reserve_fact, params)
            except StoreError as exc:
                yield from self._refused(exc)
                raise
            if not rows:
                self.fenced = True
                self._check_usable()
            (stream_id,) = self._check_floor(rows)
            self.tracker.reserved(token, [stream_id])
            return FactHandle(stream_id=stream_id, timestamp=stamp, xid=int(rows[0][2]))
        params.update(key=key, claim=secrets.randbits(63), ts=stamp, known=token.floor)
        try:
            rows = yield Query(self._reserve_fact_keyed, params)
        except StoreError as exc:
            yield from self._refused(exc)
            raise
        fact_id = held(rows)
        if fact_id is None:
            # In the claim's transaction, which locks the key's row: it is there (or raises).
            (original,) = yield from read_originals(self.info.id, [key], own_transaction=False)
            assert original is not None
            return FactHandle(original[0], original[1], duplicate=True)
        self.tracker.reserved(token, [fact_id])
        return FactHandle(fact_id, stamp, xid=int(rows[0][3]))

    def _fence_callers_session(self) -> Gen[None]:
        """On a caller's session new to this writer (`reserve_fact`'s ``fence``), in its
        transaction: fence the timeline, and on a timeline the writer's own sessions have not
        verified yet (a failover), check what the writer saw acknowledged first, so a loss is
        named (`FailoverLoss`, failing the caller's transaction) before anything is
        acknowledged there. The writer's own next session checks again: its timeline is left
        as it was."""
        moved = yield from fence_timeline(commit=False)
        if moved:
            log.warning(
                "a new timeline (a failover), first seen on a caller's session: moved %d "
                "stream sequences %d IDs forward", moved, FAILOVER_SKIP,
            )  # fmt: skip
        rows = yield Query(f"SELECT {TIMELINE_SQL}")
        seen = self.sighting.timeline
        if seen is not None and int(rows[0][0]) != seen:
            try:
                yield from check_sighting(
                    self.sighting, self._where(), "facts acknowledged to this writer", joined=True
                )
            except FailoverLoss:
                self._report_failover()
                raise

    def add_rows(self, handle: FactHandle, payloads: Sequence[Any]) -> Gen[None]:
        """Add rows of the fact to the built-in facts table (same transaction)."""
        encoded = [encode_payload(p, self.max_payload_bytes) for p in payloads]
        if not encoded:
            return
        first = handle.rows
        handle.rows += len(encoded)
        yield CopyIn(
            self._copy_facts,
            [
                (self.info.id, handle.stream_id, first + n, self.instance, handle.timestamp, text)
                for n, text in enumerate(encoded)
            ],
        )

    def finish_fact(self, token: ReservationToken, handle: FactHandle | None, ok: bool) -> None:
        """The caller's transaction ended (committed if `ok`), or can only roll back: complete
        the ID either way (a duplicate reserved none)."""
        written = handle is not None and not handle.duplicate
        self._complete(token, [handle.stream_id] if handle is not None and written else [])
        if ok and handle is not None and written:
            self._ts_floor = max(self._ts_floor, handle.timestamp)
            self.appended += 1

    # ------------------------------------------------------------ facts in transactions joined

    def join_fact(self, handle: FactHandle) -> None:
        """A fact written in a transaction of the caller's that this writer joined (and does
        not end): its ID stays pending until `resolve_joined` finds that transaction ended."""
        with self._joined_lock:
            self._joined.setdefault(handle.xid, []).append((handle.stream_id, handle.timestamp))

    @property
    def joined_pending(self) -> bool:
        return bool(self._joined)

    def resolve_joined(self) -> Gen[list[tuple[int, int]]]:
        """Complete the IDs of joined transactions that have ended, committed or not (by
        ``txid_status``: the server's commit log, which keeps each outcome; NULL only for a
        transaction so old that it ended long ago); returns ``(ID, timestamp)`` of the facts
        that committed. A writer's per-writer position thus never passes an ID whose
        transaction is still open, though nobody tells it when a joined transaction ends."""
        with self._joined_lock:
            xids = list(self._joined)
        if not xids:
            return []
        rows = yield Query("SELECT x, txid_status(x) FROM unnest(%s::bigint[]) AS x", (xids,))
        yield Commit()
        committed: list[tuple[int, int]] = []
        for xid, status in rows:
            if status == "in progress":
                continue
            with self._joined_lock:
                facts = self._joined.pop(int(xid), [])
            self.tracker.complete([stream_id for stream_id, _ in facts])
            if status == "committed" and facts:
                committed += facts
                self.appended += len(facts)
                self._ts_floor = max(self._ts_floor, *(ts for _, ts in facts))
        return committed

    # ------------------------------------------------------------------ heartbeats

    def heartbeat(self) -> Gen[HeartbeatResult]:
        """Renew the lease, persist the position (forward-only), read max allocated and time.

        Reading max allocated lets an idle writer's announceable position climb to it (see
        `PositionTracker`); the next heartbeat persists that, so an idle writer never pins
        the linear position.
        """
        tracker = self.tracker
        position = tracker.local_position
        sent = time.time()
        # One statement in autocommit (one round trip). Asynchronous commit, set for this
        # statement's own transaction: a heartbeat lost in a crash only leaves a lower position
        # or an earlier lease expiry behind, both safe; waiting for fsync here is not needed.
        rows = yield Autocommit(
            sql.SQL(
                """
                WITH c AS (SELECT set_config('synchronous_commit', 'off', true) AS v)
                UPDATE streams_writers
                SET position = GREATEST(position, %(position)s), pending = %(pending)s,
                    lease_expires_at = clock_timestamp() + make_interval(secs => %(lease)s),
                    heartbeat_at = clock_timestamp()
                FROM c
                WHERE stream = %(stream)s AND instance = %(instance)s
                  AND generation = %(generation)s AND NOT retired AND c.v IS NOT NULL
                RETURNING position, {max_allocated}, {now}, {timeline}, {flushed}
                """
            ).format(
                max_allocated=max_allocated_sql(self.info),
                now=sql.SQL(_NOW_MS),
                timeline=sql.SQL(TIMELINE_SQL),
                flushed=sql.SQL(FLUSHED_LSN_SQL),
            ),
            {
                "position": position,
                "pending": tracker.take_peak_pending(),
                "lease": self.lease_seconds,
                "stream": self.info.id,
                "instance": self.instance,
                "generation": self.generation,
            },
        )
        if not rows:
            self.fenced = True
            return HeartbeatResult(False, self._persisted, tracker.max_allocated)
        persisted, max_allocated, db_ms, timeline = (int(v) for v in rows[0][:4])
        self.clock.sample(db_ms, sent, time.time())
        if rows[0][4] is not None:  # what a rewind would take back (`Guard`, "A rewind")
            self.guard.observed(timeline, int(rows[0][4]))
        self._persisted = max(self._persisted, persisted)
        tracker.note_allocated(max_allocated)
        return HeartbeatResult(True, self._persisted, max_allocated)

    def beat(self) -> Gen[HeartbeatResult]:
        """One scheduled heartbeat; every `RETIRE_EVERY`-th also retires expired peers, so a
        dead writer stops pinning the linear position even when nobody reads positions."""
        result = yield from self.heartbeat()
        self._beats += 1
        if result.alive and self._beats % RETIRE_EVERY == 0:
            yield from retire_expired_writers(self.info)
        if result.alive and self.blocked:
            # An append found the reservation lock held exclusively: end that session.
            self.blocked = False
            yield from end_exclusive_holders(self.info)
        return result

    def retire(self) -> Gen[None]:
        """Graceful close: persist the position, then retire (treated as caught up)."""
        if self._tracker is None or self.fenced:
            return
        if self.tracker.pending_count or self.tracker.in_flight_count:
            # Facts are still being written through this writer: leave the row to its lease.
            yield from self.heartbeat()
            return
        yield Query(
            """
            UPDATE streams_writers
            SET position = GREATEST(position, %s), retired = true, generation = generation + 1,
                pending = 0
            WHERE stream = %s AND instance = %s AND generation = %s AND NOT retired
            """,
            (self.tracker.local_position, self.info.id, self.instance, self.generation),
        )
        yield Commit()
        self.fenced = True
