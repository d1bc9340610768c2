"""No login escalates (issue 37): tried as an attacker with an ordinary database login would.

One database of this module's own, set up with the role model (`streams roles create`), and a
LOGIN user for each role, one with no streams role at all (``nobody``), one granted a single
stream and one granted a single group. Each of them, in turn:

* shadows, in its own ``pg_temp``, every relation the library has (a temporary table with
  statement triggers and a row-security policy that call its own function), every stream's
  sequence and partition, and the types a function body may name (temporary domains whose
  CHECK calls its function), and places functions and operators in ``public`` (which it is
  allowed to create in, for this test) under the names the bodies use;
* then calls every function of the database that runs with another role's rights.

The attacker's function announces itself with a NOTICE naming ``current_user``: any NOTICE
sent while ``current_user`` is not the attacker means its code ran with someone else's rights
(it also tries to read the signing seeds and to make itself a superuser). On the code before
this revision, `streams_fence_timeline` ran it as the superuser who migrated.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import errors as pg_errors
from servers import create_database, database_name, drop_database

import streams
from streams.command import main
from streams.core.constants import facts_bucket
from streams.migrate import upgrade
from streams.store.privileges import ACTIONS, LOGINS, NOBODY, SOME_GROUPS, SOME_STREAMS

pytestmark = pytest.mark.timeout(300)

MODEL = (
    "streams_admin",
    "streams_operator",
    "streams_prover",
    "streams_writer",
    "streams_reader",
    "streams_group_reader",
)
#: A sample call of each function that runs with another role's rights, by name: every one
#: the database has must be here (a new one without its attack fails the test).
CALLS = {
    "streams_timeline_switchpoint": "SELECT streams_timeline_switchpoint(1)",
    "streams_fence_timeline": "SELECT streams_fence_timeline(1000000)",
    "streams_fence_stream": "SELECT streams_fence_stream({victim}, 1000000)",
    "streams_repair_sequence": "SELECT streams_repair_sequence({victim}, NULL)",
    "streams_open_group": "SELECT * FROM streams_open_group('g', ARRAY[{victim}], 'x')",
    "streams_commit_group": (
        "SELECT * FROM streams_commit_group('g', ARRAY[{victim}], ARRAY[1::bigint], "
        "ARRAY[0::bigint], ARRAY[NULL::bigint], ARRAY[1::bigint], "
        "ARRAY[gen_random_uuid()], NULL, false)"
    ),
}
#: Types a body may name: each shadowed by a temporary domain whose CHECK runs the attacker's
#: function (for the types that allow a domain).
TYPES = (
    "text",
    "int8",
    "int4",
    "bool",
    "uuid",
    "pg_lsn",
    "regclass",
    "oid",
    "name",
    "timestamptz",
    "jsonb",
    "numeric",
    "float8",
)

EVIL = """
CREATE FUNCTION pg_temp.streams_evil() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF current_user <> session_user THEN
        RAISE NOTICE 'streams-evil ran as % for %', current_user, session_user;
        BEGIN
            PERFORM count(*) FROM streams_prover.signing_keys;
            RAISE NOTICE 'streams-evil read the signing seeds';
        EXCEPTION WHEN OTHERS THEN NULL;
        END;
        BEGIN
            EXECUTE format('ALTER ROLE %I SUPERUSER', session_user);
            RAISE NOTICE 'streams-evil made % a superuser', session_user;
        EXCEPTION WHEN OTHERS THEN NULL;
        END;
    END IF;
    RETURN true;
