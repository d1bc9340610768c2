"""Every command, every option and argument, bad values, servers up and down: a specific error.

A property test over the whole CLI, walked from `streams.command.main` (so a new command or option
is covered the day it appears, a plugin's too): each example runs one command with one generated
bad value (every other parameter valid) against PostgreSQL and Redis up, both down, or Redis
alone down, with a password in the URLs. Whatever happens, the output never holds the generic
"unexpected ... (details withheld ...)" line (every failure is named), never the password, and
never a traceback; a command never runs away (each invocation has a deadline), which is also what
proves every number has a range: a value out of range that slipped through would start a
benchmark or a server.

The second test runs every command with valid values against dead servers: each fails with
one line saying what could not be reached.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import click
import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.command import main

SECRET = "Pw-S3cret.tok"
GENERIC = "details withheld"
#: Seconds one invocation may take: a parse error takes milliseconds, a dead server a moment.
DEADLINE = 60
STREAM = "cli_fuzz"
ENV_VARS = ("STREAMS_DATABASE_URL", "STREAMS_REDIS_URL", "STREAMS_PREFIX", "PGPASSWORD")


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    ctx = click.Context(group)  # click's own lookup: it also finds plugins (streams.plugins)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name)


COMMANDS = tuple(_commands(main))


def _command(path: tuple[str, ...]) -> click.Command:
    command: Any = main
    for name in path:
        command = command.get_command(click.Context(command), name)
    assert isinstance(command, click.Command)
    return command


def _params(path: tuple[str, ...]) -> list[click.Parameter]:
    """The parameters a value can be bad for (flags and --embedded have none)."""
    return [
        p
        for p in _command(path).params
        if not (isinstance(p, click.Option) and p.is_flag) and p.name != "embedded"
    ]


def _valid_args(path: tuple[str, ...]) -> list[str]:
    """Values for the required arguments (the rest keep their defaults)."""
    args: list[str] = []
    for p in _command(path).params:
        if isinstance(p, click.Argument) and p.name == "payloads":
            args.append('{"n": 1}')  # optional (stdin otherwise), but needed
        elif isinstance(p, click.Argument) and p.name == "group" and p.nargs == -1:
            args.append("billing")  # `incarnation accept`: groups, or --all
        elif isinstance(p, click.Argument) and p.required:
            args.append(STREAM)
        elif isinstance(p, click.Argument) and path in (("create",), ("drop",)):
            args.append(STREAM)  # NAME or --from-file; NAMES or --like (no --yes: kept)
    if path in (("roles", "grant"), ("roles", "revoke")):
        args += ["--stream", STREAM]  # one of --stream and --group is needed
    return args


# ------------------------------------------------------------------------------ bad values

_SECRET_URLS = {
    "database_url": [
        f"postgresql://u:{SECRET}@127.0.0.1:notaport/db",
        f"postgresql://u:{SECRET}@[::1/db",
        f"postgresql://u:{SECRET}/x@127.0.0.1/db",
        f"postgresql://%zz:{SECRET}@127.0.0.1/db",
        f"mysql://u:{SECRET}@127.0.0.1/db",
        "not a url",
    ],
    "redis_url": [
        f"redis://:{SECRET}@127.0.0.1:notaport/0",
        f"redis://:{SECRET}@[::1/0",
        f"redis://u:{SECRET}/x@127.0.0.1/0",
        f"http://:{SECRET}@127.0.0.1/0",
        "not a url",
    ],
}
_NAMES = ["Bad Name", "x" * 64, "a/b", "ü", "a\x00b", "-dash", "1starts_with_digit"]
_DURATIONS = ["5x", "-1d", "1.5h", "9" * 30 + "d", "forever!", "1h 30m", "ms"]
_BY_NAME: dict[str, list[str]] = {
    "name": [*_NAMES, "nosuch_stream_zz"],
    "stream": [*_NAMES, "nosuch_stream_zz"],
    "streams": [*_NAMES, "nosuch_stream_zz"],
    "names": [*_NAMES, "nosuch_stream_zz"],
    # An SQL LIKE pattern: NUL, or ending in its escape character.
    "like": ["a\x00b", "abc\\", "%\\", ""],
    "counts": ["", "x", "0", "10,abc", "1000000", "-5"],
    "from_file": ["/nonexistent_zz/streams.txt", ".", ""],
    "instance": ["", "bad name", "x" * 200, "-x", "a\x00"],
    "group": ["", "x" * 201, "a\x00b", "tab\there"],
    "role": ["", "x" * 64, "a\x00b", "pg_signal_backend", "streams_writer", "no_such_role_zz"],
    "tables": ["nodot", "a.b.c.d", "x;drop.y", "", "no_such_table.id", "streams_facts.nope"],
    "payloads": [
        "{",
        "nan",
        "[1,",
        '"\\ud800"',
        '"\\u0000"',
        "1e400",
        "[" * 5000 + "]" * 5000,
        '"' + "x" * (1 << 20) + '"',
    ],
    "keep": [*_DURATIONS, "0ms", ""],
    "key_window_ms": [*_DURATIONS, "0ms", ""],
    "window": [*_DURATIONS, "0ms", ""],
    "ago": [*_DURATIONS, ""],
    "every": [*_DURATIONS, "0ms", "99ms", ""],
    "older_than": [*_DURATIONS, ""],
    "stale_after": [*_DURATIONS, ""],
    "lease": [*_DURATIONS, "0ms", "499ms", "2h", ""],
    "addr": ["999.1.1.1", "not a host", "::zz", "8.8.8.8"],
    # `demo --metrics ADDR:PORT`: not of that form, a port out of range, an address not ours.
    "metrics_at": [
        "9465",
        "x:",
        ":9465",
        "127.0.0.1:99999",
        "127.0.0.1:-1",
        "127.0.0.1:0x1",
        "8.8.8.8:9465",
        "[::zz]:1",
    ],
    "prefix": ["a b", "x" * 201, "a\x00", "ü", "semi;colon"],
    **_SECRET_URLS,
    # A hot standby's URL (`bench history --read-url`, `read --read-database-url`).
    "read_url": _SECRET_URLS["database_url"],
    "read_database_url": _SECRET_URLS["database_url"],
    "jdbc_jar": ["/nonexistent/driver.jar"],
    # `up`/`down`/`status --dir`: empty, a file, NUL, a place where nothing can be made.
    "base_dir": ["", " ", "/etc/hostname", "a\x00b", "/proc/nope_zz/.streams"],
    # `bench ... --plot FILE`: a format the suffix does not name, a directory that is not there.
    "plot": [
        "plot.txt",
        "plot",
        "plot.jpg",
        "",
        ".",
        "/",
        "/nonexistent_zz/plot.png",
        "/nonexistent_zz/plot.svg",
        "no_such_dir_zz/plot.svg",
        "a\x00.png",
    ],
}


def _bad_values(param: click.Parameter) -> st.SearchStrategy[str]:
    """Values that `param` must refuse (or, for names, may find unknown)."""
    kind = param.type
    garbage = st.sampled_from(["x", "1.5", "0x10", " ", "1e3", "--", "\u2028"])
    if isinstance(kind, click.IntRange):
        out: list[st.SearchStrategy[int]] = [st.integers(10**19, 10**40).map(lambda n: -n)]
        out.append(st.integers(10**19, 10**40))
        if kind.min is not None:
            out.append(st.integers(int(kind.min) - 10**6, int(kind.min) - 1))
        if kind.max is not None:
            out.append(st.integers(int(kind.max) + 1, int(kind.max) + 10**6))
        return st.one_of(st.one_of(out).map(str), garbage)
    if isinstance(kind, click.FloatRange):
        specials = ["nan", "inf", "-inf", "NaN", "1e999", "x", "", "1,5", "--"]
        edges: list[str] = []
        if kind.min is not None:
            edges.append(str(float(kind.min) - 1e-3))
        if kind.max is not None:
            edges.append(str(float(kind.max) * 2 + 1))
        return st.sampled_from(specials + edges)
    if isinstance(kind, click.Choice):
        choices = {str(c) for c in kind.choices}
        return st.text(min_size=1, max_size=12).filter(lambda t: t not in choices)
    name = str(param.name)
    if name in _BY_NAME:
        return st.sampled_from(_BY_NAME[name])
    if name == "writer_url":
        return st.sampled_from(_SECRET_URLS["database_url"])
    if name in ("ks",):
        return st.sampled_from(["1,x", "0,-1", "", "1,,2", "9" * 12, "1;2"])
    if name in ("modes",):
        return st.sampled_from(["shared,nope", "", "own,,shared", "SHARED"])
    if name in ("points",):
        return st.sampled_from(["1", "0x1", "x1", "1x", "1x-1", "", "1x1,,2x2", "300x1", "1X1"])
    raise AssertionError(f"no bad values known for {param.name!r} ({kind!r}): add them")


def _invocation(path: tuple[str, ...], param: click.Parameter, value: str) -> list[str]:
    args = _valid_args(path)
    if isinstance(param, click.Argument):
        if param.required and args:
            index = [p for p in _command(path).params if isinstance(p, click.Argument)].index(param)
            args[index] = value
        else:
            args.append(value)
        # "--" keeps a value starting with "-" an argument, as a careful user would write it.
        return [*path, "--", *args] if value.startswith("-") else [*path, *args]
    option = max(param.opts, key=len)
    return [*path, *args, option, value]


@st.composite
def bad_invocations(draw: st.DrawFn) -> list[str]:
    path = draw(st.sampled_from(COMMANDS))
    params = _params(path)
    if not params:  # e.g. `streams list`: only its URLs can be bad
        params = [p for p in _command(path).params if p.name in _SECRET_URLS]
    param = draw(st.sampled_from(params))
    return _invocation(path, param, draw(_bad_values(param)))


# ------------------------------------------------------------------------------ running


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _with_password(url: str) -> str:
    """The same server, a password in the URL (trust authentication ignores it)."""
    parts = urlsplit(url)
    user = parts.username or "postgres"
    netloc = f"{user}:{quote(SECRET, safe='')}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=netloc))


class _Deadline(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _Deadline(f"still running after {DEADLINE} s")


def run_cli(argv: list[str], env: dict[str, str]) -> Result:
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(DEADLINE)
    started = time.monotonic()
    try:
        return CliRunner().invoke(main, argv, env=env, input="")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if os.environ.get("STREAMS_CLI_SLOW") and time.monotonic() - started > 2:
            print(f"SLOW {time.monotonic() - started:.1f}s {argv!r:.200}")


def check(result: Result, argv: list[str]) -> None:
    shown = f"{argv!r:.300}\nexit {result.exit_code}\n{result.output[-2000:]}"
    assert not isinstance(result.exception, _Deadline), f"ran away: {shown}"
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), f"{result.exception!r}: {shown}"
    assert GENERIC not in result.output, f"a failure without a name: {shown}"
    for form in {SECRET, quote(SECRET, safe="")}:
        assert form not in result.output, f"the password is shown: {shown}"
    if result.exit_code == 3 and argv[0] == "status":  # a service manager's "not running"
        assert "not running" in result.output, shown
    elif result.exit_code != 0:
        assert "Error" in result.output or "FAIL" in result.output, shown


@pytest.fixture(scope="module")
def servers(postgres_admin_url: str, redis_url: str) -> Iterator[dict[str, dict[str, str]]]:
    """Environments: both servers up, both down, and Redis alone down (each with a password)."""
    from servers import create_database, drop_database

    import streams
    from streams.migrate import upgrade

    url = create_database(postgres_admin_url, prefix="streams_cli_fuzz")
    upgrade(url)
    with streams.connect(url) as client:
        client.create_stream(STREAM)
        with client.writer(STREAM, instance="seed") as writer:
            writer.append({"seed": True})
    dead = _closed_port()
    down_db = f"postgresql://u:{SECRET}@127.0.0.1:{dead}/x"
    down_redis = f"redis://:{SECRET}@127.0.0.1:{dead}/0"
    yield {
        "up": {"STREAMS_DATABASE_URL": _with_password(url), "STREAMS_REDIS_URL": redis_url},
        "down": {  # one attempt, not the wait for a starting server
            "STREAMS_DATABASE_URL": down_db,
            "STREAMS_REDIS_URL": down_redis,
            "STREAMS_CONNECT_TIMEOUT": "0",
        },
        "redis-down": {
            "STREAMS_DATABASE_URL": _with_password(url),
            "STREAMS_REDIS_URL": down_redis,
        },
    }
    drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the checkout (./.streams, files)


@settings(
    max_examples=int(os.environ.get("STREAMS_CLI_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(argv=bad_invocations(), scenario=st.sampled_from(["up", "down", "redis-down"]))
def test_bad_values_get_a_specific_error(
    servers: dict[str, dict[str, str]], argv: list[str], scenario: str
) -> None:
    check(run_cli(argv, servers[scenario]), argv)


def test_every_bad_value_kind_is_known() -> None:
    """Each parameter of each command has bad values (a new one must bring its own)."""
    for path in COMMANDS:
        for param in _params(path):
            _bad_values(param)


#: The embedded servers' commands use no configured server (`tests/embedded/test_background.py`).
SERVERLESS = {("up",), ("down",), ("status",)}


@pytest.mark.parametrize("path", [p for p in COMMANDS if p not in SERVERLESS], ids=" ".join)
def test_every_command_on_dead_servers_says_what_failed(
    servers: dict[str, dict[str, str]], path: tuple[str, ...]
) -> None:
    argv = [*path, *_valid_args(path)]
    if path == ("positions",):
        argv.append("--from-redis")
    result = run_cli(argv, servers["down"])
    check(result, argv)
    assert result.exit_code == 1, result.output
    assert any(
        what in result.output
        for what in ("cannot connect to PostgreSQL", "cannot use Redis", "cannot reach")
    ), result.output
