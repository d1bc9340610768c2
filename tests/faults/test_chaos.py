"""Every fault at once, at random times, from one seed (issue 27).

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

Checked at the end (`check_everything`): every acknowledged fact is stored exactly once with
the acknowledged payload and every unknown one at most once; no stream ID was handed out twice
(two acks, or an ack or a stored fact at an ID a rolled-back reservation had); every stored
fact is whole; every plain reader delivered exactly the stored facts up to its position, in
order, each once, each whole and as stored (nothing invented); each group's committed epochs are
disjoint across all its consumers' lifetimes and together with the rest of what they delivered
cover every fact, and the transactional group's effects hold every fact exactly once; every
error a child met is one of the library's (`streams.StreamsError`).

The run is made twice: every child logged in as the database's admin, then under the role
model (`streams roles create`), each child logged in as a login of its own role: writers as
``streams_writer``, one plain reader as ``streams_prover`` (it stands for election), the other
as ``streams_reader``, the group consumers as ``streams_group_reader`` (issue 37).

``STREAMS_CHAOS_SEED`` replays a run (the seed is printed, and in every failure);
``STREAMS_CHAOS_SECONDS`` (default 60) is how long faults go on; ``STREAMS_CHAOS_KEEP=1`` keeps
the run's directory (the children's logs). Children die with the test
(``PR_SET_PDEATHSIG``, and their process groups are killed), the servers are stopped by PID;
each run has its own data directory, database, streams and channel prefix.
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
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from faultkit import (
    Attacker,
    Child,
    RestartablePostgres,
    RestartableRedis,
    restartable_postgres,
)
from helpers import TESTS_DIR
from servers import new_redis_prefix, new_stream_name
from soak import Soak

import streams
from streams.embedded import ensure_database

SECONDS = float(os.environ.get("STREAMS_CHAOS_SECONDS", "60"))
SEED = int(os.environ.get("STREAMS_CHAOS_SEED") or secrets.randbelow(2**31))
CHILD = TESTS_DIR / "chaos_child.py"
LEASE = 2.0
#: Rolled-back reservations before an immediate stop: more than PostgreSQL's 32 values a
#: sequence logs ahead, so one of them wrote the sequence's WAL record.
HOLE_GAPS = 34
T = TypeVar("T")

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(int(SECONDS) + 300)]


@dataclass
class Slot:
    """One role kept alive: a child, started again when it died (as a supervisor would)."""

    name: str
    role: str  # writer | plain | auto | tx
    streams: list[str]
    lives: list[Child] = field(default_factory=list)

    def live(self) -> list[Child]:
        return [c for c in self.lives if c.proc.poll() is None]


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
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port}"))


class Chaos:
    def __init__(
        self, pg: RestartablePostgres, workdir: Path, rng: random.Random, *, roles: bool = False
    ) -> None:
        self.workdir = workdir
        self.rng = rng
        self.stack = contextlib.ExitStack()
        self.pg = pg
        (workdir / "redis").mkdir()
        self.redis = RestartableRedis(workdir / "redis")
        self.stack.callback(self.redis.close)
        self.redis.start(first=True)
        database = f"chaos_{SEED}_{secrets.token_hex(3)}"
        self.url = self.pg.proxy.url(ensure_database(self.pg.server.url, database))
        self.direct = self.pg.server.url.rsplit("/", 1)[0] + f"/{database}"
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
        if roles:
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

    # ------------------------------------------------------------------ faults

    def fault(self) -> None:
        rng = self.rng
        kinds = {
            "kill-writer": 3, "stop-writer": 3, "kill-reader": 2, "stop-reader": 2,
            "kill-at-epoch": 3, "zombie": 1, "pg-fast": 1, "pg-immediate": 1, "pg-hole": 2,
            "terminate": 3, "redis-restart": 1,
        }  # fmt: skip
        kind = rng.choices(list(kinds), list(kinds.values()))[0]
        self.faults[kind] += 1
        running = [c for c in self.live("writer") if id(c) not in self.stopped()]
        readers = [c for c in self.live("plain", "auto", "tx") if id(c) not in self.stopped()]
        groups = [c for c in self.live("auto", "tx") if id(c) not in self.stopped()]
        if kind == "kill-writer" and running:
            rng.choice(running).signal(signal.SIGKILL)
        elif kind == "stop-writer" and running:
            self._stop(rng.choice(running), rng.uniform(0.2, LEASE * 2))
        elif kind == "kill-reader" and readers:
            rng.choice(readers).signal(signal.SIGKILL)
        elif kind == "stop-reader" and readers:
            self._stop(rng.choice(readers), rng.uniform(0.2, 3.0))
        elif kind == "kill-at-epoch" and groups:
            rng.choice(groups).signal(signal.SIGUSR1)
        elif kind == "zombie" and groups:
            self._zombie(rng.choice(groups))
        elif kind in ("pg-fast", "pg-immediate"):
            self.pg.restart(kind[3:], down_for=rng.uniform(0, 1.5))
        elif kind == "pg-hole":
            self._hole()
        elif kind == "terminate":
            self._terminate(rng.randint(1, 3))
        elif kind == "redis-restart":
            self.redis.kill()
            time.sleep(rng.uniform(0, 1.5))
            self.redis.start()
        else:
            self.faults[kind] -= 1

    def _stop(self, child: Child, seconds: float) -> None:
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
            with psycopg.connect(self.direct, autocommit=True, connect_timeout=3) as admin:
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
        self.pg.restart("immediate")
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
    summary: dict[str, Any] = {"seed": SEED, "faults": dict(chaos.faults)}
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
    for child in chaos.children:
        writer = child.name
        if writer not in by_writer:
            continue
        stream = by_writer[writer]
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
        committed: dict[str, dict[int, str]] = defaultdict(dict)
        delivered_any: dict[str, set[int]] = defaultdict(set)
        for child in slot.lives:
            problems += check_lifetime(child, stored, committed, delivered_any)
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
    summary["lifetimes"] = {s.name: len(s.lives) for s in chaos.slots}
    summary["fenced"] = sum(
        1 for c in chaos.children for line in c.history if line.startswith("FENCED")
    )
    summary["attacks"] = dict(chaos.attacker.sent)
    summary["notes"] = chaos.notes
    return problems, summary


def check_lifetime(
    child: Child,
    stored: dict[str, dict[int, list[dict[str, Any]]]],
    committed: dict[str, dict[int, str]],
    delivered_any: dict[str, set[int]],
) -> list[str]:
    name = child.name
    problems: list[str] = []
    start: dict[str, int] | None = None
    position: dict[str, int] = {}
    delivered: dict[str, list[str]] = defaultdict(list)
    uncommitted: dict[str, list[int]] = defaultdict(list)
    for line in child.history:
        if line.startswith("START "):
            start = json.loads(line[6:])
            position = dict(start)
        elif line.startswith("E "):
            _, stream, *facts = line.split()
            delivered[stream] += facts
            uncommitted[stream] += [int(f.split(":")[0]) for f in facts]
        elif line.startswith("P "):
            _, stream, at = line.split()
            position[stream] = int(at)
        elif line.startswith("C "):
            for stream, ids in uncommitted.items():
                for stream_id in ids:
                    if stream_id in committed[stream]:
                        problems.append(
                            f"{name}: {stream} fact {stream_id} committed by the group twice: "
                            f"by {committed[stream][stream_id]} and by {name}"
                        )
                    committed[stream][stream_id] = name
            uncommitted.clear()
    if start is None:
        return problems
    for stream_name, upto_id in position.items():
        kept = stored[stream_name]
        got = delivered[stream_name]
        ids = [int(f.split(":")[0]) for f in got]
        delivered_any[stream_name].update(ids)
        owed = [i for i in sorted(kept) if start[stream_name] < i <= upto_id]
        upto = [i for i in ids if i <= upto_id]
        if upto != owed:
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
            elif stream_id not in kept:
                problems.append(f"{name}: {stream_name} delivered {fact}, which is not stored")
    return problems


@pytest.fixture(params=[False, True], ids=["one-login", "role-model"])
def chaos(request: pytest.FixtureRequest) -> Iterator[Chaos]:
    """The run's private servers and children, all gone afterwards. Not pytest's
    ``tmp_path``: as root, PostgreSQL runs as another user, who cannot enter it. Twice: every
    child as the admin, then (issue 37) each as a login of its own role."""
    workdir = Path(tempfile.mkdtemp(prefix="streams-chaos-"))
    try:
        with restartable_postgres({"wal_writer_delay": "10s"}) as pg:
            run = Chaos(pg, workdir, random.Random(SEED), roles=request.param)
            try:
                yield run
            finally:
                run.close()
    finally:
        if os.environ.get("STREAMS_CHAOS_KEEP"):  # the children's logs, for a post-mortem
            print(f"chaos: kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def test_chaos_every_fault_at_once(chaos: Chaos) -> None:
    print(f"\nchaos: STREAMS_CHAOS_SEED={SEED} STREAMS_CHAOS_SECONDS={SECONDS:g}")
    rng = chaos.rng
    started = time.monotonic()
    # STREAMS_SOAK_DIR: sampled and judged for leaks (tests/soak.py, `make soak`).
    soak = Soak.beside(chaos.pids, chaos.url, chaos.redis.url, chaos.prefix, chaos.names,
                       seconds=SECONDS, seed=SEED)  # fmt: skip
    chaos.stack.callback(soak.stop)
    chaos.supervise()
    time.sleep(2.0)  # warm up: every child connected
    next_fault = time.monotonic() + rng.uniform(0.2, 1.2)
    while time.monotonic() - started < SECONDS:
        chaos.supervise()
        if time.monotonic() >= next_fault:
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
        f"STREAMS_CHAOS_SEED={SEED} STREAMS_CHAOS_SECONDS={SECONDS:g} (streams {chaos.names}): "
        f"{len(problems)} problems\n{report(problems)}\nsummary: {json.dumps(summary)}"
    )
    soak.assert_flat()


#: The kinds of problem, in the order a report shows them (a few of each).
KINDS = [
    ("not a library error", "not a library error"),
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
