"""The Spark source on a real standalone cluster, shipped as a user without it on the cluster
would ship it, through every failure a cluster has: an executor JVM killed during a batch and
the driver killed mid-stream.

The cluster (tests/sparkcluster.py) is a master and a worker JVM started from the installed
PySpark; the project reaches the executors only as a venv-pack archive of a virtualenv made from
the built wheel, through ``spark-submit --archives`` with ``spark.pyspark.python`` pointing into
it; no process of the cluster can see the tests' own virtualenv. The jobs are the examples as
docs/spark.md submits them: ``spark/examples/produce.py`` (the sink) writes the first facts,
then ``spark/examples/consume.py`` reads them, and a live writer's, writing each micro-batch to
``--output``; the test checks every batch holds exactly the facts of its logged offsets (so the
retried task read the same facts), that all batches together hold every fact once, whole and in
order, and that the sink wrote each of its facts once and whole.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from helpers import REPO_ROOT, fact_rows, wait_until
from sparkcluster import (
    Cluster,
    PackedEnv,
    driver_dir,
    executor_pids,
    free_port,
    pack_environment,
    start_cluster,
    stop_group,
    submit,
)

from streams import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONSUME = REPO_ROOT / "spark" / "examples" / "consume.py"
PRODUCE = REPO_ROOT / "spark" / "examples" / "produce.py"
#: A job whose tasks report where their Python runs.
PROBE = REPO_ROOT / "tests" / "spark_probe.py"
#: Facts the sink example writes (3 rows each) before the consumer starts.
ORDERS = 300


@pytest.fixture(scope="session")
def packed_env(tmp_path_factory: pytest.TempPathFactory) -> PackedEnv:
    """The virtualenv made from the wheel and its venv-pack archive, built once a session."""
    return pack_environment(tmp_path_factory.mktemp("packed"), REPO_ROOT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("the Spark cluster test needs Java 17+", pytrace=False)
    running = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield running
    running.stop()


def _ui_json(port: int, path: str) -> Any:
    """A document of the driver's REST API (its UI, on 127.0.0.1)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=10) as resp:
        return json.loads(resp.read())


def _app_id(port: int) -> str:
    """The application ID the driver's UI reports (the executors' command lines carry it)."""
    deadline, error = time.monotonic() + 90, ""
    while time.monotonic() < deadline:
        try:
            apps = _ui_json(port, "applications")
        except (OSError, ValueError) as exc:  # not up yet, or answering empty while it starts
            error = str(exc)
        else:
            if apps:
                return str(apps[0]["id"])
        time.sleep(0.2)
    raise AssertionError(f"the driver's UI lists no application: {error}")


def _busy_executors(port: int, app_id: str) -> list[str]:
    """IDs of the executors (not the driver) running a task now, from the driver's UI."""
    try:
        executors = _ui_json(port, f"applications/{app_id}/executors")
    except (OSError, ValueError):
        return []
    return [e["id"] for e in executors if e["id"] != "driver" and e["activeTasks"] > 0]


def _batches(output: Path) -> dict[int, Path]:
    """The batch folders ``consume.py --output`` committed (Spark's ``_SUCCESS`` marker)."""
    return {
        int(p.name.split("=", 1)[1]): p for p in output.glob("batch=*") if (p / "_SUCCESS").exists()
    }


def _lost_tasks(log: Path) -> int:
    """How many tasks the driver has logged as lost (``WARN TaskSetManager: Lost task``)."""
    return log.read_text(errors="replace").count("Lost task")


def _writing(output: Path) -> int | None:
    """The batch whose folder Spark is writing now (``_temporary`` there, no ``_SUCCESS``)."""
    for path in output.glob("batch=*"):
        if (path / "_temporary").exists() and not (path / "_SUCCESS").exists():
            return int(path.name.split("=", 1)[1])
    return None


def _logged_offsets(checkpoint: Path, stream: str) -> dict[int, int]:
    """Batch ID -> the end offset Spark logged for it (the source's JSON on the last line)."""
    offsets = {}
    for path in (checkpoint / "offsets").iterdir():
        if path.name.isdigit():
            source = json.loads(path.read_text().strip().splitlines()[-1])
            offsets[int(path.name)] = int(source["streams"][stream])
    return offsets