END $$;
CREATE FUNCTION pg_temp.streams_evil_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_temp.streams_evil(); RETURN NULL; END $$;
"""


@dataclass(frozen=True)
class Setup:
    url: str
    users: dict[str, str]  #: kind -> URL of a LOGIN user
    names: dict[str, str]  #: kind -> that user's name
    victim: int  #: the stream granted to the "scoped writer"
    other: int  #: a stream it is not granted


def _url_as(url: str, user: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port or 5432}"))


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def setup(postgres_admin_url: str) -> Iterator[Setup]:
    url = create_database(postgres_admin_url, prefix="streams_escalation")
    tag = secrets.token_hex(3)
    kinds = [*MODEL, "nobody", "scoped_writer", "scoped_group", "bystander"]
    names = {k: f"streams_e{tag}_{k.removeprefix('streams_')}" for k in kinds}
    try:
        upgrade(url)
        with streams.connect(url) as client:
            client.create_stream("victim")
            client.create_stream("other")
            for name in ("victim", "other"):
                with client.writer(name) as writer:
                    writer.append_batch([{"n": n} for n in range(3)])
            # A writer row on "other" and group g's row on "victim", for the matrix.
            with client.writer("other", instance="matrix-writer"):
                pass
            group = client.reader("victim", group="g")
            group.poll(timeout=5.0)
            group.commit()
            group.close()
        code, out = _cli("roles", "create", "--database-url", url)
        assert code == 0, out
        with psycopg.connect(url, autocommit=True) as conn:
            for kind, user in names.items():
                conn.execute(f"CREATE ROLE {user} LOGIN")
                if kind in MODEL:
                    conn.execute(f"GRANT {kind} TO {user}")
                # Some deployments still let every role create in public, or schemas of its
                # own: the attack may use both.
                conn.execute(f"GRANT CREATE ON SCHEMA public TO {user}")
                conn.execute(f'GRANT CREATE ON DATABASE "{database_name(url)}" TO {user}')
            ids: dict[str, int] = dict(
                conn.execute("SELECT name, id FROM streams_registry").fetchall()
            )
        code, out = _cli(
            "roles", "grant", names["scoped_writer"], "--stream", "victim", "--database-url", url
        )
        assert code == 0, out
        code, out = _cli(
            "roles", "grant", names["scoped_group"], "--group", "g", "--database-url", url
        )
        assert code == 0, out
        yield Setup(
            url,
            {k: _url_as(url, u) for k, u in names.items()},
            names,
            int(ids["victim"]),
            int(ids["other"]),
        )
    finally:
        drop_database(postgres_admin_url, database_name(url))
        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            for user in names.values():
                conn.execute(f"DROP ROLE IF EXISTS {user}")


def _definer_functions(conn: psycopg.Connection[Any]) -> list[tuple[str, str, bool, bool, Any]]:
    return [
        (str(name), str(owner), bool(can_login), bool(superuser), config)
        for name, owner, can_login, superuser, config in conn.execute(
            "SELECT p.proname, o.rolname, o.rolcanlogin, o.rolsuper, p.proconfig "
            "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "JOIN pg_roles o ON o.oid = p.proowner "
            "WHERE p.prosecdef AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
            "ORDER BY 1"
        ).fetchall()
    ]


def test_every_definer_function_is_pinned_owned_by_a_nologin_role_and_not_public(
    setup: Setup,
) -> None:
    with psycopg.connect(setup.url, autocommit=True) as conn:
        found = _definer_functions(conn)
        public = conn.execute(
            "SELECT p.proname FROM pg_proc p WHERE p.prosecdef AND p.pronamespace = "
            "'public'::regnamespace AND (p.proacl IS NULL OR EXISTS (SELECT FROM "
            "aclexplode(p.proacl) a WHERE a.grantee = 0))"
        ).fetchall()
    assert sorted(name for name, *_ in found) == sorted(CALLS)
    for name, owner, can_login, superuser, config in found:
        assert owner == "streams_definer", name
        assert not can_login and not superuser, name
        assert config == ["search_path=pg_catalog, pg_temp"], name
    assert public == []
    code, out = _cli("roles", "check", "--json", "--database-url", setup.url)
    assert code == 0, out


def _plant(conn: psycopg.Connection[Any], setup: Setup) -> None:
    """Shadow everything the definer functions could name, as the connection's login."""
    conn.execute(EVIL)
    relations = conn.execute(
        "SELECT c.relname, c.relkind, c.oid FROM pg_class c "
        "WHERE c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'streams%%' "
        "AND c.relkind IN ('r', 'p', 'S', 'v')"
    ).fetchall()
    for name, kind, oid in relations:
        if kind == "S":
            conn.execute(f'CREATE TEMP SEQUENCE "{name}" START 999')
            continue
        columns = conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (oid,),
        ).fetchall()
        body = ", ".join(f'"{c}" {t}' for c, t in columns) or "x int"
        conn.execute(f'CREATE TEMP TABLE "{name}" ({body})')
        conn.execute(f'INSERT INTO pg_temp."{name}" DEFAULT VALUES')
        conn.execute(
            "CREATE TRIGGER evil BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE "
            f'ON pg_temp."{name}" FOR EACH STATEMENT '
            "EXECUTE FUNCTION pg_temp.streams_evil_trigger()"
        )
        conn.execute(f'ALTER TABLE pg_temp."{name}" ENABLE ROW LEVEL SECURITY')
        conn.execute(
            f'CREATE POLICY evil ON pg_temp."{name}" USING (pg_temp.streams_evil()) '
            "WITH CHECK (pg_temp.streams_evil())"
        )
    for kind in TYPES:
        conn.execute(
            f"CREATE DOMAIN pg_temp.{kind} AS pg_catalog.{kind} CHECK (pg_temp.streams_evil())"
        )
    # Functions and operators a body may use, in a schema the attacker may create in.
    user = conn.execute("SELECT current_user").fetchone()
    assert user is not None
    schema = f"evil_{user[0]}"
    conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    for where in ("public", schema):
        for signature, returns in (
            ("setval(text, bigint)", "bigint"),
            ("pg_sequence_last_value(text)", "bigint"),
            ("lpad(text, integer, text)", "text"),
            ("now()", "timestamptz"),
            ("gen_random_uuid()", "uuid"),
            ("quote_ident(name)", "text"),
            ("has_table_privilege(name, regclass, text)", "boolean"),
            ("max(bigint)", "bigint"),
        ):
            name = signature.split("(")[0]
            args = signature[len(name) + 1 : -1]
            # (In public, another attacker of this module may have placed it already.)
            with contextlib.suppress(pg_errors.DuplicateFunction, pg_errors.InsufficientPrivilege):
                conn.execute(
                    f'CREATE FUNCTION "{where}".{name}({args}) RETURNS {returns} LANGUAGE '
                    "plpgsql AS $$ BEGIN PERFORM pg_temp.streams_evil(); RETURN NULL; END $$"
                )
        for operator, left, right in (
            ("=", "text", "text"),
            ("||", "text", "text"),
            ("<=", "bigint", "bigint"),
            ("+", "bigint", "bigint"),
            (">", "bigint", "bigint"),
            ("~", "text", "text"),
        ):
            function = f'"{where}".evil_op_{len(operator)}_{operator.encode().hex()}'
            with contextlib.suppress(pg_errors.DuplicateFunction, pg_errors.InsufficientPrivilege):
                conn.execute(
                    f"CREATE FUNCTION {function}(a {left}, b {right}) RETURNS boolean "
                    "LANGUAGE plpgsql AS $$ BEGIN RETURN pg_temp.streams_evil(); END $$"
                )
            with contextlib.suppress(pg_errors.DuplicateFunction, pg_errors.InsufficientPrivilege):
                conn.execute(
                    f'CREATE OPERATOR "{where}".{operator} (LEFTARG = {left}, '
                    f"RIGHTARG = {right}, FUNCTION = {function})"
                )
    conn.execute(f'SET search_path = pg_temp, "{schema}", public, pg_catalog')


