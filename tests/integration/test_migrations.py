"""Schema migrations run the way an operator runs them: ``alembic upgrade head`` in a checkout,
and `streams.migrate.upgrade` (what ``streams migrate`` and the wheel use)."""

from __future__ import annotations

import itertools
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner
from helpers import REPO_ROOT, partition_bound, partition_parents
from servers import create_database, drop_database

import streams
from streams.command import main
from streams.core.constants import facts_partition
from streams.migrate import current_revision, upgrade

TABLES = (
    "streams_facts",
    "streams_group_generations",
    "streams_group_grants",
    "streams_idempotency_claims",
    "streams_idempotency_keys",
    "streams_incarnation",
    "streams_keys",
    "streams_proofs",
    "streams_reader_groups",
    "streams_registry",
    "streams_sink_commits",
    "streams_sink_queries",
    "streams_writers",
)
VERSION_TABLE = "streams_alembic_version"
HEAD = "0020_domain_checks"


# ---------------------------------------------------------------------------------------------
# Alembic in a checkout vs `streams.migrate`


@pytest.fixture
def empty_database(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url, prefix="streams_alembic")
    yield url
    drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))


def _alembic(url: str, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    env["STREAMS_DATABASE_URL"] = url
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"alembic {' '.join(args)}: {proc.stdout}\n{proc.stderr}"


def _tables(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = current_schema() AND table_name LIKE 'streams%'"
        ).fetchall()
    return {row[0] for row in rows}


def _sequences(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT sequence_name FROM information_schema.sequences "
            "WHERE sequence_schema = current_schema()"
        ).fetchall()
    return {row[0] for row in rows}


def test_alembic_upgrade_downgrade_and_streams_migrate(empty_database: str) -> None:
    url = empty_database
    assert _tables(url) == set()

    _alembic(url, "upgrade", "head")
    assert _tables(url) == {*TABLES, VERSION_TABLE}
    assert current_revision(url) == HEAD
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(HEAD,)]

    # A stream's sequence is part of the schema too: downgrade must remove it.
    with streams.connect(url) as client:
        info = client.create_stream("alembic-check")
        with client.writer("alembic-check", instance="alembic-test") as writer:
            assert writer.append({"n": 1}).first_id == 1
    assert info.sequence_name in _sequences(url)

    _alembic(url, "downgrade", "base")
    assert set(TABLES).isdisjoint(_tables(url))
    assert current_revision(url) is None
    assert _sequences(url) == set()

    upgrade(url)
    assert set(TABLES) <= _tables(url)
    assert current_revision(url) == HEAD
    upgrade(url)  # idempotent
    assert current_revision(url) == HEAD
    with streams.connect(url) as client:
        assert client.streams() == []


def test_idempotency_keys_survive_downgrade_to_0009_and_upgrade_again(empty_database: str) -> None:
    """Revision 0010 moves keyed facts' IDs from the key rows (0009) into claim rows, and its
    downgrade moves them back: keys written before either step still return their originals."""
    url = empty_database
    _alembic(url, "upgrade", "head")
    with streams.connect(url) as client:
        client.create_stream("keyed")
        with client.writer("keyed") as writer:
            batch = writer.append_batch([{"n": 1}, {"n": 2}, {"n": 3}], keys=["a", "b", "c"])
            mixed = writer.append_batch([{"n": 4}, {"n": 2}], keys=["d", "b"])
            single = writer.append({"n": 5}, key="e")
    assert mixed.duplicates == (1,)
    written = {"a": batch.ids[0], "b": batch.ids[1], "c": batch.ids[2], "d": mixed.ids[0]}
    written["e"] = single.first_id

    _alembic(url, "downgrade", "0009_idempotency_keys")
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT key, stream_id FROM streams_idempotency_keys").fetchall()
    assert dict(rows) == written

    _alembic(url, "upgrade", "head")
    with psycopg.connect(url, autocommit=True) as conn:
        claims = conn.execute("SELECT count(*) FROM streams_idempotency_claims").fetchone()
    assert claims == (3,)  # one per claim: the two batches and the single
    with streams.connect(url) as client, client.writer("keyed") as writer:
        again = writer.append_batch([{"n": 0}] * 5, keys=["e", "d", "c", "b", "a"])
        assert again.duplicate and list(again.ids) == [written[k] for k in "edcba"]
        assert writer.append({"n": 6}, key="f").first_id > max(written.values())


