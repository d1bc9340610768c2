"""Facts partitioned by stream: one partition (``streams_facts_<stream id>``) per stream.

Why: both indexes of ``streams_facts`` lead with the stream, so in one shared table every
stream but the last-created one appends in the *middle* of each index, where page splits leave
half-full pages, and pages emptied by retention are not reused by the appends that follow
(`streams bench history`: 78 -> 113 -> 128 -> 144 MiB of index over three prune-refill cycles at
2M facts, against 78 -> 98 -> 98 -> 98 when the stream's keys sat at the right edge). In its
own partition every stream appends at the right edge of its own indexes, and dropping a stream
drops its tables instead of deleting its rows.

`streams.store.registry.create_stream` creates a stream's partition and attaches it (SHARE UPDATE
EXCLUSIVE on ``streams_facts``: appends and reads of other streams go on); `drop_stream`
detaches it concurrently and drops it. There is no default partition: a row for a stream
without one is an error, never a silent landing place.

Upgrading copies every fact into the new table (one transaction, ACCESS EXCLUSIVE on the old
table for the copy): on a large deployment, plan a maintenance window. Facts of streams no
longer registered (none: `drop_stream` deletes them) are not carried over.

Revision ID: 0006_partitions
Revises: 0005_retention
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0006_partitions"
down_revision = "0005_retention"
branch_labels = None
depends_on = None

_COLUMNS = """
    -- No foreign key: its per-row check would cost appends ~2x (measured); rows are only
    -- written by writers of registered streams and drop_stream drops them.
    stream     integer NOT NULL,
    stream_id  bigint  NOT NULL CONSTRAINT streams_facts_stream_id_check CHECK (stream_id > 0),
    -- A fact may be several rows sharing its stream ID.
    row_no     integer NOT NULL DEFAULT 0,
    instance   text    NOT NULL,
    -- Milliseconds since the Unix epoch, after the stream's timestamping rules.
    ts         bigint  NOT NULL CONSTRAINT streams_facts_ts_check CHECK (ts >= 0),
    payload    jsonb,
    PRIMARY KEY (stream, stream_id, row_no)
"""


def _move(into: str) -> None:
    op.execute("ALTER TABLE streams_facts RENAME TO streams_facts_old")
    op.execute("ALTER INDEX streams_facts_pkey RENAME TO streams_facts_old_pkey")
    op.execute("ALTER INDEX streams_facts_by_time RENAME TO streams_facts_old_by_time")
    op.execute(f"CREATE TABLE streams_facts ({_COLUMNS}) {into}")
    # Reading by time: "the first fact with timestamp >= T".
    op.execute("CREATE INDEX streams_facts_by_time ON streams_facts (stream, ts, stream_id)")


def upgrade() -> None:
    _move("PARTITION BY LIST (stream)")
    op.execute(
        """
        DO $$
        DECLARE r record;
        BEGIN
            FOR r IN SELECT id FROM streams_registry ORDER BY id LOOP
                EXECUTE format(
                    'CREATE TABLE streams_facts_%s PARTITION OF streams_facts FOR VALUES IN (%s)',
                    r.id, r.id);
            END LOOP;
        END $$
        """
    )
    op.execute(
        "INSERT INTO streams_facts SELECT * FROM streams_facts_old "
        "WHERE stream IN (SELECT id FROM streams_registry)"
    )
    op.execute("DROP TABLE streams_facts_old")


def downgrade() -> None:
    _move("")
    op.execute("INSERT INTO streams_facts SELECT * FROM streams_facts_old")
    op.execute("DROP TABLE streams_facts_old")
