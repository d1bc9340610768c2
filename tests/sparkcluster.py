"""A real Spark standalone cluster on this machine, and the environment shipped to it.

Terms:

* ``SPARK_HOME`` is the installed ``pyspark`` package directory: pip's PySpark ships
  ``bin/spark-class``, ``bin/spark-submit`` and the jars, so it runs a master and a worker as
  well as a distribution does.
* The *cluster* is one master and one worker JVM (``spark-class ...Master`` / ``...Worker``),
  bound to 127.0.0.1 on free ports, each in its own process group, stopped by PID. The master's
  REST submission server is off (it would take the fixed port 6066).
* The *packed environment* is what a user without ``streams`` on the cluster ships to it: a
  virtualenv made for the purpose from the wheel built from the checkout
  (``streams[spark-executor]``: no PySpark, the cluster's own ``pyspark.zip`` serves its Python
  workers), packed by ``venv-pack`` into a ``.tar.gz``. ``spark-submit --archives
  env.tar.gz#environment`` unpacks it as ``./environment`` in every executor's directory and
  ``spark.pyspark.python=./environment/bin/python`` runs the Python workers from it. The driver
  plans a Python data source in Python too, with the same relative path, from its working
  directory: there ``environment`` is a link to the unpacked virtualenv (the user's own).
* A *clean environment* for the JVMs names no Python of the tests: no ``VIRTUAL_ENV``,
  ``PYTHONPATH`` or ``PYSPARK_*``, and the tests' virtualenv is off ``PATH``; so the only Python
  that can import ``streams`` on the cluster is the shipped one.

venv-pack does not ship the interpreter: the virtualenv links to the Python it was made with,
which every node must have at the same path (here the one machine is every node).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pyspark

SPARK_HOME = Path(pyspark.__file__).resolve().parent
HOST = "127.0.0.1"
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that points at the tests' Python."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"} and not k.startswith("PYSPARK_")
    }
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env.update(SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP=HOST, **extra)
    return env


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def wait_for_log(path: Path, text: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``text`` appears in the log a process writes, failing with its tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before {text!r}:\n{_tail(path)}")
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} after {timeout}s:\n{_tail(path)}")


def stop_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """Stop a process started with ``start_new_session`` and everything in its group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    # Children (executor JVMs, Python workers) may outlive the leader.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@dataclass
class Cluster:
    """A running master and worker; ``url`` is the master's ``spark://`` URL."""

    url: str
    base: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{_tail(self.base / name)}" for name in ("master.log", "worker.log")
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the worker first: it stops its executors
            stop_group(proc)


def start_cluster(base: Path, cores: int = 2, memory: str = "2g") -> Cluster:
    """Start a master and a worker from the installed PySpark; wait until the worker has
    registered (each JVM starts in a few seconds)."""
    base.mkdir(parents=True, exist_ok=True)
    (base / "local").mkdir(exist_ok=True)
    port = free_port()
    env = clean_env(
        SPARK_LOCAL_DIRS=str(base / "local"),  # scratch and fetched files, not /tmp
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
        SPARK_WORKER_OPTS="-Dspark.worker.cleanup.enabled=false",
    )
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    commands = {
        "master.log": [
            spark_class, "org.apache.spark.deploy.master.Master", "--host", HOST,
            "--port", str(port), "--webui-port", str(free_port()),
        ],
        "worker.log": [
            spark_class, "org.apache.spark.deploy.worker.Worker", f"spark://{HOST}:{port}",
            "--host", HOST, "--port", str(free_port()), "--webui-port", str(free_port()),
            "--cores", str(cores), "--memory", memory, "--work-dir", str(base / "work"),
        ],
    }  # fmt: skip
    cluster = Cluster(url=f"spark://{HOST}:{port}", base=base)
    try:
        for log, command in commands.items():
            with (base / log).open("wb") as out:
                proc = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True, cwd=base,
                )  # fmt: skip
            cluster.procs.append(proc)
        master, worker = cluster.procs
        wait_for_log(base / "master.log", "I have been elected leader", 90, master)
        wait_for_log(base / "worker.log", "Successfully registered with master", 90, worker)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@dataclass(frozen=True)
class PackedEnv:
    """``venv``: the virtualenv made for the purpose; ``archive``: it, packed by venv-pack."""

    venv: Path
    archive: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def pack_environment(base: Path, repo: Path) -> PackedEnv:
    """Build the wheel from ``repo``, install it with the ``spark-executor`` extra in a new
    virtualenv (from the package index; pip's cache makes it quick), pack that."""
    base.mkdir(parents=True, exist_ok=True)

    def run(*command: str) -> None:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=900, check=False, cwd=base
        )
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])

    dist = base / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(repo))
    (wheel,) = dist.glob("streams-*.whl")
    env_dir = base / "streams-env"
    # Made from the base interpreter, not the tests' virtualenv (venv follows sys._base_executable).
    venv.EnvBuilder(with_pip=True, symlinks=True).create(env_dir)  # as `python -m venv`
    python = env_dir / "bin" / "python"
    run(str(python), "-m", "pip", "install", "-q", f"{wheel}[spark-executor]")
    archive = base / "streams-env.tar.gz"
    run(
        sys.executable, "-m", "venv_pack", "--prefix", str(env_dir), "--output", str(archive),
        "--compress-level", "1", "--quiet",
    )  # fmt: skip
    return PackedEnv(venv=env_dir, archive=archive)


def driver_dir(base: Path, packed: PackedEnv) -> Path:
    """A working directory for ``spark-submit`` where ``./environment`` is the virtualenv."""
    base.mkdir(parents=True, exist_ok=True)
    link = base / "environment"
    if not link.exists():
        link.symlink_to(packed.venv, target_is_directory=True)
    return base


def submit(
    cluster: Cluster,
    packed: PackedEnv,
    script: Path,
    args: list[str],
    *,
    cwd: Path,
    log: Path,
    env: dict[str, str],
    archives: bool = True,
    conf: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``spark-submit`` ``script`` to the cluster in client mode, the way docs/spark.md shows:
    the archive through ``--archives``, Python workers from ``./environment``. Returns the
    process (its own group: the launcher, the driver JVM and the driver's Python)."""
    command = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", cluster.url]
    if archives:
        command += ["--archives", f"{packed.archive}#environment"]
    settings = {
        "spark.pyspark.python": "./environment/bin/python",
        "spark.sql.shuffle.partitions": "2",  # the examples' per-batch summaries are small
        # Python workers slow to connect back on two loaded cores fail a query after 15 s.
        "spark.python.authenticate.socketTimeout": "120s",
        **(conf or {}),
    }
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    command += [str(script), *args]
    full_env = clean_env(
        PYSPARK_DRIVER_PYTHON="./environment/bin/python",
        SPARK_LOCAL_DIRS=str(cluster.base / "local"),
        **env,
    )
    with log.open("ab") as out:
        out.write(("$ " + " ".join(command) + "\n").encode())
        out.flush()
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])


def executor_pids(app_id: str) -> list[int]:
    """The PIDs of the executor JVMs of application ``app_id`` (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmd = _cmdline(int(entry.name))
            if EXECUTOR_CLASS in cmd and app_id in cmd:
                pids.append(int(entry.name))
    return sorted(pids)