KINDS = [*MODEL, "nobody", "scoped_writer", "scoped_group"]  # (the bystander attacks nothing)


@pytest.mark.parametrize("kind", KINDS)
def test_no_login_runs_code_with_a_definer_functions_rights(setup: Setup, kind: str) -> None:
    """Every shadow in place, every function called: the attacker's code never runs as anyone
    but the attacker, no seed is read, no role altered."""
    notices: list[str] = []
    before = _last(setup, setup.victim)
    with psycopg.connect(setup.users[kind], autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(str(d.message_primary)))
        _plant(conn, setup)
        with psycopg.connect(setup.url, autocommit=True) as admin:
            found = {name for name, *_ in _definer_functions(admin)}
        assert found == set(CALLS)
        outcomes = {}
        for name, call in CALLS.items():
            statement = call.format(victim=setup.victim).replace(
                f"SELECT {name}", f"SELECT public.{name}"
            )
            statement = re.sub(rf"FROM {name}\(", f"FROM public.{name}(", statement)
            try:
                conn.execute(statement)
                outcomes[name] = "ran"
            except psycopg.Error as exc:
                outcomes[name] = type(exc).__name__
        # Writes through the library's tables (row security's test) as well.
        with contextlib.suppress(psycopg.Error):
            conn.execute(
                "UPDATE public.streams_writers SET position = position WHERE stream = %s",
                (setup.victim,),
            )
    escalations = [n for n in notices if n.startswith("streams-evil")]
    assert escalations == [], (kind, outcomes, escalations)
    with psycopg.connect(setup.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT rolsuper FROM pg_roles WHERE rolname = %s", (setup.names[kind],)
        ).fetchone()
        assert row == (False,)
    # The fence found the timeline fenced and moved nothing; the repair moved nothing (not to
    # 999, the shadow sequences' start, either).
    assert _last(setup, setup.victim) == before


