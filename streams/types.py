"""The data types a caller of `streams` sees: what the client, writers and readers return and
take besides facts and epochs (those are `streams.core.epochs`'s).

* `StreamInfo`: a stream's registry row; `FactTable` (and `FactTableSpec`, what a declaration
  may be): a user table declared to hold a stream's facts.
* `Ack`: the acknowledgement of an append; `FactChunk`: facts as JSON text, for
  `WriterCore.append_facts` (the Spark sink's path).
* `StreamPositions`, `WriterRow`, `GroupRow`: what ``positions(stream)`` and ``groups(stream)``
  report.
* `PruneResult`: what one ``prune`` of a stream did.

The store (`streams.store`) makes and reads them; this module imports nothing of it (nor of the
client, the shells or the transport), so anything may import it. `streams` exports the ones
most callers need.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

from psycopg import sql

from .core.timestamps import TimestampMode
from .errors import InvalidFactTables, UsageError

__all__ = [
    "DEFAULT_KEY_WINDOW_MS",
    "Ack",
    "Created",
    "FactChunk",
    "FactTable",
    "FactTableSpec",
    "GroupRow",
    "PruneResult",
    "StreamInfo",
    "StreamPositions",
    "StreamSpec",
    "WriterRow",
]

#: A stream's key window unless set otherwise: an idempotency key names its append for 24 hours.
DEFAULT_KEY_WINDOW_MS = 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """A stream's registry row."""

    id: int
    name: str
    sequence_name: str
    timestamping: TimestampMode
    uncapped: bool
    retention_ms: int | None
    #: User tables that hold facts of this stream, besides ``streams_facts``.
    fact_tables: tuple[FactTable, ...] = ()
    #: How long an append's idempotency key names it (`streams.store.idempotency`).
    key_window_ms: int = DEFAULT_KEY_WINDOW_MS

    @property
    def sequence(self) -> sql.Identifier:
        return sql.Identifier(self.sequence_name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "timestamping": str(self.timestamping),
            "uncapped": self.uncapped,
            "retention_ms": self.retention_ms,
            "fact_tables": [str(t) for t in self.fact_tables],
            "key_window_ms": self.key_window_ms,
        }


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What `create_streams` makes of one stream: its name and settings (as `create_stream`'s
    arguments)."""

    name: str
    timestamping: TimestampMode | str = TimestampMode.CLIENT_PREFER
    uncapped: bool = False
    retention_ms: int | None = None
    fact_tables: Sequence[FactTableSpec] | None = None
    key_window_ms: int | None = None

    @classmethod
    def parse(cls, spec: object) -> StreamSpec:
        """A name, a `StreamSpec`, or a mapping of `create_stream`'s arguments (``name``
        required), as `streams create --from-file` reads them."""
        if isinstance(spec, StreamSpec):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, Mapping):
            unknown = set(spec) - set(cls.__slots__)
            if "name" not in spec or unknown:
                raise ValueError(
                    f"a stream is a name or an object with 'name' and any of "
                    f"{sorted(set(cls.__slots__) - {'name'})}"
                    + (f" (unknown: {sorted(unknown)})" if unknown else "")
                )
            return cls(**{str(k): v for k, v in spec.items()})
        raise ValueError(f"a stream is a name or an object with 'name', not {type(spec).__name__}")


class Created(NamedTuple):
    """A stream `create_streams` was asked for: its registry row, and whether this call made
    it (False: it existed already, with these settings)."""

    info: StreamInfo
    new: bool


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")
#: ``TARGET WHERE COLUMN = 'VALUE'``: the value a single-quoted SQL string literal (``''`` for a
#: quote inside it); the parts are checked further by `FactTable.parse`.
_FILTERED = re.compile(
    r"(?P<target>\S+)\s+WHERE\s+(?P<column>[^\s=]+)\s*=\s*'(?P<value>(?:[^']|'')*)'",
    re.IGNORECASE,
)
_FORMS = (
    "use 'table.column', 'schema.table.column', \"table.column WHERE column = 'value'\" "
    "(also with a schema; the value a single-quoted SQL string, '' for a quote in it), "
    "a (table, column) pair or a (table, column, {column: 'value'}) triple, "
    "with plain identifiers (letters, digits, '_', '$')"
)


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class FactTable:
    """A user table holding facts of a stream: ``table`` (``schema.table``), the column with the
    stream ID, and optionally the rows that are this stream's: those whose ``where_column``
    equals ``where_value`` (a table shared by several streams, each with its own value). Without
    one, every row of the table is the stream's.

    Written ``"schema.table.column WHERE where_column = 'value'"`` (`parse` reads it, ``str``
    renders it; ``''`` for a quote inside the value). Sequence repair reads
    ``max(column) FROM table [WHERE where_column = value]`` (and `streams doctor` that filter's
    recent IDs), so index ``(column)``, or ``(where_column, column)`` for a declaration with a
    filter. ``where_column`` may be of any type the value can be compared with as
    ``where_column = 'value'`` (text, an enum, an integer, ...).

    Stored in ``streams_registry.fact_tables`` as ``{"table": ..., "column": ...}``, with
    ``"where_column"`` and ``"where_value"`` besides for a filter: the JSON needed no schema
    migration, and rows written before filters existed mean "the whole table", as before.
    Ordered (by table, column, then filter) and hashable, like any value.
    """

    table: str
    column: str
    where_column: str | None = None
    where_value: str | None = None

    def __post_init__(self) -> None:
        if (self.where_column is None) != (self.where_value is None):
            raise InvalidFactTables(
                f"invalid fact table {self.table}.{self.column}: give where_column and "
                "where_value together, or neither"
            )

    def __str__(self) -> str:
        if self.where_column is None or self.where_value is None:
            return f"{self.table}.{self.column}"
        value = self.where_value.replace("'", "''")
        return f"{self.table}.{self.column} WHERE {self.where_column} = '{value}'"

    def _key(self) -> tuple[str, str, bool, str, str]:
        return (
            self.table,
            self.column,
            self.where_column is not None,
            self.where_column or "",
            self.where_value or "",
        )

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, FactTable):
            return NotImplemented
        return self._key() < other._key()

    @classmethod
    def parse(cls, spec: object) -> FactTable:
        """One declaration, checked strictly (`InvalidFactTables` shows the accepted forms):

        * ``"table.column"`` or ``"schema.table.column"``: every row of the table;
        * ``"table.column WHERE where_column = 'value'"`` (also with a schema; ``WHERE`` in
          any case; the value a single-quoted SQL string literal, ``''`` for a quote in it):
          only the rows whose ``where_column`` equals the value;
        * a ``(table, column)`` pair or a ``(table, column, {where_column: "value"})`` triple
          (``table`` may be ``"schema.table"``);
        * a `FactTable` (checked the same way).

        The schema defaults to ``public``. Plain identifiers only: they become SQL identifiers;
        the value is only ever passed as a parameter.
        """
        where: tuple[object, object] | None = None
        if isinstance(spec, FactTable):
            parts: list[object] = [*spec.table.split("."), spec.column]
            if spec.where_column is not None:
                where = (spec.where_column, spec.where_value)
        elif isinstance(spec, str):
            target = spec
            if (found := _FILTERED.fullmatch(spec)) is not None:
                target = found["target"]
                where = (found["column"], found["value"].replace("''", "'"))
            parts = [*target.split(".")]
        elif (
            isinstance(spec, tuple | list)
            and len(spec) in (2, 3)
            and isinstance(spec[0], str)
            and (len(spec) == 2 or (isinstance(spec[2], dict) and len(spec[2]) == 1))
        ):
            parts = [*spec[0].split("."), spec[1]]
            if len(spec) == 3:
                ((column, value),) = spec[2].items()
                where = (column, value)
        else:
            raise InvalidFactTables(f"invalid fact table {spec!r}: {_FORMS}")
        if len(parts) == 2:
            parts.insert(0, "public")
        identifiers = [*parts, *([where[0]] if where is not None else [])]
        if len(parts) != 3 or not all(
            isinstance(p, str) and _IDENTIFIER.fullmatch(p) for p in identifiers
        ):
            raise InvalidFactTables(f"invalid fact table {spec!r}: {_FORMS}")
        table, column = f"{parts[0]}.{parts[1]}", str(parts[2])
        if where is None:
            return cls(table, column)
        where_column, where_value = where
        if not isinstance(where_value, str) or "\x00" in where_value:
            raise InvalidFactTables(
                f"invalid fact table {spec!r}: the value of {where_column} must be a string "
                f"(without NUL characters); {_FORMS}"
            )
        return cls(table, column, str(where_column), where_value)

    def as_json(self) -> dict[str, str]:
        """The object stored in ``streams_registry.fact_tables`` (`from_json` reads it)."""
        found = {"table": self.table, "column": self.column}
        if self.where_column is not None and self.where_value is not None:
            found.update(where_column=self.where_column, where_value=self.where_value)
        return found

    @classmethod
    def from_json(cls, found: dict[str, Any]) -> FactTable:
        """A stored declaration; one without ``where_column`` (older rows too) is the whole
        table."""
        return cls(
            found["table"], found["column"], found.get("where_column"), found.get("where_value")
        )

    def _relation(self) -> sql.Identifier:
        return sql.Identifier(*self.table.split("."))

    def _where(self, param: str) -> sql.Composable:
        """`` WHERE where_column = %(param)s``, or nothing for the whole table. The value is a
        parameter of the statement (`params`), never SQL text: as a literal, a ``%`` in it
        would be read as a placeholder by the driver."""
        if self.where_column is None:
            return sql.SQL("")
        return sql.SQL(" WHERE {} = {}").format(
            sql.Identifier(self.where_column), sql.Placeholder(param)
        )

    def params(self, param: str) -> dict[str, str]:
        """The parameters `max_sql` and `ids_sql` with the same ``param`` need."""
        if self.where_column is None or self.where_value is None:
            return {}
        return {param: self.where_value}

    def max_sql(self, param: str) -> sql.Composed:
        """``(SELECT max(column) FROM table [WHERE where_column = %(param)s])``, for a statement
        with named parameters that include `params` (an index on ``(where_column, column)``
        answers it at once)."""
        return sql.SQL("(SELECT max({column}) FROM {relation}{where})").format(
            column=sql.Identifier(self.column), relation=self._relation(), where=self._where(param)
        )

    def present_sql(self, param: str, ids: str) -> sql.Composed:
        """Which of the IDs ``%(ids)s`` (a bigint array) the table holds (this stream's rows),
        as `max_sql`: an index probe per ID."""
        where = (
            sql.SQL(" AND {} = {}").format(
                sql.Identifier(self.where_column), sql.Placeholder(param)
            )
            if self.where_column is not None
            else sql.SQL("")
        )
        return sql.SQL(
            "SELECT DISTINCT {column}::bigint FROM {relation} WHERE {column} = ANY({ids}){where}"
        ).format(
            column=sql.Identifier(self.column),
            relation=self._relation(),
            ids=sql.Placeholder(ids),
            where=where,
        )

    def ids_sql(self, param: str) -> sql.Composed:
        """Every stream ID of the table (of this stream's rows), as `max_sql`."""
        return sql.SQL("SELECT {column}::bigint FROM {relation}{where}").format(
            column=sql.Identifier(self.column), relation=self._relation(), where=self._where(param)
        )


#: What a declaration of a fact table may be (see `FactTable.parse`).
FactTableSpec: TypeAlias = "str | tuple[str, str] | tuple[str, str, Mapping[str, str]] | FactTable"


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledgement of an append: IDs (ascending, not necessarily contiguous) and times.

    ``first_id``/``last_id`` are the lowest and highest ID, ``first_timestamp``/
    ``last_timestamp`` the timestamps of those two facts, ``ids`` the ID of each payload's fact
    in the order of the payloads. With idempotency keys (`streams.store.idempotency`),
    ``duplicates`` are the positions of the payloads whose key had been written already: their
    IDs are the original facts' (so ``ids`` need not ascend then) and this append wrote
    nothing for them. ``duplicates`` takes no part in comparisons: a retried append's `Ack`
    equals the original's.
    """

    first_id: int
    last_id: int
    first_timestamp: int
    last_timestamp: int
    count: int
    ids: tuple[int, ...] = field(repr=False)
    duplicates: tuple[int, ...] = field(default=(), compare=False)

    @property
    def duplicate(self) -> bool:
        """Every payload's key had been written already: this append wrote nothing."""
        return len(self.duplicates) == self.count

    @classmethod
    def of(cls, ids: Sequence[int], stamps: Sequence[int], duplicates: Sequence[int] = ()) -> Ack:
        """The `Ack` of facts ``ids`` (in payload order) with timestamps ``stamps``."""
        low = min(range(len(ids)), key=ids.__getitem__)
        high = max(range(len(ids)), key=ids.__getitem__)
        return cls(
            ids[low], ids[high], stamps[low], stamps[high], len(ids), tuple(ids), tuple(duplicates)
        )


@dataclass(frozen=True, slots=True)
class FactChunk:
    """Facts for `WriterCore.append_facts`: every row's payload as JSON text, the facts one
    after the other (each fact's row 0 first); ``sizes``, the rows of each fact (None: one row
    each); one client timestamp (or None) per fact."""

    rows: Sequence[str]
    timestamps: Sequence[int | None]
    sizes: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if len(self.timestamps) != self.count:
            raise UsageError("a chunk needs one timestamp entry per fact")
        if self.sizes is not None and (
            sum(self.sizes) != len(self.rows) or min(self.sizes, default=1) < 1
        ):
            raise UsageError("a chunk's sizes must be >= 1 and add up to its rows")

    @property
    def count(self) -> int:
        """The facts in the chunk."""
        return len(self.rows) if self.sizes is None else len(self.sizes)

    @classmethod
    def of(cls, facts: Sequence[Sequence[str]], timestamps: Sequence[int | None]) -> FactChunk:
        """A chunk of these facts, each given as its rows."""
        return cls([text for rows in facts for text in rows], timestamps, [len(r) for r in facts])


@dataclass(frozen=True, slots=True)
class WriterRow:
    """A writer's row: its persisted position, lease and what it last reported."""

    instance: str
    generation: int
    position: int
    retired: bool
    lease_expires_in_ms: int
    pending: int = 0
    #: Milliseconds since its last heartbeat (or registration).
    heartbeat_age_ms: int = 0

    @property
    def state(self) -> str:
        """``retired`` (closed, fenced or pruned from the linear position), ``lease expired``
        (stopped heartbeating; retired at the next chance), ``active`` (it had IDs pending
        between its last two heartbeats, i.e. it wrote) or ``idle`` (nothing pending in that
        time: it holds nobody back)."""
        if self.retired:
            return "retired"
        if self.lease_expires_in_ms < 0:
            return "lease expired"
        return "active" if self.pending else "idle"

    def as_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "generation": self.generation,
            "retired": self.retired,
            "state": self.state,
            "lease_expires_in_ms": self.lease_expires_in_ms,
            "heartbeat_age_ms": self.heartbeat_age_ms,
            "pending": self.pending,
        }


@dataclass(frozen=True, slots=True)
class StreamPositions:
    """What `positions(stream)` reports; every figure read in one database snapshot."""

    stream: str
    linear: int
    max_allocated: int
    writers: Mapping[str, WriterRow]
    #: The minimum of the writers' persisted positions: trails ``linear`` by a heartbeat.
    persisted_linear: int = 0
    groups: tuple[GroupRow, ...] = ()
    #: Age in ms of the oldest open writing transaction (the oldest pending ID), if any.
    oldest_pending_ms: int | None = None
    #: Every fact ``<=`` it may have been removed by retention (`prune`); 0: none was.
    pruned_through: int = 0
    #: How long an append's idempotency key names it (`streams.store.idempotency`).
    key_window_ms: int = DEFAULT_KEY_WINDOW_MS

    @property
    def scratchpad(self) -> int:
        """IDs in (linear, max allocated]: pending, or completed behind a pending one."""
        return self.max_allocated - self.linear

    def as_dict(self, *, retired: bool = True) -> dict[str, Any]:
        """JSON-ready; ``retired=False`` folds retired writers into ``retired_writers``."""
        shown = {n: w for n, w in sorted(self.writers.items()) if retired or not w.retired}
        return {
            "stream": self.stream,
            "linear": self.linear,
            "persisted_linear": self.persisted_linear,
            "max_allocated": self.max_allocated,
            "scratchpad": self.scratchpad,
            "oldest_pending_ms": self.oldest_pending_ms,
            "pruned_through": self.pruned_through,
            "key_window_ms": self.key_window_ms,
            "groups": {g.group: g.as_dict() for g in self.groups},
            "writers": {name: row.as_dict() for name, row in shown.items()},
            "retired_writers": sum(w.retired for w in self.writers.values()),
        }


@dataclass(frozen=True, slots=True)
class GroupRow:
    """A reader group's committed frontier on one stream and its lag behind the stream."""

    stream: str
    group: str
    position: int
    ts_floor: int
    lag: int
    updated_at: str
    #: Age in ms of the oldest fact the group has not consumed (None when it is caught up).
    lag_ms: int | None = None
    #: Milliseconds since the group's last commit (``updated_at``, by the database's clock).
    idle_ms: int = 0
    #: It stops `prune` short of what the stream's retention period allows
    #: (`streams.core.staleness.holds_retention`).
    holds_retention: bool = False
    #: How many IDs `prune` would remove but for this group (0 unless it holds retention back:
    #: `streams.core.staleness.retention_held`).
    retention_held_ids: int = 0
    #: Idle for the stale-after time while holding retention back (`streams.core.staleness`).
    stale: bool = False
    #: The generation of the group's consumer (`take_generations`): how many times a consumer
    #: opened the group on this stream; None if none did since the generations exist.
    generation: int | None = None
    #: Who opened it last (``host:pid`` of a reader, the Spark query), and when (ISO 8601).
    owner: str | None = None
    taken_at: str | None = None
    #: Milliseconds since then (by the database's clock): since the group last changed hands.
    taken_age_ms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "position": self.position,
            "lag": self.lag,
            "lag_ms": self.lag_ms,
            "updated_at": self.updated_at,
            "idle_ms": self.idle_ms,
            "holds_retention": self.holds_retention,
            "stale": self.stale,
            "generation": self.generation,
            "owner": self.owner,
            "taken_at": self.taken_at,
            "taken_age_ms": self.taken_age_ms,
        }


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What one `prune` of a stream did."""

    stream: str
    #: ``pruned_through`` before and after.
    before: int
    after: int
    #: How far retention allowed, and what held it there (`PruneTarget`).
    target: int
    limited_by: str
    rows_deleted: int
    transactions: int
    #: Idempotency keys older than the stream's key window, removed (`prune_keys`).
    keys_deleted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "pruned_through_before": self.before,
            "pruned_through": self.after,
            "target": self.target,
            "limited_by": self.limited_by,
            "rows_deleted": self.rows_deleted,
            "transactions": self.transactions,
            "keys_deleted": self.keys_deleted,
        }
