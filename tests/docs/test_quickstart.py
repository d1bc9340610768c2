"""docs/quickstart.md runs as written, as a newcomer runs it: no URL configured and, where the
machine allows it, no server reachable at all (a network namespace of its own, with only its
loopback): ``streams up``, the README's Python taste and Spark taste unchanged, ``streams
positions``, ``streams down``; what each prints is what the page says, and nothing is left
running (issue 41).

The page's runnable blocks, in order: ``sh quickstart`` (each line a command; a ``text`` block
right after it is its expected output), ``python`` (consecutive blocks are one program, as the
page tells the reader to save them), ``python spark`` (a program of its own). A ``print(...)``
whose line ends in ``# X`` must print a line that ``X`` starts with (``# 1002: every ID ...``).
An expected ``text`` line matches the printed line whose words begin with its words (the words
after ``...`` are not compared: idle times, pids and owners differ between runs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from streams.devservers import pid_alive

PAGE = REPO_ROOT / "docs" / "quickstart.md"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
_PRINTED = re.compile(r"^\s*print\(.*\)\s*#\s*(.+)$")

#: Run inside the namespace: each step, its output in files, stopping at the first failure.
RUNNER = """
import json, subprocess, sys
steps = json.load(open("steps.json"))
for number, (kind, body) in enumerate(steps):
    if kind == "sh":
        argv = ["bash", "-e", "-c", body]
    else:
        name = f"step{number}.py"
        open(name, "w").write(body)
        argv = [sys.executable, name]
    with open(f"step{number}.out", "w") as out, open(f"step{number}.err", "w") as err:
        code = subprocess.run(argv, stdout=out, stderr=err, timeout=400).returncode
    try:  # what `streams up` recorded (`streams down` removes it): the test's cleanup
        seen = open(".streams/up.json").read()
        open("up.json.seen", "w").write(seen)
    except OSError:
        pass
    if code != 0:
        sys.exit(f"step {number} ({kind}) exited {code}")
"""


def page_steps() -> list[tuple[str, str, list[str]]]:
    """(kind, body, expected lines) for each runnable step of the page, in order."""
    steps: list[tuple[str, str, list[str]]] = []
    python: list[str] = []
    for tag, body in _FENCE.findall(PAGE.read_text()):
        info = tag.strip()
        if info != "python" and python:
            steps.append(_python_step("\n".join(python)))
            python = []
        if info == "python":
            python.append(body)
        elif info == "python spark":
            steps.append(_python_step(body))
        elif info == "sh quickstart":
            steps.append(("sh", body, []))
        elif info == "text" and steps and steps[-1][0] == "sh":
            kind, command, _ = steps[-1]
            steps[-1] = (kind, command, body.splitlines())
    if python:
        steps.append(_python_step("\n".join(python)))
    return steps


def _python_step(code: str) -> tuple[str, str, list[str]]:
    expected = [m.group(1) for m in map(_PRINTED.match, code.splitlines()) if m]
    return ("python", code, expected)


def _isolation() -> list[str]:
    """The command prefix that gives the run a network of its own (only a loopback), if this
    machine allows it; else nothing (the run still has no URL configured)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        probe = subprocess.run(
            [*prefix, "ip", "link", "set", "lo", "up"], capture_output=True, check=False
        )
        if probe.returncode == 0:
            return [*prefix, "sh", "-c", 'ip link set lo up && exec "$@"', "isolated"]
    return []


def _matches(expected: str, printed: str) -> bool:
    words = expected.split("...", maxsplit=1)[0].split()
    return printed.split()[: len(words)] == words


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A fresh project directory; the servers started there die with the test."""
    tmp_path.chmod(0o755)  # under root, PostgreSQL runs as an unprivileged account
    try:
        yield tmp_path
    finally:
        up = tmp_path / "up.json.seen"
        if up.exists():
            recorded = json.loads(up.read_text())
            for pid in (recorded["postgres_pid"], recorded["redis_pid"]):
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_the_page_has_the_readme_tastes() -> None:
    """The quickstart shows the README's Python and Spark tastes unchanged."""
    from helpers import doc_blocks, readme_blocks

    assert doc_blocks(PAGE, "python") == readme_blocks("python")
    assert doc_blocks(PAGE, "python spark") == readme_blocks("python spark")
    kinds = [kind for kind, _, _ in page_steps()]
    assert kinds == ["sh", "python", "python", "sh", "sh"], kinds  # Python, then Spark


def test_the_quickstart_runs_as_written_with_no_server(project: Path) -> None:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("the quickstart's Spark taste needs Java 17+", pytrace=False)
    steps = page_steps()
    (project / "steps.json").write_text(json.dumps([(kind, body) for kind, body, _ in steps]))
    (project / "runner.py").write_text(RUNNER)
    conf = project / "spark-conf"  # a loaded machine needs more than Spark's 15 s default
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(
        "spark.python.authenticate.socketTimeout 120s\nspark.ui.enabled false\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    env |= {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SPARK_CONF_DIR": str(conf),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}  # fmt: skip
    run = subprocess.run(
        [*_isolation(), sys.executable, "runner.py"],
        cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip

    def output(number: int, stream: str = "out") -> str:
        path = project / f"step{number}.{stream}"
        return path.read_text() if path.exists() else ""

    last = max([n for n in range(len(steps)) if (project / f"step{n}.out").exists()] or [0])
    assert run.returncode == 0, (run.stderr, output(last, "err")[-3000:])
    for number, (kind, _, expected) in enumerate(steps):
        printed = output(number).splitlines()
        if kind == "python":  # each commented print, in order, among what the program printed
            remaining = iter(printed)
            for comment in expected:
                assert any(line and comment.startswith(line.strip()) for line in remaining), (
                    f"step {number}: nothing printed {comment!r}; it printed {printed}"
                )
        else:
            assert len(printed) >= len(expected), (number, printed)
            for want, got in zip(expected, printed, strict=False):
                assert _matches(want, got), f"step {number}: {got!r} is not {want!r}"
    assert "export STREAMS_DATABASE_URL=" in output(0)
    recorded = json.loads((project / "up.json.seen").read_text())
    assert not pid_alive(recorded["postgres_pid"]) and not pid_alive(recorded["redis_pid"])
