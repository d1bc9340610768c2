"""Options of the Spark source, checked once when the query starts. Pure; no I/O.

Every bad value raises one `streams.errors.ConfigurationError` naming the option (and never a
password: URLs are shown through `streams.config.redact_url`). The result, `SourceOptions`, is a
frozen, picklable value that travels to the driver's stream reader and, through the partitions,
to the executors.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streams.config import Settings, redact_url, validate_stream_name
from streams.connector import (
    DEFAULT_CORRUPT_COLUMN,
    PayloadSchema,
    SchemaError,
    compile_pattern,
    parse_schema_text,
    payload_schema,
    with_running_servers,
)
from streams.core.fact_columns import OWN_NAMES
from streams.errors import ConfigurationError, InvalidPattern, InvalidStreamName

from .offsets import frontier_from_json

__all__ = ["KNOWN_OPTIONS", "SourceOptions", "parse_duration", "parse_options"]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

#: Option names (Spark's camelCase; Spark itself matches them case-insensitively).
KNOWN_OPTIONS = (
    "stream",
    "streams",
    "streamPattern",
    "databaseUrl",
    "readDatabaseUrl",
    "standbyMaxWait",
    "redisUrl",
    "prefix",
    "startingPosition",
    "startingTimestamp",
    "startingAgo",
    "startingPositionByTimestamp",
    "endingPosition",
    "endingTimestamp",
    "endingPositionByTimestamp",
    "maxFactsPerTrigger",
    "minFactsPerTrigger",
    "maxTriggerDelay",
    "partitions",
    "group",
    "failOnDataLoss",
    "pollInterval",
    "timestampIn",
    "statementTimeout",
    "prefetch",
    "schema",
    "mode",
    "columnNameOfCorruptRecord",
)
_BY_LOWER = {name.lower(): name for name in KNOWN_OPTIONS}

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: Default of ``maxTriggerDelay`` (Kafka's default too).
DEFAULT_MAX_TRIGGER_DELAY = 15 * 60.0
#: Default of ``statementTimeout`` (seconds): far above any statement of a healthy server (the
#: driver's take milliseconds; an executor's read that runs longer goes on from its last row).
DEFAULT_STATEMENT_TIMEOUT = 60.0

#: Most seconds the driver and the executors wait between two tries to reach PostgreSQL
#: (exponential from 50 ms): a failover's new primary is found within about a second.
RETRY_CAP = 1.0

_STARTS = ("startingPosition", "startingTimestamp", "startingAgo", "startingPositionByTimestamp")
_ENDS = ("endingPosition", "endingTimestamp", "endingPositionByTimestamp")


def parse_duration(text: str, option: str) -> float:
    """``500ms``, ``30s``, ``15m``, ``2h``, ``1d`` (a bare number is seconds) -> seconds."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise ConfigurationError(
            f"option {option}: {text!r} is not a duration (use e.g. 500ms, 30s, 15m, 2h, 1d)"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]


