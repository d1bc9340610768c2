"""Settings, names and limits: validation only, no I/O.

Configuration comes from arguments first, then the environment (the shells that open clients,
`streams.connect`, the CLI and the Spark source, then look for the servers ``streams up`` keeps
running: `streams.devservers.background.with_running_servers`):

* ``STREAMS_DATABASE_URL``: a ``postgresql://`` URL (the truth);
* ``STREAMS_REDIS_URL``: ``redis://`` or ``rediss://`` (the fast path), or
  ``redis+sentinel://`` / ``redis+cluster://`` (`streams.redis_urls`);
* ``STREAMS_PREFIX``: the Redis channel prefix, default ``streams``;
* ``STREAMS_CONNECT_TIMEOUT``: seconds spent opening a PostgreSQL connection while the server
  is starting, restarting or refusing connections, default `DEFAULT_CONNECT_TIMEOUT`;
* ``STREAMS_READ_DATABASE_URL``: a hot standby of the database, where readers read their rows
  (`streams.core.standby_fence`); ``STREAMS_STANDBY_MAX_WAIT``: seconds a reader waits for it
  when it is behind or down before reading from the primary, default
  `DEFAULT_STANDBY_MAX_WAIT`.

Secrets never leave this module unredacted: anything that shows a URL uses `redact_url`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit

from .errors import ConfigurationError, InvalidStreamName
from .redis_urls import TOPOLOGY_SCHEMES, parse_redis_url

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_PREFIX",
    "DEFAULT_STANDBY_MAX_WAIT",
    "ENCODING_HINT",
    "Settings",
    "check_read_database_url",
    "default_connect_timeout",
    "redact_url",
    "scrub_secrets",
    "url_passwords",
    "validate_database_url",
    "validate_instance_name",
    "validate_prefix",
    "validate_redis_url",
    "validate_stream_name",
]

DEFAULT_PREFIX = "streams"
#: The error when no database is configured and no `streams up` servers run here.
NO_DATABASE = (
    "no database URL: pass database_url= (--database-url), set STREAMS_DATABASE_URL, or run "
    "`streams up` in this directory to start private PostgreSQL and Redis servers"
)
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
#: How long a writer that stopped heartbeating may hold the linear position back.
DEFAULT_LEASE_SECONDS = 10.0
#: Seconds opening a PostgreSQL connection keeps trying while the server is starting up,
#: shutting down, restarting or refusing connections (`streams.store.sessions`): a restart
#: (a fast shutdown, a start and a short crash recovery) takes a few seconds, a busy one tens;
#: 30 s rides out most without hiding a server that is really down for long. Not retried at
#: all: a bad password, an unknown database or role, a bad URL.
DEFAULT_CONNECT_TIMEOUT = 30.0
#: Seconds a reader with a read URL waits for its standby before reading from the primary
#: (`streams.core.standby_fence.DEFAULT_MAX_WAIT`, repeated here: config imports no core).
DEFAULT_STANDBY_MAX_WAIT = 5.0

_STREAM_NAME = re.compile(r"[a-z][a-z0-9_.\-]{0,62}")
_INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")


def validate_stream_name(name: object) -> str:
    """A stream name: 1-63 chars, lowercase letter first, then ``[a-z0-9_.-]``.

    Names travel unquoted in wire-protocol lines and CLI output, so no spaces or control
    characters; they never reach SQL as identifiers (sequences are named by the registry id).
    """
    if not isinstance(name, str) or not _STREAM_NAME.fullmatch(name):
        raise InvalidStreamName(
            f"invalid stream name {name!r}: use 1-63 characters, a lowercase letter first, "
            "then lowercase letters, digits, '_', '.' or '-'"
        )
    return name


def validate_prefix(prefix: object) -> str:
    """A Redis channel prefix: 1-200 characters ``[A-Za-z0-9_.:/-]`` (a Synapse deployment's
    is its server name, such as ``matrix.example.org``)."""
    if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.:/\-]{1,200}", prefix):
        raise ConfigurationError(
            f"invalid channel prefix {prefix!r}: use 1-200 characters from letters, digits, "
            "'_', '.', ':', '/' or '-'"
        )
    return prefix


def validate_instance_name(name: object) -> str:
    """A writer instance name (host, pod or worker name): 1-128 chars ``[A-Za-z0-9_.:-]``."""
    if not isinstance(name, str) or not _INSTANCE_NAME.fullmatch(name):
        raise InvalidStreamName(
            f"invalid writer instance name {name!r}: use 1-128 characters from "
            "letters, digits, '_', '.', ':' or '-', starting with a letter or digit"
        )
    return name


def redact_url(url: str) -> str:
    """The URL (or libpq ``key=value`` string) with every password replaced by ``***``.

    Conservative on purpose, because a raw password may contain any of ``/ ? # @ : & =``:

    * URL form (``scheme://...``): everything between ``scheme://`` and the *last* ``@`` is
      userinfo, and everything after its first ``:`` is hidden (``redis://:pw@h``,
      ``rediss://user:pw@h``, ``unix://:pw@/path``, ``postgresql://u:pa/ss@h/db``); a
      ``password=`` parameter is hidden up to the end of the string.
    * ``key=value`` form: a ``password`` value is hidden, quoted (``'a b\\'c'``) or not, up to
      the next ``key=``.

    A URL whose last ``@`` is in the query (``?application_name=a@b``) loses more than its
    password; that is the price of never showing part of one. Parsed by hand: `urlsplit` ends
    the userinfo at the first ``/ ? #`` and would show the rest of such a password.
    """
    match = _SCHEME.match(url)
    if match is None:
        return _redact_conninfo(url)
    head, rest = url[: match.end()], url[match.end() :]
    hidden: list[tuple[int, int]] = []
    at = rest.rfind("@")
    colon = rest.find(":", 0, max(at, 0))
    if colon >= 0:
        hidden.append((colon + 1, at))
    hidden += [(m.end(1), len(rest)) for m in _QUERY_PASSWORD.finditer(rest)]
    return head + _mask(rest, hidden)


def url_passwords(url: str) -> list[str]:
    """Every string `url` may carry as a password, as written (percent-encoded or not).

    The candidates `redact_url` hides (userinfo after the first ``:``, ``password=`` values to
    the end and to the next ``&``, ``key=value`` password values, quoted or not), plus what
    `urllib.parse` would take as the password. Used to scrub driver messages with
    `scrub_secrets`.
    """
    found: list[str] = []
    match = _SCHEME.match(url)
    if match is not None:
        userinfo, at, _ = url[match.end() :].rpartition("@")
        if at and ":" in userinfo:
            password = userinfo.partition(":")[2]
            found += [password, password.partition("@")[0], password.partition("/")[0]]
        for m in _QUERY_PASSWORD.finditer(url):
            value = url[m.end(1) :]
            found += [value, value.partition("&")[0]]
        with contextlib.suppress(ValueError):
            found.append(urlsplit(url).password or "")
    else:
        for start, end in _conninfo_password_spans(url):
            raw = url[start:end]
            found += [raw, _unquote_conninfo(raw)]
    return [p for p in dict.fromkeys(found) if p]


def scrub_secrets(text: str, secrets: Iterable[str]) -> str:
    """`text` (e.g. a driver's error message) with every form of every secret replaced by ``***``.

    Each secret is scrubbed as given, percent-decoded (``%2F`` -> ``/``, ``+`` -> space) and
    percent-encoded (upper and lower case hex), and as Python's ``repr`` and JSON would escape
    it. Forms shorter than 4 characters are only scrubbed where they stand alone (not inside a
    word), so that a short password does not shred the message.
    """
    forms: set[str] = set()
    for secret in secrets:
        if not secret:
            continue
        for plain in {secret, unquote(secret), unquote_plus(secret)}:
            encoded = {
                quote(plain, safe=""),
                quote(plain, safe=_USERINFO_SAFE),
                quote_plus(plain, safe=""),
            }
            encoded |= {_lower_hex(e) for e in encoded}
            forms |= {plain, repr(plain)[1:-1], json.dumps(plain)[1:-1], *encoded}
    for form in sorted((f for f in forms if f), key=len, reverse=True):
        if len(form) >= 4:
            text = text.replace(form, "***")
        else:
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(form)}(?![A-Za-z0-9])", "***", text)
    return text


#: What to tell someone whose URL does not parse the way it reads.
ENCODING_HINT = (
    "percent-encode special characters in the user name and password "
    "(/ as %2F, @ as %40, : as %3A, ? as %3F, # as %23, & as %26, % as %25, space as %20)"
)


def validate_database_url(url: str) -> str:
    """Reject a ``postgresql://`` URL that libpq would read differently from how it reads.

    libpq takes ``user:password`` up to the first ``@`` or ``/``: with a raw ``/`` or ``@`` in
    the password, part of it becomes the host, port or database name, where server messages
    would show it. Such URLs have an ``@`` left in the host or path; they raise
    `ConfigurationError` (redacted, with `ENCODING_HINT`). Whether libpq can parse the rest is
    checked when connecting (`streams.store.sessions`), by libpq itself.
    """
    match = _SCHEME.match(url)
    if match is None:
        return url  # key=value form: libpq's own parser decides
    rest = url[match.end() :]
    if any(c.isspace() for c in rest):  # libpq drops some spaces silently, rejects others
        raise ConfigurationError(
            f"database URL {redact_url(url)!r} contains white space; {ENCODING_HINT}"
        )
    cut = min(i for i in (rest.find("@"), rest.find("/"), len(rest)) if i >= 0)
    after = rest[cut + 1 :] if rest[cut : cut + 1] == "@" else rest
    if "@" in after.partition("?")[0]:
        raise ConfigurationError(
            f"database URL {redact_url(url)!r} is ambiguous: its password (or user name) seems "
            f"to contain '/' or '@'; {ENCODING_HINT}"
        )
    return url


def validate_redis_url(url: str) -> str:
    """Reject a Redis URL that redis-py's parser (`urllib.parse`) would fail on or misread.

    Mirrors what `redis.connection.parse_url` does with the authority (this module imports no
    driver): the port must be an integer, brackets must match, and no ``@`` or ``#`` may follow
    the host (a raw ``/ ? #`` in the password ends the host early). A ``password=`` parameter
    must come last, because everything after it is hidden as password. Failures raise
    `ConfigurationError` with the URL redacted, never the parser's message, which quotes the
    URL.
    """
    scheme = _scheme_of(url)
    if scheme in TOPOLOGY_SCHEMES:
        parse_redis_url(url)  # its errors never quote the password
        return url
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigurationError(
            "Redis URL must be redis://, rediss://, unix://, redis+sentinel://, "
            f"redis+cluster:// (rediss+ for TLS), got {redact_url(url)!r}"
        )
    rest = url[len(scheme) + 3 :]
    host_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    after_host = rest[host_end:]
    query_password = _QUERY_PASSWORD.search(after_host)
    if query_password and "&" in after_host[query_password.end(1) :]:
        raise ConfigurationError(
            f"Redis URL {redact_url(url)!r}: password= must be the last query parameter "
            "(everything after it is taken as the password); percent-encode '&' in it as %26"
        )
    bad = "@" in after_host or "#" in after_host
    if not bad:
        try:
            parts = urlsplit(url)
            _ = (parts.port, parts.hostname, parts.username, parts.password)
        except ValueError:
            bad = True
    if bad:
        raise ConfigurationError(
            f"Redis URL {redact_url(url)!r} does not parse as it reads: {ENCODING_HINT}"
        )
    return url


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_QUERY_PASSWORD = re.compile(r"(?is)(password=).*\Z")
_CONNINFO_PASSWORD = re.compile(r"(?i)password\s*=\s*")
_CONNINFO_NEXT_KEY = re.compile(r"\s+[A-Za-z_][A-Za-z0-9_]*\s*=")
_USERINFO_SAFE = "!$&'()*+,;=:"


def _scheme_of(url: str) -> str:
    match = _SCHEME.match(url)
    return url[: match.end() - 3].lower() if match else ""


def _conninfo_password_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each ``password`` value in a libpq ``key=value`` string, conservatively:
    a quoted value runs to its closing quote (``\\'`` does not close it) or the end, and the
    value then extends to the next ``key=``."""
    spans = []
    pos = 0
    while (m := _CONNINFO_PASSWORD.search(text, pos)) is not None:
        start = end = m.end()
        if text[start : start + 1] == "'":
            end = start + 1
            while end < len(text) and text[end] != "'":
                end += 2 if text[end] == "\\" else 1
            end = min(end + 1, len(text))
        else:  # unquoted: up to unescaped white space
            while end < len(text) and not text[end].isspace():
                end += 2 if text[end] == "\\" else 1
            end = min(end, len(text))
        following = _CONNINFO_NEXT_KEY.search(text, end)
        end = following.start() if following else len(text)
        spans.append((start, end))
        pos = max(end, start + 1)
    return spans


def _redact_conninfo(text: str) -> str:
    return _mask(text, _conninfo_password_spans(text))


def _mask(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each maximal run covered by the (possibly overlapping) spans as ``***``."""
    covered = [False] * len(text)
    for start, end in spans:
        covered[start:end] = [True] * (end - start)
    out: list[str] = []
    for i, char in enumerate(text):
        if not covered[i]:
            out.append(char)
        elif i == 0 or not covered[i - 1]:
            out.append("***")
    return "".join(out)


def _unquote_conninfo(raw: str) -> str:
    value = raw
    if value.startswith("'"):
        value = value[1:].rsplit("'", 1)[0] if value.endswith("'") else value[1:]
    return re.sub(r"\\(.)", r"\1", value)


def _lower_hex(text: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), text)


@dataclass(frozen=True, slots=True)
class Settings:
    """Resolved settings. The repr redacts URLs, so logging a Settings is safe."""

    database_url: str = field(repr=False)
    redis_url: str | None = field(default=None, repr=False)
    prefix: str = DEFAULT_PREFIX
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    #: Readers follow one elected prober's proofs by default (`streams.proofs`; Redis only).
    shared_proofs: bool = False
    #: Seconds opening a connection waits for a server that is starting (`connect_timeout`).
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    #: A hot standby's URL: readers read their rows there, behind the fence
    #: (`streams.core.standby_fence`); None: every read goes to ``database_url``.
    read_database_url: str | None = field(default=None, repr=False)
    #: Seconds a reader waits for a standby that is behind or down before reading from the
    #: primary (`streams.core.standby_fence.StandbyRoute`).
    standby_max_wait: float = DEFAULT_STANDBY_MAX_WAIT

    def __repr__(self) -> str:
        redis = redact_url(self.redis_url) if self.redis_url else None
        read = redact_url(self.read_database_url) if self.read_database_url else None
        return (
            f"Settings(database_url={redact_url(self.database_url)!r}, redis_url={redis!r}, "
            f"prefix={self.prefix!r}, max_payload_bytes={self.max_payload_bytes}, "
            f"lease_seconds={self.lease_seconds}, shared_proofs={self.shared_proofs}, "
            f"connect_timeout={self.connect_timeout}, read_database_url={read!r}, "
            f"standby_max_wait={self.standby_max_wait})"
        )

    @classmethod
    def resolve(
        cls,
        database_url: str | None = None,
        redis_url: str | None = None,
        prefix: str | None = None,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        require_redis: bool = False,
        shared_proofs: bool | None = None,
        connect_timeout: float | None = None,
        read_database_url: str | None = None,
        standby_max_wait: float | None = None,
    ) -> Settings:
        db = database_url or os.environ.get("STREAMS_DATABASE_URL")
        if not db:
            raise ConfigurationError(NO_DATABASE)
        scheme = _scheme_of(db)
        if scheme not in ("postgresql", "postgres") and not scheme.startswith("postgresql+"):
            raise ConfigurationError(
                f"database URL must be postgresql://..., got {redact_url(db)!r}"
            )
        validate_database_url(db)
        # "" (not None): no Redis, whatever the environment says (commands that use none).
        env_redis = os.environ.get("STREAMS_REDIS_URL") if redis_url is None else None
        redis = redis_url or env_redis or None
        if redis is not None:
            validate_redis_url(redis)
        if require_redis and redis is None:
            raise ConfigurationError("no Redis URL: pass redis_url= or set STREAMS_REDIS_URL")
        chosen_prefix = validate_prefix(
            prefix
            or (os.environ.get("STREAMS_PREFIX") if prefix is None else None)
            or DEFAULT_PREFIX
        )
        if max_payload_bytes <= 0:
            raise ConfigurationError("max_payload_bytes must be positive")
        if not 0.5 <= lease_seconds <= 3600:
            raise ConfigurationError("lease_seconds must be between 0.5 and 3600")
        if shared_proofs is None:
            flag = os.environ.get("STREAMS_SHARED_PROOFS", "").strip().lower()
            if flag not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ConfigurationError(f"STREAMS_SHARED_PROOFS must be 0 or 1, not {flag!r}")
            shared_proofs = flag in ("1", "true", "yes", "on")
        if connect_timeout is None:
            connect_timeout = default_connect_timeout()
        else:
            connect_timeout = _check_connect_timeout(connect_timeout, "connect_timeout")
        read_url = read_database_url or os.environ.get("STREAMS_READ_DATABASE_URL") or None
        if read_url is not None:
            read_url = _plain_postgres_url(check_read_database_url(read_url))
        if standby_max_wait is None:
            raw = os.environ.get("STREAMS_STANDBY_MAX_WAIT", "").strip()
            standby_max_wait = _seconds(raw, "STREAMS_STANDBY_MAX_WAIT") if raw else None
        else:
            standby_max_wait = _check_max_wait(standby_max_wait, "standby_max_wait")
        return cls(
            read_database_url=read_url,
            standby_max_wait=(
                DEFAULT_STANDBY_MAX_WAIT if standby_max_wait is None else standby_max_wait
            ),
            database_url=_plain_postgres_url(db),
            redis_url=redis,
            prefix=chosen_prefix,
            max_payload_bytes=max_payload_bytes,
            lease_seconds=lease_seconds,
            shared_proofs=shared_proofs,
            connect_timeout=connect_timeout,
        )


def default_connect_timeout() -> float:
    """``STREAMS_CONNECT_TIMEOUT`` if set, else `DEFAULT_CONNECT_TIMEOUT` (the default of every
    connection the library opens, the command line's included)."""
    raw = os.environ.get("STREAMS_CONNECT_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_CONNECT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    return _check_connect_timeout(value, "STREAMS_CONNECT_TIMEOUT")


def _check_connect_timeout(value: float, what: str) -> float:
    if not (isinstance(value, int | float) and 0 <= value <= 3600):  # also rejects NaN
        raise ConfigurationError(f"{what} must be a number of seconds from 0 to 3600")
    return float(value)


def check_read_database_url(url: str) -> str:
    """A read URL (``STREAMS_READ_DATABASE_URL``, ``read_database_url=``, Spark's
    ``readDatabaseUrl``): a PostgreSQL URL, as the database URL; `ConfigurationError` else."""
    scheme = _scheme_of(url)
    if scheme not in ("postgresql", "postgres") and not scheme.startswith("postgresql+"):
        raise ConfigurationError(f"read URL must be postgresql://..., got {redact_url(url)!r}")
    validate_database_url(url)
    return url


def _seconds(raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    return _check_max_wait(value, what)


def _check_max_wait(value: float, what: str) -> float:
    if isinstance(value, bool) or not (isinstance(value, int | float) and 0 <= value <= 86400):
        raise ConfigurationError(f"{what} must be a number of seconds from 0 to 86400")
    return float(value)


def _plain_postgres_url(url: str) -> str:
    """psycopg wants ``postgresql://``; accept SQLAlchemy's ``postgresql+psycopg://`` too."""
    scheme, sep, rest = url.partition("://")
    if scheme.startswith("postgresql+"):
        return f"postgresql{sep}{rest}"
    return url
