"""A sequence repair reads the stream's own partition: its cost no longer grows with the
number of streams (issue 40).

``streams_repair_sequence`` read the highest fact ID through ``streams_facts``. A session's
first statement on the partitioned table loads the descriptor of every partition (about 8 ms at
1,000 streams, ten times that at 10,000), and every writer opening on a new session repairs.
The function now reads the stream's partition by name when its owner may (it holds
``SELECT (stream, stream_id)`` there), and through the parent otherwise. The upgrade gives
``streams_definer`` that privilege on every partition when a superuser migrates (as revision
0015 gave it the parent's); new streams get it when they are created
(`streams.store.privileges.STREAM_PRIVILEGES`), and ``streams roles create`` grants what is
missing.

Revision ID: 0017_repair_own_partition
Revises: 0016_repair_sequence_last
Create Date: 2026-12-04
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0017_repair_own_partition"
down_revision = "0016_repair_sequence_last"
branch_labels = None
depends_on = None

_SCHEMA_SQL = (
    "SELECT n.nspname FROM pg_catalog.pg_class c "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = 'streams_registry'::regclass"
)

PINNED = "SET search_path = pg_catalog, pg_temp"
DEFINER = "streams_definer"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _repair(s: str, schema: str) -> str:
    """The function, for the library's schema ``s`` (quoted) named ``schema``. Owner and
    grants stay as revision 0015 set them (``CREATE OR REPLACE`` keeps both)."""
    qualified = _literal(_ident(schema) + ".")
    return f"""
        CREATE OR REPLACE FUNCTION {s}.streams_repair_sequence(
            p_stream pg_catalog.int4, p_seen pg_catalog.int8 DEFAULT NULL)
        RETURNS pg_catalog.int8
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {PINNED} AS $$
        DECLARE
            seq pg_catalog.regclass;
            part pg_catalog.regclass;
            last pg_catalog.int8;
            stored pg_catalog.int8;
            used pg_catalog.int8;
            seqmax pg_catalog.int8;
        BEGIN
            SELECT pg_catalog.to_regclass({qualified} || pg_catalog.quote_ident(g.sequence_name)),
                   pg_catalog.to_regclass({qualified} || 'streams_facts_' || g.id)
            INTO seq, part
            FROM {s}.streams_registry g WHERE g.id = p_stream;
            IF seq IS NULL THEN
                RAISE EXCEPTION 'streams_repair_sequence: no stream %', p_stream
                    USING ERRCODE = '22023';
            END IF;
            -- Judged by the login (session_user): a writer of this stream, whoever may set the
            -- sequence itself, or an operator.
            IF NOT (COALESCE(pg_catalog.has_table_privilege(session_user, part, 'INSERT'), false)
                    OR pg_catalog.has_sequence_privilege(session_user, seq, 'UPDATE')
                    OR COALESCE(pg_catalog.pg_has_role(session_user,
                        pg_catalog.to_regrole('streams_operator'), 'USAGE'), false)) THEN
                RAISE EXCEPTION 'streams_repair_sequence: % may not repair stream %',
                    session_user, p_stream USING ERRCODE = '42501';
            END IF;
            IF p_seen IS NOT NULL AND p_seen < 0 THEN
                RAISE EXCEPTION 'streams_repair_sequence: seen must not be negative'
                    USING ERRCODE = '22023';
            END IF;
            -- Planned for this stream's value each time (EXECUTE): a plan cached for any stream
            -- (plpgsql's generic plan, after five calls in a session) would open and lock every
            -- partition of streams_facts, more than the lock table holds at 10^4 streams.
            -- In the stream's own partition when the owner may read it there (revision 0017):
            -- through the parent, a session's first statement loads the descriptor of every
            -- partition (tens of ms at 10^4 streams, paid by each new writer session).
            IF part IS NOT NULL
               AND pg_catalog.has_column_privilege(part, 'stream_id', 'SELECT') THEN
                EXECUTE 'SELECT pg_catalog.max(f.stream_id) FROM ' || part::pg_catalog.text
                        || ' f WHERE f.stream = ' || p_stream::pg_catalog.text
                INTO stored;
            ELSE
                EXECUTE 'SELECT pg_catalog.max(f.stream_id) FROM {s}.streams_facts f '
                        || 'WHERE f.stream = ' || p_stream::pg_catalog.text
                INTO stored;
            END IF;
            used := GREATEST(
                stored,
                (SELECT pg_catalog.max(w.position) FROM {s}.streams_writers w
                 WHERE w.stream = p_stream),
                (SELECT pg_catalog.max(r.position) FROM {s}.streams_reader_groups r
                 WHERE r.stream = p_stream),
                (SELECT NULLIF(g.pruned_through, 0) FROM {s}.streams_registry g
                 WHERE g.id = p_stream),
                p_seen);
            -- Read after every ID counted in used was handed out: below used only if the
            -- sequence went back, never because writers took IDs meanwhile.
            SELECT pg_catalog.pg_sequence_last_value(seq), p.seqmax INTO last, seqmax
            FROM pg_catalog.pg_sequence p WHERE p.seqrelid = seq;
            -- IDs start at 1; a fresh sequence (never called) has handed out nothing.
            IF used IS NULL OR used < 1 OR (last IS NOT NULL AND last >= used) THEN
                RETURN NULL;
            END IF;
            IF used > seqmax THEN
                RAISE EXCEPTION 'streams_repair_sequence: % is beyond the sequence''s end', used
                    USING ERRCODE = '22003';
            END IF;
            -- Never below what it has handed out by now (writers may be appending).
            used := GREATEST(used, pg_catalog.pg_sequence_last_value(seq));
            PERFORM pg_catalog.setval(seq, used);
            RETURN used;
        END
        $$
        """


def _grant_partitions(s: str) -> str:
    """``SELECT (stream, stream_id)`` on every partition to the definer, when it exists and a
    superuser migrates (the condition under which revision 0015 gave it the functions)."""
    return f"""
    DO $$
    DECLARE p record;
    BEGIN
        IF pg_catalog.to_regrole({_literal(DEFINER)}) IS NULL
           OR NOT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
        THEN
            RETURN;
        END IF;
        FOR p IN
            SELECT i.inhrelid::pg_catalog.regclass AS part FROM pg_catalog.pg_inherits i
            WHERE i.inhparent = {_literal(s + ".streams_facts")}::pg_catalog.regclass
        LOOP
            EXECUTE 'GRANT SELECT (stream, stream_id) ON ' || p.part::pg_catalog.text
                    || ' TO {DEFINER}';
        END LOOP;
    END $$
    """


def _revision_0016() -> ModuleType:
    path = Path(__file__).with_name("0016_repair_sequence_last.py")
    spec = importlib.util.spec_from_file_location("streams_revision_0016", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    op.execute(_grant_partitions(_ident(schema)))
    op.execute(_repair(_ident(schema), schema))


def downgrade() -> None:
    """Revision 0016's body of the function (the grants on partitions stay: harmless)."""
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    op.execute(_revision_0016()._repair(_ident(schema), schema))
