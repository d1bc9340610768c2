"""No password ever shows: not in redacted URLs, errors, log records or CLI output.

Property tests draw passwords from a wide alphabet (printable ASCII including ``/ @ : ? # & %
= ' " \\`` and space, plus non-ASCII) and put them, raw and percent-encoded, into the userinfo
and into ``?password=`` of database and Redis URLs. Every form of the password (as drawn,
percent-encoded, percent-decoded) of at least 4 characters must be absent from everything a
user or a log can see.

To keep the property honest rather than trivially true or flaky, a password must contain a
digit or a symbol (so it is not an ordinary word of an error message), and an example is
discarded when a form of its password occurs in the *baseline*: the output of the same
operation for the same URL without a password (``5432``, ``.0.0``, ``: C`` would otherwise be
"found" in any message). The example-based tests below pin each defect from the bug report.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import string
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import quote, unquote, unquote_plus, urlsplit

import psycopg
import pytest
import redis.connection
from click.testing import CliRunner, Result
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

import streams
from streams.command import main
from streams.config import (
    Settings,
    redact_url,
    scrub_secrets,
    url_passwords,
    validate_redis_url,
)
from streams.errors import ConfigurationError, StoreError, StreamsError
from streams.migrate import upgrade
from streams.ops.doctor import diagnose
from streams.store import sessions

ENV_VARS = ("STREAMS_DATABASE_URL", "STREAMS_REDIS_URL", "STREAMS_PREFIX", "PGPASSWORD")
SYMBOLS = "/@:?#&%=' \"\\!$*+,;<>[]^`{|}~-._"
ALPHABET = string.ascii_letters + string.digits + SYMBOLS + "äéß€日✓"
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("migrate",),
    ("create", "s-redaction"),
    ("list",),
    ("append", "s-redaction", "{}"),
    ("read", "s-redaction"),
    ("positions",),
    ("doctor",),
    ("demo", "--duration", "1", "--no-spark"),
)

#: redis-py's own URL parser (untyped).
redis_parse_url: Any = redis.connection.parse_url

#: Characters that ordinary output (IDs, hex names, URLs, reprs) is not made of alone: a
#: password must hold one, so that it cannot occur in the output by coincidence (an all-digit
#: password such as "0000" does: stream IDs, ports). Every other character is still drawn.
_DISTINCT = "/@?#&%'\"\\!$*+;<>[]^`{|}~äéß€日✓"

passwords = st.text(alphabet=ALPHABET, min_size=4, max_size=16).filter(
    lambda p: any(c in _DISTINCT for c in p) and any(c.isalnum() for c in p)
)


@pytest.fixture(autouse=True, scope="module")
def _clean_env() -> Iterator[None]:
    """No test here may see real settings (module scope: Hypothesis tests share it)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ENV_VARS:
            mp.delenv(name, raising=False)
        # Closed ports on purpose: one attempt each, not the wait for a starting server.
        mp.setenv("STREAMS_CONNECT_TIMEOUT", "0")
        yield


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# ---------------------------------------------------------------------------------------------
# Helpers


def forms(password: str) -> set[str]:
    """The password as drawn, percent-encoded and percent-decoded (4+ characters each)."""
    candidates = {password, quote(password, safe=""), unquote(password), unquote_plus(password)}
    return {f for f in candidates if len(f) >= 4}


def db_urls(password: str, host: str, port: int, db: str, user: str = "postgres") -> list[str]:
    """Database URLs carrying `password` raw and encoded, in the userinfo and as a parameter."""
    encoded = quote(password, safe="")
    base = f"{host}:{port}/{db}"
    return [
        f"postgresql://{user}:{password}@{base}",
        f"postgresql://{user}:{encoded}@{base}",
        f"postgresql://{user}@{base}?password={password}",
        f"postgresql://{user}@{base}?sslmode=disable&password={encoded}",
    ]


def bare_db_url(host: str, port: int, db: str, user: str = "postgres") -> str:
    return f"postgresql://{user}@{host}:{port}/{db}"


def redis_urls(password: str) -> list[str]:
    encoded = quote(password, safe="")
    return [
        f"redis://:{password}@127.0.0.1:6379/0",
        f"redis://:{encoded}@127.0.0.1:6379/0",
        f"rediss://user:{password}@127.0.0.1:6379",
        f"unix://:{password}@/tmp/no-such-redis.sock",
        f"redis://127.0.0.1:6379/0?password={password}",
        f"redis://127.0.0.1:6379/0?password={encoded}",
    ]


