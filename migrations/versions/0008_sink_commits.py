"""Sink commits: what the Spark sink (`streams_spark.sink`) needs to write each row exactly once.

A *sink query* is one Spark write into one stream: a streaming query (its id, which Spark keeps in
the checkpoint, so it survives restarts) or one batch write job (a random id). Its row in
``streams_sink_queries`` holds ``committed_batch``, the last micro-batch whose write Spark
committed on the driver (-1 before the first). A *task commit* in ``streams_sink_commits`` is
written in the same transaction as the facts of one Spark task (query, batch, partition): a
retried task or a replayed batch finds it, or finds its batch at or below ``committed_batch``,
and writes nothing. The argument, and how old rows go, is in `streams.store.sinks`.

Both tables hang off the stream's registry row (dropping a stream drops them).

Revision ID: 0008_sink_commits
Revises: 0007_replication_keys
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

revision = "0008_sink_commits"
down_revision = "0007_replication_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE streams_sink_queries (
            stream          integer     NOT NULL REFERENCES streams_registry (id)
                                        ON DELETE CASCADE,
            query_id        text        NOT NULL CHECK (length(query_id) BETWEEN 1 AND 200),
            committed_batch bigint      NOT NULL DEFAULT -1,
            created_at      timestamptz NOT NULL DEFAULT now(),
            -- when the driver last committed a batch (or the row was created): retention
            committed_at    timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (stream, query_id)
        )
        """
    )
    op.execute(
        """
        CREATE TABLE streams_sink_commits (
            stream       integer     NOT NULL,
            query_id     text        NOT NULL,
            batch_id     bigint      NOT NULL,
            partition_id integer     NOT NULL,
            committed_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (stream, query_id, batch_id, partition_id),
            FOREIGN KEY (stream, query_id) REFERENCES streams_sink_queries (stream, query_id)
                ON DELETE CASCADE
        )
        """
    )
    # Retention deletes the queries whose last commit is oldest.
    op.execute(
        "CREATE INDEX streams_sink_queries_committed_at ON streams_sink_queries (committed_at)"
    )


def downgrade() -> None:
    op.execute("DROP TABLE streams_sink_commits")
    op.execute("DROP TABLE streams_sink_queries")