def test_the_old_functions_fell_to_the_same_attack(postgres_admin_url: str) -> None:
    """The attack is real: against revision 0014 (the functions of 0013), a login with no
    streams role ran its code as the superuser who migrated (the test above would fail there)."""
    url = create_database(postgres_admin_url, prefix="streams_escalation_old")
    user = f"streams_e{secrets.token_hex(3)}_old"
    try:
        upgrade(url, "0014_idempotency_claim_keys")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {user} LOGIN")
            conn.execute(f"GRANT CREATE ON SCHEMA public TO {user}")
        notices: list[str] = []
        with psycopg.connect(_url_as(url, user), autocommit=True) as conn:
            conn.add_notice_handler(lambda d: notices.append(str(d.message_primary)))
            conn.execute(EVIL)
            conn.execute(
                "CREATE TEMP TABLE streams_incarnation (singleton bool, id uuid, "
                "created_at timestamptz, fenced_timeline bigint)"
            )
            conn.execute("INSERT INTO pg_temp.streams_incarnation DEFAULT VALUES")
            conn.execute(
                "CREATE TRIGGER evil BEFORE UPDATE ON pg_temp.streams_incarnation "
                "FOR EACH STATEMENT EXECUTE FUNCTION pg_temp.streams_evil_trigger()"
            )
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT streams_fence_timeline(1000000)")
        assert any(n.startswith("streams-evil ran as") for n in notices), notices
        assert any("a superuser" in n for n in notices), notices
    finally:
        drop_database(postgres_admin_url, database_name(url))
        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS {user}")


def _refused(url: str, statement: str, params: Any = None) -> str:
    """``statement`` fails as the user of ``url``; the SQLSTATE."""
    with psycopg.connect(url, autocommit=True) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(statement, params)
    return str(caught.value.sqlstate)


def _last(setup: Setup, stream: int) -> int:
    with psycopg.connect(setup.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_sequence_last_value(sequence_name::regclass) FROM streams_registry "
            "WHERE id = %s",
            (stream,),
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "streams_admin"])
def test_no_role_but_the_owner_sets_a_sequence(setup: Setup, kind: str) -> None:
    before = _last(setup, setup.other)
    state = _refused(
        setup.users[kind], "SELECT setval(sequence_name::regclass, 1) FROM streams_registry"
    )
    assert state == "42501"
    assert _last(setup, setup.other) == before


