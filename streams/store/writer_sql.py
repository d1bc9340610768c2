"""The statements a writer reserves and writes with, prepared once per registration.

Every reserving statement opens with the lease check and the reservation lock on its floor
(docs/design/fencing.md, docs/design/probe.md); the keyed ones claim their keys first
(docs/design/claim.md). The markers of the text casts by which a statement refuses are here
too; what a refusal means is `streams.store.writer_state.WriterState._refused`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from psycopg import sql

from ..core.constants import facts_partition, reservation_lock_class
from ..core.fact_columns import STORED_NAMES
from ..types import StreamInfo
from .idempotency import GATE, SINGLE_RESULT, claim_ctes, record_cte
from .leases import max_allocated_sql, reservation_lock_key_sql, writer_lock_sql

#: SQLSTATE of a unique violation: a reserved ID that is already stored.
UNIQUE_VIOLATION = "23505"

#: SQLSTATE of a failed text-to-number cast: how the one-statement append refuses an ID below
#: its floor (the message carries `REWOUND`).
INVALID_TEXT = "22P02"
#: The facts' columns, in the order a written row lists them (COPY, INSERT).
FACT_COLUMNS = sql.SQL(", ".join(STORED_NAMES))
REWOUND = "streams-sequence-rewound"
#: The text cast by which a reservation fails at once when another session holds the stream's
#: reservation lock at its floor exclusively (no library session ever does: they share it), so
#: a writer never waits behind it (`ReservationBlocked`).
BLOCKED = "streams-reservation-blocked"

NOW_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


def tcp_settings(lease_seconds: float) -> dict[str, str]:
    """Server-side settings that find a client that is gone or cut off within about the
    lease: TCP keepalives (idle lease/2, then 4 probes lease/8 apart) and a limit on
    unacknowledged data. They do not find a frozen process (its kernel still answers):
    ending an expired writer's sessions does (docs/design/liveness.md)."""
    lease = lease_seconds
    return {
        "tcp_keepalives_idle": str(max(1, int(lease / 2))),
        "tcp_keepalives_interval": str(max(1, int(lease / 8))),
        "tcp_keepalives_count": "4",
        "tcp_user_timeout": str(int(lease * 1000)),
    }


def set_configs(names: Iterable[str], *, local: bool) -> list[sql.Composed]:
    """``set_config(name, %(name)s, local)`` for each setting."""
    flag = sql.SQL("true" if local else "false")
    return [
        sql.SQL("set_config({}, {}, {})").format(sql.Literal(name), sql.Placeholder(name), flag)
        for name in names
    ]


@dataclass(frozen=True, slots=True)
class WriterStatements:
    """The statements of one writer on one stream, rendered once to bytes: psycopg then caches
    their conversion, where a `sql.Composed` would be re-rendered on every append (about 30 us
    of a ~400 us append here)."""

    #: One fact, reserved and inserted in one autocommit statement.
    reserve_one: bytes
    #: ``%(count)s`` IDs, then COPY.
    reserve_many: bytes
    copy_facts: str
    #: IDs in a caller's transaction, with its ID (`txid_current()`).
    reserve_fact: bytes
    reserve_one_keyed: bytes
    reserve_fact_keyed: bytes
    reserve_many_keyed: bytes


def _prefix_with(
    info: StreamInfo, guards: sql.Composable, head: str = "", gate: str = ""
) -> sql.Composed:
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
        blocked=sql.Literal(BLOCKED + " "),
        lock_key=reservation_lock_key_sql(sql.SQL("k.floor")),
    )


