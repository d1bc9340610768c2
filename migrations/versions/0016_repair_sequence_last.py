"""A sequence repair reads the sequence last: it never sets back a sequence writers are using.

``streams_repair_sequence`` (revision 0015) read the sequence's last value first, then, in
later statements, the highest ID the stream's facts, writers, groups and retention hold. In
between, writers appending concurrently took IDs past the value read and committed facts with
them; the repair then saw an ID "above" the sequence and set it back to that ID while writers
went on past it: the next reservation got an ID already handed out, which the writer's own
check refused (`SequenceRewound`: nothing was written). It happened when a writer opened
(which repairs) while others appended (seen once in CI, ``test_concurrent_writers_and_a_
following_reader``).

Now the highest ID used is read first and the sequence after it. Every ID counted there was
handed out before the sequence is read, so the sequence is below it only if it really went
back (a restore, a ``setval`` by hand); and the repair sets it to the larger of that ID and its
value at that moment, never lower than what it has handed out.

Revision ID: 0016_repair_sequence_last
Revises: 0015_enforced_privileges
Create Date: 2026-12-04
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0016_repair_sequence_last"
down_revision = "0015_enforced_privileges"
branch_labels = None
depends_on = None

_SCHEMA_SQL = (
    "SELECT n.nspname FROM pg_catalog.pg_class c "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = 'streams_registry'::regclass"
)
PINNED = "SET search_path = pg_catalog, pg_temp"


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
            EXECUTE 'SELECT pg_catalog.max(f.stream_id) FROM {s}.streams_facts f WHERE f.stream = '
                    || p_stream::pg_catalog.text
            INTO stored;
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


def _revision_0015() -> ModuleType:
    path = Path(__file__).with_name("0015_enforced_privileges.py")
    spec = importlib.util.spec_from_file_location("streams_revision_0015", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    op.execute(_repair(_ident(schema), schema))


def downgrade() -> None:
    """Revision 0015's body of the function, as it was."""
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    old = _revision_0015()
    bodies = old._functions(_ident(schema), schema)
    (body,) = (b for b in bodies if ".streams_repair_sequence(" in b)
    op.execute(body)