@pytest.mark.parametrize("kind", ["streams_operator", "streams_reader", "nobody", "scoped_group"])
def test_roles_that_do_not_write_reserve_no_id(setup: Setup, kind: str) -> None:
    assert _refused(setup.users[kind], f"SELECT nextval('streams_seq_{setup.other}')") == "42501"


def test_a_writer_granted_one_stream_writes_no_other(setup: Setup) -> None:
    url = setup.users["scoped_writer"]
    with streams.connect(url) as client, client.writer("victim") as writer:
        ack = writer.append({"mine": True})
    assert ack.count == 1
    with (
        streams.connect(url) as client,
        pytest.raises(streams.StoreError) as caught,
        client.writer("other") as writer,
    ):
        writer.append({"theirs": True})
    assert caught.value.sqlstate == "42501"
    row = f"({setup.other}, 999, 0, 'x', 0, '{{}}')"
    assert _refused(url, f"INSERT INTO streams_facts_{setup.other} VALUES {row}") == "42501"
    assert _refused(url, f"INSERT INTO streams_facts VALUES {row}") == "42501"
    assert _refused(url, f"SELECT nextval('streams_seq_{setup.other}')") == "42501"
    # Another stream's writer rows: invisible to its updates, refused to its inserts.
    with psycopg.connect(url, autocommit=True) as conn:
        changed = conn.execute(
            "UPDATE streams_writers SET position = position + 5, generation = 0 WHERE stream = %s",
            (setup.other,),
        ).rowcount
        assert changed == 0
    state = _refused(
        url,
        "INSERT INTO streams_writers (stream, instance, position, lease_expires_at) "
        "VALUES (%s, 'forged', 0, now() + interval '1 hour')",
        (setup.other,),
    )
    assert state == "42501"
    # Nor repair (move) the other stream's sequence, nor fence it.
    assert _refused(url, "SELECT streams_repair_sequence(%s, 10)", (setup.other,)) == "42501"
    assert _refused(url, "SELECT streams_fence_stream(%s, 1000000)", (setup.other,)) == "42501"


def test_the_fence_takes_no_negative_and_no_unbounded_skip(setup: Setup) -> None:
    before = _last(setup, setup.victim)
    for skip in (-5, 0, 10, 10**12):
        state = _refused(
            setup.users["streams_writer"], "SELECT streams_fence_timeline(%s)", (skip,)
        )
        assert state == "22023", skip
        state = _refused(
            setup.users["streams_writer"],
            "SELECT streams_fence_stream(%s, %s)",
            (setup.victim, skip),
        )
        assert state == "22023", skip
    assert _last(setup, setup.victim) == before
    assert _refused(setup.users["nobody"], "SELECT streams_fence_timeline(1000000)") == "42501"
    assert (
        _refused(setup.users["nobody"], "SELECT streams_fence_stream(%s, 1000000)", (setup.victim,))
        == "42501"
    )


def test_a_repair_only_moves_forward(setup: Setup) -> None:
    before = _last(setup, setup.victim)
    with psycopg.connect(setup.users["streams_writer"], autocommit=True) as conn:
        row = conn.execute("SELECT streams_repair_sequence(%s, 1)", (setup.victim,)).fetchone()
        assert row == (None,)
        assert _last(setup, setup.victim) == before
        row = conn.execute(
            "SELECT streams_repair_sequence(%s, %s)", (setup.victim, before + 10)
        ).fetchone()
        assert row == (before + 10,)
    state = _refused(
        setup.users["streams_writer"], "SELECT streams_repair_sequence(%s, -1)", (setup.victim,)
    )
    assert state == "22023"