BARE_REDIS_URLS = [
    "redis://127.0.0.1:6379/0",
    "rediss://user@127.0.0.1:6379",
    "unix:///tmp/no-such-redis.sock",
]


def exception_texts(exc: BaseException | None) -> list[str]:
    """str, repr and the formatted traceback of `exc` and of every exception it chains."""
    texts: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
        exc = exc.__cause__ or exc.__context__
    return texts


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(self.format(record))
        self.texts.append(repr(record.args))


@contextmanager
def all_logs() -> Iterator[list[str]]:
    """Every log record (root logger at DEBUG, so every library's records) as text.

    A handler of our own rather than pytest's ``caplog``: Hypothesis runs many examples in one
    test call, and each example needs its own records.
    """
    handler = _Collect()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler.texts
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def attempt(func: Any, *args: Any, **kwargs: Any) -> tuple[Any, BaseException | None]:
    """Call func; return (result, None) or (None, the StreamsError it raised)."""
    try:
        return func(*args, **kwargs), None
    except StreamsError as exc:
        return None, exc


def assert_hidden(password: str, texts: list[str], baseline: list[str]) -> None:
    """No form of `password` in `texts`; examples whose forms occur in `baseline` are void."""
    joined = "\n".join(texts)
    joined_baseline = "\n".join(baseline)
    found = forms(password)
    assume(not any(f in joined_baseline for f in found))
    for form in found:
        assert form not in joined, f"{form!r} shown in:\n{joined}"


def cli(*args: str, url: str | None, redis_url: str | None = None) -> Result:
    argv = list(args)
    if url is not None:
        argv += ["--database-url", url]
    if redis_url is not None:
        argv += ["--redis-url", redis_url]
    return CliRunner().invoke(main, argv)


def result_texts(result: Result) -> list[str]:
    return [result.output, *exception_texts(result.exception)]


