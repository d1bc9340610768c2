"""Streams' partitions hang under buckets: creating a stream costs the same at 10^4 streams as at
ten (issue 40).

Attaching a partition rebuilds its parent's partition descriptor, in proportion to the
parent's partitions (about 22 ms at 10^4 of them). From this revision on, the library attaches
a new stream's partition to a bucket, a partition of ``streams_facts`` for 256 consecutive
stream IDs that is itself partitioned by stream (`streams.store.registry`, "Layout").

The upgrade moves nothing: the partitions of streams created before stay attached to
``streams_facts`` (moving them would read each of them again under a lock), and the library
handles both. The revision exists so that a library of revision 0017, which attaches to the
root and would collide with a bucket's IDs, refuses this database. The downgrade puts every
partition back under the root and drops the buckets (each partition is read once to validate
it, under the migration's locks).

Revision ID: 0018_bucketed_partitions
Revises: 0017_repair_own_partition
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0018_bucketed_partitions"
down_revision = "0017_repair_own_partition"
branch_labels = None
depends_on = None

_SCHEMA_SQL = (
    "SELECT n.nspname FROM pg_catalog.pg_class c "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = 'streams_registry'::regclass"
)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _flatten(root: str) -> str:
    """Every stream partition under a bucket moved to the root ``root`` (qualified, quoted),
    and the buckets dropped."""
    return f"""
    DO $$
    DECLARE
        b record;
        p record;
        moved pg_catalog.text[];
        ids pg_catalog.int8[];
    BEGIN
        FOR b IN
            SELECT i.inhrelid::pg_catalog.regclass AS bucket FROM pg_catalog.pg_inherits i
            JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
            WHERE i.inhparent = {_literal(root)}::pg_catalog.regclass AND c.relkind = 'p'
        LOOP
            moved := '{{}}';
            ids := '{{}}';
            FOR p IN
                SELECT i.inhrelid::pg_catalog.regclass AS part,
                       pg_catalog.substring(c.relname, '^streams_facts_([0-9]+)$') AS id
                FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
                WHERE i.inhparent = b.bucket
            LOOP
                IF p.id IS NULL THEN
                    RAISE EXCEPTION 'downgrade: % under % is no stream''s partition',
                        p.part, b.bucket;
                END IF;
                EXECUTE 'ALTER TABLE ' || b.bucket::pg_catalog.text || ' DETACH PARTITION '
                        || p.part::pg_catalog.text;
                moved := moved || p.part::pg_catalog.text;
                ids := ids || p.id::pg_catalog.int8;
            END LOOP;
            EXECUTE 'ALTER TABLE ' || {_literal(root)} || ' DETACH PARTITION '
                    || b.bucket::pg_catalog.text;
            EXECUTE 'DROP TABLE ' || b.bucket::pg_catalog.text;
            FOR i IN 1 .. COALESCE(pg_catalog.array_length(moved, 1), 0) LOOP
                EXECUTE 'ALTER TABLE ' || {_literal(root)} || ' ATTACH PARTITION ' || moved[i]
                        || ' FOR VALUES IN (' || ids[i]::pg_catalog.text || ')';
            END LOOP;
        END LOOP;
    END $$
    """


def upgrade() -> None:
    """Nothing to move (see above)."""


def downgrade() -> None:
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    op.execute(_flatten(_ident(schema) + ".streams_facts"))
