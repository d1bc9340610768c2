"""Retention: each stream records how far its facts have been pruned.

``pruned_through`` is the stream's compaction frontier (Materialize's "since"): every fact with
an ID ``<=`` it may have been removed by retention (`streams.store.retention.prune_step`), and none
above it has been. It only moves forward, in the same transaction as the rows it removes, so a
reader that sees it ``<=`` its position after reading a page knows the page lost nothing.

Revision ID: 0005_retention
Revises: 0004_proofs
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0005_retention"
down_revision = "0004_proofs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: PostgreSQL 11+ adds the column without rewriting the table.
    op.execute(
        "ALTER TABLE streams_registry "
        "ADD COLUMN pruned_through bigint NOT NULL DEFAULT 0 CHECK (pruned_through >= 0)"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE streams_registry DROP COLUMN pruned_through")
