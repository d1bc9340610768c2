"""Tests of settings, names and URL redaction (`streams.config`), no servers needed."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.config import (
    DEFAULT_PREFIX,
    Settings,
    redact_url,
    validate_instance_name,
    validate_stream_name,
)
from streams.errors import ConfigurationError, InvalidStreamName, StreamsError

ENV_VARS = ("STREAMS_DATABASE_URL", "STREAMS_REDIS_URL", "STREAMS_PREFIX")
DB_URL = "postgresql://app:db-secret@db.example:5432/app"
REDIS_URL = "redis://:redis-secret@cache.example:6379/0"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here may see the developer's or CI's real settings."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------
# Names


@pytest.mark.parametrize("name", ["events", "a", "a.b-c_1", "z9", "a" * 63, "b" + "-" * 62])
def test_stream_name_accepted(name: str) -> None:
    assert validate_stream_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "Events",
        "eventS",
        "1abc",
        "_abc",
        ".abc",
        "-abc",
        "a b",
        "a;drop table",
        "a" * 64,
        "ü",
        "aü",
        "a\n",
        "a\x00",
        "a/b",
        "a:b",
    ],
)
def test_stream_name_rejected(name: str) -> None:
    with pytest.raises(InvalidStreamName):
        validate_stream_name(name)


@pytest.mark.parametrize("name", [None, 1, b"events", ["events"]])
def test_stream_name_rejects_non_str(name: object) -> None:
    with pytest.raises(InvalidStreamName):
        validate_stream_name(name)


def test_invalid_name_errors_are_catchable_broadly() -> None:
    with pytest.raises(ValueError):
        validate_stream_name("")
    with pytest.raises(StreamsError):
        validate_instance_name("")


@pytest.mark.parametrize(
    "name",
    ["w", "W", "1", "host-1", "pod.ns:8080", "Worker_2", "a" * 128, "9" + "-" * 127],
)
def test_instance_name_accepted(name: str) -> None:
    assert validate_instance_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "-a", "_a", ".a", ":a", "a b", "a;drop table", "a" * 129, "ü", "hostü", "a/b", "a\n"],
)
def test_instance_name_rejected(name: str) -> None:
    with pytest.raises(InvalidStreamName):
        validate_instance_name(name)


@pytest.mark.parametrize("name", [None, 7, b"host"])
def test_instance_name_rejects_non_str(name: object) -> None:
    with pytest.raises(InvalidStreamName):
        validate_instance_name(name)


# ---------------------------------------------------------------------------------------------
# Redaction


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://user:secret@host/db", "postgresql://user:***@host/db"),
        ("postgresql://user:secret@host:5432/db", "postgresql://user:***@host:5432/db"),
        ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("postgresql://user:p@ss@host/db", "postgresql://user:***@host/db"),
        ("postgresql://user:secret@h1:5432,h2:5432/db", "postgresql://user:***@h1:5432,h2:5432/db"),
        ("postgresql://host/db?password=secret", "postgresql://host/db?password=***"),
        # A raw password may contain '&': everything after password= is hidden.
        (
            "postgresql://host/db?user=u&PASSWORD=secret&sslmode=require",
            "postgresql://host/db?user=u&PASSWORD=***",
        ),
        ("postgresql://u:pa/ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p@ss:w@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p?s#s@h/db", "postgresql://u:***@h/db"),
        ("rediss://user:secret@host:6380", "rediss://user:***@host:6380"),
        ("unix://:secret@/tmp/redis.sock?db=0", "unix://:***@/tmp/redis.sock?db=0"),
        ("redis://host:6379/0?password=secret", "redis://host:6379/0?password=***"),
        ("host=h password=secret dbname=d", "host=h password=*** dbname=d"),
        ("host=h password = 'sec ret' dbname=d", "host=h password = *** dbname=d"),
        (r"host=h password='se\'c ret' dbname=d", "host=h password=*** dbname=d"),
        (r"host=h password=se\ cret", "host=h password=***"),
        ("host=h password='secret", "host=h password=***"),
        ("password=secret more words dbname=d", "password=*** dbname=d"),
    ],
)
def test_redact_url_hides_passwords(url: str, expected: str) -> None:
    redacted = redact_url(url)
    assert redacted == expected
    assert "secret" not in redacted
    assert "p@ss" not in redacted


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://user@host/db",
        "postgresql://host:5432/db",
        "postgresql://host/db?sslmode=require&application_name=x",
        "redis://localhost:6379/0",
        "rediss://user@cache.example:6380",
    ],
)
def test_redact_url_leaves_passwordless_urls_unchanged(url: str) -> None:
    assert redact_url(url) == url


@pytest.mark.parametrize(
    "url", ["postgresql:///db?host=/var/run/postgresql", "unix:///tmp/redis.sock"]
)
def test_redact_url_leaves_empty_host_urls_unchanged(url: str) -> None:
    assert redact_url(url) == url


def test_redact_url_malformed_urls_still_hide_the_password() -> None:
    assert redact_url("postgresql://[::1/db") == "postgresql://[::1/db"
    assert redact_url("postgresql://u:pw@[::1/db") == "postgresql://u:***@[::1/db"


#: Characters libpq and urlsplit agree on inside a password (RFC 3986 userinfo, plus '@').
_PASSWORD_CHARS = string.ascii_letters + string.digits + "-._~!$&'()*+,;=%@"


@given(password=st.text(alphabet=_PASSWORD_CHARS, min_size=4, max_size=20))
def test_redact_url_never_shows_a_password(password: str) -> None:
    url = f"postgresql://user:{password}@host.example:5432/db"
    redacted = redact_url(url)
    assert redacted == "postgresql://user:***@host.example:5432/db"


@pytest.mark.parametrize("password", ["sec?ret", "sec#ret"])
def test_redact_url_password_with_query_or_fragment_delimiter(password: str) -> None:
    redacted = redact_url(f"postgresql://user:{password}@host/db")
    assert "ret" not in redacted


# ---------------------------------------------------------------------------------------------
# Settings


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMS_DATABASE_URL", DB_URL)
    monkeypatch.setenv("STREAMS_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("STREAMS_PREFIX", "myapp:streams")
    settings = Settings.resolve()
    assert settings.database_url == DB_URL
    assert settings.redis_url == REDIS_URL
    assert settings.prefix == "myapp:streams"


def test_settings_arguments_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMS_DATABASE_URL", "postgresql://env/db")
    monkeypatch.setenv("STREAMS_REDIS_URL", "redis://env:6379")
    monkeypatch.setenv("STREAMS_PREFIX", "env")
    settings = Settings.resolve(DB_URL, REDIS_URL, "args")
    assert settings.database_url == DB_URL
    assert settings.redis_url == REDIS_URL
    assert settings.prefix == "args"


def test_settings_defaults() -> None:
    settings = Settings.resolve("postgresql://host/db")
    assert settings.redis_url is None
    assert settings.prefix == DEFAULT_PREFIX


def test_settings_without_database_url() -> None:
    with pytest.raises(ConfigurationError, match="STREAMS_DATABASE_URL"):
        Settings.resolve()


def test_settings_rejects_mysql_url_without_leaking_password() -> None:
    with pytest.raises(ConfigurationError) as caught:
        Settings.resolve("mysql://app:db-secret@db.example/app")
    assert "db-secret" not in str(caught.value)


def test_settings_rejects_mysql_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMS_DATABASE_URL", "mysql://db.example/app")
    with pytest.raises(ConfigurationError):
        Settings.resolve()


def test_settings_rejects_http_redis_url_without_leaking_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMS_REDIS_URL", "http://:redis-secret@cache.example:6379")
    with pytest.raises(ConfigurationError) as caught:
        Settings.resolve(DB_URL)
    assert "redis-secret" not in str(caught.value)


@pytest.mark.parametrize("scheme", ["redis", "rediss", "unix"])
def test_settings_accepts_redis_schemes(scheme: str) -> None:
    url = f"{scheme}://cache.example:6379" if scheme != "unix" else "unix:///tmp/redis.sock"
    assert Settings.resolve(DB_URL, url).redis_url == url


def test_settings_require_redis() -> None:
    with pytest.raises(ConfigurationError, match="STREAMS_REDIS_URL"):
        Settings.resolve(DB_URL, require_redis=True)


@pytest.mark.parametrize("prefix", ["bad prefix", "a;b", "ü", "x" * 201, "a\nb"])
def test_settings_rejects_bad_prefix(prefix: str) -> None:
    with pytest.raises(ConfigurationError):
        Settings.resolve(DB_URL, prefix=prefix)


def test_settings_rejects_bad_prefix_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMS_PREFIX", "bad prefix")
    with pytest.raises(ConfigurationError):
        Settings.resolve(DB_URL)


@pytest.mark.parametrize("payload", [0, -1])
def test_settings_rejects_bad_payload_limit(payload: int) -> None:
    with pytest.raises(ConfigurationError):
        Settings.resolve(DB_URL, max_payload_bytes=payload)


@pytest.mark.parametrize("lease", [0.0, 0.49, 3600.5])
def test_settings_rejects_bad_lease(lease: float) -> None:
    with pytest.raises(ConfigurationError):
        Settings.resolve(DB_URL, lease_seconds=lease)


def test_settings_repr_never_shows_passwords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMS_DATABASE_URL", DB_URL + "?password=query-secret")
    monkeypatch.setenv("STREAMS_REDIS_URL", REDIS_URL)
    settings = Settings.resolve()
    for rendered in (repr(settings), str(settings), f"{settings}", f"{settings!r}"):
        assert "db-secret" not in rendered
        assert "redis-secret" not in rendered
        assert "query-secret" not in rendered
        assert "db.example" in rendered
        assert "cache.example" in rendered


@pytest.mark.parametrize(
    ("given_url", "expected"),
    [
        ("postgresql+psycopg://app:pw@db/app", "postgresql://app:pw@db/app"),
        ("postgresql+psycopg2://db/app", "postgresql://db/app"),
        ("postgresql://db/app", "postgresql://db/app"),
        ("postgres://db/app", "postgres://db/app"),
    ],
)
def test_settings_normalises_postgres_url(given_url: str, expected: str) -> None:
    assert Settings.resolve(given_url).database_url == expected


def test_settings_is_frozen() -> None:
    settings = Settings.resolve(DB_URL)
    with pytest.raises(AttributeError):
        settings.prefix = "other"  # type: ignore[misc]
