"""Idempotency keys: an append's key names it for a window, so a retried append writes once.

``streams_idempotency_keys`` has one row per (stream, key) written within the stream's key
window: the fact the key's append wrote (``stream_id``, ``ts``: its `Ack` can be rebuilt from
them) and when (``written_at``). The primary key is what makes a key unique per stream; the
claim protocol that uses it (a key is claimed *before* any ID is reserved) is argued in
`streams.store.idempotency`. ``claim`` is the random token of the transaction that wrote the row:
the statement after the claim tells its own claim from another's by it. ``stream_id`` and ``ts``
are NULL only inside the claiming transaction, between its claim and its reservation; a row
never commits that way (the reservation statement fails the transaction otherwise).

``streams_registry.key_window_ms`` is each stream's window (default 24 hours): a key older than
it is written anew, and `streams prune` removes such rows (index ``(stream, written_at)``).

The table has no foreign key to ``streams_registry``: a foreign key check would lock the stream's
registry row in every keyed append; `streams.store.registry.drop_stream` deletes a stream's keys.
Its fill factor leaves room on each page for the update that records the fact in the same
transaction as the claim, so that update is a heap-only tuple (no new index entries).

Revision ID: 0009_idempotency_keys
Revises: 0007_replication_keys
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

revision = "0009_idempotency_keys"
down_revision = "0008_sink_commits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: PostgreSQL 11+ adds the column without rewriting the table.
    op.execute(
        "ALTER TABLE streams_registry ADD COLUMN key_window_ms bigint NOT NULL "
        "DEFAULT 86400000 CHECK (key_window_ms > 0)"
    )
    op.execute(
        """
        CREATE TABLE streams_idempotency_keys (
            stream     integer     NOT NULL,
            key        text        NOT NULL,
            claim      bigint      NOT NULL,
            written_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            stream_id  bigint,
            ts         bigint,
            PRIMARY KEY (stream, key)
        ) WITH (fillfactor = 75)
        """
    )
    op.execute(
        "CREATE INDEX streams_idempotency_keys_written ON streams_idempotency_keys "
        "(stream, written_at)"
    )


def downgrade() -> None:
    op.execute("DROP TABLE streams_idempotency_keys")
    op.execute("ALTER TABLE streams_registry DROP COLUMN key_window_ms")
