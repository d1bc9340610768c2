"""Shared proofs: one elected prober per stream records what PostgreSQL proves complete.

Every reader used to prove its stream's complete position itself, reading ``pg_locks`` (which
the server copies whole, for every lock of every application) once per hint: with K readers that
is K probes per fact. Now one process per stream, elected with a session advisory lock, probes
and records the result here; other readers read the position and the rows behind it in one
statement (one snapshot: see `streams.store` "shared proofs"). A lost or stale row only makes
readers fall back to probing themselves; the table holds nothing that cannot be recomputed.

Revision ID: 0004_proofs
Revises: 0003_fact_tables
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0004_proofs"
down_revision = "0003_fact_tables"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # fillfactor 50: the row of a busy stream is updated hundreds of times a second; room on
    # the page keeps those updates HOT (no index churn) and pruned in place.
    op.execute(
        """
        CREATE TABLE streams_proofs (
            stream    integer PRIMARY KEY REFERENCES streams_registry (id) ON DELETE CASCADE,
            -- Every ID <= complete has completed (committed or rolled back): forward-only.
            complete  bigint NOT NULL CHECK (complete >= 0),
            -- When the prober last proved it (even unchanged): readers treat an old row as
            -- no proof at all and probe themselves.
            proven_at timestamptz NOT NULL
        ) WITH (fillfactor = 50)
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE streams_proofs")