def prepare_statements(info: StreamInfo, settings: Iterable[str]) -> WriterStatements:
    """The statements of a writer on stream ``info``; ``settings``: the TCP settings a caller's
    transaction gets (`tcp_settings`)."""
    prefix = _prefix_with(info, sql.SQL(""))
    seq = sql.Literal(info.sequence_name)
    # Facts go to the stream's own partition, named: PostgreSQL checks privileges on the
    # table a statement names, so a role granted one stream's partition writes that stream
    # only (`streams.store.roles`, "streams and groups of one's own").
    facts = sql.Identifier(facts_partition(info.id))
    # One fact in one autocommit statement: nothing can run between the reservation and the
    # commit, so the checks of `_check_floor` and `PositionTracker.reserved` (ID >= L, and
    # above the max allocated this process knew when it began) are made *in* the statement:
    # an ID failing them makes the text cast fail, and the statement, hence the
    # transaction, with it. A CASE with a data-dependent condition evaluates its ELSE only
    # for such a row.
    reserve_one = (
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
            columns=FACT_COLUMNS,
            rewound=sql.Literal(REWOUND + " "),
        )
        .as_bytes(None)
    )
    many = sql.SQL("{prefix} SELECT nextval({seq}), g.floor FROM g, generate_series(1, %(count)s)")
    guards = sql.SQL(" || ").join(set_configs(settings, local=True))
    # For a fact in the caller's transaction, also that transaction's ID (`FactHandle.xid`):
    # free, since the lease check's row lock has given it one.
    reserve_fact = (
        sql.SQL(
            "{prefix} SELECT nextval({seq}), g.floor, txid_current() "
            "FROM g, generate_series(1, %(count)s)"
        )
        .format(prefix=_prefix_with(info, sql.SQL("|| ") + guards), seq=seq)
        .as_bytes(None)
    )
    one_keyed, fact_keyed, many_keyed = _prepare_keyed(info, guards, seq, facts)
    return WriterStatements(
        reserve_one=reserve_one,
        reserve_many=many.format(prefix=prefix, seq=seq).as_bytes(None),
        copy_facts=sql.SQL("COPY {} ({}) FROM STDIN").format(facts, FACT_COLUMNS).as_string(None),
        reserve_fact=reserve_fact,
        reserve_one_keyed=one_keyed,
        reserve_fact_keyed=fact_keyed,
        reserve_many_keyed=many_keyed,
    )


def _prepare_keyed(
    info: StreamInfo, guards: sql.Composable, seq: sql.Literal, facts: sql.Identifier
) -> tuple[bytes, bytes, bytes]:
    """The statements of keyed appends (docs/design/claim.md): each claims its keys, then
    (gated on holding one) checks the lease, reserves and records the IDs in the claim's
    row, in one statement. The checks of ``reserve_one`` (ID >= L, above what this process
    knew) are made in the statement, which fails otherwise; a batch's are made by the
    client before its COPY and COMMIT."""
    checked = sql.SQL(
        "CASE WHEN r.id >= r.floor AND r.id > %(known)s THEN r.id "
        "ELSE ({rewound} || r.id || ' ' || r.floor)::bigint END"
    ).format(rewound=sql.Literal(REWOUND + " "))
    one = sql.SQL("{prefix}, r AS (SELECT nextval({seq}) AS id, g.floor FROM g)")
    # One fact: its row, and its ID recorded in the claim's row (from the inserted row).
    reserve_one = (
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
                prefix=_prefix_with(info, sql.SQL(""), claim_ctes(many=False), GATE), seq=seq
            ),
            checked=checked,
            facts=facts,
            columns=FACT_COLUMNS,
            record=sql.SQL(record_cte("ARRAY[f.stream_id]", "f")),
            result=sql.SQL(SINGLE_RESULT.format(extra="")),
        )
        .as_bytes(None)
    )
    # A fact in the caller's transaction: its ID recorded at once (its rows come later),
    # and that transaction's ID (`FactHandle.xid`).
    reserve_fact = (
        sql.SQL("{reserve}, {record} {result}")
        .format(
            reserve=one.format(
                prefix=_prefix_with(info, sql.SQL("|| ") + guards, claim_ctes(many=False), GATE),
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
    reserve_many = (
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
            prefix=_prefix_with(info, sql.SQL(""), claim_ctes(many=True), GATE),
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
    return reserve_one, reserve_fact, reserve_many
