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

A failover may also lose the WAL record of a sequence's last values (PostgreSQL logs a
sequence 32 values ahead): the new primary would hand out again IDs the old one gave to facts
it acknowledged, and readers that passed them would skip the new facts written under them.
``streams_incarnation.fenced_timeline`` is the timeline whose sequences were last moved past
that risk, and ``streams_fence_timeline(skip)`` (``SECURITY DEFINER``: writers need no
privilege on sequences) is what a writer's session runs when it starts: on a timeline newer
than the fenced one it moves every stream's sequence ``skip`` IDs forward, once (the row's
lock makes concurrent callers wait for the first, then find it done), and returns how many
sequences it moved; IDs handed out on the old timeline past the switch point, up to ``skip``
of them, are never handed out again.

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


#: The timeline WAL is written on (a primary's), as `streams.store.identity.INCARNATION_SQL`.
TIMELINE_SQL = "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint"


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
    op.execute("ALTER TABLE streams_incarnation ADD COLUMN fenced_timeline bigint")
    op.execute(f"UPDATE streams_incarnation SET fenced_timeline = ({TIMELINE_SQL})")
    op.execute(
        f"""
        CREATE FUNCTION streams_fence_timeline(skip bigint) RETURNS bigint
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
        DECLARE
            current bigint;
            moved bigint := 0;
            r record;
        BEGIN
            IF pg_is_in_recovery() THEN
                RETURN 0;
            END IF;
            current := ({TIMELINE_SQL});
            UPDATE streams_incarnation SET fenced_timeline = current
            WHERE fenced_timeline IS NULL OR fenced_timeline < current;
            IF NOT FOUND THEN
                RETURN 0;
            END IF;
            FOR r IN SELECT sequence_name FROM streams_registry LOOP
                PERFORM setval(r.sequence_name::regclass,
                               COALESCE(pg_sequence_last_value(r.sequence_name::regclass), 0)
                               + skip);
                moved := moved + 1;
            END LOOP;
            RETURN moved;
        END
        $$
        """
    )


def downgrade() -> None:
    op.execute("DROP FUNCTION streams_fence_timeline(bigint)")
    op.execute("ALTER TABLE streams_incarnation DROP COLUMN fenced_timeline")
    op.execute("DROP FUNCTION streams_timeline_switchpoint(bigint)")
