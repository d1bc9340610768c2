"""Idempotency claims list their keys: key rows lose their ``written_at`` index.

Until now `streams prune` found expired key rows through the index ``(stream, written_at)`` of
``streams_idempotency_keys``: one more index entry written for every key claimed, about a fifth
of what claiming a key costs the server (``streams bench write``, docs/performance.md). Now
each row of ``streams_idempotency_claims`` lists the keys its claim wrote (``keys``, in no
particular order), and `prune_keys` walks the expired claims through their primary key
``(stream, written_at, claim)`` and deletes their keys' rows by the primary key of
``streams_idempotency_keys`` ("the claim argument" in `streams.store.idempotency`): the index
goes.

Their arrays (``keys``, ``ids``) are stored uncompressed (``STORAGE EXTERNAL``): compressing
those of a batch cost more server time than the index did.

Existing claims get the keys whose rows refer to them (a key row shares ``written_at`` and
``claim`` with the claim that wrote it); a claim that no key row refers to any
more (what the next prune would delete: none can gain a key row) is deleted.

Revision ID: 0014_idempotency_claim_keys
Revises: 0013_timeline_switchpoint
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0014_idempotency_claim_keys"
down_revision = "0013_timeline_switchpoint"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: added without rewriting the table; dropped once every row has keys.
    op.execute(
        "ALTER TABLE streams_idempotency_claims "
        "ADD COLUMN keys text[] COLLATE \"C\" NOT NULL DEFAULT '{}'"
    )
    op.execute(
        """
        UPDATE streams_idempotency_claims c SET keys = k.keys
        FROM (
            SELECT stream, written_at, claim, array_agg(key ORDER BY ord) AS keys
            FROM streams_idempotency_keys GROUP BY stream, written_at, claim
        ) k
        WHERE c.stream = k.stream AND c.written_at = k.written_at AND c.claim = k.claim
        """
    )
    op.execute("DELETE FROM streams_idempotency_claims WHERE keys = '{}'")
    # A batch's arrays are stored out of line uncompressed: pglz compression of 1,000 keys and
    # IDs cost ~3.4 ms of server CPU a batch (~1 ms without; lz4 ~1.4 ms) to save ~15% of
    # their bytes.
    op.execute(
        "ALTER TABLE streams_idempotency_claims ALTER COLUMN keys DROP DEFAULT, "
        "ALTER COLUMN keys SET STORAGE EXTERNAL, ALTER COLUMN ids SET STORAGE EXTERNAL"
    )
    op.execute("DROP INDEX streams_idempotency_keys_written")


def downgrade() -> None:
    op.execute(
        "CREATE INDEX streams_idempotency_keys_written ON streams_idempotency_keys "
        "(stream, written_at)"
    )
    op.execute(
        "ALTER TABLE streams_idempotency_claims DROP COLUMN keys, "
        "ALTER COLUMN ids SET STORAGE EXTENDED"
    )
