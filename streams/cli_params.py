"""What every `streams` command shares: its parameter types and its error discipline.

The operator's commands (`streams.ops`) and the benchmarks (`streams.bench`, and those of
installed packages, `streams.plugins`) both take them from here, so neither imports the other.

Parameter types check a value where click parses it, so a bad one is a usage error naming the
option (``Error: Invalid value for '--from-time': ...``) before any connection is made: every
number has a range, every float is finite, names and durations are checked by the same rules
the library applies (`streams.config`), durations are bounded.

`common_options` adds ``--database-url``, ``--redis-url``, ``--prefix`` and ``--embedded`` to a
command and turns any failure into one ``Error: ...`` line on stderr (exit 1) that says what
failed and never shows a secret (`failure_line`). Its last resort, for an exception nothing
here recognises, shows only the class name ("details withheld"); the CLI's property test
(tests/cli/test_cli_errors.py) holds that no input, with the servers up or down, ends there.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, overload

import click
import psycopg
import redis
from click.core import ParameterSource

from .config import (
    Settings,
    scrub_secrets,
    url_passwords,
    validate_instance_name,
    validate_prefix,
    validate_redis_url,
    validate_stream_name,
)
from .errors import StreamsError
from .store import sessions
from .transport import redis_errors

__all__ = [
    "DURATION",
    "GROUP_NAME",
    "INSTANCE_NAME",
    "LAST_DATE_MS",
    "MAX_DURATION_MS",
    "MAX_ID",
    "MAX_READABLE_MS",
    "PREFIX",
    "RETENTION",
    "STREAM_ID",
    "STREAM_NAME",
    "Duration",
    "FiniteFloat",
    "IntList",
    "ListenAddress",
    "NameList",
    "common_options",
    "failure_line",
    "parse_duration_ms",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The largest stream ID: PostgreSQL's bigint.
MAX_ID = 2**63 - 1
#: The last millisecond a date can show (9999-12-31T23:59:59.999Z).
LAST_DATE_MS = 253_402_300_799_999
#: A start by time beyond the last date (9999-12-31T23:59:59.999Z) cannot be made a date.
MAX_READABLE_MS = LAST_DATE_MS
#: Durations up to a million days: beyond the epoch from any date (``--ago 100000d`` reads
#: everything), and far inside what dates and bigint milliseconds can hold.
MAX_DURATION_MS = 1_000_000 * 86_400_000

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")
_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: str, *, max_ms: int = MAX_DURATION_MS) -> int:
    """``90s``, ``5m``, ``1h30m``, ``250ms`` -> milliseconds (at most `max_ms`)."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise click.BadParameter(f"invalid duration {text!r} (e.g. 250ms, 90s, 5m, 1h30m)")
    if any(len(n) > 15 for n, _ in parts):  # beyond any bound below, and cheap to refuse
        raise click.BadParameter(f"duration {text!r} is too long (at most {max_ms // 86_400_000}d)")
    ms = sum(int(n) * _UNITS[u] for n, u in parts)
    if ms > max_ms:
        raise click.BadParameter(f"duration {text!r} is too long (at most {max_ms // 86_400_000}d)")
    return ms


class Duration(click.ParamType[int]):
    """A duration such as ``5m`` or ``1h30m``, as milliseconds in ``[min_ms, max_ms]``."""

    name = "duration"

    def __init__(self, min_ms: int = 0, max_ms: int = MAX_DURATION_MS) -> None:
        self.min_ms, self.max_ms = min_ms, max_ms

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value  # a default already in ms
        try:
            ms = parse_duration_ms(str(value), max_ms=self.max_ms)
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)
        if ms < self.min_ms:
            self.fail(f"duration {value!r} is too short (at least {self.min_ms} ms)", param, ctx)
        return ms


class FiniteFloat(click.FloatRange):
    """A float range that also refuses ``nan`` and ``inf`` (click's range lets ``nan`` by:
    every comparison with it is false)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a valid float", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class ListenAddress(click.ParamType[tuple[str, int]]):
    """``ADDR:PORT`` to serve on (``[::1]:9465`` for IPv6), as ``(addr, port)``; the port in
    0-65535. Whether the address is this host's is only known when it is bound."""

    name = "addr:port"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        addr, sep, port = str(value).rpartition(":")
        addr = addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr
        if not sep or not addr or not port.isascii() or not port.isdigit() or len(port) > 5:
            self.fail(f"{value!r} is not ADDR:PORT (e.g. 127.0.0.1:9465)", param, ctx)
        if int(port) > 65535 or not addr.isprintable():
            self.fail(f"{value!r}: the port is 0-65535, the address printable", param, ctx)
        return addr, int(port)


