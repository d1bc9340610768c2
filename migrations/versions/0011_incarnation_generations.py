"""The database's incarnation, and reader-group generations.

``streams_incarnation`` holds one row, written once by this revision with a random ``id``: with
the system identifier, the database's OID, this table's OID and the timeline it makes up the
database's *incarnation* (`streams.store.identity`). A database dropped and recreated gets a
new ``id``; a dump restored into another database or cluster a new database OID (and system
identifier); ``pg_restore --clean`` into the same database recreates the table (a new table
OID); a failover or a point-in-time recovery a new timeline. Every process checks it on connect
and reconnect, and group rows (``streams_reader_groups.incarnation``) and Spark offsets carry it.

``streams_group_generations`` holds, per (stream, group), the generation of the group's current
consumer: opening a group takes the next one (and a fresh random ``token``: a generation number
starts again at 1 after the group is deleted, a token never repeats), and a commit under an
older one fails (`streams.errors.GroupFenced`), so a consumer that outlived its replacement
cannot move the group (`streams.store.reader_groups`, "the fencing argument of groups"). Its rows go
with their stream (``ON DELETE CASCADE``, as the group rows do).

Revision ID: 0011_incarnation_generations
Revises: 0010_idempotency_claims
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0011_incarnation_generations"
down_revision = "0010_idempotency_claims"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE streams_incarnation (
            singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
            id         uuid        NOT NULL DEFAULT gen_random_uuid(),
            created_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("INSERT INTO streams_incarnation DEFAULT VALUES")
    op.execute(
        """
        CREATE TABLE streams_group_generations (
            stream     integer     NOT NULL REFERENCES streams_registry (id) ON DELETE CASCADE,
            group_name text        NOT NULL,
            generation bigint      NOT NULL,
            owner      text        NOT NULL DEFAULT '',
            taken_at   timestamptz NOT NULL DEFAULT now(),
            token      uuid        NOT NULL DEFAULT gen_random_uuid(),
            PRIMARY KEY (stream, group_name)
        )
        """
    )
    op.execute("ALTER TABLE streams_reader_groups ADD COLUMN incarnation text")


def downgrade() -> None:
    op.execute("ALTER TABLE streams_reader_groups DROP COLUMN incarnation")
    op.execute("DROP TABLE streams_group_generations")
    op.execute("DROP TABLE streams_incarnation")
