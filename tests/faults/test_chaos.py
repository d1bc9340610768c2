"""Every fault at once, at random times, from one seed (issue 27), failovers included (issue 38).

Writer processes (single appends, batches, keyed appends, multi-row ``fact()`` facts, and
``fact()`` reservations rolled back on purpose), plain readers, a reader group that commits with
`Reader.commit` and one that commits in its own transaction with its effects
(``commit(conn=...)``), all on shared proofs over Redis, on a private PostgreSQL and a private
Redis of this run. Meanwhile, at random: writers and readers are killed (SIGKILL) and frozen
(SIGSTOP, then SIGCONT), group consumers are killed between receiving an epoch and committing
it, a group consumer is frozen until a replacement opened its group and then woken (a zombie),
PostgreSQL is stopped ``fast`` and ``immediate`` and started again, random sessions are ended
(``pg_terminate_backend``), Redis is restarted, and lines are forged and replayed on every
channel. An ``immediate`` stop also comes right after rolled-back reservations with writers
paused and readers caught up (the window where a sequence's WAL record was not flushed yet;
``wal_writer_delay`` is 10 s to widen it).

**Failover** (the variants ``failover-sync`` and ``failover-async``): PostgreSQL is a primary
and a streaming standby (`pgpair.FailoverPair`), each behind a proxy of its own, and every child
(and the test) uses the libpq multi-host URL of both with ``target_session_attrs=read-write``.
At random moments, under every role at work (writers, plain and group readers, the elected
prover), the primary is killed (SIGKILL to its postmaster) or stopped ``immediate``, and the
standby promoted (``pg_ctl promote``); the old primary is then rebuilt as the new standby
(``pg_rewind``, or ``pg_basebackup``: by the seed, and when ``pg_rewind`` fails) in the
background while the other faults go on, and made synchronous again; then the next failover,
several per run; half of the immediate stops after rolled-back reservations (above) are such
a failover too. The restarts stop and start whichever server is the primary then, and the
standby is restarted too (``standby-restart``: a synchronous primary's commits wait for it). A
promoted standby runs asynchronously until its own standby is rebuilt (`FailoverPair`: as
Patroni's non-strict synchronous mode); no failover comes before that.

* ``failover-sync``: the standby is synchronous, so the checks below hold unchanged: nothing
  acknowledged is lost. The one loss allowed is of a fact no writer saw acknowledged that a
  reader delivered in the moment before the standby had it (a commit is visible before the
  standby confirms it): that reader must stop with `streams.FailoverLoss` before it delivers
  anything of the new timeline.
* ``failover-async``: the standby is asynchronous, and half of the failovers first cut it off
  for up to 1.5 s (it then lacks what the primary acknowledged meanwhile). Every acknowledged
  fact missing at the end must have been named (stream and ID range) by a `streams.FailoverLoss`
  raised to the writer process that had it acknowledged, before that writer's next append
  that is stored; a reader that delivered facts that are gone must stop with it, as above; a
  group commit lost with the old timeline may make the group consume again what it had
  committed (counted); nothing else changes.

Every `streams.FailoverLoss` a child met must name facts that are missing (``first`` and
``last``). A child that cannot open its client, writer or reader (``OPEN``), or meets another
`streams.DatabaseChanged` (``CHANGED``), is a problem: the library waits for a server that is
restarting or failing over, and a failover is the same history.

Checked at the end (`check_everything`): every acknowledged fact is stored exactly once with
the acknowledged payload and every unknown one at most once; no stream ID was handed out twice
(two acks, or an ack or a stored fact at an ID a rolled-back reservation had); every stored
fact is whole; every plain reader delivered exactly the stored facts up to its position, in
order, each once, each whole and as stored (nothing invented); each group's committed epochs are
disjoint across all its consumers' lifetimes and together with the rest of what they delivered
cover every fact, and the transactional group's effects hold every fact exactly once; every
error a child met is one of the library's (`streams.StreamsError`).

Variants (``STREAMS_CHAOS_VARIANTS``, a comma-separated list or ``all``): ``one-login`` (one
server, every child logged in as the database's admin), ``role-model`` (one server, under the
role model of `streams roles create`: each child a login of its own role: writers as
``streams_writer``, one plain reader as ``streams_prover`` (it stands for election), the other
as ``streams_reader``, the group consumers as ``streams_group_reader``; issue 37),
``failover-sync`` (under the role model) and ``failover-async`` (as the admin). By default
``one-login``, ``failover-sync`` and ``failover-async`` run (all four with
``STREAMS_SOAK_DIR``, a soak choosing one with ``-k``: `make soak` takes ``role-model``).

``STREAMS_CHAOS_SEED`` replays a run (the seed is printed, and in every failure);
``STREAMS_CHAOS_SECONDS`` (default 60) is how long faults go on; ``STREAMS_CHAOS_KEEP=1`` keeps
the run's directory (each child's stderr, its lines with the time they came, and the test's
events). From 300 s on (or with ``STREAMS_CHAOS_SPARK=1``) a Spark query (`streams_spark`, local
mode, `chaos_spark`) reads both streams under the same faults, and is restarted from its
checkpoint at random; its output must hold every stored fact once (not in ``failover-async``,
where a query proven past the switch point stops by design). Children die with the test
(``PR_SET_PDEATHSIG``, and their process groups are killed), the servers are stopped by PID;
each run has its own data directories, database, streams and channel prefix. The summary
printed at the end counts promotions, rebuilds, restarts, kills, facts acknowledged, groups
(and Spark's batches). A sampler started next to a run finds what to watch in
`Chaos.child_pids`, `Chaos.server_pids` and `Chaos.urls`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from chaos_spark import SparkRun
from faultkit import (
    Attacker,
    Child,
    RestartablePostgres,
    RestartableRedis,
    restartable_postgres,
)
from helpers import TESTS_DIR
from pgpair import FailoverPair, failover_pair
from servers import new_redis_prefix, new_stream_name
from soak import Soak

import streams
from streams.devservers import ensure_database
from streams.store.failover import FAILOVER_SKIP

SECONDS = float(os.environ.get("STREAMS_CHAOS_SECONDS", "60"))
SEED = int(os.environ.get("STREAMS_CHAOS_SEED") or secrets.randbelow(2**31))
SPARK = os.environ.get("STREAMS_CHAOS_SPARK", "1" if SECONDS >= 300 else "0") == "1"
CHILD = TESTS_DIR / "chaos_child.py"
LEASE = 2.0
#: Rolled-back reservations before an immediate stop: more than PostgreSQL's 32 values a
#: sequence logs ahead, so one of them wrote the sequence's WAL record.
HOLE_GAPS = 34
#: IDs above a lost fact from which a reader is surely on a later timeline: every failover
#: moves the sequences `FAILOVER_SKIP` forward, and no timeline of a run hands out half that.
LATER_TIMELINE = FAILOVER_SKIP // 2
T = TypeVar("T")


@dataclass(frozen=True)
class Variant:
    name: str
    #: Every child a login of its own role (issue 37), or all of them the admin.
    roles: bool
    #: None: one server (`RestartablePostgres`); "sync" or "async": a `FailoverPair`.
    failover: str | None = None


VARIANTS = {
    v.name: v
    for v in (
        Variant("one-login", roles=False),
        Variant("role-model", roles=True),
        Variant("failover-sync", roles=True, failover="sync"),
        Variant("failover-async", roles=False, failover="async"),
    )
}
#: A soak (``STREAMS_SOAK_DIR``: `make soak` picks its variant with ``-k``) may run any.
_CHOSEN = os.environ.get("STREAMS_CHAOS_VARIANTS") or (
    "all" if os.environ.get("STREAMS_SOAK_DIR") else "one-login,failover-sync,failover-async"
)
CHOSEN = list(VARIANTS) if _CHOSEN == "all" else [v.strip() for v in _CHOSEN.split(",")]
assert set(CHOSEN) <= set(VARIANTS), f"STREAMS_CHAOS_VARIANTS: not one of {sorted(VARIANTS)}"

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.timeout(int(SECONDS) + (600 if SPARK else 300)),
]


class Servers(Protocol):
    """The PostgreSQL of a run, one server or a failover pair (what `Chaos` asks of it)."""

    def create_database(self, name: str) -> None: ...

    def url(self, database: str) -> str:
        """The URL every child and the test use."""
        ...

    def direct(self, database: str) -> str:
        """The primary alone (sessions of that server: `Chaos._terminate`)."""
        ...

    def restart(self, mode: str, down_for: float = 0.0) -> float: ...

    def pids(self) -> dict[str, int]: ...


class SingleServer:
    """`Servers` of one `RestartablePostgres` (behind its proxy)."""

    def __init__(self, pg: RestartablePostgres) -> None:
        self.pg = pg

    def create_database(self, name: str) -> None:
        ensure_database(self.pg.server.url, name)

    def url(self, database: str) -> str:
        return self.pg.url(database)

    def direct(self, database: str) -> str:
        return self.pg.server.url.rsplit("/", 1)[0] + f"/{database}"

    def restart(self, mode: str, down_for: float = 0.0) -> float:
        return self.pg.restart(mode, down_for)

    def pids(self) -> dict[str, int]:
        return {"postgres": self.pg.server.pid}


class PairServers:
    """`Servers` of a `FailoverPair`: the multi-host URL; restarts are the primary's."""

    def __init__(self, pair: FailoverPair) -> None:
        self.pair = pair

    def create_database(self, name: str) -> None:
        ensure_database(self.pair.direct("postgres"), name)

    def url(self, database: str) -> str:
        return self.pair.url(database)

    def direct(self, database: str) -> str:
        return self.pair.direct(database)

    def restart(self, mode: str, down_for: float = 0.0) -> float:
        return self.pair.restart(mode, down_for)

    def pids(self) -> dict[str, int]:
        return {f"postgres {role}": pid for role, pid in self.pair.pids().items()}