def test_claims_list_their_keys_after_upgrade_to_0014_and_prune_removes_them(
    empty_database: str,
) -> None:
    """Revision 0014 gives each existing claim row the keys whose rows refer to it (in position
    order), and deletes claim rows no key row refers to; its downgrade drops the lists. Keys
    written before it still return their originals, and prune then removes them through their
    claims."""
    url = empty_database
    _alembic(url, "upgrade", "head")
    with streams.connect(url) as client:
        client.create_stream("keyed")
        with client.writer("keyed") as writer:
            batch = writer.append_batch([{"n": 1}, {"n": 2}, {"n": 3}], keys=["c", "a", "b"])
            single = writer.append({"n": 4}, key="d")
    _alembic(url, "downgrade", "0013_timeline_switchpoint")
    with psycopg.connect(url, autocommit=True) as conn:
        # A claim whose keys are gone (what a prune would delete).
        conn.execute(
            "INSERT INTO streams_idempotency_claims (stream, written_at, claim, ids) "
            "SELECT id, clock_timestamp(), 7, '{99}' FROM streams_registry"
        )
    _alembic(url, "upgrade", "head")
    with psycopg.connect(url, autocommit=True) as conn:
        lists = conn.execute(
            "SELECT keys FROM streams_idempotency_claims ORDER BY written_at"
        ).fetchall()
        index = conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE indexname = 'streams_idempotency_keys_written'"
        ).fetchone()
    assert [row[0] for row in lists] == [["c", "a", "b"], ["d"]]
    assert index == (0,)
    with streams.connect(url) as client:
        with client.writer("keyed") as writer:
            again = writer.append_batch([{"n": 0}] * 4, keys=["d", "a", "b", "c"])
        originals = [single.first_id, *batch.ids[1:], batch.ids[0]]
        assert again.duplicate and list(again.ids) == originals
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE streams_registry SET key_window_ms = 1")
        assert client.prune("keyed").keys_deleted == 4
    with psycopg.connect(url, autocommit=True) as conn:
        left = conn.execute(
            "SELECT (SELECT count(*) FROM streams_idempotency_keys), "
            "(SELECT count(*) FROM streams_idempotency_claims)"
        ).fetchone()
    assert left == (0, 0)


#: A stream made by revision 0014's library and its role model's grants (`streams roles
#: create` of then), where 0015 takes some away.
OLD_MODEL = (
    *(
        f"DO $$ BEGIN CREATE ROLE {r} NOLOGIN; EXCEPTION WHEN OTHERS THEN NULL; END $$"
        for r in ("streams_admin", "streams_writer", "streams_group_reader")
    ),
    "INSERT INTO streams_registry (id, name, sequence_name) OVERRIDING SYSTEM VALUE "
    "VALUES (1, 'before', 'streams_seq_1')",
    "CREATE SEQUENCE streams_seq_1 AS bigint MINVALUE 1 START WITH 1 NO CYCLE",
    "CREATE TABLE streams_facts_1 (LIKE streams_facts INCLUDING DEFAULTS INCLUDING CONSTRAINTS)",
    "ALTER TABLE streams_facts ATTACH PARTITION streams_facts_1 FOR VALUES IN (1)",
    "GRANT USAGE ON SCHEMA public TO streams_writer, streams_group_reader",
    *(
        f"ALTER TABLE {t} OWNER TO streams_admin"
        for t in (*TABLES, "streams_facts_1", "streams_alembic_version")
        if t != "streams_group_grants"
    ),
    "ALTER SEQUENCE streams_seq_1 OWNER TO streams_admin",
    "GRANT SELECT ON streams_alembic_version, streams_registry, streams_incarnation, "
    "streams_reader_groups TO streams_writer",
    "GRANT SELECT (stream, stream_id, row_no, instance, ts), INSERT ON streams_facts "
    "TO streams_writer",
    "GRANT SELECT, INSERT, UPDATE ON streams_writers, streams_idempotency_keys, "
    "streams_idempotency_claims TO streams_writer",
    "GRANT SELECT, USAGE, UPDATE ON SEQUENCE streams_seq_1 TO streams_writer",
    "GRANT SELECT ON streams_alembic_version, streams_registry, streams_incarnation, "
    "streams_facts, streams_proofs, streams_keys, streams_writers, streams_reader_groups, "
    "streams_group_generations TO streams_group_reader",
    "GRANT INSERT, UPDATE ON streams_reader_groups, streams_group_generations "
    "TO streams_group_reader",
    "GRANT SELECT ON SEQUENCE streams_seq_1 TO streams_group_reader",
)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _url_as(url: str, user: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port or 5432}"))