def assert_one_line_error(result: Result) -> None:
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # no traceback
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def with_password(url: str, password: str) -> list[str]:
    """Variants of the server `url` (user, host, port, database kept) carrying `password`."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    return db_urls(
        password, parts.hostname, parts.port or 5432, parts.path.lstrip("/"), parts.username or ""
    )


def without_password(url: str) -> str:
    parts = urlsplit(url)
    assert parts.hostname is not None
    return bare_db_url(
        parts.hostname, parts.port or 5432, parts.path.lstrip("/"), parts.username or ""
    )


# ---------------------------------------------------------------------------------------------
# Pure properties


@given(password=passwords)
def test_redact_url_output_does_not_depend_on_the_password(password: str) -> None:
    # Stronger than "the password is not in it": the redacted text is the same for any
    # password, so no part of it (not even a fragment) can show. Exception: a raw '@' in a
    # ?password= value becomes the "last @" that ends the userinfo, so more is hidden.
    for url, placeholder in zip(
        [*db_urls(password, "db.example", 5432, "app"), *redis_urls(password)],
        [*db_urls("x", "db.example", 5432, "app"), *redis_urls("x")],
        strict=True,
    ):
        if not ("?" in url and "@" in password and password in url):
            assert redact_url(url) == redact_url(placeholder), url
        assert_hidden(password, [redact_url(url)], [redact_url(placeholder)])


@given(password=passwords, before=st.text(max_size=10), after=st.text(max_size=10))
def test_scrub_secrets_removes_every_form(password: str, before: str, after: str) -> None:
    for form in (password, quote(password, safe=""), unquote(password), repr(password)[1:-1]):
        text = scrub_secrets(f"{before}{form}{after}", [password])
        assert_hidden(password, [text], [before + after])


@given(password=passwords, quoting=st.sampled_from(["'", ""]))
def test_redact_conninfo_hides_the_password(password: str, quoting: str) -> None:
    if quoting:
        value = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    else:
        value = password.replace("\\", "\\\\").replace(" ", "\\ ").replace("'", "\\'")
    conninfo = f"host=db.example password={value} dbname=app"
    with_libpq: dict[str, Any] | None = None
    with suppress(psycopg.Error):
        with_libpq = conninfo_to_dict(conninfo)
    if with_libpq is not None:  # the value is written correctly: libpq reads our password
        assert with_libpq["password"] == password
    assert redact_url(conninfo) == "host=db.example password=*** dbname=app"
    assert password in url_passwords(conninfo)


@settings(max_examples=50)
@given(password=passwords)
def test_settings_never_show_a_password(password: str) -> None:
    bare = bare_db_url("db.example", 5432, "app")
    baseline = [repr(Settings.resolve(bare, url)) for url in BARE_REDIS_URLS]
    texts: list[str] = []
    with all_logs() as logs:
        for url in db_urls(password, "db.example", 5432, "app"):
            resolved, error = attempt(Settings.resolve, url)
            texts += [repr(resolved), str(resolved), *exception_texts(error)]
            if error is not None:
                assert isinstance(error, ConfigurationError)
                assert "percent-encode" in str(error)
        for url in redis_urls(password):
            resolved, error = attempt(Settings.resolve, bare, url)
            texts += [repr(resolved), *exception_texts(error)]
    assert_hidden(password, texts + logs, baseline)


@settings(max_examples=50)
@given(password=passwords)
def test_accepted_urls_mean_what_they_read(password: str) -> None:
    """What `Settings.resolve` accepts, the drivers read with exactly this password: the
    checks in `streams.config` mirror redis-py's and libpq's parsers (and are this strict)."""
    raw, encoded, query_raw, query_encoded = db_urls(password, "db.example", 5432, "app")
    for url, query in ((raw, False), (encoded, False), (query_raw, True), (query_encoded, True)):
        _, error = attempt(Settings.resolve, url)
        if error is None:
            try:
                params = conninfo_to_dict(url)
            # Rejected when connecting (sessions.parse_database_url); psycopg's parser raises
            # UnicodeDecodeError for a %-escape that is not UTF-8 ("%80").
            except (psycopg.Error, UnicodeDecodeError):
                with pytest.raises(ConfigurationError):
                    sessions.parse_database_url(url)
                continue
            expected = unquote(password) if url in (raw, query_raw) else password
            got = params.get("password")
            # A raw '&' ends a query value for libpq: the rest is another (invalid) parameter.
            assert got == expected or (query and "&" in password), (url, params)
    assert_parses(encoded, password)
    for url in redis_urls(password):
        ok = attempt(validate_redis_url, url)[1] is None
        try:
            parsed = redis_parse_url(url)
        except ValueError:
            assert not ok, url  # everything redis-py rejects, we reject (without its message)
            continue
        if ok:
            expected = unquote_plus(password) if "?password=" in url else unquote(password)
            if quote(password, safe="") in url:
                expected = password
            assert parsed.get("password") == expected, (url, parsed)


def assert_parses(url: str, password: str) -> None:
    """A percent-encoded password is always accepted and read back exactly."""
    assert attempt(Settings.resolve, url)[1] is None
    assert sessions.parse_database_url(url)["password"] == password


# ---------------------------------------------------------------------------------------------
# I/O properties: a closed port, the real server


@settings(max_examples=25)
@given(password=passwords)
def test_connecting_to_a_closed_port_never_shows_a_password(
    password: str, closed_port: int
) -> None:
    bare = bare_db_url("127.0.0.1", closed_port, "x")
    baseline = [
        *exception_texts(attempt(streams.connect, bare)[1]),
        *exception_texts(attempt(upgrade, bare)[1]),
    ]
    texts: list[str] = []
    with all_logs() as logs:
        for url in db_urls(password, "127.0.0.1", closed_port, "x"):
            for call in (
                streams.connect,
                lambda u: sessions.connect(u, autocommit=True),
                lambda u: asyncio.run(sessions.aconnect(u, autocommit=True)),
                lambda u: asyncio.run(streams.aconnect(u)),
                upgrade,
            ):
                _, error = attempt(call, url)
                assert isinstance(error, ConfigurationError | StoreError), url
                if isinstance(error, StoreError):
                    assert "Connection refused" in str(error)
                    assert "docker compose up -d" in str(error)
                texts += exception_texts(error)
    assert_hidden(password, texts + logs, baseline)


@settings(max_examples=25)
@given(password=passwords)
def test_the_real_server_never_shows_a_password(password: str, streams_url: str) -> None:
    # Trust authentication accepts any password, so the percent-encoded URL connects.
    baseline: list[str] = [redact_url(without_password(streams_url))]
    texts: list[str] = []
    with all_logs() as logs:
        for url in with_password(streams_url, password):
            client, error = attempt(streams.connect, url)
            if client is not None:
                with client:
                    texts += [repr(client.settings), repr(client.streams())]
            texts += exception_texts(error)
            texts += exception_texts(attempt(upgrade, url)[1])
        encoded = with_password(streams_url, password)[1]
        with streams.connect(encoded) as client:  # always accepted
            texts.append(repr(client.settings))
    assert_hidden(password, texts + logs, baseline)


# ---------------------------------------------------------------------------------------------
# The CLI


@settings(max_examples=25)
@given(password=passwords)
def test_no_cli_command_shows_a_password_for_a_closed_port(password: str, closed_port: int) -> None:
    bare = bare_db_url("127.0.0.1", closed_port, "x")
    baseline = [t for args in COMMANDS for t in result_texts(cli(*args, url=bare))]
    texts: list[str] = []
    with all_logs() as logs:
        for url in db_urls(password, "127.0.0.1", closed_port, "x"):
            for args in COMMANDS:
                result = cli(*args, url=url)
                assert result.exit_code == 1, (args, result.output, result.exception)
                if args != ("doctor",):  # doctor prints its checks, then exits 1
                    assert_one_line_error(result)
                texts += result_texts(result)
    assert_hidden(password, texts + logs, baseline)


@settings(max_examples=8)
@given(password=passwords)
def test_cli_on_the_real_server_never_shows_a_password(
    password: str, streams_url: str, redis_url: str
) -> None:
    bare = without_password(streams_url)
    commands = [("migrate",), ("list",), ("positions",), ("doctor",), ("create", "s-redact")]
    baseline = [t for args in commands for t in result_texts(cli(*args, url=bare))]
    baseline += result_texts(cli("doctor", url=bare, redis_url=redis_url))
    texts: list[str] = []
    with all_logs() as logs:
        for url in with_password(streams_url, password):
            for args in commands:
                texts += result_texts(cli(*args, url=url))
        # The local Redis has no password: AUTH fails (rediss:// and unix:// are covered by
        # Settings above; a TLS handshake with a plain server would only wait for a timeout).
        for rurl in [u for u in redis_urls(password) if u.startswith("redis://")]:
            texts += result_texts(cli("doctor", url=bare, redis_url=rurl))
    assert_hidden(password, texts + logs, baseline)


# ---------------------------------------------------------------------------------------------
# The defects from the bug report, one by one


def test_unencoded_slash_in_the_password_is_redacted() -> None:
    assert redact_url("postgresql://u:pa/ss@h/db") == "postgresql://u:***@h/db"
    error = StoreError(f"cannot reach {redact_url('postgresql://u:pa/ss@h/db')}")
    assert "pa/ss" not in str(error) and "ss@" not in repr(error)


def test_unencoded_slash_is_rejected_with_a_hint() -> None:
    with pytest.raises(ConfigurationError) as caught:
        Settings.resolve("postgresql://u:pa/ss@h/db")
    message = str(caught.value)
    assert "postgresql://u:***@h/db" in message
    assert "%2F" in message
    for fragment in ("'pa'", '"pa"', "pa/", "/ss", "ss@"):
        assert fragment not in message


def test_cli_with_unencoded_slash_is_one_line(closed_port: int) -> None:
    result = cli("list", url=f"postgresql://u:pa/ss@127.0.0.1:{closed_port}/db")
    assert_one_line_error(result)
    assert "pa/ss" not in result.output and "ss@" not in result.output
    assert "ConfigurationError" in result.output


@pytest.mark.parametrize(
    "url", ["postgresql://u:p@ss:w0rd@127.0.0.1:5432/db", "postgresql://u:p:ss@w0rd@127.0.0.1/db"]
)
def test_demo_with_at_and_colon_in_the_password_is_one_line(url: str) -> None:
    # Was: SQLAlchemy's URL parser raised with part of the password, and a traceback.
    result = cli("demo", url=url)
    assert_one_line_error(result)
    texts = "\n".join(result_texts(result))
    for fragment in ("ss:w0rd", "w0rd", "p@ss", "ss@w0rd"):
        assert fragment not in texts
    assert "percent-encode" in result.output


def test_libpq_parse_errors_are_never_echoed() -> None:
    # libpq would say: invalid percent-encoded token: "pa%ss"
    with pytest.raises(ConfigurationError) as caught:
        sessions.connect("postgresql://u:pa%ss@127.0.0.1/db", autocommit=True)
    assert "pa%ss" not in str(caught.value)
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert "postgresql://u:***@127.0.0.1/db" in str(caught.value)


def test_bad_port_in_the_url_is_reported_without_the_password() -> None:
    # libpq would quote the port: invalid integer value "pa" for connection option "port".
    with pytest.raises(ConfigurationError) as caught:
        sessions.connect("postgresql://u:pa/ss@127.0.0.1/db", autocommit=True)
    for fragment in ("'pa'", '"pa"', "pa/", "/ss", "ss@"):
        assert fragment not in str(caught.value)


def test_doctor_with_a_slash_in_the_redis_password(streams_url: str) -> None:
    redis_url = "redis://:pa/ss@127.0.0.1:6379/0"
    result = cli("doctor", url=streams_url, redis_url=redis_url)
    assert_one_line_error(result)
    assert "ConfigurationError" in result.output
    assert "redis://:***@127.0.0.1:6379/0" in result.output
    for fragment in ("pa/ss", "'pa'", "ss@"):
        assert fragment not in result.output


def test_diagnose_survives_any_redis_url(streams_url: str) -> None:
    # Settings built by hand skip validation: redis-py's parser raises ValueError quoting
    # 'pa'; doctor shows the class name and the redacted URL only.
    bad = Settings(database_url=streams_url, redis_url="redis://:pa/ss@127.0.0.1:6379/0")
    with all_logs() as logs:
        checks = diagnose(bad)
    redis_check = next(c for c in checks if c.name == "redis")
    assert not redis_check.ok
    assert redis_check.detail == "cannot reach redis://:***@127.0.0.1:6379/0: ValueError"
    assert not any("pa/ss" in t or "'pa'" in t for t in logs)


def test_redis_url_validation_rejects_what_redis_py_misreads() -> None:
    for url in (
        "redis://:pa/ss@127.0.0.1:6379/0",  # ValueError quoting 'pa' in redis-py
        "redis://:12/ss@127.0.0.1",  # redis-py would connect to localhost:12, db 'ss@...'
        "redis://:p#ss@127.0.0.1",
        "redis://127.0.0.1/0?password=a&b=c",  # 'b' would become a connection keyword
    ):
        with pytest.raises(ConfigurationError) as caught:
            validate_redis_url(url)
        for fragment in ("'pa'", "/ss", "ss@", "p#ss", "b=c", "'12'"):
            assert fragment not in str(caught.value)


# ---------------------------------------------------------------------------------------------
# Connection errors say what happened and what to do


def test_connection_refused_says_so_and_what_to_do(closed_port: int) -> None:
    url = f"postgresql://u:topsecret@127.0.0.1:{closed_port}/x"
    with pytest.raises(StoreError) as caught:
        streams.connect(url)
    message = str(caught.value)
    assert f"postgresql://u:***@127.0.0.1:{closed_port}/x" in message
    assert "Connection refused" in message
    assert "docker compose up -d" in message and "`streams up`" in message
    assert "topsecret" not in message and "\n" not in message
    assert caught.value.__context__ is None


def test_async_connection_refused(closed_port: int) -> None:
    url = f"postgresql://u:topsecret@127.0.0.1:{closed_port}/x"
    with pytest.raises(StoreError, match="Connection refused") as caught:
        asyncio.run(streams.aconnect(url))
    assert "topsecret" not in str(caught.value)


def test_missing_database_says_so(streams_url: str) -> None:
    parts = urlsplit(streams_url)
    url = f"postgresql://{parts.username}:s3cret@{parts.hostname}:{parts.port}/no_such_db_x1"
    for connect in (
        lambda: streams.connect(url),
        lambda: asyncio.run(streams.aconnect(url)),
        lambda: upgrade(url),
    ):
        with pytest.raises(StoreError) as caught:
            connect()
        message = str(caught.value)
        assert 'database "no_such_db_x1" does not exist' in message
        assert "create the database" in message
        assert "s3cret" not in message


def test_cli_connection_errors_are_one_line_with_the_reason(closed_port: int) -> None:
    url = f"postgresql://u:topsecret@127.0.0.1:{closed_port}/x"
    for args in COMMANDS:
        result = cli(*args, url=url)
        if args == ("doctor",):
            assert result.exit_code == 1
            assert "Connection refused" in result.output
        else:
            assert_one_line_error(result)
            assert result.stderr.startswith("Error: StoreError: cannot connect to PostgreSQL"), (
                result.stderr
            )
            assert "Connection refused" in result.stderr
        assert "topsecret" not in result.output


def test_pgpassword_is_scrubbed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGPASSWORD", "env-s3cret")
    error = sessions.connection_error(
        "postgresql://h/db", RuntimeError("it said env-s3cret"), purpose="test"
    )
    assert "env-s3cret" not in str(error)


def test_environment_is_clean() -> None:
    assert not any(os.environ.get(name) for name in ENV_VARS)
