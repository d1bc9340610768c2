"""`streams demo` end to end, as a new user runs it: no database URL configured, so it starts
embedded servers in ./.streams/ of the working directory, runs writer processes, a Python
reader group (and a Spark query), and checks its own result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _run_demo(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    env["PYSPARK_PYTHON"] = sys.executable
    return subprocess.run(
        [sys.executable, "-m", "streams", "demo", "--json", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _server_processes(data_dir: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if str(data_dir) in line]


def test_demo_on_embedded_servers_with_no_url(tmp_path: Path) -> None:
    # Postgres runs as an unprivileged account under root: it must reach the directory.
    tmp_path.chmod(0o755)
    proc = _run_demo(tmp_path, "--duration", "20", "--no-spark", "--rate", "30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True, summary
    assert summary["committed_facts"] > 500
    assert summary["python_facts"] == summary["committed_facts"]
    assert "embedded servers" in proc.stderr and str(tmp_path / ".streams") in proc.stderr
    assert (tmp_path / ".streams").is_dir()
    assert _server_processes(tmp_path / ".streams") == [], "servers left running"


@pytest.mark.slow
def test_demo_with_spark(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    proc = _run_demo(tmp_path, "--duration", "15", "--rate", "20", "--writers", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True, summary
    assert summary["spark_facts"] == summary["committed_facts"] > 100
    assert summary["spark_batches"] >= 2
    assert _server_processes(tmp_path / ".streams") == []
