"""The role model (`streams.store.roles`, `streams roles`): each role does its job with the
library's own calls while logged in as a user granted only that role, and is refused (SQLSTATE
42501, insufficient privilege) everything else, by the library and by raw SQL alike;
`streams roles check` (and `streams doctor`) flag grants beyond the model.

One database of this module's own: `streams roles create` transfers its objects to
``streams_admin``. The group roles are the cluster's and stay (the next run finds them); the
LOGIN users are this module's (unique names), dropped at the end.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner
from helpers import wait_until
from psycopg import errors as pg_errors
from servers import create_database, database_name, drop_database, with_database

import streams
import streams.proofs
from streams.command import main
from streams.errors import StoreError
from streams.migrate import upgrade
from streams.store import sessions
from streams.store.driver import run
from streams.store.leases import retire_expired_writers
from streams.store.privileges import ROLES
from streams.store.probe import prove, try_become_prover
from streams.store.registry import drop_stream, load_stream
from streams.store.sinks import TaskKey, claim_task, commit_batch, sink_state

pytestmark = pytest.mark.timeout(180)

NOT_ALLOWED = "42501"
#: The stream made before `streams roles create`: its sequence must be covered too.
OLD_STREAM = "made_before_roles"


@dataclass(frozen=True)
class Setup:
    url: str  #: as the superuser that set it up
    users: dict[str, str]  #: group role -> URL of a LOGIN user granted only that role
    names: dict[str, str]  #: group role -> that user's name

    def as_(self, role: str) -> str:
        return self.users[role]


def _url_as(url: str, user: str) -> str:
    parts = urlsplit(url)
    netloc = f"{user}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=netloc))


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _prover_schema(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT to_regnamespace('streams_prover') IS NOT NULL").fetchone()
    return bool(row and row[0])


@pytest.fixture(scope="module")
def setup(postgres_admin_url: str) -> Iterator[Setup]:
    url = create_database(postgres_admin_url, prefix="streams_roles")
    tag = secrets.token_hex(3)
    names = {role: f"streams_t{tag}_{role.removeprefix('streams_')}" for role in ROLES}
    names["streams_admin_2"] = f"streams_t{tag}_admin_2"
    try:
        upgrade(url)
        with streams.connect(url) as client:
            client.create_stream(OLD_STREAM)
        code, out = _cli("roles", "create", "--database-url", url)
        assert code == 0, out
        with psycopg.connect(url, autocommit=True) as conn:
            for role, user in names.items():
                conn.execute(f"CREATE ROLE {user} LOGIN")
                conn.execute(f"GRANT {role.removesuffix('_2')} TO {user}")
        yield Setup(url, {role: _url_as(url, user) for role, user in names.items()}, names)
    finally:
        drop_database(postgres_admin_url, database_name(url))
        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            for user in names.values():
                conn.execute(f"DROP ROLE IF EXISTS {user}")


@pytest.fixture
def stream(setup: Setup) -> str:
    """A stream created by an admin user (not a superuser) after the roles were set up."""
    name = f"s_{secrets.token_hex(6)}"
    with streams.connect(setup.as_("streams_admin")) as admin:
        admin.create_stream(name)
    return name


def _append(setup: Setup, stream: str, count: int) -> None:
    with streams.connect(setup.as_("streams_writer")) as client, client.writer(stream) as writer:
        writer.append_batch([{"n": n} for n in range(count)])


def _refused(url: str, statement: str, params: Any = None) -> None:
    """``statement`` fails with insufficient privilege for the user of ``url``."""
    with (
        psycopg.connect(url, autocommit=True) as conn,
        pytest.raises(pg_errors.InsufficientPrivilege),
    ):
        conn.execute(statement, params)


def _library_refused(call: Callable[[], object]) -> None:
    with pytest.raises(StoreError) as caught:
        call()
    assert caught.value.sqlstate == NOT_ALLOWED, caught.value


def _stream_id(setup: Setup, stream: str) -> int:
    with psycopg.connect(setup.url, autocommit=True) as conn:
        row = conn.execute("SELECT id FROM streams_registry WHERE name = %s", (stream,)).fetchone()
    assert row is not None
    return int(row[0])


def _read_all(url: str, stream: str, count: int, **options: Any) -> list[int]:
    with streams.connect(url, **options) as client:
        reader = client.reader(stream)
        got: list[int] = []
        deadline = time.monotonic() + 15
        while len(got) < count:
            assert time.monotonic() < deadline, got
            epoch = reader.poll(timeout=1.0)
            if epoch is not None:
                got += [f.payload["n"] for f in epoch.facts]
        return got


def test_writer_appends_and_reads_no_payload(setup: Setup, stream: str) -> None:
    with streams.connect(setup.as_("streams_writer")) as client, client.writer(stream) as writer:
        writer.append({"n": 0})
        writer.append({"n": 1}, key="k1")
        assert writer.append({"n": 1}, key="k1").first_id == 2  # the key's original
        writer.append_batch([{"n": 2}, {"n": 3}])
    with psycopg.connect(setup.url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT payload->>'n' FROM streams_facts WHERE stream = %s ORDER BY stream_id",
            (_stream_id(setup, stream),),
        ).fetchall()
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    writer_url = setup.as_("streams_writer")
    _refused(writer_url, "SELECT payload FROM streams_facts LIMIT 1")
    _refused(writer_url, "UPDATE streams_proofs SET complete = complete + 1")
    _refused(writer_url, "UPDATE streams_keys SET retired_at = now()")
    _refused(writer_url, "DELETE FROM streams_reader_groups")


def test_writer_runs_the_spark_sinks_commits(setup: Setup, stream: str) -> None:
    with sessions.connect(setup.as_("streams_writer"), autocommit=True, purpose="test") as conn:
        info = run(conn, load_stream(stream))
        conn.autocommit = False
        assert run(conn, claim_task(info, TaskKey("q1", 0, 0))) is True
        conn.commit()
        assert run(conn, claim_task(info, TaskKey("q1", 0, 0))) is False
        conn.rollback()
        done = run(conn, commit_batch(info, "q1", 0))
        assert (done.committed_batch, done.task_commits_deleted) == (0, 1)
        conn.commit()
        # retention of idle queries (q1, as q2 commits): FOR UPDATE SKIP LOCKED, then DELETE
        time.sleep(0.01)
        done = run(conn, commit_batch(info, "q2", 0, retention_seconds=0.0))
        conn.commit()
        assert done.stale_queries_deleted == 1
        assert run(conn, sink_state(info, "q1")) == (None, [])


def test_a_stream_made_before_the_roles_is_covered(setup: Setup) -> None:
    _append(setup, OLD_STREAM, 2)
    assert _read_all(setup.as_("streams_reader"), OLD_STREAM, 2) == [0, 1]


def test_reader_reads_and_may_write_nothing(setup: Setup, stream: str) -> None:
    _append(setup, stream, 3)
    url = setup.as_("streams_reader")
    assert _read_all(url, stream, 3) == [0, 1, 2]
    key = _stream_id(setup, stream)
    # Raw SQL: facts, proofs, keys, groups, writers, sequences.
    _refused(
        url,
        "INSERT INTO streams_facts (stream, stream_id, instance, ts, payload) "
        "VALUES (%s, 1000, 'forger', 0, '{}')",
        (key,),
    )
    _refused(url, "UPDATE streams_proofs SET complete = complete + 1000")
    _refused(url, "INSERT INTO streams_proofs VALUES (%s, 1000, now())", (key,))
    _refused(url, "INSERT INTO streams_keys (created_at) VALUES (now())")
    _refused(url, "UPDATE streams_keys SET retired_at = now()")
    _refused(
        url,
        "INSERT INTO streams_reader_groups (stream, group_name, position) VALUES (%s, 'g', 1)",
        (key,),
    )
    _refused(url, "UPDATE streams_reader_groups SET position = position + 1")
    _refused(
        url,
        "INSERT INTO streams_group_generations (stream, group_name, generation) "
        "VALUES (%s, 'g', 1)",
        (key,),
    )
    _refused(url, "UPDATE streams_writers SET retired = true")
    _refused(url, f"SELECT nextval('streams_seq_{key}')")
    _refused(url, f"SELECT setval('streams_seq_{key}', 1)")
    if _prover_schema(setup.url):
        _refused(url, "SELECT * FROM streams_prover.signing_keys")
    # The library's own calls: what it may (positions, without retiring writers), and not.
    with streams.connect(url) as client:
        assert client.positions(stream).max_allocated >= 3
        _library_refused(lambda: client.writer(stream).close())
        _library_refused(client.rotate_replication_keys)

        def commit_group() -> None:
            reader = client.reader(stream, group="readers")
            try:
                reader.poll(timeout=2.0)
                reader.commit()
            finally:
                reader.close()

        _library_refused(commit_group)
    with sessions.connect(url, autocommit=False, purpose="test") as conn:
        info = run(conn, load_stream(stream))
        _library_refused(lambda: run(conn, prove([info])))


def test_reader_with_shared_proofs_follows_but_never_proves(
    setup: Setup, stream: str, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _prover_schema(setup.url):
        pytest.skip("needs revision 0012_prover_keys (the prover's own schema)")
    stood: list[list[str]] = []
    original = try_become_prover

    def spy(infos: Any) -> Any:
        stood.append([info.name for info in infos])
        return original(infos)

    monkeypatch.setattr(streams.proofs, "try_become_prover", spy)
    _append(setup, stream, 3)
    with streams.connect(
        setup.as_("streams_reader"), redis_url, redis_prefix, shared_proofs=True
    ) as client:
        reader = client.reader(stream)
        got: list[int] = []
        deadline = time.monotonic() + 15
        while len(got) < 3:
            assert time.monotonic() < deadline, got
            epoch = reader.poll(timeout=1.0)
            if epoch is not None:
                got += [f.payload["n"] for f in epoch.facts]
        # Elections come every 0.5 s while no prover is heard: time for a few.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            reader.poll(timeout=0.1)
        proofs = client._proofs
        assert proofs is None or stream not in proofs.proving
    assert got == [0, 1, 2]
    assert not [names for names in stood if stream in names], "a reader stood for election"


def test_prover_proves(setup: Setup, stream: str, redis_url: str, redis_prefix: str) -> None:
    _append(setup, stream, 3)
    with streams.connect(
        setup.as_("streams_prover"), redis_url, redis_prefix, shared_proofs=True
    ) as client:
        reader = client.reader(stream, poll_interval=0.2)
        proofs = client._proofs
        assert proofs is not None

        def proven() -> bool:
            reader.poll(timeout=0.1)
            with psycopg.connect(setup.url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT complete FROM streams_proofs WHERE stream = %s",
                    (_stream_id(setup, stream),),
                ).fetchone()
            return stream in proofs.proving and row is not None and row[0] >= 3

        wait_until(proven, 20, "the prover user to prove the stream")
    url = setup.as_("streams_prover")
    _refused(
        url, "INSERT INTO streams_facts (stream, stream_id, instance, ts) VALUES (1, 1, 'x', 0)"
    )
    _refused(url, "DELETE FROM streams_proofs")
    # The liveness job of readers and the prover: retire a writer whose lease expired.
    with psycopg.connect(setup.url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO streams_writers (stream, instance, position, lease_expires_at) "
            "VALUES (%s, 'frozen', 0, now() - interval '1 minute')",
            (_stream_id(setup, stream),),
        )
    with sessions.connect(url, autocommit=False, purpose="test") as conn:
        info = run(conn, load_stream(stream))
        assert run(conn, retire_expired_writers(info)) == ["frozen"]


def test_group_reader_commits_its_group_and_writes_nothing_else(setup: Setup, stream: str) -> None:
    _append(setup, stream, 3)
    url = setup.as_("streams_group_reader")
    with streams.connect(url) as client:
        reader = client.reader(stream, group="billing")
        got: list[int] = []
        deadline = time.monotonic() + 15
        while len(got) < 3:
            assert time.monotonic() < deadline, got
            epoch = reader.poll(timeout=1.0)
            if epoch is not None:
                got += [f.payload["n"] for f in epoch.facts]
        assert reader.commit() == {stream: 3}
        reader.close()
    with psycopg.connect(setup.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT position FROM streams_reader_groups WHERE stream = %s AND group_name = %s",
            (_stream_id(setup, stream), "billing"),
        ).fetchone()
    assert row == (3,)
    key = _stream_id(setup, stream)
    _refused(
        url,
        "INSERT INTO streams_facts (stream, stream_id, instance, ts) VALUES (%s, 99, 'x', 0)",
        (key,),
    )
    _refused(url, "UPDATE streams_proofs SET complete = complete + 1")
    _refused(url, "UPDATE streams_keys SET retired_at = now()")
    _refused(url, "UPDATE streams_writers SET retired = true")
    _refused(url, "DELETE FROM streams_reader_groups")  # deleting groups is the operator's
    operator = setup.as_("streams_operator")
    code, out = _cli("incarnation", "accept", "--all", "--database-url", operator)
    assert code == 0, out
    code, out = _cli(
        "groups", "delete", "billing", "--stream", stream, "--yes", "--database-url", operator
    )
    assert code == 0, out
    with psycopg.connect(setup.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM streams_reader_groups WHERE stream = %s", (key,)
        ).fetchone()
    assert row == (0,)


def test_operator_runs_doctor_and_prune(setup: Setup, stream: str) -> None:
    url = setup.as_("streams_operator")
    key = _stream_id(setup, stream)
    _append(setup, stream, 5)
    with streams.connect(setup.as_("streams_admin")) as admin:
        admin.set_retention(stream, 1)
    with psycopg.connect(setup.url, autocommit=True) as conn:
        # a writer whose lease expired long ago, for --repair to retire
        conn.execute(
            "INSERT INTO streams_writers (stream, instance, position, lease_expires_at) "
            "VALUES (%s, 'ghost', 0, now() - interval '1 minute')",
            (key,),
        )
    time.sleep(0.01)
    code, out = _cli("prune", stream, "--json", "--database-url", url)
    assert code == 0, out
    code, out = _cli("doctor", "--repair", "--json", "--database-url", url)
    report = json.loads(out)
    assert f"stream {stream}: retired writer ghost (lease expired)" in report["repaired"], out
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["roles"]["ok"], checks["roles"]
    assert code == 0, [c for c in report["checks"] if not c["ok"]]
    with psycopg.connect(setup.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), (SELECT pruned_through FROM streams_registry WHERE id = %s) "
            "FROM streams_facts WHERE stream = %s",
            (key, key),
        ).fetchone()
    assert row == (0, 5)
    with streams.connect(url) as client:  # positions retires expired writers first
        assert client.positions(stream).linear == 5
    # pg_signal_backend: the operator may end a writer's session (doctor --repair does).
    with psycopg.connect(setup.as_("streams_writer"), autocommit=True) as victim:
        pid = victim.info.backend_pid
        with psycopg.connect(url, autocommit=True) as conn:
            ended = conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()
        assert ended == (True,)
    _refused(url, "UPDATE streams_proofs SET complete = complete + 1")
    _refused(url, "INSERT INTO streams_keys (created_at) VALUES (now())")
    if _prover_schema(setup.url):
        _refused(url, "SELECT * FROM streams_prover.signing_keys")


def test_any_admin_drops_a_stream_another_admin_created(setup: Setup, stream: str) -> None:
    _append(setup, stream, 1)
    with sessions.connect(setup.as_("streams_admin_2"), autocommit=False, purpose="test") as conn:
        assert run(conn, drop_stream(stream)) is True


@contextlib.contextmanager
def _restored(setup: Setup) -> Iterator[None]:
    """Undo what a test granted: `streams roles create` again."""
    try:
        yield
    finally:
        code, out = _cli("roles", "create", "--database-url", setup.url)
        assert code == 0, out


def _check(url: str) -> tuple[int, dict[str, Any]]:
    code, out = _cli("roles", "check", "--json", "--database-url", url)
    return code, json.loads(out)


def test_check_is_clean_and_flags_broad_grants(setup: Setup) -> None:
    code, out = _cli("roles", "create", "--database-url", setup.url)  # idempotent
    assert code == 0, out
    for url in (setup.url, setup.as_("streams_operator")):
        code, report = _check(url)
        assert (code, report) == (0, {"ok": True, "overbroad": [], "missing": []})
    bi = f"streams_bi_{secrets.token_hex(3)}"
    with _restored(setup), psycopg.connect(setup.url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {bi} LOGIN")
        try:
            conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {bi}")
            if _prover_schema(setup.url):  # it never reaches the private keys
                _refused(_url_as(setup.url, bi), "SELECT seed FROM streams_prover.signing_keys")
            code, report = _check(setup.url)
            assert code == 1
            flagged = {(f["role"], f["relation"]) for f in report["overbroad"]}
            assert flagged == {(bi, "streams_keys")}, report
            code, out = _cli("doctor", "--json", "--database-url", setup.url)
            roles = next(c for c in json.loads(out) if c["name"] == "roles")
            assert code == 1 and not roles["ok"] and bi in roles["detail"], roles

            conn.execute("GRANT UPDATE ON streams_proofs TO streams_reader")
            conn.execute("GRANT SELECT ON streams_facts TO PUBLIC")
            if _prover_schema(setup.url):
                conn.execute(f"GRANT USAGE ON SCHEMA streams_prover TO {bi}")
                conn.execute(f"GRANT SELECT ON streams_prover.signing_keys TO {bi}")
            code, report = _check(setup.url)
            assert code == 1
            flagged = {(f["role"], f["relation"]) for f in report["overbroad"]}
            reader = setup.names["streams_reader"]
            assert {
                ("streams_reader", "streams_proofs"),
                (reader, "streams_proofs"),  # a member of it
                ("PUBLIC", "streams_facts"),
            } <= flagged, report
            assert ("streams_prover", "streams_proofs") not in flagged
            if _prover_schema(setup.url):
                assert (bi, "streams_prover.signing_keys") in flagged, report
        finally:
            conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {bi}")
            if _prover_schema(setup.url):
                conn.execute(f"REVOKE ALL ON SCHEMA streams_prover FROM {bi}")
                conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA streams_prover FROM {bi}")
            conn.execute(f"DROP ROLE {bi}")
    code, report = _check(setup.url)
    assert (code, report["overbroad"]) == (0, []), report


def test_check_reports_grants_the_model_misses(setup: Setup) -> None:
    with _restored(setup), psycopg.connect(setup.url, autocommit=True) as conn:
        conn.execute(
            f"REVOKE INSERT ON streams_facts_{_stream_id(setup, OLD_STREAM)} FROM streams_writer"
        )
        conn.execute(
            "REVOKE EXECUTE ON FUNCTION streams_commit_group(text, integer[], bigint[], "
            "bigint[], bigint[], bigint[], uuid[], text, boolean) FROM streams_group_reader"
        )
        code, report = _check(setup.url)
        assert code == 1
        assert report["missing"] == [
            f"streams_writer lacks INSERT on streams_facts_{_stream_id(setup, OLD_STREAM)}",
            "streams_group_reader lacks EXECUTE on streams_commit_group(text, integer[], "
            "bigint[], bigint[], bigint[], bigint[], uuid[], text, boolean)",
        ], report


def test_show_lists_each_roles_privileges(setup: Setup) -> None:
    code, out = _cli("roles", "show", "--json", "--database-url", setup.url)
    assert code == 0, out
    by_role = {r["role"]: r for r in json.loads(out)["roles"]}
    assert list(by_role) == [*ROLES, "streams_definer"]
    writer = by_role["streams_writer"]
    assert "streams_facts" not in writer["privileges"]  # its streams' partitions instead
    partitions = writer["stream_partitions"]
    assert partitions["privileges"] == {p: partitions["count"] for p in ("INSERT", "SELECT")}
    assert setup.names["streams_writer"] in writer["members"]
    sequences = writer["stream_sequences"]
    assert sequences["privileges"] == {p: sequences["count"] for p in ("SELECT", "USAGE")}
    assert {f.split("(")[0] for f in writer["functions"]} == {
        "streams_timeline_switchpoint",
        "streams_fence_timeline",
        "streams_fence_stream",
        "streams_repair_sequence",
    }
    definer = by_role["streams_definer"]
    assert definer["stream_sequences"]["privileges"] == {
        p: sequences["count"] for p in ("SELECT", "UPDATE")
    }
    reader = by_role["streams_reader"]
    assert {p for ps in reader["privileges"].values() for p in ps} == {"SELECT"}
    group_reader = by_role["streams_group_reader"]["privileges"]
    assert group_reader["streams_proofs"] == ["SELECT"]
    assert group_reader["streams_reader_groups"] == ["SELECT"]  # commits: the functions'
    assert {f.split("(")[0] for f in by_role["streams_group_reader"]["functions"]} == {
        "streams_timeline_switchpoint",
        "streams_open_group",
        "streams_commit_group",
    }
    assert by_role["streams_prover"]["privileges"]["streams_proofs"] == [
        "INSERT",
        "SELECT",
        "UPDATE",
    ]
    assert "pg_signal_backend" in by_role["streams_operator"]["member_of"]
    admin = by_role["streams_admin"]
    assert {"streams_facts", "streams_keys", "streams_proofs"} <= set(admin["owns"])
    assert "streams_facts" not in admin["privileges"]
    code, out = _cli("roles", "show", "--database-url", setup.url)
    assert code == 0 and "streams_group_reader (members:" in out, out


def test_a_schema_owner_who_is_not_a_superuser_sets_the_roles_up(postgres_admin_url: str) -> None:
    """`streams roles create` as the owner of the database and its schema, with CREATEROLE
    only: it makes itself a member of streams_admin, hands the objects over, and grants."""
    owner = f"streams_owner_{secrets.token_hex(3)}"
    with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {owner} LOGIN CREATEROLE")
    name = f"streams_roles_owner_{secrets.token_hex(3)}"
    try:
        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} OWNER {owner}")
        url = _url_as(with_database(postgres_admin_url, name), owner)
        upgrade(url)
        with streams.connect(url) as client:
            client.create_stream("before")
        code, out = _cli("roles", "create", "--database-url", url)
        assert code == 0, out
        assert "streams_admin granted to the current user" in out
        with streams.connect(url) as client:
            client.create_stream("after")
        code, report = _check(url)
        assert (code, report) == (0, {"ok": True, "overbroad": [], "missing": []})
    finally:
        drop_database(postgres_admin_url, name)
        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS {owner}")
