"""Streams declare the user tables that hold their facts.

A fact written with ``writer.fact(conn)`` may live only in the caller's own tables. Sequence
repair (a writer starting, ``streams doctor --repair``) must see those IDs too, or it would hand
an ID out again after the sequence was set back. Each stream lists its tables as a JSON array of
``{"table": "<schema>.<table>", "column": "<id column>"}`` (like the ``tables`` a Synapse
``MultiWriterIdGenerator`` is given); ``streams_facts`` is always included implicitly.

Revision ID: 0003_fact_tables
Revises: 0002_reservation_locks
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0003_fact_tables"
down_revision = "0002_reservation_locks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE streams_registry
        ADD COLUMN fact_tables jsonb NOT NULL DEFAULT '[]'
            CHECK (jsonb_typeof(fact_tables) = 'array')
        """
    )


def downgrade() -> None:
    op.execute("ALTER TABLE streams_registry DROP COLUMN fact_tables")
