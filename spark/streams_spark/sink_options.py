"""Options of the Spark sink, and which columns make a fact. Pure; no I/O.

Terms: the **payload** of a row is the JSON value stored for it (one row of a fact); the
**key column** groups rows into multi-row facts; the **timestamp column** gives a fact its
client timestamp (`streams.core.timestamps`). `parse_sink_options` checks the options when the
write starts (every bad value is one `streams.errors.ConfigurationError` naming the option, never
a password); `plan_columns` checks them against the DataFrame's schema and says how each row
becomes a payload. Both results are frozen and picklable: they travel to the executors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from streams.config import (
    DEFAULT_LEASE_SECONDS,
    Settings,
    redact_url,
    validate_instance_name,
    validate_stream_name,
)
from streams.connector import SINK_COMMIT_RETENTION_SECONDS, FactChunk, with_running_servers
from streams.errors import ConfigurationError, InvalidStreamName

from .options import KNOWN_OPTIONS, parse_duration

__all__ = [
    "SINK_OPTIONS",
    "ColumnPlan",
    "SinkOptions",
    "chunked",
    "group_rows",
    "parse_sink_options",
    "plan_columns",
]

#: The sink's option names (Spark's camelCase; matched case-insensitively, as Spark does).
SINK_OPTIONS = (
    "stream",
    "databaseUrl",
    "instancePrefix",
    "payloadColumn",
    "payloadColumns",
    "timestampColumn",
    "keyColumn",
    "commitRetention",
    "leaseSeconds",
)
#: Options Spark itself adds to a write's options (they mean nothing to the sink).
SPARK_OPTIONS = ("checkpointLocation", "path")
_BY_LOWER = {name.lower(): name for name in SINK_OPTIONS}
_SPARK_LOWER = {name.lower() for name in SPARK_OPTIONS}
_READ_LOWER = {name.lower(): name for name in KNOWN_OPTIONS}

#: Instance prefixes end in ``-<partition id>``: room for that within the 128 characters.
_MAX_PREFIX = 100
#: The range of ``leaseSeconds``: long enough to renew (every lease/4), short enough that a
#: task that died does not hold a stream for an hour.
MIN_LEASE_SECONDS = 1.0
MAX_LEASE_SECONDS = 3600.0
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


@dataclass(frozen=True, slots=True)
class SinkOptions:
    """Every sink option, resolved and checked (picklable; its repr hides the URL)."""

    stream: str
    database_url: str = field(repr=False)
    #: None: ``spark-<query id>`` for streaming writes, ``spark`` for batch writes.
    instance_prefix: str | None = None
    payload_column: str | None = None
    payload_columns: tuple[str, ...] | None = None
    timestamp_column: str | None = None
    key_column: str | None = None
    commit_retention: float = SINK_COMMIT_RETENTION_SECONDS
    #: The lease of each task's writer: its whole transaction must end within it (readers end
    #: a session that holds a stream's reservation lock longer), and readers wait that long
    #: behind a task that died in it.
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    def __repr__(self) -> str:
        return (
            f"SinkOptions(stream={self.stream!r}, "
            f"database_url={redact_url(self.database_url)!r}, prefix={self.instance_prefix!r})"
        )


def parse_sink_options(
    raw: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> SinkOptions:
    """Check every option of a write (see docs/spark.md); raises `ConfigurationError`."""
    env = os.environ if environ is None else environ
    given: dict[str, str] = {}
    for key, value in raw.items():
        lowered = str(key).lower()
        if lowered in _SPARK_LOWER:
            continue
        name = _BY_LOWER.get(lowered)
        if name is None:
            if lowered in _READ_LOWER:
                raise ConfigurationError(
                    f"option {_READ_LOWER[lowered]} applies to reads (spark.read / readStream), "
                    "not to writes"
                )
            raise ConfigurationError(
                f"unknown option {key!r} for writes to format 'streams': the options are "
                f"{', '.join(SINK_OPTIONS)}"
            )
        given[name] = str(value)

    stream = given.get("stream", "").strip()
    if not stream:
        raise ConfigurationError(
            'option stream: name the stream to write to, e.g. .option("stream", "orders")'
        )
    try:
        validate_stream_name(stream)
    except InvalidStreamName as exc:
        raise ConfigurationError(f"option stream: {exc} (a write goes to one stream)") from None
    url = given.get("databaseUrl") or env.get("STREAMS_DATABASE_URL")
    try:
        database_url = Settings.resolve(with_running_servers(url or None, None)[0]).database_url
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"option databaseUrl (or env STREAMS_DATABASE_URL): {exc}"
        ) from None

    prefix = _prefix(given)
    payload_column, payload_columns = _payload(given)
    timestamp_column = _column(given, "timestampColumn")
    key_column = _column(given, "keyColumn")
    if key_column and timestamp_column and key_column.lower() == timestamp_column.lower():
        raise ConfigurationError("options keyColumn and timestampColumn: name different columns")

    retention = SINK_COMMIT_RETENTION_SECONDS
    if "commitRetention" in given:
        retention = parse_duration(given["commitRetention"], "commitRetention")
        if retention < 3600:
            raise ConfigurationError(
                "option commitRetention: at least 1h (a query stopped for longer than this "
                "and restarted from its checkpoint may write its last batch again)"
            )
    lease = DEFAULT_LEASE_SECONDS
    if "leaseSeconds" in given:
        lease = parse_duration(given["leaseSeconds"], "leaseSeconds")
        if not MIN_LEASE_SECONDS <= lease <= MAX_LEASE_SECONDS:
            raise ConfigurationError(
                f"option leaseSeconds: between {MIN_LEASE_SECONDS:g}s and "
                f"{MAX_LEASE_SECONDS:g}s (each task's transaction must end within it)"
            )
    return SinkOptions(
        stream=stream,
        database_url=database_url,
        instance_prefix=prefix,
        payload_column=payload_column,
        payload_columns=payload_columns,
        timestamp_column=timestamp_column,
        key_column=key_column,
        commit_retention=retention,
        lease_seconds=lease,
    )


def _prefix(given: Mapping[str, str]) -> str | None:
    if "instancePrefix" not in given:
        return None
    prefix = given["instancePrefix"].strip()
    if len(prefix) > _MAX_PREFIX or not _PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"option instancePrefix: {prefix!r} is not valid: use 1-{_MAX_PREFIX} characters "
            "from letters, digits, '_', '.', ':' or '-', starting with a letter or digit"
        )
    validate_instance_name(f"{prefix}-0")
    return prefix


def _payload(given: Mapping[str, str]) -> tuple[str | None, tuple[str, ...] | None]:
    if "payloadColumn" in given and "payloadColumns" in given:
        raise ConfigurationError("options payloadColumn and payloadColumns: give one of them")
    if "payloadColumns" not in given:
        return _column(given, "payloadColumn"), None
    names = [part.strip() for part in given["payloadColumns"].split(",") if part.strip()]
    if not names:
        raise ConfigurationError("option payloadColumns: name one or more columns")
    if len({n.lower() for n in names}) != len(names):
        raise ConfigurationError("option payloadColumns: a column is named twice")
    return None, tuple(names)


def _column(given: Mapping[str, str], option: str) -> str | None:
    if option not in given:
        return None
    name = given[option].strip()
    if not name:
        raise ConfigurationError(f"option {option}: name a column")
    return name


# ------------------------------------------------------------------------------ columns


@dataclass(frozen=True, slots=True)
class ColumnPlan:
    """How a row of the DataFrame becomes a payload (by column position in the schema)."""

    #: The payload is this one column's value (``payload_object`` is then None).
    payload_index: int | None
    #: True: that column is a string holding JSON text, stored as it is.
    payload_is_text: bool
    #: The payload is a JSON object of these columns: (name in the object, column position).
    payload_object: tuple[tuple[str, int], ...] | None
    timestamp_index: int | None
    #: True: the timestamp column is a Spark timestamp; False: milliseconds since the epoch.
    timestamp_is_time: bool
    key_index: int | None


def plan_columns(options: SinkOptions, schema: StructType) -> ColumnPlan:
    """Check the options' columns against ``schema``; raises `ConfigurationError`."""
    fields = schema.fields

    def find(name: str, option: str) -> int:
        exact = [i for i, f in enumerate(fields) if f.name == name]
        loose = [i for i, f in enumerate(fields) if f.name.lower() == name.lower()]
        found = exact or loose
        if len(found) != 1:
            have = ", ".join(f.name for f in fields) or "none"
            what = "is ambiguous" if found else "is not a column"
            raise ConfigurationError(f"option {option}: {name!r} {what} (columns: {have})")
        return found[0]

    timestamp_index = key_index = None
    timestamp_is_time = False
    if options.timestamp_column is not None:
        timestamp_index = find(options.timestamp_column, "timestampColumn")
        kind = fields[timestamp_index].dataType
        if not isinstance(kind, TimestampType | TimestampNTZType | LongType | IntegerType):
            raise ConfigurationError(
                f"option timestampColumn: column {fields[timestamp_index].name!r} is "
                f"{kind.simpleString()}; use a timestamp or milliseconds since the epoch (long)"
            )
        timestamp_is_time = isinstance(kind, TimestampType | TimestampNTZType)
    if options.key_column is not None:
        key_index = find(options.key_column, "keyColumn")
        kind = fields[key_index].dataType
        if isinstance(kind, ArrayType | MapType | StructType):
            raise ConfigurationError(
                f"option keyColumn: column {fields[key_index].name!r} is {kind.simpleString()}; "
                "use a column of a simple type (string, number, date...)"
            )
    if timestamp_index is not None and timestamp_index == key_index:
        raise ConfigurationError("options keyColumn and timestampColumn: name different columns")

    if options.payload_column is not None:
        index = find(options.payload_column, "payloadColumn")
        _check_json(fields[index].name, fields[index].dataType, "payloadColumn")
        return ColumnPlan(
            payload_index=index,
            payload_is_text=isinstance(fields[index].dataType, StringType),
            payload_object=None,
            timestamp_index=timestamp_index,
            timestamp_is_time=timestamp_is_time,
            key_index=key_index,
        )
    if options.payload_columns is not None:
        chosen = [find(name, "payloadColumns") for name in options.payload_columns]
        option = "payloadColumns"
    else:
        chosen = [i for i in range(len(fields)) if i not in (timestamp_index, key_index)]
        option = "payloadColumns (default: every column but the key and timestamp columns)"
        if not chosen:
            raise ConfigurationError(f"option {option}: no column is left for the payload")
    names = [fields[i].name for i in chosen]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"option {option}: two payload columns have the same name")
    for index in chosen:
        _check_json(fields[index].name, fields[index].dataType, option)
    return ColumnPlan(
        payload_index=None,
        payload_is_text=False,
        payload_object=tuple((fields[i].name, i) for i in chosen),
        timestamp_index=timestamp_index,
        timestamp_is_time=timestamp_is_time,
        key_index=key_index,
    )