@dataclass
class Slot:
    """One role kept alive: a child, started again when it died (as a supervisor would)."""

    name: str
    role: str  # writer | plain | auto | tx
    streams: list[str]
    lives: list[Child] = field(default_factory=list)

    def live(self) -> list[Child]:
        return [c for c in self.lives if c.proc.poll() is None]


@dataclass
class Failover:
    """One promotion: how the primary went, how long the standby had been cut off before
    (asynchronous only), the seconds until the new primary took writes, and how many lines
    each child's history held once the old primary was gone (``gone``) and once the new one
    took writes (``promoted``). Lines come through a pipe, a moment after they are printed:
    one that came before ``promoted`` was printed before the old primary died (nothing
    commits without a primary), and one that came after ``gone`` was printed after it died,
    or a moment before."""

    how: str
    cut_off: float
    seconds: float = 0.0
    gone: dict[str, int] = field(default_factory=dict)
    promoted: dict[str, int] = field(default_factory=dict)

    def before(self, child: str, line: int) -> bool:
        """Whether ``child``'s line number ``line`` tells of something before this failover."""
        return child in self.promoted and line < self.promoted[child]

    def after(self, child: str, line: int) -> bool:
        """Whether it tells of something after (or at the moment of) this failover."""
        return child not in self.gone or line >= self.gone[child]


#: Under the role model, the login each kind of child uses (a LOGIN role granted only that
#: group role): writers, the plain reader that stands for election as the prover, the plain
#: reader that cannot prove, and the group consumers.
ROLE_OF = {
    "writer": "streams_writer",
    "prover": "streams_prover",
    "reader": "streams_reader",
    "group": "streams_group_reader",
}


