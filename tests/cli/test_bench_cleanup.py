"""Every benchmark removes what it created (`streams.bench.common.scratch_streams`): its streams
(registry rows, partitions of ``streams_facts``, sequences) with their writer rows, reader
groups and proofs, its raw baseline tables, and its child processes; when it ends, when it
fails, and when it is interrupted (SIGINT, as Ctrl-C sends).

Each test runs on a fresh database and compares what the database holds before and after (every
relation of the schema and every row of the bookkeeping tables); the registry's ID sequence
shows that the benchmark did create its streams.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from helpers import assert_image, default_sigint
from servers import create_database, database_name, drop_database

import streams
from streams.bench.common import drop_streams, scratch_streams
from streams.bench.history import run_history_bench
from streams.bench.write import run_write_bench
from streams.command import main
from streams.migrate import upgrade

Snapshot = dict[str, list[tuple[Any, ...]]]


@pytest.fixture
def bench_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh database at the schema head, for one test; dropped afterwards."""
    url = create_database(postgres_admin_url, prefix="streams_bench")
    upgrade(url)
    yield url
    drop_database(postgres_admin_url, database_name(url))


def snapshot(url: str) -> Snapshot:
    """Every relation of the schema, and the rows that belong to streams."""
    queries = {
        "relations": "SELECT relkind, relname FROM pg_class "
        "WHERE relnamespace = 'public'::regnamespace ORDER BY 1, 2",
        "streams": "SELECT id, name, sequence_name FROM streams_registry ORDER BY 1",
        "writers": "SELECT stream, instance FROM streams_writers ORDER BY 1, 2",
        "groups": "SELECT stream, group_name FROM streams_reader_groups ORDER BY 1, 2",
        "proofs": "SELECT stream FROM streams_proofs ORDER BY 1",
    }
    with psycopg.connect(url) as conn:
        return {name: conn.execute(query).fetchall() for name, query in queries.items()}


def streams_created(url: str) -> int:
    """How many streams were ever created (the registry's ID sequence)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT last_value, is_called FROM streams_registry_id_seq").fetchone()
    assert row is not None
    return int(row[0]) if row[1] else 0


def children(pid: int) -> dict[int, str]:
    """Live (not zombie) child processes of ``pid``: their command lines."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def ours(pids: dict[int, str]) -> set[int]:
    """Benchmark processes (multiprocessing's resource tracker lives as long as its parent)."""
    return {pid for pid, cmdline in pids.items() if "resource_tracker" not in cmdline}


