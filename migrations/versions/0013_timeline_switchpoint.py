"""The switch point of a timeline: where a failover's new history left the old one.

After a failover (a standby promoted: a new timeline) the new primary holds the old primary's
history up to the *switch point*, a WAL position, and nothing after it. A process that kept a
position learned on the old timeline together with the WAL position of the proof behind it (a
Spark offset) can tell whether everything that proof covered is in the new history: it is when
the proof's WAL position is at or below the switch point (`streams.store.failover`).

PostgreSQL keeps switch points in the timeline history files (``pg_wal/<timeline>.history``),
which only a superuser (or a holder of ``pg_read_server_files``) may read. This revision adds
``streams_timeline_switchpoint(old_timeline)``, ``SECURITY DEFINER``, which reads the current
timeline's history file and returns only the switch point of ``old_timeline`` (NULL: the same
timeline, or one that is not an ancestor of the current: another branch). It works when its
owner may read the file (the migration run by a superuser); otherwise it raises, and the
caller treats the switch point as unknown (the safe side: a process stops rather than
guesses). Anyone may call it: a WAL position of the past is no secret.

Revision ID: 0013_timeline_switchpoint
Revises: 0012_prover_keys
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0013_timeline_switchpoint"
down_revision = "0012_prover_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
        CREATE FUNCTION streams_timeline_switchpoint(old_timeline bigint) RETURNS pg_lsn
        LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $$
        DECLARE
            current bigint;
            history text;
            line text;
            parts text[];
        BEGIN
            IF pg_is_in_recovery() THEN
                SELECT c.timeline_id INTO current FROM pg_control_checkpoint() c;
            ELSE
                current := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))
                           ::bit(32)::bigint;
            END IF;
            IF current <= old_timeline THEN
                RETURN NULL;
            END IF;
            history := pg_read_file('pg_wal/' || lpad(upper(to_hex(current)), 8, '0')
                                    || '.history');
            FOREACH line IN ARRAY string_to_array(history, E'\n') LOOP
                parts := regexp_split_to_array(line, E'\t');
                IF parts[1] ~ '^[0-9]+$' AND parts[1]::bigint = old_timeline THEN
                    RETURN parts[2]::pg_lsn;
                END IF;
            END LOOP;
            RETURN NULL;
        END
        $$
        """
    )
    # Functions are executable by PUBLIC by default: what this one tells is no secret.


def downgrade() -> None:
    op.execute("DROP FUNCTION streams_timeline_switchpoint(bigint)")
