"""A fact's columns, defined once: the row SQL, the COPY statements, the Arrow and Spark
schemas and `streams.core.epochs.Fact` are derived from `FACT_COLUMNS` by name. Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias

__all__ = [
    "EXPOSED_NAMES",
    "FACT_COLUMNS",
    "FACT_FIELDS",
    "INSTANCE",
    "KEY",
    "KEY_ORDER",
    "OWN_NAMES",
    "PAYLOAD",
    "ROW_COLUMNS",
    "ROW_INDEX",
    "ROW_NO",
    "ROW_SELECT",
    "STORED_NAMES",
    "STREAM",
    "STREAM_ID",
    "TIMESTAMP",
    "FactColumn",
    "Kind",
    "Row",
]

#: One row of a statement's result, as the store's drivers hand it over; a fact row is
#: `ROW_COLUMNS` in order (`ROW_INDEX`). Plain tuples: catching up touches every row.
Row: TypeAlias = tuple[Any, ...]

Kind: TypeAlias = Literal["string", "int64", "int32", "timestamp"]


@dataclass(frozen=True, slots=True)
class FactColumn:
    """One column of a fact's rows."""

    #: Its name in ``streams_facts``.
    stored: str
    #: Its name where callers see it (Arrow batches, Spark rows).
    exposed: str
    #: What a read selects for it (the payload as JSON text).
    read: str
    #: Its type where callers see it (`streams.arrow.schema`, the Spark source's schema).
    kind: Kind
    #: Its field of `streams.core.epochs.Fact` (None: a fact holds all its rows).
    fact: str | None


STREAM: Final = FactColumn("stream", "stream", "stream", "string", "stream")
STREAM_ID: Final = FactColumn("stream_id", "stream_id", "stream_id", "int64", "stream_id")
ROW_NO: Final = FactColumn("row_no", "row_no", "row_no", "int32", None)
INSTANCE: Final = FactColumn("instance", "instance", "instance", "string", "instance")
TIMESTAMP: Final = FactColumn("ts", "timestamp", "ts", "timestamp", "timestamp")
PAYLOAD: Final = FactColumn("payload", "payload", "payload::text", "string", "payloads")

#: Every column, in the order rows are written (COPY) and exposed (Arrow, Spark).
FACT_COLUMNS: Final = (STREAM, STREAM_ID, ROW_NO, INSTANCE, TIMESTAMP, PAYLOAD)
#: The columns a read returns (the stream is known to the reader): `Row`'s order.
ROW_COLUMNS: Final = FACT_COLUMNS[1:]
#: A fact row's key: its order in a stream.
KEY: Final = (STREAM_ID, ROW_NO)

STORED_NAMES: Final = tuple(c.stored for c in FACT_COLUMNS)
#: SQL text: the row key's order (``ORDER BY``) and what a read selects (`ROW_COLUMNS`).
KEY_ORDER: Final = ", ".join(c.stored for c in KEY)
ROW_SELECT: Final = ", ".join(c.read for c in ROW_COLUMNS)
EXPOSED_NAMES: Final = tuple(c.exposed for c in FACT_COLUMNS)
#: The exposed columns besides the payload (which a payload schema replaces by its fields).
OWN_NAMES: Final = tuple(c.exposed for c in FACT_COLUMNS if c is not PAYLOAD)
#: A column's index in a `Row`, by stored name.
ROW_INDEX: Final = MappingProxyType({c.stored: i for i, c in enumerate(ROW_COLUMNS)})
#: `streams.core.epochs.Fact`'s fields, in order.
FACT_FIELDS: Final = tuple(c.fact for c in FACT_COLUMNS if c.fact is not None)