def _positive_int(text: str, option: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigurationError(f"option {option}: {text!r} is not an integer") from None
    if value < 1:
        raise ConfigurationError(f"option {option}: must be >= 1, got {value}")
    return value


def _boolean(text: str, option: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigurationError(f"option {option}: {text!r} is not true or false")


def _timestamp_ms(text: str, option: str) -> int:
    """Milliseconds since the epoch, or ISO-8601 (a time without zone is UTC)."""
    raw = text.strip()
    if re.fullmatch(r"\d+", raw):
        return int(raw)
    try:
        when = dt.datetime.fromisoformat(raw)
    except ValueError:
        raise ConfigurationError(
            f"option {option}: {text!r} is neither milliseconds since the epoch nor ISO-8601 "
            "(e.g. 2026-11-23T09:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    # Exact ceiling in integers, as the Python reader does.
    return -((_EPOCH - when) // dt.timedelta(milliseconds=1))


def _timestamps_by_stream(text: str, option: str, names: list[str]) -> dict[str, int]:
    """``{"orders": 1763900000000, "payments": "2026-11-23T09:00:00Z"}``: a time per stream
    (ms since the epoch or ISO-8601), naming exactly the streams read."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigurationError(f"option {option}: {text!r} is not valid JSON") from None
    if not isinstance(data, dict):
        raise ConfigurationError(
            f'option {option}: expected a JSON object of times by stream, e.g. {{"orders": '
            "1763900000000}"
        )
    unknown, missing = sorted(set(data) - set(names)), sorted(set(names) - set(data))
    if unknown or missing:
        raise ConfigurationError(
            f"option {option}: name exactly the streams read ({', '.join(names)}); unknown "
            f"{unknown}, missing {missing}"
        )
    out: dict[str, int] = {}
    for name in names:
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigurationError(
                f"option {option}: the time of stream {name!r} must be ms since the epoch or "
                "an ISO-8601 string"
            )
        out[name] = _timestamp_ms(str(value), f"{option} ({name})")
    return out


@dataclass(frozen=True, slots=True)
class Position:
    """A start or end: ``kind`` is earliest | latest | id | frontier | timestamp | ago |
    timestamps (a time per stream, in ``timestamps``)."""

    kind: str
    id: int = 0
    frontier: Mapping[str, int] = field(default_factory=dict)
    timestamp_ms: int = 0
    ago_seconds: float = 0.0
    timestamps: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """Every option, resolved and checked (picklable; its repr hides the URLs).

    ``streams``: the streams named (``stream``/``streams``), empty with ``pattern``
    (``streamPattern``: every stream whose name matches it in full, as it is created)."""

    streams: tuple[str, ...]
    database_url: str = field(repr=False)
    redis_url: str | None = field(default=None, repr=False)
    prefix: str = "streams"
    start: Position = field(default_factory=lambda: Position("earliest"))
    end: Position | None = None
    max_facts: int | None = None
    min_facts: int | None = None
    max_trigger_delay: float = DEFAULT_MAX_TRIGGER_DELAY
    partitions: int = 1
    group: str = ""
    group_explicit: bool = False
    fail_on_data_loss: bool = True
    poll_interval: float | None = None
    timestamp_in: str = "arrow"
    statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT
    prefetch: bool = True
    #: A hot standby where executors read their ranges, behind the fence
    #: (`streams.connector.read_range` with ``proof_lsn``); None: the database URL.
    read_database_url: str | None = field(default=None, repr=False)
    #: Seconds an executor waits for that standby before reading from the primary.
    standby_max_wait: float = 5.0
    #: The option that set ``end`` (for errors).
    end_option: str = "endingPosition"
    #: ``schema`` (with ``mode``, ``columnNameOfCorruptRecord``): typed columns from the
    #: payload instead of ``payload`` (`streams.core.typed_payloads`); None: ``payload``.
    payload_schema: PayloadSchema | None = None
    #: ``streamPattern``: a Python regular expression (`re.fullmatch`); None: ``streams``.
    pattern: str | None = None

    @property
    def statement_timeout_ms(self) -> int:
        return max(1, round(self.statement_timeout * 1000))

    def __repr__(self) -> str:
        which = f"pattern={self.pattern!r}" if self.pattern else f"streams={list(self.streams)}"
        return (
            f"SourceOptions({which}, "
            f"database_url={redact_url(self.database_url)!r}, group={self.group!r})"
        )


def parse_options(
    raw: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> SourceOptions:
    """Check every option (see the README's option table); raises `ConfigurationError`."""
    env = os.environ if environ is None else environ
    given: dict[str, str] = {}
    for key, value in raw.items():
        name = _BY_LOWER.get(str(key).lower())
        if name is None:
            raise ConfigurationError(
                f"unknown option {key!r} for format 'streams': the options are "
                f"{', '.join(KNOWN_OPTIONS)}"
            )
        given[name] = str(value)

    names, pattern = _stream_names(given), _pattern(given)
    settings = _settings(given, env)
    for exclusive in (_STARTS, _ENDS):
        chosen = [k for k in exclusive if k in given]
        if len(chosen) > 1:
            raise ConfigurationError(f"options {', '.join(chosen)}: give at most one of them")
    start = Position("earliest")
    if "startingPosition" in given:
        start = _position(given["startingPosition"], "startingPosition", names, ending=False)
    elif "startingTimestamp" in given:
        start = Position(
            "timestamp", timestamp_ms=_timestamp_ms(given["startingTimestamp"], "startingTimestamp")
        )
    elif "startingAgo" in given:
        start = Position("ago", ago_seconds=parse_duration(given["startingAgo"], "startingAgo"))
    elif "startingPositionByTimestamp" in given:
        option = "startingPositionByTimestamp"
        start = Position(
            "timestamps", timestamps=_timestamps_by_stream(given[option], option, names)
        )
    end, end_option = _ending(given, names)

    max_facts, min_facts, delay = _trigger_limits(given)

    partitions = 1
    if "partitions" in given:
        partitions = _positive_int(given["partitions"], "partitions")
        if partitions > 10_000:
            raise ConfigurationError("option partitions: at most 10000")

    group_explicit = "group" in given
    group = given.get("group", "").strip()
    if group_explicit and not 0 < len(group) <= 200:
        raise ConfigurationError("option group: a non-empty name of at most 200 characters")
    if not group_explicit:
        group = default_group(names, given, pattern)

    fail = (
        _boolean(given["failOnDataLoss"], "failOnDataLoss") if "failOnDataLoss" in given else True
    )
    poll = None
    if "pollInterval" in given:
        poll = parse_duration(given["pollInterval"], "pollInterval")
        if not 0.001 <= poll <= 3600:
            raise ConfigurationError("option pollInterval: between 1ms and 1h")
    timestamp_in = given.get("timestampIn", "arrow").strip().lower()
    if timestamp_in not in ("arrow", "sql"):
        raise ConfigurationError("option timestampIn: 'arrow' or 'sql'")
    timeout = DEFAULT_STATEMENT_TIMEOUT
    if "statementTimeout" in given:
        timeout = parse_duration(given["statementTimeout"], "statementTimeout")
        if not 0.01 <= timeout <= 86400:
            raise ConfigurationError("option statementTimeout: between 10ms and 1d")
    prefetch = _boolean(given["prefetch"], "prefetch") if "prefetch" in given else True

    return SourceOptions(
        streams=tuple(names),
        database_url=settings.database_url,
        redis_url=settings.redis_url,
        prefix=settings.prefix,
        start=start,
        end=end,
        max_facts=max_facts,
        min_facts=min_facts,
        max_trigger_delay=delay,
        partitions=partitions,
        group=group,
        group_explicit=group_explicit,
        fail_on_data_loss=fail,
        poll_interval=poll,
        timestamp_in=timestamp_in,
        statement_timeout=timeout,
        prefetch=prefetch,
        end_option=end_option,
        payload_schema=_payload_schema(given),
        pattern=pattern,
        **_standby(given, env, settings),
    )


#: The source's column after the fact's: the batch's end position on the row's stream.
EPOCH_UPPER = "epoch_upper"
#: The source's own columns besides ``payload``: a schema field may not take their names.
ROW_COLUMNS = (*OWN_NAMES, EPOCH_UPPER)


def _payload_schema(given: Mapping[str, str]) -> PayloadSchema | None:
    """``schema`` (a Spark DDL string or a ``StructType`` JSON), ``mode`` and
    ``columnNameOfCorruptRecord``, checked here (parsed without Spark: the planner process has
    no JVM)."""
    if "schema" not in given:
        for option in ("mode", "columnNameOfCorruptRecord"):
            if option in given:
                raise ConfigurationError(f"option {option} applies only with option schema")
        return None
    try:
        fields = parse_schema_text(given["schema"])
        return payload_schema(
            fields,
            given.get("mode", "PERMISSIVE"),
            given.get("columnNameOfCorruptRecord", DEFAULT_CORRUPT_COLUMN),
            reserved=ROW_COLUMNS,
        )
    except SchemaError as exc:
        option = "mode" if str(exc).startswith("mode ") else "schema"
        if "corrupt-record column" in str(exc):
            option = "columnNameOfCorruptRecord"
        raise ConfigurationError(f"option {option}: {exc}") from None


def _ending(given: Mapping[str, str], names: list[str]) -> tuple[Position | None, str]:
    """The end of a batch read, and the option that set it."""
    if "endingTimestamp" in given:
        ms = _timestamp_ms(given["endingTimestamp"], "endingTimestamp")
        return Position("timestamp", timestamp_ms=ms), "endingTimestamp"
    if "endingPositionByTimestamp" in given:
        option = "endingPositionByTimestamp"
        times = _timestamps_by_stream(given[option], option, names)
        return Position("timestamps", timestamps=times), option
    if "endingPosition" in given:
        return _position(given["endingPosition"], "endingPosition", names, ending=True), (
            "endingPosition"
        )
    return None, "endingPosition"


def _trigger_limits(given: Mapping[str, str]) -> tuple[int | None, int | None, float]:
    max_facts = min_facts = None
    if "maxFactsPerTrigger" in given:
        max_facts = _positive_int(given["maxFactsPerTrigger"], "maxFactsPerTrigger")
    if "minFactsPerTrigger" in given:
        min_facts = _positive_int(given["minFactsPerTrigger"], "minFactsPerTrigger")
    if max_facts is not None and min_facts is not None and min_facts > max_facts:
        raise ConfigurationError(
            f"options minFactsPerTrigger ({min_facts}) and maxFactsPerTrigger ({max_facts}): "
            "the minimum must not exceed the maximum"
        )
    delay = DEFAULT_MAX_TRIGGER_DELAY
    if "maxTriggerDelay" in given:
        if min_facts is None:
            raise ConfigurationError("option maxTriggerDelay only applies with minFactsPerTrigger")
        delay = parse_duration(given["maxTriggerDelay"], "maxTriggerDelay")

    return max_facts, min_facts, delay


def _stream_names(given: Mapping[str, str]) -> list[str]:
    if "stream" in given and "streams" in given:
        raise ConfigurationError("options stream and streams: give one of them, not both")
    if "streamPattern" in given:
        named = [o for o in ("stream", "streams") if o in given]
        if named:
            raise ConfigurationError(
                f"options streamPattern and {named[0]}: give one of them, not both"
            )
        return []
    option = "streams" if "streams" in given else "stream"
    text = given.get(option, "")
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigurationError(
            "option stream (or streams, or streamPattern): name the stream(s) to read, e.g. "
            '.option("stream", "orders"), .option("streams", "orders,payments") or '
            '.option("streamPattern", "orders_.*")'
        )
    if len(set(names)) != len(names):
        raise ConfigurationError(f"option {option}: a stream is named twice in {text!r}")
    for name in names:
        try:
            validate_stream_name(name)
        except InvalidStreamName as exc:
            raise ConfigurationError(f"option {option}: {exc}") from None

    return names


#: Options that name streams, which a pattern query cannot (its streams are not known yet).
_BY_NAME = ("startingPositionByTimestamp", "endingPositionByTimestamp")


def _pattern(given: Mapping[str, str]) -> str | None:
    """``streamPattern``: a valid Python regex, matched in full against stream names."""
    if "streamPattern" not in given:
        return None
    text = given["streamPattern"]
    try:
        compile_pattern(text)
    except InvalidPattern as exc:
        raise ConfigurationError(f"option streamPattern: {exc}") from None
    for option in (*_BY_NAME, "startingPosition", "endingPosition"):
        if option in given and (option in _BY_NAME or given[option].strip().startswith("{")):
            raise ConfigurationError(
                f"option {option}: a pattern query (streamPattern) cannot name its streams "
                "(use earliest, latest, a stream ID or a time)"
            )
    return text


def _standby(
    given: Mapping[str, str], env: Mapping[str, str], settings: Settings
) -> dict[str, Any]:
    """``readDatabaseUrl`` (or env ``STREAMS_READ_DATABASE_URL``) and ``standbyMaxWait``."""
    read_url = given.get("readDatabaseUrl") or env.get("STREAMS_READ_DATABASE_URL") or None
    if read_url is not None:
        try:
            read_url = Settings.resolve(read_url).database_url
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"option readDatabaseUrl (or env STREAMS_READ_DATABASE_URL): {exc}"
            ) from None
    max_wait = settings.standby_max_wait
    if "standbyMaxWait" in given:
        max_wait = parse_duration(given["standbyMaxWait"], "standbyMaxWait")
        if not 0 <= max_wait <= 86400:
            raise ConfigurationError("option standbyMaxWait: between 0 and 1d")
    return {"read_database_url": read_url, "standby_max_wait": max_wait}


def _settings(given: Mapping[str, str], env: Mapping[str, str]) -> Settings:
    try:
        database_url, redis_url = with_running_servers(
            given.get("databaseUrl") or env.get("STREAMS_DATABASE_URL"),
            given.get("redisUrl") or None,
        )
        return Settings.resolve(database_url, redis_url, given.get("prefix") or None)
    except ConfigurationError as exc:
        message = str(exc)
        if "Redis" in message:
            raise ConfigurationError(f"option redisUrl: {message}") from None
        if "prefix" in message:
            raise ConfigurationError(f"option prefix: {message}") from None
        raise ConfigurationError(
            f"option databaseUrl (or env STREAMS_DATABASE_URL): {message}"
        ) from None


def default_group(names: list[str], given: Mapping[str, str], pattern: str | None = None) -> str:
    """``spark-<12 hex>``: a digest of the streams (or the pattern) and the starting options.

    A Python data source never learns its query's checkpoint location or name, so the group is
    derived from what identifies the query to the source: the same query restarted from its
    checkpoint keeps its group. Two queries with identical options share one (commits are
    forward-only, so the group then shows the furthest): set ``group`` to tell them apart.
    """
    ident: dict[str, Any] = {
        **({"pattern": pattern} if pattern is not None else {"streams": sorted(names)}),
        **{k: given[k] for k in _STARTS if k in given},
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    return f"spark-{digest}"


def _position(text: str, option: str, names: list[str], *, ending: bool) -> Position:
    raw = text.strip()
    lowered = raw.lower()
    if lowered == "latest":
        return Position("latest")
    if lowered == "earliest" and not ending:
        return Position("earliest")
    if re.fullmatch(r"\d+", raw):
        value = int(raw)
        if value < 1:
            raise ConfigurationError(f"option {option}: a stream ID must be >= 1")
        return Position("id", id=value)
    if raw.startswith("{"):
        frontier = frontier_from_json(raw, option)
        unknown = sorted(set(frontier) - set(names))
        missing = sorted(set(names) - set(frontier))
        if unknown or missing:
            raise ConfigurationError(
                f"option {option}: the frontier must name exactly the streams read "
                f"({', '.join(names)}); unknown {unknown}, missing {missing}"
            )
        return Position("frontier", frontier=dict(sorted(frontier.items())))
    choices = (
        "'latest', a stream ID or a frontier JSON"
        if ending
        else ("'earliest', 'latest', a stream ID or a frontier JSON")
    )
    raise ConfigurationError(f"option {option}: {text!r} is not valid; use {choices}")
