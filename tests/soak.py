"""A soak (issue 38): the chaos run of every fault (``tests/faults/test_chaos.py``) kept up for
an hour while every process and server is sampled, then judged: nothing may grow beyond what
retention keeps, and the run's own checks must pass.

``make soak`` runs it (``STREAMS_CHAOS_SECONDS=3600``, the role-model variant, a sample a
minute, the report in ``.soak/``). The chaos test starts one (`Soak.beside`) only when
``STREAMS_SOAK_DIR`` is set: the suite's chaos run is unchanged. Settings, from the
environment: ``STREAMS_SOAK_DIR`` (where the report goes, one folder per variant),
``STREAMS_SOAK_EVERY`` (seconds between samples, default 60), ``STREAMS_SOAK_RETENTION``
(seconds the soak's own stream keeps, default a twelfth of the run within 30-300),
``STREAMS_SOAK_WARMUP`` (seconds the judgement ignores, default `default_warmup`).

Sampled every tick (`Sampler`), each series named ``"<metric> <subject>"``:

* per service process, by its slot (a slot's child is restarted by the test as a supervisor
  would: its PID changes, its series goes on), once it has run for `SETTLED` seconds: RSS
  (``VmRSS``), open file descriptors (sockets included: its connections), threads;
* PostgreSQL: client sessions of the run's database, in all and per login;
* Redis: ``used_memory``, ``connected_clients`` and keys;
* every table of the database: size with indexes and TOAST, and rows.

What "growth beyond retention" means here. The chaos run's final check needs every fact its
writers acknowledged, so its two streams keep everything: their partitions, and the effects
table of the transactional group, grow with the facts written, by design. For those the soak
judges the bytes per row, which must stay flat: rolled-back reservations and MVCC leave dead
rows, and a table whose autovacuum does not keep up grows per row. Every other table has
bounded content under an operator's routine, which the soak runs each tick as a schedule would
(`Upkeep`): `streams.Client.prune` (idempotency keys older than the key window, which the soak
sets to `window`; on the soak's own stream, facts past its retention),
`streams.Client.prune_writers` (writers retired longer ago than the window) and ``VACUUM``
(autovacuum cannot run in a server restarted every few seconds: `Upkeep`): the writers, keys,
claims, registry, groups, proofs... must be flat in size. Retention itself is judged on a
stream of the soak's own with a retention (``STREAMS_SOAK_RETENTION``): its partition must be
flat once the first windows have been filled and pruned (the default warm-up covers two).

Processes: the chaos children live seconds to minutes (they are killed at random), so a slot's
series spans many lifetimes and shows only a fast leak. The soak therefore adds two
*bystanders* (`Bystanders`): a writer and a plain reader of its own stream (the chaos child's
programs), which meet every server fault (PostgreSQL stopped, sessions ended, Redis restarted,
lines replayed on their channels) but are never killed: their RSS, descriptors and threads over
the hour are those of the library in a long-lived service. RSS, descriptors, threads,
connections and Redis must be flat. A chaos plain reader starts each life at the earliest fact
and catches up, and the size it settles at grows with the history it replayed until that passes
about 20,000 facts (measured on one stream: 58 MB after catching up 2,000 facts, 61 after
5,000, 63 after 10,000, 64-65 from 20,000 to 160,000): the hour's warm-up (11 minutes, some
10,000 and 25,000 facts in the two streams) covers most of it. The test's own process is
reported, not judged: it keeps every line its children printed, for the final check.

The bystanders change the chaos run a little: some of the sessions it ends at random are
theirs, and their commits during a "hole" fault flush the WAL that fault leaves unflushed (the
group consumers and heartbeats commit there too). The suite's chaos run has no bystanders.

The judgement is `soakjudge.judge` (the medians of the first and last thirds after a warm-up);
the report, `soakreport.write_report`: the samples as JSON and CSV, a plot, a markdown summary.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis
from faultkit import die_with_parent
from helpers import TESTS_DIR
from psycopg import sql
from soakjudge import Verdict, judge, split_series
from soakreport import write_report

import streams

__all__ = ["Bystanders", "Sampler", "Soak", "SoakSettings", "Upkeep", "process_stats"]

CHILD = TESTS_DIR / "chaos_child.py"
#: Tables of the chaos run that keep every fact (judged per row, as its streams' partitions).
KEEPS_EVERY_FACT = ("chaos_effects",)
#: The bystander writer's lease: the chaos children's.
LEASE = 2.0
Processes = Callable[[], Mapping[str, int]]
#: Seconds a process runs before it is sampled: a child just (re)started is still importing
#: and connecting (about 35 MB, 1 thread, 3 descriptors; 57 MB, 4, 9 five seconds later, on
#: the busy 2-core machine), and would read as growth wherever restarts are frequent.
SETTLED = 10.0


def default_retention(seconds: float) -> float:
    """A twelfth of the run, within 30 s - 5 min: an hour's soak prunes a 5-minute window
    about ten times; a short run still fills and prunes its window a few times."""
    return min(300.0, max(30.0, seconds / 12))


def default_warmup(seconds: float, every: float, retention: float) -> float:
    """A tenth of the run, at least two retention windows and a tick (the retained stream
    full and pruned twice) and five minutes (the chaos streams past the history that sets a
    fresh reader's size), but never more than half the run (a short run judges its second
    half)."""
    return min(max(0.1 * seconds, 2 * retention + every, 300.0), seconds / 2)


@dataclass(frozen=True, slots=True)
class SoakSettings:
    directory: Path
    seconds: float
    every: float
    retention: float
    warmup: float

    @property
    def window(self) -> float:
        """Key window and writer-row age the upkeep prunes past: the retention, but at least
        two minutes (a keyed append retried after an unknown outcome must find its key)."""
        return max(self.retention, 120.0)

    @classmethod
    def from_env(cls, seconds: float) -> SoakSettings | None:
        directory = os.environ.get("STREAMS_SOAK_DIR")
        if not directory:
            return None
        every = float(os.environ.get("STREAMS_SOAK_EVERY") or 60)
        retention = float(os.environ.get("STREAMS_SOAK_RETENTION") or default_retention(seconds))
        warmup = os.environ.get("STREAMS_SOAK_WARMUP")
        return cls(
            Path(directory),
            seconds,
            every,
            retention,
            float(warmup) if warmup else default_warmup(seconds, every, retention),
        )


# ---------------------------------------------------------------------------- sampling


def process_stats(pid: int) -> dict[str, float] | None:
    """RSS (MB), open descriptors, threads and age (s) of a live process; None if it is gone
    or a zombie (no memory left to measure)."""
    proc = Path(f"/proc/{pid}")
    try:
        status = dict(
            line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line
        )
        if status.get("State", "").strip().startswith(("Z", "X")) or "VmRSS" not in status:
            return None
        fds = len(os.listdir(proc / "fd"))
        # Field 22 of stat, after the parenthesised name (which may hold spaces): start time.
        start_ticks = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return {
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
        "fds": float(fds),
        "threads": float(int(status["Threads"])),
        "age": uptime - start_ticks / os.sysconf("SC_CLK_TCK"),
    }


class Sampler:
    """One sample of everything (`sample`); each server is asked on a fresh connection, so a
    fault of the run costs at most that server's series at that tick."""

    def __init__(
        self, processes: Processes, database_url: str, redis_url: str, kept: Sequence[str]
    ) -> None:
        self.processes = processes
        self.database_url = database_url
        self.redis_url = redis_url
        #: Streams that keep every fact (judged per row); other partitions by size.
        self.kept = set(kept)

    def sample(self, t: float, patience: float = 0.0) -> dict[str, Any]:
        """Everything at ``t``; a server that does not answer is asked again for up to
        ``patience`` seconds (under the faults PostgreSQL is down a good part of the time)."""
        values: dict[str, float] = {}
        pids: dict[str, int] = {}
        ages: dict[str, float] = {}
        errors: list[str] = []
        for subject, pid in sorted(self.processes().items()):
            stats = process_stats(pid)
            if stats is None:
                continue
            pids[subject], ages[subject] = pid, round(stats["age"], 1)
            if stats["age"] >= SETTLED:
                for metric in ("rss_mb", "fds", "threads"):
                    values[f"{metric} {subject}"] = stats[metric]
        harness = process_stats(os.getpid())
        if harness is not None:
            for metric in ("rss_mb", "fds", "threads"):
                values[f"harness_{metric} test"] = harness[metric]
        deadline = time.monotonic() + patience
        for server, read, failure in (
            ("postgres", self.postgres, (psycopg.Error, OSError)),
            ("redis", self.redis, (redis.RedisError, OSError)),
        ):
            while True:
                try:
                    values.update(read())
                    break
                except failure as exc:
                    if time.monotonic() >= deadline:
                        text = " ".join(str(exc).split())[:160]
                        errors.append(f"{server}: {type(exc).__name__}: {text}")
                        break
                    time.sleep(0.5)
        return {"t": round(t, 1), "values": values, "pids": pids, "ages": ages, "errors": errors}

    def postgres(self) -> dict[str, float]:
        values: dict[str, float] = {}
        with psycopg.connect(
            self.database_url, autocommit=True, connect_timeout=3,
            options="-c statement_timeout=20000",
        ) as conn:  # fmt: skip
            # Every login, with 0 for none: a series whose login has no session at a tick is 0
            # there, not missing.
            sessions = conn.execute(
                "SELECT r.rolname, count(a.pid) FROM pg_roles r LEFT JOIN pg_stat_activity a "
                "ON a.usename = r.rolname AND a.datname = current_database() "
                "AND a.backend_type = 'client backend' AND a.pid <> pg_backend_pid() "
                "WHERE r.rolcanlogin GROUP BY 1"
            ).fetchall()
            for login, count in sessions:
                values[f"pg_connections {login}"] = float(count)
            values["pg_connections all"] = float(sum(int(c) for _, c in sessions))
            names = {
                int(key): str(name)
                for key, name in conn.execute("SELECT id, name FROM streams_registry")
            }
            tables = conn.execute(
                "SELECT n.nspname, c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
                "AND n.nspname <> 'information_schema' AND n.nspname NOT LIKE 'pg\\_%'"
            ).fetchall()
            for schema, table, size in tables:
                rows = conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))
                ).fetchone()
                count = float(rows[0]) if rows else math.nan
                label, keeps_all = self._table(str(schema), str(table), names)
                values[f"rows {label}"] = count
                if keeps_all:
                    values[f"data_kb {label}"] = int(size) / 1024
                    if count > 0:
                        values[f"bytes_per_row {label}"] = int(size) / count
                else:
                    values[f"table_kb {label}"] = int(size) / 1024
        return values

    def _table(self, schema: str, table: str, names: Mapping[int, str]) -> tuple[str, bool]:
        """The table's label in the report, and whether it keeps every fact."""
        match = re.fullmatch(r"streams_facts_(\d+)", table)
        if match and int(match[1]) in names:
            name = names[int(match[1])]
            return f"facts:{name}", name in self.kept
        label = table if schema == "public" else f"{schema}.{table}"
        return label, table in KEEPS_EVERY_FACT

    def redis(self) -> dict[str, float]:
        client = redis.Redis.from_url(self.redis_url, socket_timeout=3, socket_connect_timeout=3)
        try:
            memory = client.info("memory")
            clients = client.info("clients")
            keys = client.dbsize()
        finally:
            client.close()
        return {
            "redis_used_mb server": int(memory["used_memory"]) / 2**20,
            "redis_clients server": float(clients["connected_clients"]),
            "redis_keys server": float(keys),
        }


