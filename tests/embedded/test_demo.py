"""`streams demo` end to end, as a new user runs it: no database URL configured, so it starts
embedded servers in ./.streams/ of the working directory, runs writer processes, a Python
reader group (and a Spark query), and checks its own result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import default_sigint


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
    # Java's and Spark's own output went to the log the summary names, not to the terminal;
    # the summary's `ok` includes both groups holding the stream's end (nothing lags).
    for noise in ("NativeCodeLoader", "incubator modules", "[Stage", "WARN"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert Path(summary["spark_log"]).is_file()


def test_ctrl_c_stops_the_demo_quietly_with_what_it_verified(tmp_path: Path) -> None:
    """The terminal sends SIGINT to the whole process group: the writers must not print a
    traceback each, and the user's interruption is no failure: exit 130, an interrupted
    summary of everything committed until then."""
    tmp_path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streams", "demo", "--json", "--no-spark", "--duration", "120"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=default_sigint,  # noqa: PLW1509 (one signal call)
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # until the live view shows facts flowing
            lines.append(line)
            if line.startswith("linear ") and not line.startswith("linear 0 "):
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = "".join(lines) + err
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["ok"] is True, summary
    assert summary["python_facts"] == summary["committed_facts"] > 0
    assert _server_processes(tmp_path / ".streams") == []


def test_the_demo_without_java_says_so_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    env.pop("JAVA_HOME", None)
    env["PATH"] = str(tmp_path)  # no java (the demo runs by this interpreter's full path)
    proc = subprocess.run(
        [sys.executable, "-m", "streams", "demo", "--duration", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "Java 17" in line and "--no-spark" in line, line
    assert not (tmp_path / ".streams").exists(), "servers were started for nothing"
