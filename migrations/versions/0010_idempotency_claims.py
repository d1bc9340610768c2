"""Idempotency claims: a keyed append writes each key's row once, and its IDs in one row.

Revision 0009 recorded a keyed fact's ID in its key's row with an ``UPDATE`` after the claim
(the ID is reserved only once the key is claimed: "the claim argument" in
`streams.store.idempotency`). One statement cannot write a row twice, so that took two
statements (a pipeline for one fact) and a second write of every key row of a batch. Now the
claim writes the key's row once, with what is known before the ID (its timestamp ``ts`` and
``ord``, the key's position in its append, from 1), and the same statement, after it, writes
one row per claiming append in the new ``streams_idempotency_claims``: ``(stream, written_at,
claim)``, the IDs it reserved (``ids``, ascending) and the positions of the keys it claimed
(``ords``, ascending; NULL when it claimed every key, positions 1..n). A key's fact is
``ids[i]`` where ``ords[i]`` is its ``ord`` (``ids[ord]`` when ``ords`` is NULL). A key row and
its claim row share ``written_at`` and ``claim``, and commit together or not at all.

Key rows are no longer updated after their claim: fill factor back to 100, and ``key`` compares
bytewise (``COLLATE "C"``: keys are only ever compared for equality; a collation only made the
primary key slower). Rows written under 0009 are converted: the keys of one claim take its
earliest ``written_at`` and their positions in ID order, and get one claim row.

Revision ID: 0010_idempotency_claims
Revises: 0009_idempotency_keys
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0010_idempotency_claims"
down_revision = "0009_idempotency_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE streams_idempotency_claims (
            stream     integer     NOT NULL,
            written_at timestamptz NOT NULL,
            claim      bigint      NOT NULL,
            ords       integer[],
            ids        bigint[]    NOT NULL,
            PRIMARY KEY (stream, written_at, claim)
        )
        """
    )
    op.execute("ALTER TABLE streams_idempotency_keys ADD COLUMN ord integer")
    op.execute(
        """
        UPDATE streams_idempotency_keys k SET written_at = m.at, ord = m.ord
        FROM (
            SELECT stream, key, min(written_at) OVER w AS at,
                   row_number() OVER (w ORDER BY stream_id) AS ord
            FROM streams_idempotency_keys
            WINDOW w AS (PARTITION BY stream, claim)
        ) m
        WHERE k.stream = m.stream AND k.key = m.key
        """
    )
    op.execute(
        """
        INSERT INTO streams_idempotency_claims (stream, written_at, claim, ids)
        SELECT stream, written_at, claim, array_agg(stream_id ORDER BY ord)
        FROM streams_idempotency_keys GROUP BY stream, written_at, claim
        """
    )
    op.execute(
        """
        ALTER TABLE streams_idempotency_keys
            SET (fillfactor = 100),
            DROP COLUMN stream_id,
            ALTER COLUMN ord SET NOT NULL,
            ALTER COLUMN ts SET NOT NULL,
            ALTER COLUMN key TYPE text COLLATE "C"
        """
    )


def downgrade() -> None:
    op.execute(
        """
        ALTER TABLE streams_idempotency_keys
            SET (fillfactor = 75),
            ADD COLUMN stream_id bigint,
            ALTER COLUMN ts DROP NOT NULL,
            ALTER COLUMN key TYPE text COLLATE pg_catalog."default"
        """
    )
    op.execute(
        """
        UPDATE streams_idempotency_keys k
        SET stream_id = c.ids[COALESCE(array_position(c.ords, k.ord), k.ord)]
        FROM streams_idempotency_claims c
        WHERE c.stream = k.stream AND c.written_at = k.written_at AND c.claim = k.claim
        """
    )
    op.execute("ALTER TABLE streams_idempotency_keys DROP COLUMN ord")
    op.execute("DROP TABLE streams_idempotency_claims")