def gone(pids: set[int], timeout: float = 15.0) -> set[int]:
    """Those of ``pids`` still alive (not zombies) after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = set()
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.add(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


# ------------------------------------------------------------------------------ a run ends


BENCHES = {
    # name: (arguments, streams the run creates)
    "write": (["--seconds", "0.2", "--rounds", "1", "--writers", "1", "--memory-facts", "0"], 1),
    "latency": (["--seconds", "0.5", "--writers", "1", "--catchup-facts", "500"], 2),
    "fanout": (["--readers", "1", "--modes", "own", "--seconds", "0.5", "--writers", "1"], 2),
    "fleet": (["--points", "1x1", "--seconds", "0.5"], 1),
    "probe": (["--iterations", "3", "--idle-sessions", "1", "--locks", "10"], 3),
    # The subject, 2 + 2 fillers, and a stream created per round at each count and again.
    "streams": (["--counts", "3,6", "--rounds", "1"], 8),
}


#: The benchmarks that draw their figures (``--plot``), in the format each run here uses.
PLOTS = {"write": ".png", "latency": ".svg", "fleet": ".svg", "streams": ".png"}


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_a_benchmark_leaves_nothing_behind(
    bench_url: str, redis_url: str, bench: str, tmp_path: Path
) -> None:
    """...and, where it draws a plot, the same run writes it (the figures of a real run)."""
    args, created = BENCHES[bench]
    before = snapshot(bench_url)
    before_children = set(children(os.getpid()))
    plot = tmp_path / f"bench-{bench}{PLOTS.get(bench, '')}"
    if bench in PLOTS:
        args = [*args, "--plot", str(plot)]
    argv = ["bench", bench, *args, "--database-url", bench_url, "--redis-url", redis_url]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert streams_created(bench_url) == created
    assert snapshot(bench_url) == before
    assert gone(ours(children(os.getpid())) - before_children) == set()
    if bench in PLOTS:
        assert f"plot written to {plot}" in result.output
        assert_image(plot)
    if bench == "streams":  # the baseline measured again at the end, and the verdicts on it
        assert "3 streams again, the baseline after the run" in result.output, result.output
        assert "at 6 streams, against the baseline before / after / mean:" in result.output
        assert result.output.count("(baseline ") == 7, result.output


def test_a_failed_benchmark_leaves_nothing_behind(bench_url: str, redis_url: str) -> None:
    """The benchmark fails midway (here: its report), with its raw table and its stream made."""
    before = snapshot(bench_url)
    before_children = set(children(os.getpid()))

    def report(line: str) -> None:
        raise RuntimeError(f"report refused: {line}")

    with pytest.raises(RuntimeError, match="report refused: single x1"):
        run_write_bench(
            bench_url, redis_url=redis_url, writer_counts=(1,), seconds=0.2, rounds=1,
            report=report,
        )  # fmt: skip
    assert streams_created(bench_url) == 1
    assert snapshot(bench_url) == before
    assert gone(ours(children(os.getpid())) - before_children) == set()


def test_history_fails_between_measurements_and_leaves_nothing(
    bench_url: str, redis_url: str
) -> None:
    """A failure after the load, with the admin session and the client open: they are closed
    first, so that dropping the streams does not wait for them."""
    before = snapshot(bench_url)
    settings = streams.Settings.resolve(bench_url, redis_url)

    def report(line: str) -> None:
        if line.startswith("single-fact appends"):
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        run_history_bench(
            settings, facts=1000, catchup_facts=100, append_seconds=0.1, report=report
        )
    assert streams_created(bench_url) == 2
    assert snapshot(bench_url) == before


def test_history_keep_keeps_only_the_long_stream(bench_url: str) -> None:
    before = snapshot(bench_url)
    lines: list[str] = []
    settings = streams.Settings.resolve(bench_url)
    run_history_bench(
        settings, facts=1000, catchup_facts=100, keep=True, append_seconds=0.1,
        report=lines.append,
    )  # fmt: skip
    after = snapshot(bench_url)
    ((key, name, sequence),) = after["streams"]
    assert lines[0] == f"loading 1,000 facts into {name} ..."
    relations = set(after["relations"]) - set(before["relations"])
    assert ("r", f"streams_facts_{key}") in relations
    assert ("S", sequence) in relations
    assert streams_created(bench_url) == 2  # the empty stream beside it is gone
    drop_streams(bench_url, [name])
    assert snapshot(bench_url) == before


# ------------------------------------------------------------------------------ Ctrl-C


def _bench_process(url: str, redis_url: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    return subprocess.Popen(
        [sys.executable, "-m", "streams", "bench", *args, "--database-url", url,
         "--redis-url", redis_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=default_sigint,  # noqa: PLW1509 (one signal call: no lock taken)
    )  # fmt: skip


INTERRUPTED = {
    # name: (arguments, what its busy child processes run)
    "write": (
        ["--seconds", "20", "--rounds", "1", "--writers", "2", "--memory-facts", "0"],
        "multiprocessing.spawn",
    ),
    "fanout": (
        ["--readers", "1", "--modes", "own", "--seconds", "20", "--writers", "2"],
        "streams.bench.fanout_child",
    ),
}


@pytest.mark.parametrize(
    ("bench", "signum"),
    [(bench, signal.SIGINT) for bench in sorted(INTERRUPTED)] + [("write", signal.SIGTERM)],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else value,
)
def test_an_interrupted_benchmark_leaves_nothing_behind(
    bench_url: str, redis_url: str, bench: str, signum: signal.Signals
) -> None:
    """SIGINT (Ctrl-C) or SIGTERM (a job's timeout, ``kill``) once the benchmark has made its
    stream (and, for ``write``, its raw table) and its writer processes are appending: it ends
    them and drops everything before it exits."""
    args, program = INTERRUPTED[bench]
    before = snapshot(bench_url)
    proc = _bench_process(bench_url, redis_url, bench, *args)
    try:
        deadline = time.monotonic() + 60
        busy: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            now = snapshot(bench_url)
            busy = {pid for pid, cmd in children(proc.pid).items() if program in cmd}
            made = len(now["streams"]) == 1 and (
                bench != "write"
                or any(name.startswith("streams_bench_raw_") for _, name in now["relations"])
            )
            if made and len(busy) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the benchmark never got going: {proc.communicate(timeout=60)}")
        time.sleep(1.0)  # the writers append
        if bench == "fanout":  # they did: the point's stream has facts (on a loaded machine
            # the writer processes may take a while to get going)

            def appended() -> bool:
                with psycopg.connect(bench_url) as conn:
                    row = conn.execute(
                        "SELECT pg_sequence_last_value(sequence_name::regclass) "
                        "FROM streams_registry"
                    ).fetchone()
                return row is not None and row[0] is not None and row[0] > 0

            deadline = time.monotonic() + 30
            while not appended():
                assert time.monotonic() < deadline, "the benchmark's writers never appended"
                time.sleep(0.2)
        everyone = ours(children(proc.pid))
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (out, err)  # interrupted, as shells expect (either signal)
    assert "Traceback" not in err and "Aborted!" not in err, err
    assert snapshot(bench_url) == before
    assert gone(everyone) == set()


def test_ctrl_c_while_cleaning_up_does_not_stop_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A first Ctrl-C during the removal says what is going on and lets it finish (here: a
    child that ignores SIGTERM is killed once its grace period is over)."""
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
         "time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with (
            pytest.raises(RuntimeError, match="the benchmark failed"),
            scratch_streams("postgresql://nowhere.invalid/x", "test") as scratch,
        ):
            scratch.watch(stubborn)
            timer.start()  # fires while the scratch waits for the child
            raise RuntimeError("the benchmark failed")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()
    assert stubborn.returncode == -signal.SIGKILL
    assert "Ctrl-C again to leave them" in capsys.readouterr().err