def _check_json(name: str, kind: DataType, option: str) -> None:
    """Every Spark type has a JSON form except binary (no JSON text stands for bytes)."""
    if _has_binary(kind):
        raise ConfigurationError(
            f"option {option}: column {name!r} is {kind.simpleString()}, which has no JSON "
            "form; convert it first (e.g. base64(col))"
        )


def _has_binary(kind: DataType) -> bool:
    if isinstance(kind, BinaryType):
        return True
    if isinstance(kind, ArrayType):
        return _has_binary(kind.elementType)
    if isinstance(kind, MapType):
        return _has_binary(kind.keyType) or _has_binary(kind.valueType)
    if isinstance(kind, StructType):
        return any(_has_binary(f.dataType) for f in kind.fields)
    return False


# ------------------------------------------------------------------------------ facts


def group_rows(
    keys: Sequence[Hashable | None], texts: Sequence[str], stamps: Sequence[int | None]
) -> tuple[list[list[str]], list[int | None]]:
    """Rows sharing a key form one fact: (each fact's rows, each fact's timestamp).

    Facts come in the order their keys first appear, rows in input order; a row with a null
    key is a fact of its own. A fact's timestamp is the latest of its rows' (None if none has
    one).
    """
    facts: list[list[str]] = []
    fact_stamps: list[int | None] = []
    index: dict[Hashable, int] = {}
    for key, text, stamp in zip(keys, texts, stamps, strict=True):
        at = index.get(key) if key is not None else None
        if at is None:
            if key is not None:
                index[key] = len(facts)
            facts.append([text])
            fact_stamps.append(stamp)
            continue
        facts[at].append(text)
        if stamp is not None:
            known = fact_stamps[at]
            fact_stamps[at] = stamp if known is None else max(known, stamp)
    return facts, fact_stamps


def chunked(
    rows: Sequence[str],
    stamps: Sequence[int | None],
    rows_per_chunk: int,
    sizes: Sequence[int] | None = None,
) -> list[FactChunk]:
    """Cut facts (their rows one after the other; ``sizes``: rows of each fact, None: one row
    each) into chunks of about ``rows_per_chunk`` rows; a fact is never split."""
    if sizes is None:
        return [
            FactChunk(rows[at : at + rows_per_chunk], stamps[at : at + rows_per_chunk])
            for at in range(0, len(rows), rows_per_chunk)
        ]
    chunks: list[FactChunk] = []
    first = row = count = 0
    for end, size in enumerate(sizes, 1):
        count += size
        if count >= rows_per_chunk:
            chunks.append(FactChunk(rows[row : row + count], stamps[first:end], sizes[first:end]))
            first, row, count = end, row + count, 0
    if first < len(sizes):
        chunks.append(FactChunk(rows[row:], stamps[first:], sizes[first:]))
    return chunks
