"""No session holds a stream back longer than the lease, registered writer or not (issue 37).

Advisory locks have no privileges: any login may take a stream's reservation lock
(`streams.core.constants`), and every reader then stops below its key for as long as that
session holds it. Here a LOGIN with no streams role (granted only CONNECT) does so:

(a) with ``pg_advisory_xact_lock_shared`` in a transaction it leaves open;
(b) with a session-level ``pg_advisory_lock_shared``, then idle;
(c) session-level, across short transactions one after the other (``xact_start`` and
    ``state_change`` keep moving);
(d) several keys from several sessions, each in one of those ways.

Each time, a reader (or, under the role model, the elected prover) ends those sessions once the
lease plus detection has passed ("the holding argument", docs/design/liveness.md): the fact
behind them is delivered within `BOUND`, and the attacker's sessions are gone. Writers that
behave are never ended, however long the stream stays held meanwhile; `streams doctor` names
the holder (role, application, address) and ``--repair`` ends it.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner
from helpers import fact_rows, wait_until
from psycopg import sql
from servers import create_database, database_name, drop_database

import streams
import streams.store.holders as holders_module
from streams.command import main
from streams.config import Settings
from streams.core.stalls import HeldStreams
from streams.metrics import DatabaseCollector
from streams.migrate import upgrade
from streams.reader import Reader
from streams.store import sessions
from streams.store.driver import Gen, run
from streams.store.holders import holding_state
from streams.types import StreamInfo
from streams.writer import Writer

pytestmark = pytest.mark.timeout(240)

LEASE = 2.0
#: The stall must stay within this: the lease, counted from the first probe that saw the
#: sequence pass the held key; then at most a second to the next check (`CHECK_EVERY`), up to a
#: second for the server to end the session, and the reader's polls (0.1 s) and loaded-machine
#: slack.
BOUND = LEASE + 5.0
#: What the attacker calls itself (``application_name``): doctor must name it.
APPLICATION = "mallory-psql"


def _url_as(url: str, user: str) -> str:
    parts = urlsplit(url)
    netloc = f"{user}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=netloc))


def _int4(floor: int) -> int:
    """The reservation lock's second key for ``L = floor`` (``L mod 2**32`` as an int4)."""
    return (floor + 2**31) % 2**32 - 2**31


@dataclass
class Login:
    """A LOGIN role granted nothing but CONNECT on the database."""

    name: str
    url: str

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True, application_name=APPLICATION)


def _login(admin_url: str, database_url: str) -> Iterator[Login]:
    name = f"mallory_{secrets.token_hex(4)}"
    database = sql.Identifier(database_name(database_url))
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        admin.execute(
            sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(database, sql.Identifier(name))
        )
    try:
        with psycopg.connect(database_url, autocommit=True) as admin:
            member_of = admin.execute(
                "SELECT count(*) FROM pg_auth_members WHERE member = %s::regrole",
                (name,),
            ).fetchone()
        assert member_of == (0,), "the attacker is a member of no role"
        yield Login(name, _url_as(database_url, name))
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("REVOKE CONNECT ON DATABASE {} FROM {}").format(
                    database, sql.Identifier(name)
                )
            )
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def mallory(streams_url: str) -> Iterator[Login]:
    yield from _login(streams_url, streams_url)


