"""Opening PostgreSQL connections: the one place that calls ``psycopg.connect``.

`connect` and `aconnect` check the URL with libpq's own parser first (so an unparsable URL is a
`ConfigurationError` that shows the URL redacted, never libpq's message, which quotes pieces of
it), then connect, and turn a failure into a `StoreError` that says three things on one line:
what was tried (the URL, redacted), the server's own reason (the first line of libpq's message,
with every form of the password scrubbed out) and what to do next.

Waiting for a starting server
-----------------------------
A server that is starting up, shutting down or restarting refuses connections for a while
(the socket is closed, or it answers SQLSTATE 57P03, "the database system is starting up").
Such a failure is *transient*: the same attempt a little later succeeds. Both drivers try
again, with backoff, until ``connect_timeout`` seconds have passed since the first attempt
(default `streams.config.DEFAULT_CONNECT_TIMEOUT`, or ``STREAMS_CONNECT_TIMEOUT``), then raise
the `StoreError` above, saying how long they tried. Everything else fails at once: a bad
password, an unknown database or role, a host name that does not resolve, SSL settings. One
attempt never waits longer than `ATTEMPT_TIMEOUT` (libpq's own ``connect_timeout``, for a host
that does not answer at all) nor past the total. ``connect_timeout=0`` makes a single attempt
of up to `ATTEMPT_TIMEOUT`, as before this wait existed: what readers and writers do when they
reopen a connection, since they retry at their own pace (opening them waits).
The retry logic is one plan (`_open`, `streams.plans`) that both drivers run.

Opening checks
--------------
A session is not open until its checks have passed: the schema is migrated, the database is
the history its owner started on (`streams.store.identity`), the session's settings are set.
Those run as part of each attempt (``opening``: a store generator made afresh for each one), so
a server that ends the new session or restarts while they run is one more transient failure
waited out within ``connect_timeout``, exactly as a refused connection is; when the time is
up, their own error is raised, as it would have been on a single attempt. A check that fails
for good (`DatabaseChanged`, an unmigrated schema, a refused privilege) fails at once.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import set_json_loads

from ..config import (
    ENCODING_HINT,
    default_connect_timeout,
    redact_url,
    scrub_secrets,
    url_passwords,
    validate_database_url,
)
from ..core.payloads import decode_payload
from ..core.replication import backoff_delay
from ..errors import ConfigurationError, ConnectionLost, StoreError
from ..plans import Call, Io, Plan, Sleep, adrive, drive
from .driver import Gen, arun, run, transient_sqlstate

__all__ = [
    "ATTEMPT_TIMEOUT",
    "CLIENT_TCP_SETTINGS",
    "Opening",
    "aconnect",
    "connect",
    "connection_error",
    "parse_database_url",
    "secrets_of",
    "transient_connect_error",
    "use_payload_decoder",
    "with_client_tcp_settings",
]

log = logging.getLogger("streams.connect")

#: Most seconds one attempt may take (libpq's ``connect_timeout``, whole seconds, at least 2):
#: it matters only for a host that does not answer at all; a server that is down or starting
#: answers at once.
ATTEMPT_TIMEOUT = 10
#: Most seconds between two attempts (the backoff starts at 50 ms): a server that has started
#: is noticed within about this long.
RETRY_CAP = 1.0

#: libpq's TCP settings on every connection this library opens, unless the URL sets them: a
#: server that stopped answering (a partition, a host that died without closing anything) is
#: noticed within about a minute, by keepalive probes while waiting for an answer and by a
#: limit on unacknowledged data while sending, instead of the operating system's two hours
#: and more. A connection to a live server is never ended by them, however long a statement
#: runs: its kernel answers the probes. The writers' server-side settings are in
#: `streams.store.writer_sql` (``tcp_settings``).
CLIENT_TCP_SETTINGS = {
    "keepalives": "1",
    "keepalives_idle": "20",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "60000",
}

#: A session's opening checks (see "Opening checks"): a new store generator per attempt.
Opening: TypeAlias = Callable[[], Gen[Any]]

_START_SERVER = (
    "is PostgreSQL running there? Start it; or, for development, run `streams up` (private "
    "servers in ./.streams/, found with no URL set) or the repository's `docker compose up -d` "
    "(then postgresql://postgres:postgres@127.0.0.1:55432/streams)"
)
#: (pattern searched in libpq's reason, lower case) -> next step; the first match wins.
_NEXT_STEPS = (
    (r"connection refused|no such file or directory", _START_SERVER),
    (r"resolve host|translate host name", "check the host name in the URL"),
    (r"timeout|timed out", f"the server did not answer in time; {_START_SERVER}"),
    (r"unreachable|no route to host", f"check the host and the network; {_START_SERVER}"),
    (r"pg_hba\.conf", "the server refuses this user/host: check its pg_hba.conf"),
    (
        r"database \S+ does not exist",
        "create the database (`createdb NAME` or CREATE DATABASE) or fix its name in the URL",
    ),
    (r"role \S+ does not exist", "check the user name in the URL, or create the role"),
    (r"password", f"check the user and password in the URL ({ENCODING_HINT})"),
    (
        r"starting up|shutting down|recovery|not (yet )?accepting connections",
        "the server is not ready yet: retry shortly, or raise connect_timeout",
    ),
    (r"ssl", "check sslmode and the server's SSL settings"),
)
_DEFAULT_STEP = "check the URL and that the server accepts connections (`streams doctor`)"


def parse_database_url(url: str) -> dict[str, Any]:
    """libpq's reading of `url` (``postgresql://`` URL or ``key=value`` string) as a dict.

    Raises `ConfigurationError` with the URL redacted and a hint to percent-encode special
    characters when libpq cannot parse it, or when it would read it differently from how it
    reads (see `streams.config.validate_database_url`). libpq's message is never shown: it
    quotes the part of the URL it choked on, which may be part of the password.
    """
    validate_database_url(url)
    failed = False
    try:
        params = conninfo_to_dict(url)
    except Exception:  # psycopg.ProgrammingError, UnicodeDecodeError on bad %-escapes, ...
        failed = True
    if failed:  # raised outside the except block: no chained driver message
        raise ConfigurationError(
            f"cannot parse the database URL {redact_url(url)!r}: {ENCODING_HINT}"
        )
    return params


def secrets_of(url: str, params: dict[str, Any] | None = None) -> list[str]:
    """Every password `url` may carry (as written and as libpq reads it), and PGPASSWORD."""
    found = url_passwords(url)
    if params and params.get("password"):
        found.append(str(params["password"]))
    if os.environ.get("PGPASSWORD"):
        found.append(os.environ["PGPASSWORD"])
    return found


def connection_error(
    url: str,
    error: BaseException,
    *,
    purpose: str,
    secrets: list[str] | None = None,
    tried: tuple[int, float] | None = None,
) -> StoreError:
    """The `StoreError` for a failed connection: what, the server's reason, the next step.
    ``tried``: (attempts, seconds) when the failure was transient and waited for in vain."""
    text = str(error).strip()
    first = text.splitlines()[0].strip() if text else type(error).__name__
    first = first.removeprefix("connection failed: ")
    reason = " ".join(scrub_secrets(first, secrets or secrets_of(url)).split())
    lowered = reason.lower()
    step = next((s for key, s in _NEXT_STEPS if re.search(key, lowered)), _DEFAULT_STEP)
    if tried is not None and tried[0] > 1:
        reason += f" (still, after {tried[0]} attempts in {tried[1]:.1f} s)"
    return StoreError(
        f"cannot connect to PostgreSQL at {redact_url(url)} ({purpose}): {reason}; {step}"
    )


#: libpq's reasons (lower case) for a failed connection that a server starting, stopping or
#: restarting gives, when the error carries no SQLSTATE (libpq reports most failures of the
#: connection phase as text only): nothing listens yet or any more (refused; a Unix socket not
#: there), the server says it is not ready, ended the session, or did not answer in time.
_TRANSIENT_REASONS = re.compile(
    r"connection refused|no such file or directory|starting up|shutting down|"
    r"not (yet )?accepting connections|recovery mode|timeout expired|timed out|"
    r"server closed the connection|connection reset|could not receive data|"
    r"could not send data|too many clients|terminating connection"
)


def transient_connect_error(error: BaseException) -> bool:
    """Is this failure to connect worth another attempt soon (see "Waiting for a starting
    server")? A SQLSTATE decides when there is one (`streams.store.driver.transient_sqlstate`:
    57P03 "cannot connect now", 53300 "too many connections", class 08); otherwise libpq's
    reason must be one of `_TRANSIENT_REASONS`. A bad password, an unknown database or role, a
    host name that does not resolve are not. An opening check's `StoreError` is transient when
    the session was lost under it or the server's error is (see "Opening checks")."""
    if isinstance(error, ConnectionLost):
        return True
    sqlstate = getattr(error, "sqlstate", None)
    if sqlstate is not None:
        return transient_sqlstate(sqlstate)
    return bool(_TRANSIENT_REASONS.search(str(error).lower()))