def _url_as(url: str, user: str) -> str:
    """``url`` (one host or several) with ``user`` as its user."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{hosts}"))


class Chaos:
    def __init__(
        self,
        servers: Servers,
        workdir: Path,
        rng: random.Random,
        variant: Variant,
        pair: FailoverPair | None = None,
    ) -> None:
        self.workdir = workdir
        self.rng = rng
        self.variant = variant
        self.stack = contextlib.ExitStack()
        self.servers = servers
        #: The failover pair (the failover variants), the same servers as ``servers``.
        self.pair = pair
        (workdir / "redis").mkdir()
        self.redis = RestartableRedis(workdir / "redis")
        self.stack.callback(self.redis.close)
        self.redis.start(first=True)
        self.database = f"chaos_{SEED}_{secrets.token_hex(3)}"
        servers.create_database(self.database)
        self.url = servers.url(self.database)
        from streams.migrate import upgrade

        upgrade(self.url)
        self.prefix = new_redis_prefix()
        self.names = [new_stream_name(), new_stream_name()]
        self.admin = self.stack.enter_context(streams.connect(self.url, lease_seconds=LEASE))
        for name in self.names:
            self.admin.create_stream(name)
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE chaos_effects (grp text, stream text, stream_id bigint, "
                "consumer text)"
            )
        #: kind -> URL the children of that kind log in with (all the admin's without roles).
        self.logins = {kind: self.url for kind in ROLE_OF}
        if variant.roles:
            self.logins = self._role_model()
        a, b = self.names
        self.slots = [
            Slot("w0", "writer", [a]),
            Slot("w1", "writer", [b]),
            Slot("w2", "writer", [a]),
            Slot("r0", "plain", [a, b]),
            Slot("r1", "plain", [a, b]),
            Slot("ga", "auto", [a, b]),
            Slot("gt", "tx", [a, b]),
        ]
        self.spawned = 0
        self.children: list[Child] = []
        self.stack.callback(self._kill_all)
        self.faults: Counter[str] = Counter()
        self.resume: list[tuple[float, Child]] = []
        #: IDs this process reserved and rolled back before an immediate stop (the hole).
        self.hole_ids: dict[str, list[int]] = defaultdict(list)
        self.hole_writer: streams.Writer | None = None
        self.hole_stream = self.names[0]
        self.attacker = Attacker(
            self.redis.url, self.prefix, self.names, seed=SEED, every_channel=True, pause=0.02
        )
        self.attacker.start()
        self.stack.callback(self.attacker.close)
        self.notes: list[str] = []
        #: Every promotion, in order (`check_everything` judges lines by them).
        self.failovers: list[Failover] = []
        #: The old primary being rebuilt as the new standby, in the background (no server
        #: fault and no failover meanwhile); an error of it fails the run.
        self.rebuilding: threading.Thread | None = None
        self.rebuild_error: BaseException | None = None
        self.next_failover = float("inf")
        #: What the test did when (seconds since the start): kept with the children's logs.
        self.events: list[str] = []
        self.started = time.monotonic()
        #: The Spark query of the long form (`start_spark`).
        self.spark: SparkRun | None = None
        self._spark_checked = 0.0
        #: Each stream's position every reader and group reached at the end (`settle`).
        self.targets: dict[str, int] = {}

    def start_spark(self, session: Any) -> None:
        """The long form's Spark query over both streams (`chaos_spark`), logged in as a group
        consumer (the source commits its offsets to a group)."""
        self.spark = SparkRun(session, self.logins["group"], self.names, self.workdir / "spark")
        self.stack.callback(self.spark.close)

    def event(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:8.2f} {what}")

    def _role_model(self) -> dict[str, str]:
        """`streams roles create` on this run's database, and a LOGIN role per kind of child,
        granted only its group role (the transactional group consumer also writes its effects
        table)."""
        from click.testing import CliRunner

        from streams.command import main

        result = CliRunner().invoke(main, ["roles", "create", "--database-url", self.url])
        assert result.exit_code == 0, result.output
        logins = {}
        with psycopg.connect(self.url, autocommit=True) as conn:
            for kind, role in ROLE_OF.items():
                user = f"chaos_{kind}_{secrets.token_hex(3)}"
                conn.execute(f"CREATE ROLE {user} LOGIN IN ROLE {role}")
                logins[kind] = _url_as(self.url, user)
            group_user = urlsplit(logins["group"]).username
            conn.execute(f"GRANT SELECT, INSERT ON chaos_effects TO {group_user}")
        return logins

    # ------------------------------------------------------------------ for a sampler

    def child_pids(self) -> dict[str, int]:
        """The children running now: name (slot and lifetime) -> PID (`pids`: by slot)."""
        return {c.name: c.proc.pid for c in self.children if c.proc.poll() is None}

    def server_pids(self) -> dict[str, int]:
        """PostgreSQL (the primary and the standby, or the one server), Redis, and Spark's JVM
        (the long form), by role."""
        pids = self.servers.pids()
        if self.redis.proc is not None and self.redis.proc.poll() is None:
            pids["redis"] = self.redis.proc.pid
        spark = self.spark.pid() if self.spark is not None else None
        if spark is not None:
            pids["spark"] = spark
        return pids

    def urls(self) -> dict[str, str]:
        """The database URL every child uses, the primary's alone (now), and Redis's."""
        return {
            "database": self.url,
            "primary": self.servers.direct(self.database),
            "redis": self.redis.url,
        }

    # ------------------------------------------------------------------ children

    def spawn(self, slot: Slot) -> Child:
        self.spawned += 1
        name = f"{slot.name}x{len(slot.lives)}"
        seed = str(self.rng.randrange(2**31))
        kind = {"writer": "writer", "auto": "group", "tx": "group"}.get(slot.role)
        if kind is None:  # a plain reader: the first may prove, the second may not
            kind = "prover" if slot.name == "r0" else "reader"
        common = [self.logins[kind], self.redis.url, self.prefix]
        if slot.role == "writer":
            args = ["writer", *common, slot.streams[0], name, seed, str(LEASE)]
        else:
            group = {"plain": [], "auto": ["auto"], "tx": ["tx"]}[slot.role]
            args = ["reader", *common, ",".join(slot.streams), slot.role, name, seed, *group]
        child = Child("", args, self.workdir / f"{name}.err", script=CHILD, name=name)
        self.event(f"spawned {name} (pid {child.proc.pid})")
        slot.lives.append(child)
        self.children.append(child)
        return child

    def supervise(self) -> None:
        now = time.monotonic()
        for at, child in list(self.resume):
            if at <= now:
                child.signal(signal.SIGCONT)
                self.resume.remove((at, child))
        for slot in self.slots:
            if slot.role != "stopped-writer" and not slot.live():
                self.spawn(slot)
        if self.spark is not None and now > self._spark_checked + 1.0:
            self._spark_checked = now
            self.spark.note_failure()  # (started again, as a supervisor would)
        if self.rebuild_error is not None:
            raise AssertionError(
                f"seed {SEED}: rebuilding the standby failed: {self.rebuild_error!r}; "
                f"{self.pair.log if self.pair else ''}"
            )

    def _kill_all(self) -> None:
        for child in self.children:
            with contextlib.suppress(Exception):
                child.close()
        if self.hole_writer is not None:
            with contextlib.suppress(Exception):
                self.hole_writer.close()

    def live(self, *roles: str) -> list[Child]:
        return [c for s in self.slots if s.role in roles for c in s.live()]

    def pids(self) -> dict[str, int]:
        """Each slot's newest live child, by slot: the processes a soak samples."""
        return {s.name: live[-1].proc.pid for s in self.slots if (live := s.live())}

    def stopped(self) -> set[int]:
        return {id(c) for _, c in self.resume}

    def wait(self, seconds: float) -> None:
        """Sleep, supervising (children restarted, frozen ones woken on time)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.supervise()
            time.sleep(0.02)

    # ------------------------------------------------------------------ faults

    def servers_free(self) -> bool:
        """No rebuild under way: a server fault now meets the servers it expects."""
        return self.rebuilding is None or not self.rebuilding.is_alive()

    def fault(self) -> None:
        rng = self.rng
        kinds = {
            "kill-writer": 3, "stop-writer": 3, "kill-reader": 2, "stop-reader": 2,
            "kill-at-epoch": 3, "zombie": 1, "pg-fast": 1, "pg-immediate": 1, "pg-hole": 2,
            "terminate": 3, "redis-restart": 1, "standby-restart": 1 if self.pair else 0,
            "spark-restart": 1 if self.spark else 0,
        }  # fmt: skip
        if not self.servers_free():  # the rebuild works on the servers: the rest goes on
            for kind in ("pg-fast", "pg-immediate", "pg-hole", "standby-restart"):
                kinds[kind] = 0
        kind = rng.choices(list(kinds), list(kinds.values()))[0]
        self.faults[kind] += 1
        self.event(kind)
        running = [c for c in self.live("writer") if id(c) not in self.stopped()]
        readers = [c for c in self.live("plain", "auto", "tx") if id(c) not in self.stopped()]
        groups = [c for c in self.live("auto", "tx") if id(c) not in self.stopped()]
        if kind == "kill-writer" and running:
            self._signal(rng.choice(running), signal.SIGKILL)
        elif kind == "stop-writer" and running:
            self._stop(rng.choice(running), rng.uniform(0.2, LEASE * 2))
        elif kind == "kill-reader" and readers:
            self._signal(rng.choice(readers), signal.SIGKILL)
        elif kind == "stop-reader" and readers:
            self._stop(rng.choice(readers), rng.uniform(0.2, 3.0))
        elif kind == "kill-at-epoch" and groups:
            self._signal(rng.choice(groups), signal.SIGUSR1)
        elif kind == "zombie" and groups:
            self._zombie(rng.choice(groups))
        elif kind in ("pg-fast", "pg-immediate"):
            self.servers.restart(kind[3:], down_for=rng.uniform(0, 1.5))
        elif kind == "pg-hole":
            self._hole()
        elif kind == "terminate":
            self._terminate(rng.randint(1, 3))
        elif kind == "redis-restart":
            self.redis.kill()
            time.sleep(rng.uniform(0, 1.5))
            self.redis.start()
        elif kind == "spark-restart" and self.spark is not None:
            self.spark.restart()
        elif kind == "standby-restart" and self.pair is not None:
            mode = rng.choice(["fast", "immediate"])
            self.pair.restart_standby(mode, down_for=rng.uniform(0, 1.0))
        else:
            self.faults[kind] -= 1

    def failover_due(self) -> bool:
        """Whether to fail over now: a while after the last rebuild ended (the other server
        faults get their turn between), and only with the pair whole."""
        if self.pair is None:
            return False
        if self.rebuilding is not None:
            if self.rebuilding.is_alive():
                return False
            self.rebuilding = None
            self.next_failover = time.monotonic() + self.rng.uniform(2.0, 8.0)
        if time.monotonic() < self.next_failover:
            return False
        if not self.pair.healthy:
            self.next_failover = time.monotonic() + 0.5  # the standby is reconnecting
            return False
        return True

    def failover(self, how: str | None = None) -> None:
        """The primary killed or stopped ``immediate`` (``how``: by the seed unless given; an
        asynchronous standby cut off a moment before, half of the time), the standby promoted;
        the old primary is rebuilt as the new standby in the background
        (`FailoverPair.rebuild`)."""
        pair = self.pair
        assert pair is not None
        rng = self.rng
        how = how or rng.choice(["kill", "immediate"])
        cut = 0.0
        if not pair.synchronous and rng.random() < 0.5:
            cut = rng.uniform(0.2, 1.5)
            pair.cut_off()
            self.wait(cut)
        self.event(f"failover: {how}" + (f", standby cut off {cut:.2f} s before" if cut else ""))
        done = Failover(how, cut)

        def stopped() -> None:
            self.event("old primary gone")
            done.gone = {c.name: len(c.history) for c in self.children}

        done.seconds = pair.failover(how, stopped)
        done.promoted = {c.name: len(c.history) for c in self.children}
        self.failovers.append(done)
        self.event(pair.log[-1])
        self.faults[f"failover-{how}"] += 1
        method = rng.choice(["rewind", "rewind", "basebackup"])

        def rebuild() -> None:
            try:
                pair.rebuild(method)
            except BaseException as exc:  # reported by the main loop (`supervise`)
                self.rebuild_error = exc
            self.event(pair.log[-1])

        self.rebuilding = threading.Thread(target=rebuild, name="chaos-rebuild", daemon=True)
        self.rebuilding.start()

    def _signal(self, child: Child, sig: int) -> None:
        self.event(f"{signal.Signals(sig).name} to {child.name}")
        child.signal(sig)

    def _stop(self, child: Child, seconds: float) -> None:
        self.event(f"stopped {child.name} for {seconds:.2f} s")
        child.signal(signal.SIGSTOP)
        self.resume.append((time.monotonic() + seconds, child))

    def _zombie(self, zombie: Child) -> None:
        """Freeze a group consumer, start a replacement of its group, wait until that one
        committed, wake the zombie: it must find it is not the owner any more."""
        slot = next(s for s in self.slots if zombie in s.lives)
        zombie.signal(signal.SIGSTOP)
        replacement = self.spawn(slot)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and not any(
            line.startswith("C ") for line in list(replacement.history)
        ):
            time.sleep(0.05)
        zombie.signal(signal.SIGCONT)
        self.notes.append(f"zombie {zombie.name} woken after {replacement.name} opened the group")

    def _terminate(self, count: int) -> None:
        try:
            url = self.servers.direct(self.database)
            with psycopg.connect(url, autocommit=True, connect_timeout=3) as admin:
                pids = [
                    int(row[0])
                    for row in admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                    ).fetchall()
                ]
                for pid in self.rng.sample(pids, min(count, len(pids))):
                    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        except psycopg.OperationalError:
            pass

    def _hole(self) -> None:
        """Writers paused, IDs reserved and rolled back, readers past them, then an immediate
        stop: after it, no ID handed out before may be handed out again."""
        for _, child in list(self.resume):  # a frozen writer cannot pause
            child.signal(signal.SIGCONT)
        self.resume.clear()
        writers = self.live("writer")
        marks = {id(c): len(c.history) for c in writers}
        for child in writers:
            child.signal(signal.SIGUSR1)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not all(
            "PAUSED" in c.history[marks[id(c)] :] for c in writers if c.proc.poll() is None
        ):
            time.sleep(0.02)
        try:
            if self.hole_writer is None:
                self.hole_stream = self.rng.choice(self.names)
                self.hole_writer = self.admin.writer(
                    self.hole_stream, instance=f"hole{self.faults['pg-hole']}"
                )
            gaps = self._rolled_back(self.hole_writer, HOLE_GAPS)
        except (streams.StreamsError, psycopg.Error) as exc:
            self.notes.append(f"hole: no reservations ({type(exc).__name__})")
            if self.hole_writer is not None:
                with contextlib.suppress(Exception):
                    self.hole_writer.close()
            self.hole_writer = None
            gaps = []
        stream = self.hole_stream
        if gaps:
            self.hole_ids[stream] += gaps
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and not all(
                last_position(c, stream) >= gaps[-1] for c in self.live("plain")
            ):
                time.sleep(0.02)
        if self.pair is not None and self.rng.random() < 0.5 and self.pair.healthy:
            # The standby lacks the sequences' unflushed WAL too: a failover in the window.
            self.faults["pg-hole-failover"] += 1
            self.failover("immediate")
        else:
            self.servers.restart("immediate")
        for child in self.live("writer"):
            child.signal(signal.SIGUSR2)

    def _rolled_back(self, writer: streams.Writer, count: int) -> list[int]:
        ids: list[int] = []
        with psycopg.connect(self.url, connect_timeout=3) as conn:
            for _ in range(count):
                with contextlib.suppress(_Rollback), writer.fact(conn) as fact:
                    ids.append(fact.stream_id)
                    raise _Rollback
        return ids

    # ------------------------------------------------------------------ the end

    def settle(self) -> dict[str, int]:
        """Faults over: wake everyone, stop the writers, let every reader and group catch up
        to the last stored fact; returns the positions reached."""
        if self.rebuilding is not None:  # the pair whole again, as the run ends
            self.rebuilding.join()
            self.supervise()  # (raises a rebuild's error)
        if self.hole_writer is not None:
            with contextlib.suppress(Exception):
                self.hole_writer.close()
            self.hole_writer = None
        for _, child in self.resume:
            child.signal(signal.SIGCONT)
        self.resume.clear()
        for child in self.live("writer"):
            child.signal(signal.SIGUSR2)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            self.supervise()
            time.sleep(0.1)
        for slot in self.slots:
            if slot.role == "writer":
                slot.role = "stopped-writer"
                for child in slot.live():
                    child.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for child in [c for s in self.slots if s.role == "stopped-writer" for c in s.lives]:
            with contextlib.suppress(Exception):
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            child.close()
        targets: dict[str, int] = {}
        deadline = time.monotonic() + 60
        for name in self.names:
            while True:
                positions = self.retrying(functools.partial(self.admin.positions, name))
                stored = max(stored_facts(self.url, name), default=0)
                if positions.linear >= stored:
                    targets[name] = positions.linear
                    break
                assert time.monotonic() < deadline, f"seed {SEED}: {name} stuck at {positions}"
                time.sleep(0.1)

        def caught_up() -> bool:
            self.supervise()
            plain = all(
                last_position(c, n) >= targets[n] for c in self.live("plain") for n in self.names
            )
            groups = self._groups()
            mine = all(
                min((p for g, s, p in groups if g == grp and s == n), default=-1) >= targets[n]
                for n in self.names
                for grp in ("auto", "tx")
            )
            return plain and mine

        deadline = time.monotonic() + 90
        while not caught_up():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"seed {SEED}: readers and groups did not catch up with {targets}: "
                    + "; ".join(
                        f"{c.name} at " + str({n: last_position(c, n) for n in self.names})
                        for c in self.live("plain")
                    )
                    + f"; groups {self._groups()}"
                )
            time.sleep(0.2)
        time.sleep(0.5)  # the last "C" lines
        for child in self.children:
            child.signal(signal.SIGCONT)
            child.signal(signal.SIGTERM)
        for child in self.children:
            with contextlib.suppress(Exception):
                child.proc.wait(10)
            child.close()
        if self.spark is not None:
            ids = {n: set(stored_facts(self.url, n)) for n in self.names}
            self.spark.finish(targets, ids, 180)
        self.targets = targets
        return targets

    def _groups(self) -> list[tuple[str, str, int]]:
        return self.retrying(
            lambda: [(g.group, n, g.position) for n in self.names for g in self.admin.groups(n)]
        )

    @staticmethod
    def retrying(call: Callable[[], T]) -> T:
        """``call()`` on the test's own client, again while its connection is broken (the
        faults broke it)."""
        for _ in range(50):
            try:
                return call()
            except streams.StoreError:
                time.sleep(0.2)
        return call()

    def close(self) -> None:
        self.stack.close()
        if os.environ.get("STREAMS_CHAOS_KEEP"):  # what each child printed, for a post-mortem
            for child in self.children:
                lines = [
                    f"{at - self.started:8.2f} {line}"
                    for at, line in zip(child.times, child.history, strict=False)
                ]
                (self.workdir / f"{child.name}.out").write_text("\n".join(lines) + "\n")
            (self.workdir / "events.log").write_text("\n".join(self.events) + "\n")


class _Rollback(Exception):
    pass


def last_position(child: Child, stream: str) -> int:
    """The last position ``child`` (a reader) printed for ``stream``."""
    for line in reversed(list(child.history)):
        if line.startswith("P ") and line.split()[1] == stream:
            return int(line.split()[2])
        if line.startswith("START "):
            return int(json.loads(line[6:])[stream])
    return -1


def stored_facts(url: str, stream: str) -> dict[int, list[dict[str, Any]]]:
    """Every stored fact of ``stream``: its payloads, in row order."""
    facts: dict[int, list[dict[str, Any]]] = defaultdict(list)
    with psycopg.connect(url, autocommit=True) as conn:
        for stream_id, payload in conn.execute(
            "SELECT f.stream_id, f.payload FROM streams_facts f JOIN streams_registry r "
            "ON r.id = f.stream WHERE r.name = %s ORDER BY f.stream_id, f.row_no",
            (stream,),
        ):
            facts[int(stream_id)].append(payload)
    return dict(facts)


def describe(stream_id: int, payloads: list[dict[str, Any]]) -> str:
    """What a reader prints for a fact (`chaos_child._describe`)."""
    first = payloads[0]
    return f"{stream_id}:{first['w']}:{first['n']}:{first['j']}:{len(payloads)}"


# ---------------------------------------------------------------------------- the checks


def check_everything(chaos: Chaos) -> tuple[list[str], dict[str, Any]]:
    """Every promise (see the module docstring); returns the problems found and a summary."""
    problems: list[str] = []
    failover = chaos.variant.failover
    summary: dict[str, Any] = {
        "seed": SEED,
        "variant": chaos.variant.name,
        "faults": dict(chaos.faults),
    }
    tally: Counter[str] = Counter()
    stored = {name: stored_facts(chaos.url, name) for name in chaos.names}
    summary["stored facts"] = {n: len(f) for n, f in stored.items()}
    by_writer: dict[str, str] = {}
    for slot in chaos.slots:
        for child in slot.lives:
            if slot.role in ("writer", "stopped-writer"):
                by_writer[child.name] = slot.streams[0]
    errors: Counter[str] = Counter()
    for child in chaos.children:
        for line in child.history:
            kind = line.split(" ", 1)[0]
            if kind in ("ERR", "OWN"):
                errors[line.split()[2]] += 1
            elif kind == "LOSS":
                errors["FailoverLoss"] += 1
                tally[
                    "FailoverLoss to a " + ("writer" if child.name in by_writer else "reader")
                ] += 1
                problems += check_loss(child.name, line, stored)
                if failover != "async" and child.name in by_writer:
                    problems.append(
                        f"{child.name}: FailoverLoss to a writer, without an asynchronous "
                        f"failover: {line}"
                    )
            elif kind == "CHANGED":
                errors["DatabaseChanged"] += 1
                problems.append(f"{child.name}: DatabaseChanged (not a FailoverLoss): {line}")
            elif kind == "OPEN":
                errors["OPEN " + line.split()[1]] += 1
                problems.append(
                    f"{child.name}: could not open its client, writer or reader: {line}"
                )
            elif kind == "BAD":
                problems.append(f"{child.name}: not a library error: {line}")
    summary["errors"] = dict(errors)

    # Storage: whole facts; each writer attempt at most once; acks as stored; no ID twice.
    for name, facts in stored.items():
        tags: dict[tuple[str, int, int], list[int]] = defaultdict(list)
        for stream_id, payloads in facts.items():
            first = payloads[0]
            rows = sorted(p["r"] for p in payloads)
            same = {(p["w"], p["n"], p["j"], p["k"]) for p in payloads}
            if len(same) != 1 or rows != list(range(first["k"])):
                problems.append(f"{name} fact {stream_id} is torn: {payloads}")
            if first["w"] not in by_writer:
                problems.append(f"{name} fact {stream_id} by no writer of this run: {first}")
            tags[(first["w"], first["n"], first["j"])].append(stream_id)
        for tag, ids in tags.items():
            if len(ids) > 1:
                problems.append(f"{name}: writer attempt {tag} stored {len(ids)} times: {ids}")
    acked: dict[str, dict[int, tuple[str, int, int, int]]] = defaultdict(dict)
    gaps: dict[str, dict[int, str]] = defaultdict(dict)
    unknown = 0
    #: Acked facts a failover lost, that their writer was told of (or could not be: it ended
    #: before its next append that is stored).
    excused: set[tuple[str, int]] = set()
    for child in chaos.children:
        writer = child.name
        if writer not in by_writer:
            continue
        stream = by_writer[writer]
        problems += check_writer_told(child, stream, stored[stream], excused, tally)
        for line in child.history:
            parts = line.split()
            if parts[0] == "ACK":
                n, k = int(parts[1]), int(parts[2])
                for j, stream_id in enumerate(map(int, parts[3:])):
                    if stream_id in acked[stream]:
                        problems.append(
                            f"{stream}: ID {stream_id} acked twice: {acked[stream][stream_id]} "
                            f"and {(writer, n, j, k)}"
                        )
                    acked[stream][stream_id] = (writer, n, j, k)
            elif parts[0] == "RB":
                gaps[stream][int(parts[2])] = f"{writer} attempt {parts[1]} (rolled back)"
            elif parts[0] == "UNK":
                unknown += 1
    for stream, ids in chaos.hole_ids.items():
        for stream_id in ids:
            gaps[stream][stream_id] = "the test's reservation before an immediate stop"
    summary["acked facts"] = {n: len(a) for n, a in acked.items()}
    summary["unknown outcomes"] = unknown
    summary["rolled-back IDs"] = {n: len(g) for n, g in gaps.items()}
    for name in chaos.names:
        facts = stored[name]
        for stream_id, (writer, n, j, k) in sorted(acked[name].items()):
            if stream_id in gaps[name]:
                problems.append(
                    f"{name}: ID {stream_id} handed out twice: to {gaps[name][stream_id]}, then "
                    f"acked to {writer} attempt {n}"
                )
            got = facts.get(stream_id)
            if got is None:
                if failover != "async" or (name, stream_id) not in excused:
                    problems.append(f"{name}: acked fact {stream_id} ({writer} {n}/{j}) is lost")
            elif describe(stream_id, got) != f"{stream_id}:{writer}:{n}:{j}:{k}":
                problems.append(
                    f"{name}: acked fact {stream_id} ({writer} {n}/{j}, {k} rows) is stored "
                    f"as {describe(stream_id, got)}"
                )
        for stream_id, why in sorted(gaps[name].items()):
            if stream_id in facts:
                problems.append(
                    f"{name}: ID {stream_id} handed out twice: to {why}, and a fact is stored "
                    f"there ({describe(stream_id, facts[stream_id])})"
                )

    # Readers: per lifetime, exactly the stored facts up to its position, in order, as stored.
    for slot in chaos.slots:
        if slot.role not in ("plain", "auto", "tx"):
            continue
        committed: dict[str, dict[int, tuple[str, int]]] = defaultdict(dict)
        delivered_any: dict[str, set[int]] = defaultdict(set)
        for child in slot.lives:
            problems += check_lifetime(chaos, child, stored, committed, delivered_any, tally)
        if slot.role == "plain":
            continue
        for name in chaos.names:
            missing = sorted(set(stored[name]) - delivered_any[name])
            if missing:
                problems.append(
                    f"group {slot.name}: {name} facts never delivered to any consumer: "
                    f"{missing[:10]} ({len(missing)})"
                )
    with psycopg.connect(chaos.url, autocommit=True) as conn:
        effects = conn.execute(
            "SELECT stream, stream_id, array_agg(consumer) FROM chaos_effects "
            "GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()
    applied: dict[str, dict[int, list[str]]] = defaultdict(dict)
    for stream, stream_id, consumers in effects:
        applied[stream][int(stream_id)] = list(consumers)
    for name in chaos.names:
        twice = {i: c for i, c in applied[name].items() if len(c) > 1}
        if twice:
            problems.append(
                f"group gt: {name} effects applied more than once: "
                f"{dict(list(sorted(twice.items()))[:10])} ({len(twice)})"
            )
        missing = sorted(set(stored[name]) - set(applied[name]))
        extra = sorted(set(applied[name]) - set(stored[name]))
        if missing or extra:
            problems.append(
                f"group gt: {name} effects missing {missing[:10]} ({len(missing)}), "
                f"of no stored fact {extra[:10]}"
            )
    faults = chaos.faults
    pair = chaos.pair
    summary["promotions"] = len(chaos.failovers)
    summary["rebuilds"] = {
        k.removeprefix("rebuild-"): v
        for k, v in (pair.counts if pair else {}).items()
        if k.startswith("rebuild-")
    }
    summary["restarts"] = {
        "primary": faults["pg-fast"]
        + faults["pg-immediate"]
        + faults["pg-hole"]
        - faults["pg-hole-failover"],
        "standby": faults["standby-restart"],
        "redis": faults["redis-restart"],
    }
    summary["kills"] = faults["kill-writer"] + faults["kill-reader"] + faults["kill-at-epoch"]
    summary["facts acknowledged"] = sum(len(a) for a in acked.values())
    group_lives = [c for s in chaos.slots if s.role in ("auto", "tx") for c in s.lives]
    summary["groups"] = {
        "consumers": len(group_lives),
        "commits": sum(1 for c in group_lives for line in c.history if line.startswith("C ")),
    }
    summary["failover"] = dict(tally)
    if chaos.spark is not None:
        problems += chaos.spark.check(stored, chaos.targets)
        summary["spark"] = chaos.spark.summary()
    if pair is not None:
        summary["pair"] = pair.log
    summary["lifetimes"] = {s.name: len(s.lives) for s in chaos.slots}
    summary["fenced"] = sum(
        1 for c in chaos.children for line in c.history if line.startswith("FENCED")
    )
    summary["attacks"] = dict(chaos.attacker.sent)
    summary["notes"] = chaos.notes
    return problems, summary


def check_loss(
    child: str, line: str, stored: dict[str, dict[int, list[dict[str, Any]]]]
) -> list[str]:
    """A ``LOSS`` line names facts that are missing: its first and last IDs are not stored."""
    _, _, stream, first_s, last_s, missing_s, *_ = line.split()
    first, last, missing = int(first_s), int(last_s), int(missing_s)
    if stream not in stored:
        return [f"{child}: FailoverLoss names a stream of no run: {line}"]
    present = [i for i in (first, last) if i in stored[stream]]
    if present or not 1 <= missing <= last - first + 1:
        return [
            f"{child}: false FailoverLoss: {stream} {first}..{last} ({missing} missing), "
            f"but {present} stored: {line}"
        ]
    return []


def check_writer_told(
    child: Child,
    stream: str,
    kept: dict[int, list[dict[str, Any]]],
    excused: set[tuple[str, int]],
    tally: Counter[str],
) -> list[str]:
    """Each acked fact of ``child`` (a writer) that is not stored must be named by a
    ``LOSS`` of the same child before its next ack of a stored fact (that append ran on a
    later timeline: a failover loses a suffix of the history, and each child appends one
    at a time). The facts so named, or acked by a child that made no such append after them,
    go into ``excused``."""
    problems: list[str] = []
    pending: list[int] = []
    for line in child.history:
        parts = line.split()
        if parts[0] == "LOSS" and parts[2] == stream:
            first, last = int(parts[3]), int(parts[4])
            named = [i for i in pending if first <= i <= last]
            tally["acked facts lost, named to their writer"] += len(named)
            excused.update((stream, i) for i in named)
            pending = [i for i in pending if not first <= i <= last]
        elif parts[0] == "ACK":
            ids = [int(i) for i in parts[3:]]
            if pending and any(i in kept for i in ids):
                problems.append(
                    f"{child.name}: {stream} acked facts {pending[:10]} ({len(pending)}) "
                    f"are lost and were never named: its next stored append ({line}) came "
                    "without a FailoverLoss naming them"
                )
                pending = []
            pending += [i for i in ids if i not in kept]
    tally["acked facts lost, writer gone before its next append"] += len(pending)
    excused.update((stream, i) for i in pending)
    return problems


def check_lifetime(
    chaos: Chaos,
    child: Child,
    stored: dict[str, dict[int, list[dict[str, Any]]]],
    committed: dict[str, dict[int, tuple[str, int]]],
    delivered_any: dict[str, set[int]],
    tally: Counter[str],
) -> list[str]:
    """One reader lifetime. ``committed``: which consumer of its group committed each fact,
    at which line (shared by the group's lifetimes); ``delivered_any``: what any did."""
    name = child.name
    problems: list[str] = []
    start: dict[str, int] | None = None
    position: dict[str, int] = {}
    delivered: dict[str, list[str]] = defaultdict(list)
    #: (line number, ID or position reached) of every E and P line, by stream.
    reached: dict[str, list[tuple[int, int]]] = defaultdict(list)
    uncommitted: dict[str, list[int]] = defaultdict(list)
    for number, line in enumerate(child.history):
        if line.startswith("START "):
            start = json.loads(line[6:])
            position = dict(start)
        elif line.startswith("E "):
            _, stream, *facts = line.split()
            delivered[stream] += facts
            ids = [int(f.split(":")[0]) for f in facts]
            uncommitted[stream] += ids
            reached[stream] += [(number, i) for i in ids]
        elif line.startswith("P "):
            _, stream, at = line.split()
            position[stream] = int(at)
            reached[stream].append((number, int(at)))
        elif line.startswith("C "):
            for stream, ids in uncommitted.items():
                for stream_id in ids:
                    if stream_id in committed[stream]:
                        by, by_line = committed[stream][stream_id]
                        if lost_commit_between(chaos, (by, by_line), (name, number)):
                            tally["group commits lost by a failover, consumed again"] += 1
                        else:
                            problems.append(
                                f"{name}: {stream} fact {stream_id} committed by the group "
                                f"twice: by {by} and by {name}"
                            )
                    committed[stream][stream_id] = (name, number)
            uncommitted.clear()
    if start is None:
        return problems
    for stream_name, upto_id in position.items():
        kept = stored[stream_name]
        got = delivered[stream_name]
        ids = [int(f.split(":")[0]) for f in got]
        delivered_any[stream_name].update(ids)
        gone = [i for i in ids if i not in kept]
        for stream_id in gone:
            # Lost by a failover after this reader delivered it: it must stop (FailoverLoss)
            # before it delivers or passes anything of a later timeline.
            later = [(n, at) for n, at in reached[stream_name] if at >= stream_id + LATER_TIMELINE]
            if not chaos.failovers:
                problems.append(f"{name}: {stream_name} delivered {stream_id}, which is not stored")
            elif later:
                problems.append(
                    f"{name}: {stream_name} delivered {stream_id}, which is not stored (a "
                    f"failover lost it), then went on to {later[0][1]} without FailoverLoss"
                )
            else:
                tally["facts delivered, then lost by a failover"] += 1
        owed = [i for i in sorted(kept) if start[stream_name] < i <= upto_id]
        upto = [i for i in ids if i <= upto_id and i in kept]
        if upto != owed or ids != sorted(set(ids)):
            extra = sorted(set(upto) - set(owed))
            missing = sorted(set(owed) - set(upto))
            dups = [i for i, c in Counter(ids).items() if c > 1]
            problems.append(
                f"{name}: {stream_name} from {start[stream_name]} to position {upto_id}: delivered "
                f"{len(upto)} of {len(owed)} stored facts; missing {missing[:10]}, not stored "
                f"{extra[:10]}, duplicated {dups[:10]}, in order {ids == sorted(set(ids))}"
            )
        for fact in got:
            stream_id = int(fact.split(":")[0])
            if stream_id in kept and describe(stream_id, kept[stream_id]) != fact:
                problems.append(
                    f"{name}: {stream_name} delivered {fact}, stored is "
                    f"{describe(stream_id, kept[stream_id])} (torn or invented)"
                )
    return problems


def lost_commit_between(chaos: Chaos, one: tuple[str, int], other: tuple[str, int]) -> bool:
    """Whether an asynchronous failover came between two group commits (consumer, line) of
    the same facts, in either order (the consumers' lifetimes overlap: a zombie and its
    replacement): the earlier may be lost with the old timeline (acknowledged, not
    replicated), and the group consumes those facts again."""
    if chaos.variant.failover != "async":
        return False
    return any(
        (f.before(*one) and f.after(*other)) or (f.before(*other) and f.after(*one))
        for f in chaos.failovers
    )


@pytest.fixture(params=CHOSEN)
def chaos(request: pytest.FixtureRequest) -> Iterator[Chaos]:
    """The run's private servers and children, all gone afterwards. Not pytest's
    ``tmp_path``: as root, PostgreSQL runs as another user, who cannot enter it. One run per
    variant of ``STREAMS_CHAOS_VARIANTS`` (see the module docstring)."""
    variant = VARIANTS[request.param]
    workdir = Path(tempfile.mkdtemp(prefix="streams-chaos-"))
    settings = {"wal_writer_delay": "10s"}
    try:
        with contextlib.ExitStack() as stack:
            servers: Servers
            pair: FailoverPair | None = None
            if variant.failover is None:
                servers = SingleServer(stack.enter_context(restartable_postgres(settings)))
            else:
                synchronous = variant.failover == "sync"
                pair = stack.enter_context(
                    failover_pair(synchronous=synchronous, settings=settings)
                )
                servers = PairServers(pair)
            run = Chaos(servers, workdir, random.Random(SEED), variant, pair)
            stack.callback(run.close)
            # Not in the asynchronous variant: a query whose offset was proven after the switch
            # point stops there with DatabaseChanged, by design (docs/spark.md).
            if SPARK and variant.failover != "async":
                run.start_spark(request.getfixturevalue("spark"))
            yield run
    finally:
        if os.environ.get("STREAMS_CHAOS_KEEP"):  # the children's logs, for a post-mortem
            print(f"chaos: kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def test_chaos_every_fault_at_once(chaos: Chaos) -> None:
    print(
        f"\nchaos: STREAMS_CHAOS_SEED={SEED} STREAMS_CHAOS_SECONDS={SECONDS:g} "
        f"STREAMS_CHAOS_VARIANTS={chaos.variant.name}"
    )
    rng = chaos.rng
    started = time.monotonic()
    # STREAMS_SOAK_DIR: sampled and judged for leaks (tests/soak.py, `make soak`).
    soak = Soak.beside(chaos.pids, chaos.url, chaos.redis.url, chaos.prefix, chaos.names,
                       seconds=SECONDS, seed=SEED)  # fmt: skip
    chaos.stack.callback(soak.stop)
    chaos.supervise()
    time.sleep(2.0)  # warm up: every child connected
    next_fault = time.monotonic() + rng.uniform(0.2, 1.2)
    if chaos.pair is not None:
        chaos.next_failover = time.monotonic() + rng.uniform(1.0, 6.0)
    while time.monotonic() - started < SECONDS:
        chaos.supervise()
        if chaos.failover_due():
            chaos.failover()
        elif time.monotonic() >= next_fault:
            chaos.fault()
            next_fault = time.monotonic() + rng.uniform(0.2, 1.2)
        time.sleep(0.02)
    soak.stop()
    targets = chaos.settle()
    problems, summary = check_everything(chaos)
    summary["final positions"] = targets
    summary["seconds"] = round(time.monotonic() - started, 1)
    print(f"chaos summary: {json.dumps(summary, sort_keys=True)}")
    assert not problems, (
        f"STREAMS_CHAOS_SEED={SEED} STREAMS_CHAOS_SECONDS={SECONDS:g} "
        f"STREAMS_CHAOS_VARIANTS={chaos.variant.name} (streams {chaos.names}): "
        f"{len(problems)} problems\n{report(problems)}\nsummary: {json.dumps(summary)}"
    )
    soak.assert_flat()


#: The kinds of problem, in the order a report shows them (a few of each).
KINDS = [
    ("not a library error", "not a library error"),
    ("could not open", "a role could not open"),
    ("not a FailoverLoss", "DatabaseChanged"),
    ("false FailoverLoss", "a FailoverLoss naming stored facts"),
    ("without an asynchronous failover", "a FailoverLoss to a writer, standby synchronous"),
    ("never named", "an acknowledged loss not named to its writer"),
    ("without FailoverLoss", "a reader went past facts a failover lost"),
    ("handed out twice", "an ID handed out twice"),
    ("acked twice", "an ID handed out twice"),
    ("is lost", "an acknowledged fact lost"),
    ("is stored as", "an acknowledged fact stored otherwise"),
    ("times:", "a write stored more than once"),
    ("torn", "a torn fact"),
    ("by no writer", "an invented fact"),
    ("which is not stored", "an invented fact delivered"),
    ("committed by the group twice", "a group consumed a fact twice"),
    ("effects applied more than once", "a group's effects twice"),
    ("effects missing", "a group's effects missing"),
    ("never delivered", "a group skipped facts"),
    ("delivered", "a reader delivered other than the stored facts"),
]


def report(problems: list[str]) -> str:
    """The problems grouped by kind: how many, and the first few of each."""
    groups: dict[str, list[str]] = defaultdict(list)
    for problem in problems:
        kind = next((k for marker, k in KINDS if marker in problem), "other")
        groups[kind].append(problem)
    lines = []
    for kind in [*dict.fromkeys(k for _, k in KINDS), "other"]:
        if kind in groups:
            lines.append(f"-- {kind}: {len(groups[kind])}")
            lines += [f"   {p}" for p in groups[kind][:6]]
    return "\n".join(lines)
