"""Opening PostgreSQL connections: the one place that calls ``psycopg.connect``.

`connect` and `aconnect` check the URL with libpq's own parser first (so an unparsable URL is a
`ConfigurationError` that shows the URL redacted, never libpq's message, which quotes pieces of
it), then connect, and turn a failure into a `StoreError` that says three things on one line:
what was tried (the URL, redacted), the server's own reason (the first line of libpq's message,
with every form of the password scrubbed out) and what to do next.
"""

from __future__ import annotations

import os
import re
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..config import ENCODING_HINT, redact_url, scrub_secrets, url_passwords, validate_database_url
from ..errors import ConfigurationError, StoreError

__all__ = [
    "CLIENT_TCP_SETTINGS",
    "aconnect",
    "connect",
    "connection_error",
    "parse_database_url",
    "secrets_of",
    "with_client_tcp_settings",
]

#: libpq's TCP settings on every connection this library opens, unless the URL sets them: a
#: server that stopped answering (a partition, a host that died without closing anything) is
#: noticed within about a minute, by keepalive probes while waiting for an answer and by a
#: limit on unacknowledged data while sending, instead of the operating system's two hours
#: and more. A connection to a live server is never ended by them, however long a statement
#: runs: its kernel answers the probes. The writers' server-side settings are in
#: `streams.store.writing` (``WriterCore._tcp_settings``).
CLIENT_TCP_SETTINGS = {
    "keepalives": "1",
    "keepalives_idle": "20",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "60000",
}

_START_SERVER = (
    "is PostgreSQL running there? Start it, or use the repository's docker-compose.yml "
    "(`docker compose up -d`, then postgresql://postgres:postgres@127.0.0.1:55432/streams)"
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
    (r"starting up|shutting down|recovery", "the server is not ready yet: retry shortly"),
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
    url: str, error: BaseException, *, purpose: str, secrets: list[str] | None = None
) -> StoreError:
    """The `StoreError` for a failed connection: what, the server's reason, the next step."""
    text = str(error).strip()
    first = text.splitlines()[0].strip() if text else type(error).__name__
    first = first.removeprefix("connection failed: ")
    reason = " ".join(scrub_secrets(first, secrets or secrets_of(url)).split())
    lowered = reason.lower()
    step = next((s for key, s in _NEXT_STEPS if re.search(key, lowered)), _DEFAULT_STEP)
    return StoreError(
        f"cannot connect to PostgreSQL at {redact_url(url)} ({purpose}): {reason}; {step}"
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
    url: str, *, autocommit: bool, connect_timeout: float = 10, purpose: str = "streams"
) -> psycopg.Connection[Any]:
    """A psycopg connection to `url`; `purpose` (e.g. ``"writer"``) is named in errors.

    Raises `ConfigurationError` for a URL libpq cannot parse and `StoreError` when the server
    cannot be reached or refuses the connection (see the module docstring).
    """
    params = parse_database_url(url)
    error: psycopg.Error | None = None
    try:
        return psycopg.connect(
            make_conninfo(url, **_tcp_options(params)),
            autocommit=autocommit,
            connect_timeout=_timeout(connect_timeout),
        )
    except psycopg.Error as exc:
        error = exc
    raise connection_error(url, error, purpose=purpose, secrets=secrets_of(url, params))


async def aconnect(
    url: str, *, autocommit: bool, connect_timeout: float = 10, purpose: str = "streams"
) -> psycopg.AsyncConnection[Any]:
    """The asyncio twin of `connect`."""
    params = parse_database_url(url)
    error: psycopg.Error | None = None
    try:
        return await psycopg.AsyncConnection.connect(
            make_conninfo(url, **_tcp_options(params)),
            autocommit=autocommit,
            connect_timeout=_timeout(connect_timeout),
        )
    except psycopg.Error as exc:
        error = exc
    raise connection_error(url, error, purpose=purpose, secrets=secrets_of(url, params))


def _timeout(seconds: float) -> int:
    # libpq's connect_timeout is whole seconds, and values below 2 are taken as 2.
    return max(1, round(seconds))
