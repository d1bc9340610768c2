"""What a writer does, written once as generators (run by `streams.store.driver.run` / `arun`).

`WriterCore` is one writer instance on one stream, the one face the shells (`streams.writer`,
`streams.heartbeat`, `streams.fact_blocks`) drive: registration, session configuration and
appends here; keyed appends in `streams.store.keyed_appends`, facts in a caller's transaction
in `streams.store.joined_facts`, heartbeats in `streams.store.writer_beats`, the statements in
`streams.store.writer_sql`, the state and the steps they share in `streams.store.writer_state`.
The life of an append: docs/design/durability.md; fencing: docs/design/fencing.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import chain, repeat
from typing import Any

from psycopg import sql

from ..core.constants import facts_partition
from ..core.payloads import encode_payload
from ..core.positions import PositionTracker, ReservationToken
from ..errors import UsageError
from ..types import Ack, FactChunk, StreamInfo
from .driver import Autocommit, Commit, CopyIn, Gen, Pipeline, Query, Row
from .failover import FAILOVER_SKIP, fence_stream
from .idempotency import check_keys
from .identity import verify
from .joined_facts import (
    FactHandle,
    add_rows,
    begin_fact,
    finish_fact,
    join_fact,
    reserve_fact,
    resolve_joined,
)
from .keyed_appends import write_keyed
from .leases import end_expired_sessions, max_allocated_sql, registration_lock, repair_sequence
from .registry import load_stream
from .writer_beats import HeartbeatResult, beat, heartbeat, retire
from .writer_sql import NOW_MS, prepare_statements, set_configs
from .writer_state import DatabaseClock, Reservation, WriterState

log = logging.getLogger("streams.writer")

__all__ = [
    "DatabaseClock",
    "FactHandle",
    "HeartbeatResult",
    "WriterCore",
    "encode_payload",
]


class WriterCore(WriterState):
    """One writer instance on one stream: the shared logic of `Writer` and `AsyncWriter`."""

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
        yield from self._fence(info, commit=False)
        # A previous process of this name that froze in a transaction would make step 2 wait
        # for ever: once its lease has expired, its sessions are ended first.
        yield from end_expired_sessions(info, self.instance)
        sent = time.time()
        rows = yield Query(f"SELECT {NOW_MS}")
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
        self._statements = prepare_statements(info, self._tcp_settings())

    def _fence(self, info: StreamInfo, *, commit: bool) -> Gen[None]:
        """Before anything is reserved on a session: on a new timeline (a failover), move the
        stream's sequence past the IDs the old primary may have handed out (once per stream
        and timeline: `streams.store.failover.fence_stream`)."""
        moved = yield from fence_stream(info.id, commit=commit)
        if moved:
            log.warning(
                "a new timeline (a failover): moved stream %r's sequence %d IDs forward (to "
                "%d), past IDs the old primary may have handed out",
                info.name, FAILOVER_SKIP, moved,
            )  # fmt: skip

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
        the TCP settings of `streams.store.writer_sql.tcp_settings` for the whole session,
        and, where the server has it (PostgreSQL 14+), a check every second that the client
        is still connected while a statement runs."""
        yield from verify(
            self.guard,
            self._where(),
            self.sighting,
            "facts acknowledged to this writer",
        )
        if self._info is not None:  # the first session fences in `register`
            yield from self._fence(self._info, commit=True)
        settings = self._tcp_settings()
        yield Query(
            sql.SQL(
                "SELECT {settings}, CASE WHEN current_setting('server_version_num')::int >= 140000"
                " THEN set_config('client_connection_check_interval', '1000', false) END"
            ).format(settings=sql.SQL(", ").join(set_configs(settings, local=False))),
            settings,
        )
        yield Commit()

    # ------------------------------------------------------------------ appends

    def append(
        self,
        payloads: Sequence[Any],
        timestamps: Sequence[int | None],
        keys: Sequence[str] | None = None,
    ) -> Gen[Ack]:
        """Append facts (one row each) in one transaction; with ``keys`` (one per payload), an
        idempotent append (`streams.store.keyed_appends`)."""
        if not payloads:
            raise UsageError("append_batch needs at least one payload")
        self._ready()
        if keys is None:
            write = partial(self._write, payloads)
        else:
            write = partial(write_keyed, self, payloads, check_keys(keys, len(payloads)))
        return (yield from self._reserving(payloads, timestamps, write))

    def _write(self, payloads: Sequence[Any], reservation: Reservation) -> Gen[Ack]:
        """One fact in one autocommit statement, or a batch: ``BEGIN`` and the reservation in
        one round trip, then ``COPY`` and ``COMMIT``."""
        statements, stamps = self.statements, reservation.stamps
        if reservation.single is not None:
            params = self._lease_params(
                ts=stamps[0], payload=reservation.single, known=reservation.token.floor
            )
            # The whole append: one statement, its own transaction (`writer_sql`, reserve_one).
            rows = yield from self._reserve(Autocommit(statements.reserve_one, params))
            if not rows:
                self._lost()
            # Committed: it completes, whatever happens next.
            self._took(reservation, [int(rows[0][0])])
        else:
            params = self._lease_params(count=len(payloads))
            (reserved,) = yield from self._reserve(
                Pipeline([Query(statements.reserve_many, params)])
            )
            if not reserved:
                self._lost()
            self._took(reservation, self._check_floor(reserved))
            info, limit = self.info, self.max_payload_bytes
            yield CopyIn(
                statements.copy_facts,
                (
                    (info.id, stream_id, 0, self.instance, stamp, encode_payload(p, limit))
                    for stream_id, stamp, p in zip(reservation.ids, stamps, payloads, strict=True)
                ),
            )
            yield Commit()
        ids = reservation.ids
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
        self._ready()
        tracker = self.tracker
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
                chunk_stamps = self._stamps(chunk.timestamps, floor)
                token = tracker.begin_reservation()
                reservations.append((token, []))
                params = self._lease_params(count=chunk.count)
                reserved = yield from self._reserve(Query(self.statements.reserve_many, params))
                if not reserved:
                    self._lost()
                chunk_ids = self._check_floor(reserved)
                tracker.reserved(token, chunk_ids)
                reservations[-1] = (token, chunk_ids)
                ids.extend(chunk_ids)
                stamps.extend(chunk_stamps)
                floor = chunk_stamps[-1]
                yield CopyIn(
                    self.statements.copy_facts, self._copy_rows(chunk, chunk_ids, chunk_stamps)
                )
            yield Commit()
        finally:
            for token, chunk_ids in reservations:
                self._complete(token, chunk_ids)
        if not ids:
            return None
        self._wrote(len(ids), stamps[-1])
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

    # ------------------------------------------------------------ facts in the caller's transaction
    # (`streams.store.joined_facts`)

    def begin_fact(
        self, timestamp: int | None, key: str | None = None
    ) -> tuple[ReservationToken, int]:
        return begin_fact(self, timestamp, key)

    def reserve_fact(
        self, token: ReservationToken, stamp: int, key: str | None = None, *, fence: bool = False
    ) -> Gen[FactHandle]:
        return reserve_fact(self, token, stamp, key, fence=fence)

    def add_rows(self, handle: FactHandle, payloads: Sequence[Any]) -> Gen[None]:
        return add_rows(self, handle, payloads)

    def finish_fact(self, token: ReservationToken, handle: FactHandle | None, ok: bool) -> None:
        finish_fact(self, token, handle, ok)

    def join_fact(self, handle: FactHandle) -> None:
        join_fact(self, handle)

    @property
    def joined_pending(self) -> bool:
        return bool(self._joined)

    def resolve_joined(self) -> Gen[list[tuple[int, int]]]:
        return resolve_joined(self)

    # ------------------------------------------------------------------ heartbeats
    # (`streams.store.writer_beats`)

    def heartbeat(self) -> Gen[HeartbeatResult]:
        return heartbeat(self)

    def beat(self) -> Gen[HeartbeatResult]:
        return beat(self)

    def retire(self) -> Gen[None]:
        return retire(self)