class _Connect(Io):
    """One attempt: a new connection (psycopg's, or its asyncio twin), libpq waiting at most
    ``timeout`` seconds for the server to answer."""

    def __init__(self, conninfo: str, autocommit: bool, timeout: int) -> None:
        super().__init__(
            psycopg.Connection.connect,
            psycopg.AsyncConnection.connect,
            conninfo,
            autocommit=autocommit,
            connect_timeout=timeout,
        )


class _Check(Io):
    """Run the opening checks on the new connection (`streams.store.steps.Run`, which this
    module cannot import: ``steps`` imports it)."""

    def __init__(self, conn: Any, gen: Gen[Any]) -> None:
        super().__init__(run, arun, conn, gen)


def _open(
    url: str,
    *,
    autocommit: bool,
    connect_timeout: float | None,
    purpose: str,
    opening: Opening | None,
    decode_payloads: bool,
) -> Plan[Any]:
    """The plan of `connect` and `aconnect`: attempts until one connects and passes its
    opening checks (the connection is returned), waiting between transient failures; raises
    the `StoreError` when a failure is not transient or ``connect_timeout`` is over."""
    params = parse_database_url(url)
    conninfo = make_conninfo(url, **_tcp_options(params))
    total = default_connect_timeout() if connect_timeout is None else connect_timeout
    started = time.monotonic()
    deadline = started + total
    attempt = 0
    while True:
        # One attempt (0) may take libpq's usual limit; several share the total.
        limit = ATTEMPT_TIMEOUT if total <= 0 else deadline - time.monotonic()
        error: psycopg.Error | StoreError
        try:
            conn = yield _Connect(conninfo, autocommit, _timeout(min(ATTEMPT_TIMEOUT, limit)))
        except psycopg.Error as exc:
            error = exc
        else:
            if decode_payloads:
                use_payload_decoder(conn)
            if opening is None:
                return conn
            try:
                yield _Check(conn, opening())
                return conn
            except StoreError as exc:
                yield Call(conn.close)
                error = exc
            except BaseException:  # a cancellation too: no half-open connection is left
                yield Call(conn.close)
                raise
        # Decided outside the except blocks: no chained driver message.
        attempt += 1
        remaining = deadline - time.monotonic()
        if isinstance(error, StoreError) and (not transient_connect_error(error) or remaining <= 0):
            raise error  # an opening check's own error, as a single attempt would raise it
        if not transient_connect_error(error) or remaining <= 0:
            tried = (attempt, time.monotonic() - started)
            raise connection_error(
                url, error, purpose=purpose, secrets=secrets_of(url, params), tried=tried
            )
        if attempt == 1:
            # Said once per connection: an operator sees why a start or a call is slow.
            log.warning(
                "%s; trying again for up to %.0f s",
                f"opening a session ({purpose}): {error}"
                if isinstance(error, StoreError)
                else connection_error(url, error, purpose=purpose, secrets=secrets_of(url, params)),
                total,
            )
        # The last attempt comes at the deadline, not a backoff step before it.
        yield Sleep(
            min(remaining, backoff_delay(attempt - 1, cap=RETRY_CAP, jitter=random.random()))
        )