@pytest.mark.parametrize("kind", ["streams_group_reader", "scoped_group"])
def test_a_group_reader_moves_no_group_row_by_hand(setup: Setup, kind: str) -> None:
    url = setup.users[kind]
    with streams.connect(url) as client:
        reader = client.reader("victim", group="g" if kind == "scoped_group" else f"g-{kind}")
        epoch = reader.poll(timeout=5.0)
        assert epoch is not None
        reader.commit()
        reader.close()
    for statement in (
        "UPDATE streams_reader_groups SET position = position + 5",
        "INSERT INTO streams_reader_groups (stream, group_name, position) "
        f"VALUES ({setup.other}, 'g', 2)",
        "UPDATE streams_group_generations SET generation = generation + 1",
    ):
        assert _refused(url, statement) == "42501", statement


def test_a_group_commit_beyond_max_allocated_is_refused_by_the_database(setup: Setup) -> None:
    url = setup.users["streams_group_reader"]
    with psycopg.connect(url, autocommit=True) as conn:
        ((stream, generation, token),) = conn.execute(
            "SELECT * FROM streams_open_group('bound', ARRAY[%s], 'raw')", (setup.victim,)
        ).fetchall()
        with pytest.raises(psycopg.Error, match="streams-position-beyond"):
            conn.execute(
                "SELECT * FROM streams_commit_group('bound', ARRAY[%s], ARRAY[%s::bigint], "
                "ARRAY[0::bigint], ARRAY[NULL::bigint], ARRAY[%s::bigint], ARRAY[%s::uuid], "
                "NULL, false)",
                (stream, 2**62, generation, token),
            )
        # A wrong token: fenced, nothing moves.
        with pytest.raises(psycopg.Error, match="streams-group-fenced"):
            conn.execute(
                "SELECT * FROM streams_commit_group('bound', ARRAY[%s], ARRAY[1::bigint], "
                "ARRAY[0::bigint], ARRAY[NULL::bigint], ARRAY[%s::bigint], "
                "ARRAY[gen_random_uuid()], NULL, false)",
                (stream, generation),
            )
        row = conn.execute(
            "SELECT count(*) FROM streams_reader_groups WHERE group_name = 'bound'"
        ).fetchone()
        assert row == (0,)


def test_a_role_granted_one_group_uses_no_other(setup: Setup) -> None:
    url = setup.users["scoped_group"]
    with streams.connect(url) as client:
        with pytest.raises(streams.StoreError) as caught:
            client.reader("victim", group="not-mine").poll(timeout=1.0)
        assert caught.value.sqlstate == "42501"
    state = _refused(url, "SELECT * FROM streams_open_group('h', ARRAY[%s], 'x')", (setup.victim,))
    assert state == "42501"


def test_nobody_calls_a_definer_function(setup: Setup) -> None:
    for name, call in CALLS.items():
        if name == "streams_timeline_switchpoint":
            continue
        state = _refused(setup.users["nobody"], call.format(victim=setup.victim))
        assert state == "42501", name


