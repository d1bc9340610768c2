"""Replication keys: the secrets that sign the facts readers take from Redis.

The elected prober of a stream (`streams.proofs`) publishes each range of facts it proved, with
the facts' rows, on the stream's Redis data channel, signed with HMAC-SHA256 under a key of this
table; readers verify the signature and deliver the range without asking PostgreSQL. Only a
party that can read this table can sign, so Redis stays untrusted: a line it forges, alters or
replays under a retired key is rejected, and the reader reads PostgreSQL instead (see
`streams.core.signing`).

``id`` names the key in every line it signs. The prober signs with the newest key that is not
retired; readers accept every key that is not retired. ``streams keys rotate`` adds a key and
retires the others; readers and probers notice within `streams.core.signing.KEY_REFRESH`.
Grant SELECT on it only to the roles of processes that read or prove streams.

Revision ID: 0007_replication_keys
Revises: 0006_partitions
Create Date: 2026-11-24
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0007_replication_keys"
down_revision = "0006_partitions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE streams_keys (
            id         serial      PRIMARY KEY,
            -- 32 random bytes from the operating system's CSPRNG (never PostgreSQL's random()).
            secret     bytea       NOT NULL CHECK (length(secret) >= 32),
            created_at timestamptz NOT NULL DEFAULT now(),
            retired_at timestamptz
        )
        """
    )
    op.execute("REVOKE ALL ON streams_keys FROM PUBLIC")
    op.get_bind().execute(
        sa.text("INSERT INTO streams_keys (secret) VALUES (:secret)"),
        {"secret": secrets.token_bytes(32)},
    )


def downgrade() -> None:
    op.execute("DROP TABLE streams_keys")
