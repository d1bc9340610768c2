"""`streams up` / `status` / `down`: the embedded servers kept running for development, found by
`streams.connect()`, the commands and the demo when no URL is configured (issue 41, item 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streams.devservers import pid_alive


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}


def streams_cli(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streams", *args],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def python(cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _recorded_pids(project: Path) -> list[int]:
    try:
        up = json.loads((project / ".streams" / "up.json").read_text())
    except FileNotFoundError:
        return []
    return [up["postgres_pid"], up["redis_pid"]]


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A project directory; whatever `streams up` left running there dies with the test."""
    tmp_path.chmod(0o755)  # under root, PostgreSQL runs as an unprivileged account
    pids: list[int] = []
    try:
        yield tmp_path
    finally:
        pids = _recorded_pids(tmp_path)
        streams_cli(tmp_path, "down")
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_keeps_servers_that_connect_the_commands_and_the_demo_find(project: Path) -> None:
    first = streams_cli(project, "up")
    assert first.returncode == 0, first.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in first.stdout.splitlines())
    assert set(exports) == {"STREAMS_DATABASE_URL", "STREAMS_REDIS_URL"}, first.stdout
    assert "streams down" in first.stderr
    pids = _recorded_pids(project)
    assert all(pid_alive(pid) for pid in pids), "up returned but its servers are gone"

    # Trusted only if this user's and writable by nobody else (a shared /tmp): another account
    # could leave an up.json naming servers of its own.
    from streams.devservers.background import find_running

    up_file = project / ".streams" / "up.json"
    assert find_running(project / "deeper") is not None  # from below, too
    for path, mode in ((up_file, 0o666), (up_file.parent, 0o777)):
        before = path.stat().st_mode & 0o777
        path.chmod(mode)
        assert find_running(project) is None, f"trusted {path} with mode {mode:o}"
        path.chmod(before)
    if os.geteuid() == 0:
        os.chown(up_file, 65534, 65534)  # nobody's
        assert find_running(project) is None
        os.chown(up_file, 0, 0)
    assert find_running(project) is not None

    again = streams_cli(project, "up")  # idempotent: the same servers
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert _recorded_pids(project) == pids

    status = streams_cli(project, "status", "--json")
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    assert document["running"] is True
    assert document["database_url"] == exports["STREAMS_DATABASE_URL"]
    assert document["postgres"]["pinned"] and document["redis"]["pinned"]

    # The README's Python taste, from a subdirectory, with no URL anywhere.
    (project / "app").mkdir()
    taste = python(
        project / "app",
        "import streams\n"
        "client = streams.connect()\n"
        "client.create_stream('orders')\n"
        "with client.writer('orders') as writer:\n"
        "    writer.append({'order': 1})\n"
        "print(client.positions('orders').linear, client.settings.redis_url is not None)\n",
    )
    assert taste.returncode == 0, taste.stderr
    assert taste.stdout.split() == ["1", "True"]

    positions = streams_cli(project / "app", "positions", "orders", "--json")
    assert positions.returncode == 0, positions.stderr
    assert "orders" in positions.stdout

    # The demo uses them and leaves them running; --embedded joins them and leaves them too.
    demo = streams_cli(project, "demo", "--no-spark", "--duration", "2", "--rate", "20")
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "embedded servers stopped" not in demo.stdout
    listed = streams_cli(project, "list", "--embedded")
    assert listed.returncode == 0 and "orders" in listed.stdout, listed.stderr
    assert all(pid_alive(pid) for pid in pids), "a command stopped the pinned servers"

    down = streams_cli(project, "down")
    assert down.returncode == 0, down.stderr
    assert "postgres: stopped" in down.stdout and "redis: stopped" in down.stdout
    assert not any(pid_alive(pid) for pid in pids), "down left a server running"
    stopped = streams_cli(project, "status")
    assert stopped.returncode == 3 and "not running" in stopped.stdout

    # With nothing running and no URL: one line that says how to start them.
    lost = python(project, "import streams\nstreams.connect()\n")
    assert lost.returncode == 1 and "streams up" in lost.stderr.splitlines()[-1]
    command = streams_cli(project, "list")
    assert command.returncode == 1 and "streams up" in command.stderr, command.stderr


def test_down_and_status_where_nothing_was_ever_started(tmp_path: Path) -> None:
    down = streams_cli(tmp_path, "down")
    assert down.returncode == 0 and "no embedded servers" in down.stdout, down.stderr
    status = streams_cli(tmp_path, "status")
    assert status.returncode == 3 and "not running" in status.stdout, status.stderr
    assert not (tmp_path / ".streams").exists(), "status made a directory"
