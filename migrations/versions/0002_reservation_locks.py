"""Readers prove completeness from PostgreSQL: writers take reservation locks.

From this revision on, every writing transaction takes a shared advisory *reservation lock*
before its ``nextval`` (see ``streams/core/constants.py`` and "the probe argument" in
``streams/store/probe.py``), and readers trust nothing else. A writer of an older library version
would not take it, and readers could then pass its pending IDs and skip its facts. This
revision changes no table: it exists so that older libraries, which insist on the exact schema
revision they were built for, refuse to write to a database whose readers rely on the locks.
It also records the rule in the catalog, where an operator looking at the tables finds it.

Revision ID: 0002_reservation_locks
Revises: 0001_initial
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0002_reservation_locks"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

_COMMENT = (
    "Facts of streams. Writers reserve stream IDs only inside a transaction that holds the "
    "stream''s shared advisory reservation lock, key (-<registry id>, (<sequence value> + 1) "
    "mod 2^32), taken before nextval; readers derive completeness from pg_locks. "
    "See streams/core/constants.py."
)


def upgrade() -> None:
    op.execute(f"COMMENT ON TABLE streams_facts IS '{_COMMENT}'")


def downgrade() -> None:
    op.execute("COMMENT ON TABLE streams_facts IS NULL")