@dataclass
class Attack:
    """The attacker's sessions, and the thread that keeps one of them busy (scenario c)."""

    admin_url: str
    sessions: list[psycopg.Connection[Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [conn.info.backend_pid for conn in self.sessions]

    def alive(self) -> list[int]:
        """The attacker's sessions the server still has."""
        with psycopg.connect(self.admin_url, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (self.pids,)
            ).fetchall()
        return sorted(int(row[0]) for row in rows)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        for conn in self.sessions:
            conn.close()


def _hold_in_transaction(login: Login, attack: Attack, stream_id: int, floor: int) -> None:
    """(a) ``BEGIN; SELECT pg_advisory_xact_lock_shared(...)``, and the transaction left open."""
    conn = login.connect()
    attack.sessions.append(conn)
    conn.execute("BEGIN")
    conn.execute("SELECT pg_advisory_xact_lock_shared(%s, %s)", (-stream_id, _int4(floor)))


def _hold_idle(login: Login, attack: Attack, stream_id: int, floor: int) -> None:
    """(b) a session-level lock, then nothing: the session is idle, in no transaction."""
    conn = login.connect()
    attack.sessions.append(conn)
    conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (-stream_id, _int4(floor)))


def _hold_across_transactions(login: Login, attack: Attack, stream_id: int, floor: int) -> None:
    """(c) a session-level lock, then one short transaction after the other."""
    conn = login.connect()
    attack.sessions.append(conn)
    conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (-stream_id, _int4(floor)))

    def busy() -> None:
        while not attack.stop.is_set():
            try:
                with conn.transaction():
                    conn.execute("SELECT pg_sleep(0.05)")
            except psycopg.Error:
                return  # ended
            time.sleep(0.05)

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    attack.threads.append(thread)


HOLDS: dict[str, Callable[[Login, Attack, int, int], None]] = {
    "transaction": _hold_in_transaction,
    "idle": _hold_idle,
    "transactions": _hold_across_transactions,
}