def _tcp_options(params: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in CLIENT_TCP_SETTINGS.items() if k not in params}


def with_client_tcp_settings(url: str) -> str:
    """``url`` with `CLIENT_TCP_SETTINGS` added where it sets none of its own (for drivers
    that take only a URL, such as ADBC's)."""
    extra = _tcp_options(parse_database_url(url))
    if not extra:
        return url
    if re.match(r"postgres(ql)?://", url):
        return url + ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in extra.items())
    return " ".join([url, *(f"{k}={v}" for k, v in extra.items())])


def connect(
    url: str,
    *,
    autocommit: bool,
    connect_timeout: float | None = None,
    purpose: str = "streams",
    opening: Opening | None = None,
    decode_payloads: bool = False,
) -> psycopg.Connection[Any]:
    """A psycopg connection to `url`; `purpose` (e.g. ``"writer"``) is named in errors.

    ``connect_timeout``: the most seconds to keep trying while the server is starting,
    restarting or refusing connections (None: `streams.config.default_connect_timeout`; see
    "Waiting for a starting server"). ``opening``: the session's checks, part of each attempt
    (see "Opening checks"). ``decode_payloads``: `use_payload_decoder` (before ``opening``).
    Raises `ConfigurationError` for a URL libpq cannot parse and `StoreError` when the server
    cannot be reached or refuses the connection.
    """
    conn: psycopg.Connection[Any] = drive(
        _open(
            url,
            autocommit=autocommit,
            connect_timeout=connect_timeout,
            purpose=purpose,
            opening=opening,
            decode_payloads=decode_payloads,
        )
    )
    return conn


async def aconnect(
    url: str,
    *,
    autocommit: bool,
    connect_timeout: float | None = None,
    purpose: str = "streams",
    opening: Opening | None = None,
    decode_payloads: bool = False,
) -> psycopg.AsyncConnection[Any]:
    """The asyncio twin of `connect`."""
    conn: psycopg.AsyncConnection[Any] = await adrive(
        _open(
            url,
            autocommit=autocommit,
            connect_timeout=connect_timeout,
            purpose=purpose,
            opening=opening,
            decode_payloads=decode_payloads,
        )
    )
    return conn


def _timeout(seconds: float) -> int:
    # libpq's connect_timeout is whole seconds, and values below 2 are taken as 2; never 0
    # (which libpq reads as "wait for ever").
    return max(2, math.ceil(seconds))


def use_payload_decoder(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Load ``jsonb`` values on ``conn`` with the payload codec (`streams.core.payloads`)
    rather than psycopg's ``json.loads``: a reader session's payloads decode as every other
    read of the library decodes them."""
    set_json_loads(decode_payload, conn)
