"""Each stream is fenced on its own after a failover: a writer's first session on a new timeline
moves its own stream's sequence, not every stream's (issue 40).

Revision 0013 made the first writer session on a new timeline move every stream's sequence
past the IDs the old primary may have handed out (``streams_fence_timeline``), in one
transaction: at 10^4 streams that transaction holds more than 10^4 locks (PostgreSQL's lock
table holds about 6,400 at its defaults, and gives out near 2x that before "out of shared
memory", after which no writer could open on the new timeline), and one writer's open pays for
every stream. This revision adds ``streams_registry.fenced_timeline`` (the timeline each
stream's sequence was last fenced on; the upgrade copies the database's) and
``streams_fence_stream(stream, skip)``, which a writer's session runs for its own stream:
on a timeline newer than the stream's, it moves that stream's sequence ``skip`` IDs forward,
once (the registry row's lock makes concurrent callers wait for the first, then find it done).
An ID of a stream is only handed out by its writers, after they fenced it (docs/design/
fencing.md), so the per-stream fence gives every stream what the database-wide one gave it.
``streams_fence_timeline`` stays for operators (unused by the library).

Who may call it: whoever may call ``streams_fence_timeline`` (the upgrade grants them), and
inside it, as ``streams_repair_sequence`` checks, a writer of that stream, whoever may set
its sequence, or an operator.

Revision ID: 0019_stream_fences
Revises: 0018_bucketed_partitions
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0019_stream_fences"
down_revision = "0018_bucketed_partitions"
branch_labels = None
depends_on = None

DEFINER = "streams_definer"
SIGNATURE = "streams_fence_stream(pg_catalog.int4, pg_catalog.int8)"
#: As revision 0015's bounds of ``streams_fence_timeline``'s skip.
MIN_SKIP = 1_000
MAX_SKIP = 1_000_000_000
PINNED = "SET search_path = pg_catalog, pg_temp"
#: The timeline WAL is written on (a primary's), as `streams.store.identity.TIMELINE_SQL`.
TIMELINE = (
    "('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), "
    "1, 8))::pg_catalog.bit(32)::pg_catalog.int8"
)

_SCHEMA_SQL = (
    "SELECT n.nspname FROM pg_catalog.pg_class c "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = 'streams_registry'::regclass"
)


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _fence_stream(s: str, schema: str) -> str:
    qualified = _literal(_ident(schema) + ".")
    return f"""
        CREATE FUNCTION {s}.streams_fence_stream(p_stream pg_catalog.int4, skip pg_catalog.int8)
        RETURNS pg_catalog.int8
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {PINNED} AS $$
        DECLARE
            seq pg_catalog.regclass;
            part pg_catalog.regclass;
            current pg_catalog.int8;
            last pg_catalog.int8;
            seqmax pg_catalog.int8;
        BEGIN
            IF skip IS NULL OR skip < {MIN_SKIP} OR skip > {MAX_SKIP} THEN
                RAISE EXCEPTION 'streams_fence_stream: skip must be between % and %, not %',
                    {MIN_SKIP}, {MAX_SKIP}, skip USING ERRCODE = '22023';
            END IF;
            IF pg_catalog.pg_is_in_recovery() THEN
                RETURN 0;
            END IF;
            SELECT pg_catalog.to_regclass({qualified} || pg_catalog.quote_ident(g.sequence_name)),
                   pg_catalog.to_regclass({qualified} || 'streams_facts_' || g.id)
            INTO seq, part
            FROM {s}.streams_registry g WHERE g.id = p_stream;
            IF seq IS NULL THEN
                RETURN 0;  -- no such stream (dropped): nothing to fence
            END IF;
            -- Judged by the login (session_user), as streams_repair_sequence judges it.
            IF NOT (COALESCE(pg_catalog.has_table_privilege(session_user, part, 'INSERT'), false)
                    OR pg_catalog.has_sequence_privilege(session_user, seq, 'UPDATE')
                    OR COALESCE(pg_catalog.pg_has_role(session_user,
                        pg_catalog.to_regrole('streams_operator'), 'USAGE'), false)) THEN
                RAISE EXCEPTION 'streams_fence_stream: % may not fence stream %',
                    session_user, p_stream USING ERRCODE = '42501';
            END IF;
            current := {TIMELINE};
            -- The row's lock makes concurrent callers wait for the first, then find it done.
            UPDATE {s}.streams_registry g SET fenced_timeline = current
            WHERE g.id = p_stream AND (g.fenced_timeline IS NULL OR g.fenced_timeline < current);
            IF NOT FOUND THEN
                RETURN 0;
            END IF;
            SELECT COALESCE(pg_catalog.pg_sequence_last_value(seq), 0), p.seqmax
            INTO last, seqmax
            FROM pg_catalog.pg_sequence p WHERE p.seqrelid = seq;
            IF last > seqmax - skip THEN
                RAISE EXCEPTION 'streams_fence_stream: sequence % is within % of its end',
                    seq, skip USING ERRCODE = '2200H';
            END IF;
            -- Forward only: at least skip (>= {MIN_SKIP}) past the value just read; nextval
            -- cannot hand out that many in between.
            PERFORM pg_catalog.setval(seq, last + skip);
            RETURN last + skip;
        END
        $$
        """


def _owner_and_grants(s: str) -> str:
    """``streams_definer`` owns it when it exists and a superuser migrates (as revision 0015
    gave it the other functions) and may then update each stream's fence; every role that may
    call ``streams_fence_timeline`` may call it, PUBLIC may not."""
    return f"""
    DO $$
    DECLARE r record;
    BEGIN
        REVOKE ALL ON FUNCTION {s}.{SIGNATURE} FROM PUBLIC;
        EXECUTE 'GRANT EXECUTE ON FUNCTION {s}.{SIGNATURE} TO '
                || pg_catalog.quote_ident(current_user);
        FOR r IN
            SELECT a.rolname FROM pg_catalog.pg_roles a
            WHERE a.rolname !~ '^pg_' AND a.rolname <> {_literal(DEFINER)}
              AND pg_catalog.has_function_privilege(a.oid,
                  {_literal(s + ".streams_fence_timeline(pg_catalog.int8)")}, 'EXECUTE')
        LOOP
            EXECUTE 'GRANT EXECUTE ON FUNCTION {s}.{SIGNATURE} TO '
                    || pg_catalog.quote_ident(r.rolname);
        END LOOP;
        IF pg_catalog.to_regrole({_literal(DEFINER)}) IS NOT NULL
           AND (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
        THEN
            GRANT UPDATE (fenced_timeline) ON {s}.streams_registry TO {DEFINER};
            ALTER FUNCTION {s}.{SIGNATURE} OWNER TO {DEFINER};
        END IF;
    END $$
    """


def upgrade() -> None:
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    s = _ident(schema)
    op.execute(f"ALTER TABLE {s}.streams_registry ADD COLUMN fenced_timeline pg_catalog.int8")
    # Every stream was fenced as far as the database was (revision 0013's fence).
    op.execute(
        f"UPDATE {s}.streams_registry SET fenced_timeline = "
        f"(SELECT pg_catalog.max(i.fenced_timeline) FROM {s}.streams_incarnation i)"
    )
    op.execute(_fence_stream(s, schema))
    op.execute(_owner_and_grants(s))


def downgrade() -> None:
    """The function and the column go; the database-wide fence stays as it was (a failover
    since the upgrade is fenced again by it on the next writer session: the skip is harmless
    twice)."""
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    s = _ident(schema)
    op.execute(f"DROP FUNCTION {s}.{SIGNATURE}")
    op.execute(f"ALTER TABLE {s}.streams_registry DROP COLUMN fenced_timeline")