def _keep_writing(
    client: Client, stream: str, stop: threading.Event, errors: list[BaseException]
) -> threading.Thread:
    """A writer appending single and multi-row facts (about 20 a second) until ``stop``: the
    consumer always has batches to run while the test waits for one to kill an executor in
    (a writer that stopped early left it nothing to do when the cluster started slowly)."""

    def run() -> None:
        rng = random.Random(7)
        try:
            with client.writer(stream, instance="live") as writer:
                n = 0
                while not stop.is_set() and n < 20_000:  # (a bound, should stop never come)
                    n += 1
                    if rng.random() < 0.3:
                        writer.append_batch([{"live": n, "i": i} for i in range(4)])
                    else:
                        writer.append({"live": n})
                    time.sleep(0.05)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_shipped_environment_is_what_executors_run(
    cluster: Cluster,
    packed_env: PackedEnv,
    client: Client,
    stream: str,
    streams_url: str,
    tmp_path: Path,
) -> None:
    """The executors run the shipped archive, as their tasks themselves report (a probe job,
    submitted as the examples are: no process sampling, which misses short-lived workers). And
    without ``--archives`` (everything else the same) the job fails on the executors: the Python
    they run exists only in the shipped archive. The interpreter the virtualenv was made from
    cannot import ``streams``: only the archive's site-packages have it."""
    base = subprocess.run(
        [str(packed_env.python.resolve()), "-I", "-c", "import streams"],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert base.returncode != 0 and "No module named 'streams'" in base.stderr, base
    client_env = {"STREAMS_DATABASE_URL": streams_url}
    with client.writer(stream) as writer:
        writer.append({"n": 1})
    report = tmp_path / "probe.json"
    probe = submit(
        cluster, packed_env, PROBE, [stream, str(report)],
        cwd=driver_dir(tmp_path / "driver", packed_env), log=tmp_path / "probe.log",
        env=client_env, conf={"spark.ui.enabled": "false"},
    )  # fmt: skip
    try:
        assert probe.wait(240) == 0, (tmp_path / "probe.log").read_text(errors="replace")[-4000:]
    finally:
        stop_group(probe)
    found = json.loads(report.read_text())
    assert found["rows"] == 1  # the streams source itself ran on the executors
    assert found["tasks"]
    for task in found["tasks"]:
        workdir = Path(task["cwd"]).resolve()
        environment = workdir / "environment"
        # The executor's own directory under the worker, the archive unpacked in it (a copy,
        # not a link to the virtualenv the archive was made from).
        assert workdir.is_relative_to((cluster.base / "work").resolve()), task
        assert environment.is_dir() and not environment.is_symlink(), task
        assert Path(task["executable"]).parent.resolve() == environment / "bin", task
        assert Path(task["prefix"]).resolve() == environment, task
        for module in ("streams", "streams_spark"):
            assert Path(task[module]).resolve().is_relative_to(environment), task
    log = tmp_path / "no-archive.log"
    job = submit(
        cluster, packed_env, CONSUME,
        [stream, "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out"),
         "--available-now", "--group", f"{stream}-control"],
        cwd=driver_dir(tmp_path / "driver", packed_env), log=log, env=client_env,
        archives=False, conf={"spark.ui.enabled": "false", "spark.task.maxFailures": "1"},
    )  # fmt: skip
    try:
        code = job.wait(240)
    finally:
        stop_group(job)
    text = log.read_text(errors="replace")
    assert code != 0, text[-3000:]
    assert 'Cannot run program "./environment/bin/python"' in text, text[-3000:]
    assert not _batches(tmp_path / "out")