# ---------------------------------------------------------------------------- the operator


class Upkeep:
    """What an operator's schedule runs, once a tick: `streams.Client.prune` and
    `streams.Client.prune_writers` on every stream, then ``VACUUM``. Autovacuum cannot do its
    work here: the faults restart PostgreSQL every ten seconds or so, its launcher waits a
    minute (``autovacuum_naptime``) after each start, and an immediate stop forgets the
    statistics that would trigger it; so the upkeep vacuums as autovacuum would on a server
    that stays up. What it cannot reclaim (rows a session still sees: a transaction left open)
    shows as growth. A fault fails a tick's upkeep; the next tick tries again, on a new
    client."""

    def __init__(self, database_url: str, names: Sequence[str], window: float) -> None:
        self.database_url = database_url
        self.names = list(names)
        self.window_ms = int(window * 1000)
        self.client: streams.Client | None = None
        self.done: Counter[str] = Counter()

    def connect(self) -> streams.Client:
        if self.client is None:
            self.client = streams.connect(self.database_url, connect_timeout=5)
        return self.client

    def run(self) -> None:
        try:
            client = self.connect()
            for name in self.names:
                pruned = client.prune(name)
                if pruned.limited_by != "no retention":  # what holds the retained stream
                    self.done[f"{name} pruned up to the {pruned.limited_by}"] += 1
                self.done["facts pruned"] += pruned.rows_deleted
                self.done["keys pruned"] += pruned.keys_deleted
                self.done["writer rows pruned"] += len(client.prune_writers(name, self.window_ms))
            with psycopg.connect(self.database_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute("VACUUM")
            self.done["ticks"] += 1
        except (streams.StreamsError, psycopg.Error) as exc:
            self.done[f"failed: {type(exc).__name__}"] += 1
            self.close()

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None


# ---------------------------------------------------------------------------- bystanders


class Bystanders:
    """A writer and a plain reader of the soak's stream (``tests/chaos_child.py``), never
    killed by the run; started again only if they die (each restart is noted). Their output
    goes to files in ``directory``, read once a tick (`keep`): facts acknowledged and
    delivered, errors by kind, and any error outside the library's tree (a problem)."""

    SUBJECTS = ("soak-writer", "soak-reader")

    def __init__(
        self,
        directory: Path,
        database_url: str,
        redis_url: str,
        prefix: str,
        stream: str,
        seed: int,
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.common = [database_url, redis_url, prefix, stream]
        self.seed = seed
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lives: Counter[str] = Counter()
        self.offsets: dict[str, int] = defaultdict(int)
        self.rest: dict[str, bytes] = defaultdict(bytes)
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.problems: list[str] = []
        self.notes: list[str] = []
        for subject in self.SUBJECTS:
            self.spawn(subject)

    def spawn(self, subject: str) -> None:
        life = self.lives[subject]
        self.lives[subject] += 1
        seed = str(self.seed + 1000 * life)
        if subject == "soak-writer":
            args = ["writer", *self.common, f"soakw{life}", seed, str(LEASE)]
        else:
            args = ["reader", *self.common, "plain", f"soakr{life}", seed]
        out = open(self.directory / f"{subject}.out", "ab")  # noqa: SIM115 (the child's now)
        err = open(self.directory / f"{subject}.err", "ab")  # noqa: SIM115
        try:
            # A child started from the soak's thread dies with that thread (PR_SET_PDEATHSIG
            # follows the thread that forked): only after `stop`, which ends it anyway.
            self.procs[subject] = subprocess.Popen(
                die_with_parent([str(CHILD), *args]),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        finally:
            out.close()  # the child holds its own copies: no descriptor left in the test
            err.close()

    def pids(self) -> dict[str, int]:
        return {s: p.pid for s, p in self.procs.items() if p.poll() is None}

    def keep(self) -> dict[str, float]:
        """Read what each printed since the last tick; start again one that died, or a reader
        that fell behind the retention (`streams.FactsPruned`: a supervisor's cure). Returns
        the facts each acknowledged or delivered since the last tick."""
        done: dict[str, float] = {}
        for subject in self.SUBJECTS:
            before = self.counts[subject]["facts"]
            self._read(subject)
            done[f"facts_per_tick {subject}"] = float(self.counts[subject]["facts"] - before)
            proc = self.procs[subject]
            code = proc.poll()
            if code is None and self.counts[subject].pop("behind", 0):
                self.notes.append(f"{subject} fell behind the retention: started again")
                self._end(proc)
                code = proc.returncode
            if code is not None:
                self.notes.append(f"{subject} exited {code}: started again")
                self.spawn(subject)
        return done

    def _read(self, subject: str) -> None:
        with open(self.directory / f"{subject}.out", "rb") as out:
            out.seek(self.offsets[subject])
            data = self.rest[subject] + out.read()
            self.offsets[subject] = out.tell()
        *lines, self.rest[subject] = data.split(b"\n")
        counts = self.counts[subject]
        for raw in lines:
            line = raw.decode(errors="replace")
            kind, _, rest = line.partition(" ")
            if kind == "ACK":
                counts["facts"] += len(rest.split()) - 2
            elif kind == "E":
                counts["facts"] += len(rest.split()) - 1
            elif kind in ("ERR", "OWN"):
                error = rest.split()[1] if len(rest.split()) > 1 else "?"
                counts[f"error {error}"] += 1
                if error == "FactsPruned":
                    counts["behind"] += 1
            elif kind == "BAD":
                self.problems.append(f"{subject}: not a library error: {line[:300]}")

    @staticmethod
    def _end(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for subject, proc in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            self._end(proc)  # and anything it started: its whole process group
            self._read(subject)


# ---------------------------------------------------------------------------- the soak


class Soak:
    """Samples a run beside it (a thread, one tick every ``settings.every`` seconds), keeps the
    bystanders and the upkeep going; `stop` ends all that and writes the report, `assert_flat`
    fails on any growth or problem. `beside` makes one only when ``STREAMS_SOAK_DIR`` is set."""

    enabled = True

    def __init__(
        self,
        settings: SoakSettings,
        processes: Processes,
        database_url: str,
        redis_url: str,
        prefix: str,
        names: Sequence[str],
        seed: int,
    ) -> None:
        self.settings = settings
        test = os.environ.get("PYTEST_CURRENT_TEST", "")
        label = re.search(r"\[(.+?)\]", test)
        self.label = label[1] if label else "run"
        self.directory = settings.directory / self.label
        self.directory.mkdir(parents=True, exist_ok=True)
        self.meta: dict[str, Any] = {
            "label": self.label,
            "seed": seed,
            "seconds": settings.seconds,
            "every": settings.every,
            "retention": settings.retention,
            "warmup": settings.warmup,
            "window": settings.window,
            "started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{socket.gethostname()}, {os.cpu_count() or '?'} cores",
        }
        self.stream = f"soak_{secrets.token_hex(4)}"
        self.upkeep = Upkeep(database_url, [*names, self.stream], settings.window)
        client = self.upkeep.connect()
        window_ms = int(settings.window * 1000)
        client.create_stream(
            self.stream, retention_ms=int(settings.retention * 1000), key_window_ms=window_ms
        )
        for name in names:
            client.set_key_window(name, window_ms)
        self.bystanders = Bystanders(
            self.directory / "bystanders", database_url, redis_url, prefix, self.stream, seed
        )

        def everyone() -> dict[str, int]:
            return {**processes(), **self.bystanders.pids()}

        self.sampler = Sampler(everyone, database_url, redis_url, names)
        self.samples: list[dict[str, Any]] = []
        self.verdicts: list[Verdict] = []
        self.problems: list[str] = []
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak", daemon=True)
        self.thread.start()
        self.stopped = False

    @classmethod
    def beside(
        cls,
        processes: Processes,
        database_url: str,
        redis_url: str,
        prefix: str,
        names: Sequence[str],
        *,
        seconds: float,
        seed: int = 0,
    ) -> Soak | NoSoak:
        """A soak of the run whose service processes ``processes()`` returns (``{slot: pid}``,
        read at every tick), on that database and Redis (the admin's URL), with the run's Redis
        prefix and streams, planned for ``seconds``; a `NoSoak` unless ``STREAMS_SOAK_DIR``."""
        settings = SoakSettings.from_env(seconds)
        if settings is None:
            return NoSoak()
        return cls(settings, processes, database_url, redis_url, prefix, names, seed)

    def _run(self) -> None:
        tick = 0
        while not self.stopping.is_set():
            t = time.monotonic() - self.started
            try:
                sample = self.sampler.sample(t, patience=min(20.0, self.settings.every / 2))
                sample["values"].update(self.bystanders.keep())
            except Exception as exc:  # a bug here must not end the sampling silently
                sample = {"t": round(t, 1), "values": {}, "errors": [f"soak: {exc!r}"]}
            self.samples.append(sample)
            self.upkeep.run()
            tick += 1
            next_tick = self.started + tick * self.settings.every
            self.stopping.wait(max(0.0, next_tick - time.monotonic()))

    def stop(self) -> None:
        """End the sampling (the faults are over: what follows is no steady state), the
        bystanders and the upkeep; judge; write the report. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        self.stopping.set()
        self.thread.join(self.settings.every + 120)
        self.bystanders.stop()
        self.upkeep.close()
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for sample in self.samples:
            for name, value in sample["values"].items():
                series[name].append((sample["t"], value))
        self.verdicts = [
            judge(name, points, self.settings.warmup, required=self._required(name))
            for name, points in sorted(series.items())
        ]
        self.problems = list(self.bystanders.problems)
        for subject in Bystanders.SUBJECTS:
            late = [v for t, v in series[f"facts_per_tick {subject}"] if t >= self.settings.warmup]
            if late and not any(late):
                self.problems.append(f"{subject}: no fact written or read after the warm-up")
        self.meta.update(
            samples=len(self.samples),
            sample_errors=sum(len(s["errors"]) for s in self.samples),
            bystander_lives=dict(self.bystanders.lives),
            bystander_counts={s: dict(c) for s, c in self.bystanders.counts.items()},
            upkeep=dict(self.upkeep.done),
            notes=self.bystanders.notes,
            problems=self.problems,
        )
        paths = write_report(self.directory, self.meta, self.samples, self.verdicts)
        print(f"\nsoak: report in {paths['summary']}")

    @staticmethod
    def _required(series: str) -> bool:
        """Whether too few samples fail ``series``: all but a chaos slot's process figures
        (its children are killed at random, some rarely live `SETTLED` seconds)."""
        metric, subject = split_series(series)
        return metric not in ("rss_mb", "fds", "threads") or subject in Bystanders.SUBJECTS

    def assert_flat(self) -> None:
        self.stop()
        failed = [v for v in self.verdicts if v.failed]
        lines = [
            f"{v.series}: {v.verdict} (early {v.early}, late {v.late}, allowed {v.allowed})"
            for v in failed
        ]
        assert not failed and not self.problems, (
            f"soak {self.label}: {len(failed)} series not flat, {len(self.problems)} problems "
            f"(report in {self.directory}):\n" + "\n".join(lines + self.problems)
        )


class NoSoak:
    """`Soak.beside` when no soak was asked for: does nothing."""

    enabled = False

    def stop(self) -> None:
        pass

    def assert_flat(self) -> None:
        pass