def test_roles_check_finds_what_an_attacker_would_use(setup: Setup) -> None:
    """A definer function left unpinned, executable by PUBLIC and owned by a superuser;
    UPDATE on a stream's sequence; a raw write on the groups' table; INSERT on the parent;
    INSERT on a bucket (the partition of the parent that the victim's partition hangs under)."""
    helper = setup.names["nobody"]
    bucket = facts_bucket(setup.victim)
    with psycopg.connect(setup.url, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION public.app_helper() RETURNS int LANGUAGE sql SECURITY DEFINER "
            "AS 'SELECT 1'"
        )
        conn.execute(f"GRANT UPDATE ON SEQUENCE streams_seq_{setup.victim} TO {helper}")
        conn.execute(f"GRANT UPDATE (position) ON streams_reader_groups TO {helper}")
        conn.execute(f"GRANT INSERT ON streams_facts TO {helper}")
        conn.execute(f"GRANT INSERT, SELECT, TRIGGER ON {bucket} TO {helper}")
        try:
            code, out = _cli("roles", "check", "--database-url", setup.url)
            assert code == 1, out
            assert "app_helper" in out and "search_path is not pinned" in out, out
            assert "PUBLIC may EXECUTE" in out and "a superuser owns it" in out, out
            assert f"{helper} may UPDATE 1 stream sequence(s)" in out, out
            assert f"{helper} may UPDATE streams_reader_groups" in out, out
            assert f"{helper} may INSERT streams_facts" in out, out
            assert f"{helper} may INSERT, TRIGGER {bucket}: a bucket reaches" in out, out
            code, doctor = _cli("doctor", "--database-url", setup.url)
            assert "app_helper" in doctor, doctor
        finally:
            conn.execute("DROP FUNCTION public.app_helper()")
            conn.execute(f"REVOKE ALL ON SEQUENCE streams_seq_{setup.victim} FROM {helper}")
            conn.execute(f"REVOKE ALL ON streams_reader_groups FROM {helper}")
            conn.execute(f"REVOKE ALL ON streams_facts FROM {helper}")
            conn.execute(f"REVOKE ALL ON {bucket} FROM {helper}")
    code, out = _cli("roles", "check", "--database-url", setup.url)
    assert code == 0, out


def test_roles_show_lists_the_streams_and_groups_granted(setup: Setup) -> None:
    code, out = _cli("roles", "show", "--database-url", setup.url)
    assert code == 0, out
    assert setup.names["scoped_writer"] in out and "streams: victim" in out, out
    assert setup.names["scoped_group"] in out and "groups: g" in out, out
    assert "streams_definer" in out, out


def test_granting_a_stream_to_a_writer_of_every_stream_is_refused(setup: Setup) -> None:
    code, out = _cli(
        "roles",
        "grant",
        setup.names["streams_writer"],
        "--stream",
        "victim",
        "--database-url",
        setup.url,
    )
    assert code != 0 and "holds every stream" in out, out
    code, out = _cli(
        "roles", "grant", "streams_writer", "--stream", "victim", "--database-url", setup.url
    )
    assert code != 0, out


# --- the privilege matrix (`streams.store.privileges.ACTIONS`), every cell tried --------------

#: Which login of the fixture stands for each of `LOGINS`.
_LOGIN_KIND = {
    **{role: role for role in MODEL},
    NOBODY: "nobody",
    SOME_STREAMS: "scoped_writer",
    SOME_GROUPS: "scoped_group",
}

_OPEN_AND_COMMIT = (
    "SELECT c.* FROM streams_open_group({group}, ARRAY[{a}], 'matrix') o, LATERAL "
    "streams_commit_group({group}, ARRAY[o.o_stream], ARRAY[{position}::bigint], "
    "ARRAY[0::bigint], ARRAY[NULL::bigint], ARRAY[o.o_generation], ARRAY[o.o_token], NULL, "
    "false) c"
)