def test_a_role_model_database_keeps_working_across_revision_0015(
    postgres_admin_url: str, empty_database: str
) -> None:
    """A database set up with the role model before revision 0015 (writers inserting through
    ``streams_facts``, with ``UPDATE`` on sequences; group readers writing the groups' tables):
    right after `streams migrate` its writers append to their streams' partitions and its
    group readers commit through the new functions; `streams roles check` then flags what
    they no longer need until `streams roles create` runs again, which takes it back."""
    url = empty_database
    upgrade(url, "0014_idempotency_claim_keys")
    tag = secrets.token_hex(3)
    writer, reader = f"streams_m{tag}_w", f"streams_m{tag}_g"
    with psycopg.connect(url, autocommit=True) as conn:
        # A stream, as revision 0014's library made it, and the role model as it granted it.
        for statement in OLD_MODEL:
            conn.execute(statement)
        conn.execute(f"CREATE ROLE {writer} LOGIN IN ROLE streams_writer")
        conn.execute(f"CREATE ROLE {reader} LOGIN IN ROLE streams_group_reader")
    try:
        upgrade(url)
        with streams.connect(_url_as(url, writer)) as client, client.writer("before") as w:
            assert w.append({"n": 1}).first_id == 1
        with streams.connect(_url_as(url, reader)) as client:
            group = client.reader("before", group="billing")
            assert group.poll(timeout=10.0) is not None
            assert group.commit() == {"before": 1}
            group.close()
        code, out = _cli("roles", "check", "--database-url", url)
        assert code == 1 and "streams_writer may INSERT" in out and "sequence" in out, out
        code, out = _cli("roles", "create", "--database-url", url)
        assert code == 0, out
        code, out = _cli("roles", "check", "--database-url", url)
        assert code == 0, out
        with streams.connect(_url_as(url, writer)) as client, client.writer("before") as w:
            assert w.append({"n": 2}).first_id == 2
    finally:
        drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))
        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            for role in (writer, reader):
                conn.execute(f"DROP ROLE IF EXISTS {role}")


def test_a_database_from_before_buckets_keeps_its_streams_at_the_root_beside_new_ones(
    empty_database: str,
) -> None:
    """Streams attached to the root (revision 0017: the downgrade puts every partition back)
    stay there after the upgrade; new streams of the same ID range go to a bucket that starts
    after them; both kinds write, read and drop."""
    url = empty_database
    _alembic(url, "upgrade", "head")
    with streams.connect(url) as client:
        client.create_streams(["old1", "old2"])
        with client.writer("old1") as writer:
            writer.append({"old": 1})
    _alembic(url, "downgrade", "0017_repair_own_partition")  # puts them under the root
    flat = partition_parents(url)
    assert set(flat.values()) == {"streams_facts"}, flat
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('streams_facts_b0')").fetchone() == (None,)
    upgrade(url)
    with streams.connect(url) as client:
        new = client.create_stream("new")
        assert partition_parents(url) == {**flat, facts_partition(new.id): "streams_facts_b0"}
        assert partition_bound(url, "streams_facts_b0").startswith(f"FOR VALUES IN ({new.id},")
        for name in ("old1", "old2", "new"):
            with client.writer(name) as writer:
                writer.append({"name": name})
        with client.reader("old1") as reader:
            assert [f.payload for f in reader.facts()] == [{"old": 1}, {"name": "old1"}]
        assert client.drop_streams(["old2", "new"]) == ["old2", "new"]
        assert set(partition_parents(url)) == {facts_partition(client.stream("old1").id)}


