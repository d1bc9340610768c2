"""Settings, names and limits: validation only, no I/O.

Configuration comes from arguments first, then the environment:

* ``STREAMS_DATABASE_URL``: a ``postgresql://`` URL (the truth);
* ``STREAMS_REDIS_URL``: ``redis://`` or ``rediss://`` (the fast path);
* ``STREAMS_PREFIX``: the Redis channel prefix, default ``streams``.

Secrets never leave this module unredacted: anything that shows a URL uses `redact_url`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .errors import ConfigurationError, InvalidStreamName

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_PREFIX",
    "Settings",
    "redact_url",
    "validate_instance_name",
    "validate_stream_name",
]

DEFAULT_PREFIX = "streams"
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
#: How long a writer that stopped heartbeating may hold the linear position back.
DEFAULT_LEASE_SECONDS = 10.0

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


def validate_instance_name(name: object) -> str:
    """A writer instance name (host, pod or worker name): 1-128 chars ``[A-Za-z0-9_.:-]``."""
    if not isinstance(name, str) or not _INSTANCE_NAME.fullmatch(name):
        raise InvalidStreamName(
            f"invalid writer instance name {name!r}: use 1-128 characters from "
            "letters, digits, '_', '.', ':' or '-', starting with a letter or digit"
        )
    return name


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (userinfo and ``password=`` parameters).

    Parsed by hand rather than with `urllib.parse.urlsplit`, which ends the host part at the
    first ``?`` or ``#`` and would therefore miss (and leak) a password containing one that
    libpq accepts, and which rewrites empty-host URLs such as ``postgresql:///db``.
    """
    scheme, sep, rest = url.partition("://")
    if sep:
        slash = rest.find("/")
        authority, tail = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
        if "@" in authority:
            userinfo, _, hostport = authority.rpartition("@")
            user, colon, _ = userinfo.partition(":")
            authority = f"{user}:***@{hostport}" if colon else f"{user}@{hostport}"
        url = f"{scheme}{sep}{authority}{tail}"
    return re.sub(r"(?i)(password=)[^&\s]*", r"\1***", url)


@dataclass(frozen=True, slots=True)
class Settings:
    """Resolved settings. The repr redacts URLs, so logging a Settings is safe."""

    database_url: str = field(repr=False)
    redis_url: str | None = field(default=None, repr=False)
    prefix: str = DEFAULT_PREFIX
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    def __repr__(self) -> str:
        redis = redact_url(self.redis_url) if self.redis_url else None
        return (
            f"Settings(database_url={redact_url(self.database_url)!r}, redis_url={redis!r}, "
            f"prefix={self.prefix!r}, max_payload_bytes={self.max_payload_bytes}, "
            f"lease_seconds={self.lease_seconds})"
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
    ) -> Settings:
        db = database_url or os.environ.get("STREAMS_DATABASE_URL")
        if not db:
            raise ConfigurationError(
                "no database URL: pass database_url= or set STREAMS_DATABASE_URL"
            )
        scheme = urlsplit(db).scheme
        if scheme not in ("postgresql", "postgres") and not scheme.startswith("postgresql+"):
            raise ConfigurationError(
                f"database URL must be postgresql://..., got {redact_url(db)!r}"
            )
        redis = redis_url or os.environ.get("STREAMS_REDIS_URL") or None
        if redis is not None and urlsplit(redis).scheme not in ("redis", "rediss", "unix"):
            raise ConfigurationError(
                f"Redis URL must be redis://, rediss:// or unix://, got {redact_url(redis)!r}"
            )
        if require_redis and redis is None:
            raise ConfigurationError("no Redis URL: pass redis_url= or set STREAMS_REDIS_URL")
        chosen_prefix = prefix or os.environ.get("STREAMS_PREFIX") or DEFAULT_PREFIX
        if not re.fullmatch(r"[A-Za-z0-9_.:/\-]{1,200}", chosen_prefix):
            raise ConfigurationError(f"invalid channel prefix {chosen_prefix!r}")
        if max_payload_bytes <= 0:
            raise ConfigurationError("max_payload_bytes must be positive")
        if not 0.5 <= lease_seconds <= 3600:
            raise ConfigurationError("lease_seconds must be between 0.5 and 3600")
        return cls(
            database_url=_plain_postgres_url(db),
            redis_url=redis,
            prefix=chosen_prefix,
            max_payload_bytes=max_payload_bytes,
            lease_seconds=lease_seconds,
        )


def _plain_postgres_url(url: str) -> str:
    """psycopg wants ``postgresql://``; accept SQLAlchemy's ``postgresql+psycopg://`` too."""
    scheme, sep, rest = url.partition("://")
    if scheme.startswith("postgresql+"):
        return f"postgresql{sep}{rest}"
    return url