class _Checked(click.ParamType[str]):
    """A name checked by one of the library's validators before anything connects.

    Its error is the library's own, as one line with exit status 1 (``Error:
    InvalidStreamName: ...``), exactly as when the library raises it: a contract of the CLI
    older than this check.
    """

    def __init__(self, name: str, check: Callable[[str], Any]) -> None:
        self.name = name
        self._check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        line = None
        try:
            self._check(value)
        except StreamsError as exc:
            line = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:
            line = f"InvalidName: {exc}"
        if line is not None:
            raise click.ClickException(line)
        return value


def _check_group(name: str) -> None:
    if not 0 < len(name) <= 200 or not name.isprintable():
        raise ValueError(f"invalid group name {name!r}: use 1-200 printable characters")


class _Retention(Duration):
    """``forever``, or a duration of at least 1 ms."""

    name = "duration|forever"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return "forever" if value == "forever" else super().convert(value, param, ctx)


RETENTION = _Retention(min_ms=1)
STREAM_NAME = _Checked("stream", validate_stream_name)
PREFIX = _Checked("prefix", validate_prefix)
INSTANCE_NAME = _Checked("instance", validate_instance_name)
GROUP_NAME = _Checked("group", _check_group)
STREAM_ID = click.IntRange(1, MAX_ID)
DURATION = Duration()


class IntList(click.ParamType[list[int]]):
    """Comma-separated integers, each in ``[min, max]`` (``1,4,16``)."""

    name = "integers"

    def __init__(self, min: int, max: int) -> None:
        self.min, self.max = min, max

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, list):
            return value
        items = [item.strip() for item in str(value).split(",")]
        if not all(re.fullmatch(r"\d{1,9}", item) for item in items):
            self.fail(f"{value!r}: use comma-separated integers, e.g. 1,4,16", param, ctx)
        numbers = [int(item) for item in items]
        if not all(self.min <= n <= self.max for n in numbers):
            self.fail(f"{value!r}: each must be in [{self.min}, {self.max}]", param, ctx)
        return numbers


class NameList(click.ParamType[list[str]]):
    """Comma-separated names, each one of ``choices`` (``shared,own``)."""

    name = "names"

    def __init__(self, choices: tuple[str, ...]) -> None:
        self.choices = choices

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, list):
            return value
        items = [item.strip() for item in str(value).split(",")]
        if not items or any(item not in self.choices for item in items):
            self.fail(
                f"{value!r}: use comma-separated names among {', '.join(self.choices)}",
                param,
                ctx,
            )
        return items


# ------------------------------------------------------------------------------- errors


def failure_line(exc: BaseException, database_url: object, redis_url: object) -> str:
    """One line for a failed command: what failed and why, every form of a password out.

    The URLs are the command's (for the passwords to scrub, and to name where Redis failed).
    """
    urls = [url for url in (database_url, redis_url) if isinstance(url, str)]
    secrets = [p for url in urls for p in url_passwords(url)]
    if isinstance(exc, StreamsError):
        line = f"{type(exc).__name__}: {exc}"
    elif isinstance(exc, psycopg.OperationalError) and _connecting(exc):
        # A connection opened outside `streams.store.sessions` (a benchmark's, a demo's): the same
        # treatment, what was tried and what to do next.
        url = database_url if isinstance(database_url, str) else ""
        store_error = sessions.connection_error(url, exc, purpose="command", secrets=secrets)
        line = f"{type(store_error).__name__}: {store_error}"
    elif isinstance(exc, psycopg.Error):
        # A server message: its first line.
        first = (str(exc).strip().splitlines() or [""])[0]
        line = f"StoreError: {type(exc).__name__}: {first}"
    elif isinstance(exc, redis.RedisError) and isinstance(redis_url, str):
        redis_error = redis_errors.connection_error(redis_url, exc, purpose="command")
        line = f"{type(redis_error).__name__}: {redis_error}"
    elif isinstance(exc, OSError) and exc.strerror:
        # The system's own words (errno text): "Address already in use", "No space left".
        line = f"{type(exc).__name__}: {exc.strerror}"
    else:
        # Anything else from the driver layers (redis-py's URL parser, SQLAlchemy, ...) may
        # quote a fragment of a password that no scrubbing can recognise: class name only.
        line = f"unexpected {type(exc).__name__} (details withheld: they may contain a secret)"
    return " ".join(scrub_secrets(line, secrets).split())


def _connecting(exc: psycopg.Error) -> bool:
    """Did libpq fail to connect (rather than a statement fail)?"""
    return str(exc).lstrip().startswith(("connection failed", "connection to server"))


