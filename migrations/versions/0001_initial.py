"""Initial schema: stream registry, facts, writers (positions and leases), reader groups.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE streams_registry (
            id            integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            name          text NOT NULL UNIQUE,
            -- Each stream has its own sequence, named after the id (never after the user's
            -- name, so a name can never become SQL).
            sequence_name text NOT NULL UNIQUE,
            timestamping  text NOT NULL DEFAULT 'client-prefer'
                          CHECK (timestamping IN ('client-prefer', 'client-require', 'arrival')),
            uncapped      boolean NOT NULL DEFAULT false,
            -- NULL: keep forever.
            retention_ms  bigint CHECK (retention_ms IS NULL OR retention_ms > 0),
            created_at    timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE streams_facts (
            -- No foreign key: its per-row check would cost appends ~2x (measured); rows are
            -- only written by writers of registered streams and drop_stream deletes them.
            stream     integer NOT NULL,
            stream_id  bigint  NOT NULL CHECK (stream_id > 0),
            -- A fact may be several rows sharing its stream ID.
            row_no     integer NOT NULL DEFAULT 0,
            instance   text    NOT NULL,
            -- Milliseconds since the Unix epoch, after the stream's timestamping rules.
            ts         bigint  NOT NULL CHECK (ts >= 0),
            payload    jsonb,
            PRIMARY KEY (stream, stream_id, row_no)
        )
        """
    )
    # Reading by time: "the first fact with timestamp >= T".
    op.execute("CREATE INDEX streams_facts_by_time ON streams_facts (stream, ts, stream_id)")
    op.execute(
        """
        CREATE TABLE streams_writers (
            stream           integer NOT NULL REFERENCES streams_registry (id) ON DELETE CASCADE,
            instance         text    NOT NULL,
            -- Bumped whenever the name is (re)registered or retired: a transaction carrying an
            -- older generation finds no row and stops before reserving (fencing).
            generation       bigint  NOT NULL DEFAULT 1,
            -- The per-writer position, forward-only (GREATEST on every update).
            position         bigint  NOT NULL CHECK (position >= 0),
            -- Reserved-but-not-completed IDs (plus reservations in flight) at the last
            -- heartbeat: for operators; never used to compute positions.
            pending          integer NOT NULL DEFAULT 0,
            retired          boolean NOT NULL DEFAULT false,
            lease_expires_at timestamptz NOT NULL,
            registered_at    timestamptz NOT NULL DEFAULT now(),
            heartbeat_at     timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (stream, instance)
        )
        """
    )
    op.execute(
        """
        CREATE TABLE streams_reader_groups (
            stream      integer NOT NULL REFERENCES streams_registry (id) ON DELETE CASCADE,
            group_name  text    NOT NULL,
            -- Everything <= position has been consumed by the group (its frontier is
            -- position + 1); forward-only.
            position    bigint  NOT NULL CHECK (position >= 0),
            -- Running maximum timestamp at `position`, so a resumed reader keeps timestamps
            -- non-decreasing without rescanning history.
            ts_floor    bigint  NOT NULL DEFAULT 0,
            updated_at  timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (stream, group_name)
        )
        """
    )


def downgrade() -> None:
    # Sequences belong to streams; drop them with their registry rows.
    op.execute(
        """
        DO $$
        DECLARE seq text;
        BEGIN
            FOR seq IN SELECT sequence_name FROM streams_registry LOOP
                EXECUTE format('DROP SEQUENCE IF EXISTS %I', seq);
            END LOOP;
        END $$
        """
    )
    op.execute("DROP TABLE streams_reader_groups")
    op.execute("DROP TABLE streams_writers")
    op.execute("DROP TABLE streams_facts")
    op.execute("DROP TABLE streams_registry")