def _statements(action: str, a: int, b: int, last_b: int) -> list[str]:
    """The raw SQL of each action of the matrix, on stream A (``a``) and B (``b``)."""
    row = "(stream, stream_id, row_no, instance, ts, payload)"
    return {
        "read facts' payloads": ["SELECT payload FROM streams_facts LIMIT 1"],
        "append to stream A": [
            f"INSERT INTO streams_facts_{a} {row} "
            f"VALUES ({a}, nextval('streams_seq_{a}'), 0, 'matrix', 0, '{{}}')"
        ],
        "append to stream B": [
            f"INSERT INTO streams_facts_{b} {row} "
            f"VALUES ({b}, nextval('streams_seq_{b}'), 0, 'matrix', 0, '{{}}')"
        ],
        "insert through streams_facts (any stream)": [
            f"INSERT INTO streams_facts {row} VALUES ({b}, 1000000000, 0, 'matrix', 0, '{{}}')"
        ],
        "insert through stream B's bucket": [
            f"INSERT INTO {facts_bucket(b)} {row} VALUES ({b}, 1000000001, 0, 'matrix', 0, '{{}}')"
        ],
        "reserve IDs of stream B (nextval)": [f"SELECT nextval('streams_seq_{b}')"],
        "set a sequence (setval, back too)": [f"SELECT setval('streams_seq_{b}', {last_b})"],
        "repair stream A's sequence forward": [f"SELECT streams_repair_sequence({a}, NULL)"],
        "fence a new timeline (bounded skip)": ["SELECT streams_fence_timeline(1000000)"],
        "fence with a negative skip": ["SELECT streams_fence_timeline(-5)"],
        "fence stream A (bounded skip)": [f"SELECT streams_fence_stream({a}, 1000000)"],
        "fence stream B (bounded skip)": [f"SELECT streams_fence_stream({b}, 1000000)"],
        "register a writer of stream B": [
            "INSERT INTO streams_writers (stream, instance, position, lease_expires_at) "
            f"VALUES ({b}, 'matrix', 0, now()) RETURNING 1"
        ],
        "retire stream B's writers": [
            f"UPDATE streams_writers SET retired = retired WHERE stream = {b} RETURNING 1"
        ],
        "commit group g (token, bound)": [_OPEN_AND_COMMIT.format(group="'g'", position=1, a=a)],
        "commit group h": [_OPEN_AND_COMMIT.format(group="'h'", position=1, a=a)],
        "commit a group past max allocated": [
            _OPEN_AND_COMMIT.format(group="'g'", position=2**62, a=a)
        ],
        "update a group's row directly": [
            "UPDATE streams_reader_groups SET position = position WHERE group_name = 'g' "
            "RETURNING 1"
        ],
        "delete a group": ["DELETE FROM streams_reader_groups WHERE group_name = 'g' RETURNING 1"],
        "write proofs": [
            "INSERT INTO streams_proofs (stream, complete, proven_at) "
            f"VALUES ({b}, 0, now()) RETURNING 1"
        ],
        "read the private keys (sign)": ["SELECT seed FROM streams_prover.signing_keys LIMIT 1"],
        "end another role's session": ["SELECT pg_terminate_backend({bystander})"],
        "create a stream": [
            "INSERT INTO streams_registry (name, sequence_name) VALUES ('m', 'm') RETURNING 1"
        ],
    }[action]


#: Errors that mean "refused": no privilege (row security's WITH CHECK too), an argument the
#: function refuses, a commit the database's bound refuses.
_REFUSED = ("42501", "22023", "22P02")


def _try(setup: Setup, login: str, action: str) -> bool:
    a, b = setup.victim, setup.other
    with psycopg.connect(setup.url, autocommit=True) as admin:
        row = admin.execute(f"SELECT last_value FROM streams_seq_{b}").fetchone()
        assert row is not None
        with psycopg.connect(setup.users["bystander"], autocommit=True) as bystander:
            pid = bystander.info.backend_pid
            with psycopg.connect(setup.users[_LOGIN_KIND[login]]) as conn:
                try:
                    for statement in _statements(action, a, b, int(row[0])):
                        cursor = conn.execute(statement.replace("{bystander}", str(pid)))
                        rows = cursor.fetchall() if cursor.description else []
                        # Row security hides rows from an UPDATE or DELETE instead of failing.
                        if "RETURNING" in statement and not rows:
                            return False
                        if action == "end another role's session" and rows != [(True,)]:
                            return False
                    return True
                except psycopg.Error as exc:
                    assert exc.sqlstate in _REFUSED, (login, action, exc)
                    return False
                finally:
                    conn.rollback()


@pytest.mark.parametrize("action", [a.name for a in ACTIONS])
def test_the_privilege_matrix_holds(setup: Setup, action: str) -> None:
    """Each login tries the action with raw SQL: exactly those of `ACTIONS` may."""
    allowed = next(a.allowed for a in ACTIONS if a.name == action)
    found = {login: _try(setup, login, action) for login in LOGINS}
    assert found == {login: login in allowed for login in LOGINS}