def test_streams_upgraded_to_per_stream_fences_keep_the_databases_fence(
    empty_database: str,
) -> None:
    """Revision 0019 gives each stream the timeline the database was fenced on: streams that
    existed before hand out their next IDs where they were (no skip without a failover), and
    so do streams created after; the downgrade and a second upgrade change nothing either."""
    url = empty_database
    _alembic(url, "upgrade", "head")
    with streams.connect(url) as client:
        client.create_stream("before")
        with client.writer("before") as writer:
            assert writer.append({"n": 1}).ids == (1,)
    _alembic(url, "downgrade", "0018_bucketed_partitions")
    _alembic(url, "upgrade", "head")
    with psycopg.connect(url, autocommit=True) as conn:
        fenced = conn.execute(
            "SELECT r.fenced_timeline, i.fenced_timeline FROM streams_registry r, "
            "streams_incarnation i"
        ).fetchall()
    assert len(fenced) == 1 and fenced[0][0] == fenced[0][1] is not None
    with streams.connect(url) as client:
        client.create_stream("after")
        for name, first in (("before", 2), ("after", 1)):
            with client.writer(name) as writer:
                assert writer.append({"n": 2}).ids == (first,)


def test_the_checks_move_to_domains_without_rewriting_the_facts(empty_database: str) -> None:
    """Revision 0020: a fact's ID and timestamp are checked by domains (one catalog row each)
    instead of a CHECK copied to every partition; the upgrade keeps every partition's heap
    (no rewrite), the database refuses a bad ID or timestamp as before, on streams from before
    and after, and the downgrade puts the table's CHECKs back."""
    url = empty_database
    _alembic(url, "upgrade", "head")
    with streams.connect(url) as client:
        client.create_streams(["old"])
        with client.writer("old") as writer:
            writer.append_batch([{"n": n} for n in range(20)])
    _alembic(url, "downgrade", "0019_stream_fences")

    def heaps() -> list[tuple[str, int]]:
        with psycopg.connect(url) as conn:
            return conn.execute(
                "SELECT relname, relfilenode FROM pg_class "
                "WHERE relname LIKE 'streams_facts%' AND relkind = 'r' ORDER BY 1"
            ).fetchall()

    def per_stream_checks() -> int:
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid "
                "WHERE c.relname LIKE 'streams_facts%' AND k.contype = 'c'"
            ).fetchone()
        return int(row[0]) if row else 0

    before = heaps()
    assert per_stream_checks() >= 4  # the root's two, the old stream's two (and its bucket's)
    _alembic(url, "upgrade", "head")
    assert heaps() == before, "the upgrade rewrote a partition"
    assert per_stream_checks() == 0
    with streams.connect(url) as client:
        new = client.create_stream("new")
        with client.writer("new") as writer:
            writer.append({"n": 1})
        with client.reader("old") as reader:
            assert [f.payload["n"] for f in reader.facts()] == list(range(20))
        old = client.stream("old")
    assert per_stream_checks() == 0
    with psycopg.connect(url) as conn:
        for stream, (stream_id, ts) in itertools.product((old.id, new.id), ((0, 1), (9, -1))):
            with pytest.raises(psycopg.errors.CheckViolation), conn.transaction():
                conn.execute(
                    "INSERT INTO streams_facts (stream, stream_id, row_no, instance, ts, payload)"
                    " VALUES (%s, %s, 0, 'forged', %s, '{}')",
                    (stream, stream_id, ts),
                )
    _alembic(url, "downgrade", "0019_stream_fences")
    assert per_stream_checks() >= 4
    _alembic(url, "upgrade", "head")