def _check_database_url(url: str) -> None:
    if url:  # empty: not configured (the environment, or embedded servers for `demo`)
        Settings.resolve(url, "", "")  # the scheme, what libpq would misread (no Redis)
        sessions.parse_database_url(url)  # what libpq cannot parse at all


def _check_redis_url(url: str) -> None:
    if url:  # empty: no Redis
        validate_redis_url(url)


DATABASE_URL = _Checked("url", _check_database_url)
REDIS_URL = _Checked("url", _check_redis_url)


#: Commands that start embedded servers when no database URL is configured at all.
EMBEDDED_BY_DEFAULT = frozenset({"demo"})

#: Where embedded servers keep their data (relative to the working directory).
EMBEDDED_DIR = Path(".streams")


def read_url_option(func: F) -> F:
    """``--read-database-url``: a hot standby where a reading command reads its rows, while
    completeness is proven on ``--database-url`` (`streams.core.standby_fence`)."""
    option = click.option(
        "--read-database-url",
        envvar="STREAMS_READ_DATABASE_URL",
        type=DATABASE_URL,
        default=None,
        help="postgresql:// URL of a hot standby to read rows from (proofs stay on the primary)",
    )
    return option(func)


@overload
def common_options(func: F) -> F: ...


@overload
def common_options(*, redis: bool = ...) -> Callable[[F], F]: ...


def common_options(func: F | None = None, *, redis: bool = True) -> Any:
    """``--database-url``, ``--redis-url``, ``--prefix``, ``--embedded``, and the error
    discipline of the module docstring, for one command. ``redis=False``: the command never
    uses Redis, so it neither checks ``--redis-url`` and ``--prefix`` (nor their variables:
    a bad ``STREAMS_REDIS_URL`` must not break ``streams list``) nor passes them on."""
    if func is None:
        return functools.partial(common_options, redis=redis)
    unused = " (not used by this command)" if not redis else ""

    @click.option(
        "--database-url", envvar="STREAMS_DATABASE_URL", type=DATABASE_URL, help="postgresql:// URL"
    )
    @click.option(
        "--redis-url",
        envvar="STREAMS_REDIS_URL",
        type=REDIS_URL if redis else click.STRING,
        help=f"redis:// or rediss:// URL{unused}",
    )
    @click.option(
        "--prefix",
        envvar="STREAMS_PREFIX",
        default=None,
        type=PREFIX if redis else click.STRING,
        help=f"Redis channel prefix{unused}",
    )
    @click.option(
        "--embedded",
        is_flag=True,
        help="Start (or reuse) private PostgreSQL and Redis servers, data in ./.streams/.",
    )
    @functools.wraps(func)
    def wrapper(*args: Any, embedded: bool, **kwargs: Any) -> Any:
        if not redis:  # "": none, and not the environment's either (`Settings.resolve`)
            kwargs["redis_url"] = kwargs["prefix"] = ""
        # The line is built outside the except block, so that no driver exception (whose
        # text may quote the URL) is chained to what click prints.
        try:
            with contextlib.ExitStack() as stack:
                if not embedded and not kwargs["database_url"]:
                    _use_background(kwargs, redis)  # `streams up`'s servers, if they run
                if embedded or (
                    func.__name__ in EMBEDDED_BY_DEFAULT and not kwargs["database_url"]
                ):
                    _use_embedded(stack, kwargs, explicit=embedded, redis=redis)
                return func(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            line = failure_line(exc, kwargs.get("database_url"), kwargs.get("redis_url"))
        raise click.ClickException(line)

    return wrapper


def _use_background(kwargs: dict[str, Any], redis: bool) -> None:
    """Point a command with no database URL at the servers `streams up` keeps running for this
    directory (or a parent), Redis included unless one is given or the command uses none."""
    from .devservers.background import find_running

    found = find_running()
    if found is not None:
        kwargs["database_url"] = found.database_url
        if redis:
            kwargs["redis_url"] = kwargs.get("redis_url") or found.redis_url


def _use_embedded(
    stack: contextlib.ExitStack, kwargs: dict[str, Any], *, explicit: bool, redis: bool
) -> None:
    """Start (or join) the project's private servers and point the command at them."""
    ctx = click.get_current_context()
    if explicit and ctx.get_parameter_source("database_url") == ParameterSource.COMMANDLINE:
        raise click.UsageError("--embedded starts its own database: drop --database-url")
    from .devservers import embedded_servers

    urls = stack.enter_context(
        embedded_servers(EMBEDDED_DIR, announce=lambda line: click.echo(line, err=True))
    )
    kwargs["database_url"] = urls.database_url
    if redis:
        kwargs["redis_url"] = urls.redis_url
