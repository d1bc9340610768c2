"""Redis failures as errors that say what failed, where, why, and what to do next.

The twin of `streams.store.sessions` for Redis: `connection_error` turns a redis-py error into a
`RedisUnavailable` whose message names what was tried (the URL, redacted), Redis's or the
system's reason (the first line of redis-py's message, every form of the password scrubbed
out) and the next step. Only for the places where Redis is required (``streams positions
--from-redis``, the latency benchmark, the doctor's check): a link between readers and writers
never raises, it reconnects and the readers poll PostgreSQL meanwhile (`streams.transport.link`).
"""

from __future__ import annotations

import re

from ..config import ENCODING_HINT, redact_url, scrub_secrets, url_passwords
from ..errors import RedisUnavailable

__all__ = ["connection_error"]

_START_SERVER = (
    "is Redis running there? Start it; or, for development, run `streams up` (private "
    "servers in ./.streams/, found with no URL set) or the repository's `docker compose up -d` "
    "(then redis://127.0.0.1:56379/0)"
)
#: (pattern searched in redis-py's reason, lower case) -> next step; the first match wins.
_NEXT_STEPS = (
    (r"connection refused|error 111|error 61\b", _START_SERVER),
    (
        r"name or service not known|nodename nor servname|name resolution|getaddrinfo",
        "check the host name in the URL",
    ),
    (r"timeout|timed out", f"the server did not answer in time; {_START_SERVER}"),
    (r"unreachable|no route to host", f"check the host and the network; {_START_SERVER}"),
    (
        r"wrongpass|invalid username-password|invalid password|without any password|noauth"
        r"|authentication required|auth",
        f"check the user and password in the URL ({ENCODING_HINT})",
    ),
    (r"max number of clients", "the server refuses more connections: check its maxclients"),
    (r"ssl|certificate|tls", "check rediss:// and the server's TLS settings"),
    (r"loading", "the server is loading its data: retry shortly"),
)
_DEFAULT_STEP = "check the URL and that the server accepts connections (`streams doctor`)"


def connection_error(url: str, error: BaseException, *, purpose: str) -> RedisUnavailable:
    """The `RedisUnavailable` for a failure talking to Redis at `url` (see the module doc)."""
    text = str(error).strip()
    first = text.splitlines()[0].strip() if text else type(error).__name__
    reason = " ".join(scrub_secrets(first, url_passwords(url)).split())
    lowered = f"{type(error).__name__} {reason}".lower()
    step = next((s for key, s in _NEXT_STEPS if re.search(key, lowered)), _DEFAULT_STEP)
    return RedisUnavailable(
        f"cannot use Redis at {redact_url(url)} ({purpose}): {reason or type(error).__name__}; "
        f"{step}"
    )