def test_consume_on_a_cluster_is_exactly_once_across_executor_and_driver_kills(
    cluster: Cluster,
    packed_env: PackedEnv,
    client: Client,
    stream: str,
    streams_url: str,
    tmp_path: Path,
) -> None:
    output, checkpoint, log = tmp_path / "out", tmp_path / "checkpoint", tmp_path / "driver.log"
    cwd = driver_dir(tmp_path / "driver", packed_env)
    env = {"STREAMS_DATABASE_URL": streams_url}
    # The sink example writes the first facts: 900 rows, the 3 rows of each order one fact.
    produce = submit(
        cluster, packed_env, PRODUCE,
        [stream, "--rows", str(3 * ORDERS), "--lines", "3", "--partitions", "2"],
        cwd=cwd, log=log, env=env, conf={"spark.ui.enabled": "false"},
    )  # fmt: skip
    try:
        assert produce.wait(240) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        stop_group(produce)
    assert f"wrote {3 * ORDERS} rows as {ORDERS} facts to {stream}" in log.read_text()
    args = [stream, "--checkpoint", str(checkpoint), "--output", str(output),
            "--max-facts", "150", "--group", f"{stream}-cluster"]  # fmt: skip
    ui = free_port()
    ui_conf = {"spark.ui.enabled": "true", "spark.ui.port": str(ui)}

    stop = threading.Event()
    errors: list[BaseException] = []
    writing = _keep_writing(client, stream, stop, errors)
    first = submit(cluster, packed_env, CONSUME, args, cwd=cwd, log=log, env=env, conf=ui_conf)
    try:
        app_id = _app_id(ui)
        # Kill the executor JVM while a task reads a batch's facts and writes its files (the
        # batch's folder is being written, not yet committed): Spark retries the task on a new
        # executor, and the batch's files must still hold exactly its facts.
        killed_in: int | None = None
        for _ in range(10):
            try:
                wait_until(
                    lambda: _writing(output) is not None and bool(_busy_executors(ui, app_id)),
                    180,
                    "a batch being written",
                )
            except AssertionError:
                raise AssertionError(log.read_text(errors="replace")[-4000:]) from None
            batch_id, pids = _writing(output), executor_pids(app_id)
            if batch_id is None or not pids:
                continue
            lost_before = _lost_tasks(log)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while _lost_tasks(log) == lost_before and time.monotonic() < deadline:
                time.sleep(0.1)
            if _lost_tasks(log) > lost_before:
                killed_in = batch_id
                break
        assert killed_in is not None, (
            "no task was lost to an executor kill:\n" + (log.read_text(errors="replace")[-3000:])
        )
        after_executor = len(_batches(output))
        wait_until(lambda: len(_batches(output)) > after_executor, 180, "a batch after it")

        time.sleep(random.uniform(0.0, 1.0))  # the driver dies anywhere in a batch
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        stop.set()
        stop_group(first)
    writing.join(30)
    assert not errors, errors
    killed_at = len(_batches(output))
    with client.writer(stream, instance="while-down") as writer:  # facts for the restart
        writer.append_batch([{"down": n} for n in range(40)])

    second = submit(cluster, packed_env, CONSUME, [*args, "--available-now"], cwd=cwd, log=log,
                    env=env, conf={"spark.ui.enabled": "false"})  # fmt: skip
    try:
        assert second.wait(240) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        stop_group(second)

    facts = fact_rows(streams_url, stream)
    batches = _batches(output)
    offsets = _logged_offsets(checkpoint, stream)
    assert len(batches) > killed_at > killed_in
    assert sorted(batches) == list(range(len(batches))) == sorted(offsets)
    # Each batch holds exactly the facts of its logged offsets, in order within each file: the
    # retried task and the replayed batch read the same facts.
    delivered: list[tuple[int, int, Any]] = []
    previous = 0
    for batch_id in sorted(batches):
        end = offsets[batch_id]
        assert end >= previous
        rows: list[tuple[int, int, Any]] = []
        for part in sorted(batches[batch_id].glob("part-*.parquet")):
            table = pq.read_table(part, columns=["stream_id", "row_no", "payload"]).to_pylist()
            in_file = [(r["stream_id"], r["row_no"], json.loads(r["payload"])) for r in table]
            assert in_file == sorted(in_file, key=lambda r: r[:2]), (batch_id, part)
            rows += in_file
        rows.sort(key=lambda r: r[:2])
        expected = [(i, r, p) for i, r, _, _, p in facts if previous < i <= end]
        assert rows == expected, f"batch {batch_id} ({previous}, {end}]"
        delivered += rows
        previous = end
    # Together: every fact once, whole, in order, nothing invented.
    assert delivered == [(i, r, p) for i, r, _, _, p in facts]
    assert {"live", "while-down"} <= {instance for _, _, instance, _, _ in facts}
    # What the sink example wrote: each order once, as one fact of its 3 rows in line order (the
    # key column, `order`, is not in the payload: it is n // 3).
    orders: dict[int, list[tuple[int, Any]]] = {}
    for stream_id, row_no, payload in delivered:
        if isinstance(payload, dict) and "line" in payload:
            orders.setdefault(stream_id, []).append((row_no, payload))
    firsts = sorted(fact[0][1]["n"] // 3 for fact in orders.values())
    assert firsts == list(range(ORDERS))
    for fact in orders.values():
        order = fact[0][1]["n"] // 3
        assert fact == [(line, {"n": 3 * order + line, "line": line}) for line in range(3)]