def _allocated(url: str, stream: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT COALESCE(pg_sequence_last_value(sequence_name::regclass), 0) "
            "FROM streams_registry WHERE name = %s",
            (stream,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _read_until(reader: Reader, stream_id: int, timeout: float) -> list[int]:
    """Poll ``reader`` until it has delivered ``stream_id``; the IDs delivered."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while stream_id not in seen:
        assert time.monotonic() < deadline, f"{stream_id} not delivered within {timeout:.0f}s"
        epoch = reader.poll(timeout=0.1)
        if epoch is not None:
            seen += [f.stream_id for f in epoch.facts]
    return seen


def _attack(
    url: str, login: Login, writer: Writer, stream: str, stream_id: int, holds: list[str]
) -> Attack:
    """Hold the next reservation key in each of ``holds``' ways, one after the other, with a
    fact appended after each but the last: every key is at or below the next fact's ID."""
    attack = Attack(url)
    for i, how in enumerate(holds):
        HOLDS[how](login, attack, stream_id, _allocated(url, stream) + 1)
        if i < len(holds) - 1:
            writer.append({"under": how})
    return attack


def _stalled_reader(
    url: str, stream: str, login: Login, holds: list[str], reader_url: str | None = None
) -> float:
    """The stall a reader (of ``reader_url``, default ``url``) sees behind the attack."""
    with streams.connect(url, lease_seconds=LEASE) as client:
        client.create_stream(stream)
        info = client.stream(stream)
        with (
            client.writer(stream, instance="w") as writer,
            streams.connect(reader_url or url, lease_seconds=LEASE) as reading,
            reading.reader(stream, poll_interval=0.1) as reader,
        ):
            seen = _read_until(reader, writer.append({"n": 0}).first_id, 30)
            attack = _attack(url, login, writer, stream, info.id, holds)
            try:
                held_at = time.monotonic()
                behind = writer.append({"behind": holds}).first_id
                seen += _read_until(reader, behind, BOUND + 10)
                stall = time.monotonic() - held_at
                wait_until(lambda: not attack.alive(), 10, "the attacker's sessions to end")
                for conn in attack.sessions:
                    with pytest.raises(psycopg.OperationalError):
                        conn.execute("SELECT 1")
            finally:
                attack.close()
        stored = sorted({row[0] for row in fact_rows(url, stream)})
    assert seen == stored, "every fact once, in order"
    assert stall <= BOUND, f"held back {stall:.1f}s (bound {BOUND}s, lease {LEASE}s)"
    print(f"{'+'.join(holds)}: stream held back {stall:.2f}s by a login with no role")
    return stall


@pytest.mark.parametrize(
    "holds",
    [["transaction"], ["idle"], ["transactions"], ["transaction", "idle", "transactions"]],
    ids=["in-transaction", "idle-session", "across-transactions", "several-sessions"],
)
def test_a_login_with_no_role_holds_a_stream_no_longer_than_the_lease(
    streams_url: str, unique_name: str, mallory: Login, holds: list[str]
) -> None:
    _stalled_reader(streams_url, unique_name, mallory, holds)


# ------------------------------------------------------------------------------------------
# Writers that behave


def test_writers_that_behave_are_never_ended(
    streams_url: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Single facts, batches and ``fact()`` transactions held open for half the bound, for
    three bounds, with the reader checking the stream every time a probe finds it held (not
    only after a second): no session is ever ended, and every fact comes once."""
    checks: list[list[int]] = []

    def spy(info: StreamInfo, held: HeldStreams, now: float) -> Gen[list[int]]:
        ended = yield from original(info, held, now)
        checks.append(ended)
        return ended

    original = holders_module.end_overdue_holders
    monkeypatch.setattr(holders_module, "end_overdue_holders", spy)
    stop = threading.Event()
    errors: list[BaseException] = []
    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        info = client.stream(unique_name)
        single = client.writer(unique_name, instance="single")
        batch = client.writer(unique_name, instance="batch")
        slow = client.writer(unique_name, instance="slow")
        own = psycopg.connect(streams_url)
        pids = (single._conn.info.backend_pid, batch._conn.info.backend_pid, own.info.backend_pid)

        def steadily(append: Callable[[int], object]) -> None:
            n = 0
            try:
                while not stop.is_set():
                    append(n)
                    n += 1
                    time.sleep(0.01)
            except BaseException as exc:
                errors.append(exc)

        def in_own_transaction(n: int) -> None:
            with slow.fact(own) as fact:
                fact.add({"slow": n})
                time.sleep(LEASE / 2)  # the transaction holds its reservation for half the bound

        work = [
            lambda n: single.append({"single": n}),
            lambda n: batch.append_batch([{"batch": n, "row": i} for i in range(20)]),
            in_own_transaction,
        ]
        threads = [threading.Thread(target=steadily, args=(w,), daemon=True) for w in work]
        with client.reader(unique_name, poll_interval=0.05) as reader:
            reader.core._held.check_after, reader.core._held.check_every = 0.0, 0.1
            seen: list[int] = []
            for thread in threads:
                thread.start()
            try:
                until = time.monotonic() + 3 * LEASE + 1
                while time.monotonic() < until:
                    epoch = reader.poll(timeout=0.05)
                    if epoch is not None:
                        seen += [f.stream_id for f in epoch.facts]
            finally:
                stop.set()
                for thread in threads:
                    thread.join(30)
            with sessions.connect(streams_url, autocommit=False, purpose="test") as conn:
                state = run(conn, holding_state(info))
            last = client.positions(unique_name).max_allocated
            seen += _read_until(reader, last, 30) if last not in seen else []
        assert (single._conn.info.backend_pid, batch._conn.info.backend_pid) == pids[:2]
        assert own.info.backend_pid == pids[2] and not own.closed
        for writer in (single, batch, slow):
            writer.close()
        own.close()
        stored = sorted({row[0] for row in fact_rows(streams_url, unique_name)})
    assert not errors, errors
    assert state.writers_lease == pytest.approx(LEASE, abs=0.1)
    assert len(checks) > 10, f"only {len(checks)} checks"
    assert not [pid for ended in checks for pid in ended], "a writer's session was ended"
    assert seen == stored, "every fact once, in order"
    print(f"{len(checks)} checks while {len(stored)} facts were written: nothing ended")


# ------------------------------------------------------------------------------------------
# Doctor and metrics


def test_doctor_names_the_holder_and_repair_ends_it(
    streams_url: str, unique_name: str, mallory: Login
) -> None:
    """With nobody reading, doctor names who holds the stream back (role, application,
    address) and when the bound passes; the metrics show the holder's role; ``doctor --repair``
    ends it once its transaction, or its idle time, has lasted longer than the bound."""
    name = f"stream {unique_name}: linear position"
    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        info = client.stream(unique_name)
        with client.writer(unique_name, instance="w") as writer:
            writer.append({"n": 0})
            attack = _attack(streams_url, mallory, writer, unique_name, info.id, HOLDS_FOR_DOCTOR)
            try:
                writer.append({"behind": True})
                with psycopg.connect(streams_url, autocommit=True) as admin:
                    ports = {
                        int(pid): int(port)
                        for pid, port in admin.execute(
                            "SELECT pid, client_port FROM pg_stat_activity WHERE pid = ANY(%s)",
                            (attack.pids,),
                        ).fetchall()
                    }
                result = CliRunner().invoke(
                    main, ["doctor", "--json", "--lease", "2s", "--database-url", streams_url]
                )
                (check,) = [c for c in json.loads(result.stdout) if c["name"] == name]
                detail = check["detail"]
                print(detail)
                assert "passes in" in detail, detail
                for words in (
                    f"role {mallory.name}",
                    f"application {APPLICATION!r}",
                    f"address 127.0.0.1:{ports[attack.pids[0]]}",
                    f"address 127.0.0.1:{ports[attack.pids[1]]}",
                    "bound (2.0 s",
                ):
                    assert words in detail, (words, detail)
                families = {
                    f.name: f for f in DatabaseCollector(Settings.resolve(streams_url)).collect()
                }
                roles = {
                    s.labels["role"]
                    for s in families["streams_stall_holder_seconds"].samples
                    if s.labels["stream"] == unique_name
                }
                assert mallory.name in roles, roles
                time.sleep(LEASE + 0.5)  # past the bound, by the holders' own times
                result = CliRunner().invoke(
                    main, ["doctor", "--json", "--lease", "2s", "--database-url", streams_url]
                )
                (check,) = [c for c in json.loads(result.stdout) if c["name"] == name]
                assert check["ok"] is False, check
                assert "past the bound (2.0 s" in check["detail"], check
                args = ["doctor", "--repair", "--json", "--lease", "2s"]
                result = CliRunner().invoke(main, [*args, "--database-url", streams_url])
                repaired = json.loads(result.stdout)["repaired"]
                print(repaired)
                for pid in attack.pids:
                    said = f"ended session pid {pid} (role {mallory.name}"
                    assert any(said in r for r in repaired), (said, repaired)
                assert not attack.alive()
            finally:
                attack.close()
            positions = client.positions(unique_name)
            assert positions.linear == positions.max_allocated


#: Doctor's one look sees how long a session has held a lock by its transaction's age, or, in
#: no transaction, its idle time: both cases.
HOLDS_FOR_DOCTOR = ["transaction", "idle"]


# ------------------------------------------------------------------------------------------
# The role model: the prover ends them, a plain reader says it cannot


@dataclass(frozen=True)
class RoleModel:
    url: str  #: as the superuser
    users: dict[str, str]  #: group role -> URL of a LOGIN granted only that role


@pytest.fixture(scope="module")
def role_model(postgres_admin_url: str) -> Iterator[RoleModel]:
    url = create_database(postgres_admin_url, prefix="streams_holders")
    tag = secrets.token_hex(3)
    roles = ("streams_prover", "streams_reader", "streams_writer")
    names = {role: f"streams_h{tag}_{role.removeprefix('streams_')}" for role in roles}
    try:
        upgrade(url)
        result = CliRunner().invoke(main, ["roles", "create", "--database-url", url])
        assert result.exit_code == 0, result.output
        with psycopg.connect(url, autocommit=True) as conn:
            for role, user in names.items():
                conn.execute(f"CREATE ROLE {user} LOGIN")
                conn.execute(f"GRANT {role} TO {user}")
        yield RoleModel(url, {role: _url_as(url, user) for role, user in names.items()})
    finally:
        drop_database(postgres_admin_url, database_name(url))
        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            for user in names.values():
                conn.execute(f"DROP ROLE IF EXISTS {user}")


@pytest.fixture
def mallory_there(postgres_admin_url: str, role_model: RoleModel) -> Iterator[Login]:
    yield from _login(postgres_admin_url, role_model.url)


def test_the_prover_ends_them_under_the_role_model(
    role_model: RoleModel,
    mallory_there: Login,
    unique_name: str,
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A LOGIN granted only ``streams_prover`` proves the stream; readers follow its proofs as
    a LOGIN granted only ``streams_reader``: the prover ends the attacker's sessions."""
    caplog.set_level(logging.WARNING, logger="streams.writer")
    with streams.connect(role_model.url) as admin:
        admin.create_stream(unique_name)
        info = admin.stream(unique_name)
    prover = streams.connect(
        role_model.users["streams_prover"], redis_url, redis_prefix, shared_proofs=True,
        lease_seconds=LEASE,
    )  # fmt: skip
    try:
        prover.reader(unique_name)  # its process follows the stream: it stands for election
        with (
            streams.connect(
                role_model.users["streams_writer"], redis_url, redis_prefix, lease_seconds=LEASE
            ) as writing,
            writing.writer(unique_name, instance="w") as writer,
            streams.connect(
                role_model.users["streams_reader"], redis_url, redis_prefix, shared_proofs=True,
                lease_seconds=LEASE,
            ) as reading,
            reading.reader(unique_name, poll_interval=0.1) as reader,
        ):  # fmt: skip
            proofs = prover._proofs
            assert proofs is not None
            seen = _read_until(reader, writer.append({"n": 0}).first_id, 30)
            wait_until(lambda: unique_name in proofs.proving, 20, "the prover to be elected")
            attack = _attack(
                role_model.url, mallory_there, writer, unique_name, info.id, ["transaction", "idle"]
            )
            try:
                held_at = time.monotonic()
                behind = writer.append({"behind": True}).first_id
                seen += _read_until(reader, behind, BOUND + 10)
                stall = time.monotonic() - held_at
                wait_until(lambda: not attack.alive(), 10, "the attacker's sessions to end")
            finally:
                attack.close()
    finally:
        prover.close()
    ended = [r for r in caplog.records if "ended session" in r.getMessage()]
    assert {r.threadName for r in ended} == {"streams-prover"}, [r.threadName for r in ended]
    assert all(f"role {mallory_there.name}" in r.getMessage() for r in ended)
    assert seen == list(range(1, behind + 1))
    assert stall <= BOUND, f"held back {stall:.1f}s (bound {BOUND}s, lease {LEASE}s)"
    print(f"prover: stream held back {stall:.2f}s by a login with no role")


def test_a_reader_that_may_not_end_them_says_so_once_and_carries_on(
    role_model: RoleModel,
    mallory_there: Login,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="streams.writer")
    with streams.connect(role_model.url) as admin:
        admin.create_stream(unique_name)
        info = admin.stream(unique_name)
    with (
        streams.connect(role_model.users["streams_writer"], lease_seconds=LEASE) as writing,
        writing.writer(unique_name, instance="w") as writer,
        streams.connect(role_model.users["streams_reader"], lease_seconds=LEASE) as reading,
        reading.reader(unique_name, poll_interval=0.1) as reader,
    ):
        seen = _read_until(reader, writer.append({"n": 0}).first_id, 30)
        attack = _attack(role_model.url, mallory_there, writer, unique_name, info.id, ["idle"])
        try:
            behind = writer.append({"behind": True}).first_id
            until = time.monotonic() + LEASE + 3.5  # past the bound, and two checks more
            while time.monotonic() < until:
                epoch = reader.poll(timeout=0.1)
                assert epoch is None or behind not in [f.stream_id for f in epoch.facts]
            assert attack.alive() == attack.pids  # nobody here may end it
            said = [
                r.getMessage()
                for r in caplog.records
                if "may not end session" in r.getMessage() and unique_name in r.getMessage()
            ]
            assert len(said) == 1, said
            assert f"role {mallory_there.name}" in said[0], said
            with psycopg.connect(role_model.url, autocommit=True) as admin_conn:
                admin_conn.execute("SELECT pg_terminate_backend(%s, 5000)", (attack.pids[0],))
            seen += _read_until(reader, behind, 20)
        finally:
            attack.close()
    assert seen == list(range(1, behind + 1))


def test_an_exclusive_holder_blocks_no_writer_for_long(
    streams_url: str, mallory: Login, unique_name: str
) -> None:
    """An exclusive lock on the stream's next reservation key (no library session ever takes
    one) would make every writer wait for it: a writer's append fails at once instead, with
    `ReservationBlocked` naming the session, and its next heartbeat ends it (this writer's role
    may: a superuser's), after which appends go on."""
    with streams.connect(streams_url, lease_seconds=LEASE) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            first = writer.append({"n": 0}).first_id
            with psycopg.connect(streams_url, autocommit=True) as admin:
                row = admin.execute(
                    "SELECT id FROM streams_registry WHERE name = %s", (unique_name,)
                ).fetchone()
            assert row is not None
            with mallory.connect() as conn:
                conn.execute("SELECT pg_advisory_lock(%s, %s)", (-int(row[0]), _int4(first + 1)))
                started = time.monotonic()
                with pytest.raises(streams.ReservationBlocked) as caught:
                    writer.append({"n": 1})
                assert time.monotonic() - started < 1.0  # no wait behind the lock
                assert mallory.name in str(caught.value) and APPLICATION in str(caught.value)
                with pytest.raises(streams.ReservationBlocked):
                    writer.append_batch([{"n": 2}, {"n": 3}])
                # The writer's heartbeat (every lease / 4) ends the session.
                wait_until(lambda: conn.closed or _ended(streams_url, conn), timeout=10)
            assert writer.append({"n": 4}).first_id > first


def _ended(admin_url: str, conn: psycopg.Connection[Any]) -> bool:
    with psycopg.connect(admin_url, autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (conn.info.backend_pid,)
        ).fetchone()
    return row == (0,)


def test_the_prover_ends_an_exclusive_holder_a_role_model_writer_may_not(
    role_model: RoleModel,
    mallory_there: Login,
    unique_name: str,
    redis_url: str,
    redis_prefix: str,
) -> None:
    """A writer of the role model may not end another role's session: its append fails at
    once with `ReservationBlocked` naming the holder, and the elected prover (a LOGIN granted
    only ``streams_prover``, which may) ends it in its once-a-second sweep; appends go on."""
    with streams.connect(role_model.url) as admin:
        admin.create_stream(unique_name)
        info = admin.stream(unique_name)
    prover = streams.connect(
        role_model.users["streams_prover"], redis_url, redis_prefix, shared_proofs=True,
        lease_seconds=LEASE,
    )  # fmt: skip
    try:
        prover.reader(unique_name)
        with (
            streams.connect(
                role_model.users["streams_writer"], redis_url, redis_prefix, lease_seconds=LEASE
            ) as writing,
            writing.writer(unique_name, instance="w") as writer,
        ):
            proofs = prover._proofs
            assert proofs is not None
            first = writer.append({"n": 0}).first_id
            wait_until(lambda: unique_name in proofs.proving, 20, "the prover to be elected")
            with mallory_there.connect() as conn:
                conn.execute("SELECT pg_advisory_lock(%s, %s)", (-info.id, _int4(first + 1)))
                blocked_at = time.monotonic()
                with pytest.raises(streams.ReservationBlocked) as caught:
                    writer.append({"n": 1})
                assert mallory_there.name in str(caught.value)
                wait_until(
                    lambda: _ended(role_model.url, conn), 10, "the prover to end the session"
                )
                ended_after = time.monotonic() - blocked_at
            assert writer.append({"n": 2}).first_id > first
    finally:
        prover.close()
    assert ended_after < 4.0, ended_after
    print(f"prover: exclusive holder ended {ended_after:.2f}s after the writer was blocked")
