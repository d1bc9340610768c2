"""Privileges the database enforces: definer functions that cannot be hijacked, sequences only
moved forward by the database, group commits through one server-side path, writers kept to
their own streams.

Definer functions (who runs what with whose rights)
----------------------------------------------------
A ``SECURITY DEFINER`` function runs with its owner's rights. Revision 0013's two such
functions had no ``pg_temp`` on their ``search_path``, and PostgreSQL then searches the
session's temporary schema *first* for relations and types: any login could shadow a table
they update (a temporary table with a trigger) or a type they declare (a temporary domain
``text`` whose CHECK calls the login's own function) and run code as the owner, usually the
superuser who migrated. This revision replaces them, and every function it adds follows the
same rules:

* ``SET search_path = pg_catalog, pg_temp``: ``pg_temp`` last, so nothing of a session is
  found before the system's own objects; functions and operators are never looked up in
  ``pg_temp``, and ``pg_catalog`` is writable by superusers only;
* every relation, type and function named with its schema (the library's schema is read here,
  once, and written into each body; a sequence or partition looked up by name at run time is
  looked up by its qualified name, never through the path);
* owned by ``streams_definer``, a ``NOLOGIN`` role made for this (when the migrating role may
  create roles: a superuser, or one with ``CREATEROLE``; otherwise the functions stay its own
  and ``streams roles check`` says so), holding only what the functions need;
* ``EXECUTE`` revoked from ``PUBLIC``, granted to the migrating role, to the role model's roles
  that need it, and to the roles that could do the same work directly before this revision
  (an application's own login keeps working); `streams roles create` grants the model again;
* arguments checked: nothing a caller passes can move a sequence back, or by an unbounded
  amount, or a group it may not use.

The functions:

* ``streams_timeline_switchpoint(old_timeline)``: as in 0013, for anyone who reads. Its owner
  needs ``EXECUTE`` on ``pg_read_file(text)`` (granted here when a superuser migrates: it reads
  files in the data directory only), or it raises and callers treat the switch point as
  unknown.
* ``streams_fence_timeline(skip)``: as in 0013, with ``skip`` between `MIN_SKIP` and
  `MAX_SKIP`, and all or none: every stream's sequence is found and every target checked
  before the first ``setval`` (which is not transactional); a stream dropped meanwhile is
  skipped (it needs no fence).
* ``streams_repair_sequence(stream, seen)``: moves a stream's sequence forward, never back, to
  the highest ID the database holds for it (its facts, its writers' and groups' positions, how
  far retention pruned) or ``seen`` (the caller's reading of the stream's declared tables,
  which this function cannot read). Only for a writer of that stream (``INSERT`` on its
  partition), whoever may set the sequence itself, or an operator: writers no longer need
  ``UPDATE`` on sequences, which would let them ``setval`` any stream's sequence back.
* ``streams_open_group(...)`` and ``streams_commit_group(...)``: the statements of
  `streams.store.reader_groups` (a new generation; a commit fenced by the generation's token,
  bounded by max allocated, forward-only or exactly from its base), behind one check of the
  group (``streams_check_group``): a role granted the group (``streams_group_grants``, or
  membership of ``streams_group_reader`` for every group), or one that may update the groups'
  table itself (an owner, a superuser, an application's login of a deployment without the role
  model). Group readers no longer need to write the groups' tables, so a raw ``UPDATE`` of
  theirs is refused.

Writers kept to their streams
-----------------------------
Writers now append to their stream's own partition (``streams_facts_<id>``), whose privileges
PostgreSQL checks when a statement names it, so a role is granted a stream by a grant on its
partition (and ``USAGE`` on its sequence). The tables a writer writes rows of besides
(``streams_writers``, the idempotency keys and claims, the Spark sink's queries and commits)
get row security: a row of stream ``s`` may be written (or locked) only by a role that may
insert into ``s``'s partition, an operator or the prover (`_may_write`). Reading is
not restricted. Owners and superusers bypass row security, as ever.

Revision ID: 0015_enforced_privileges
Revises: 0014_idempotency_claim_keys
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0015_enforced_privileges"
down_revision = "0014_idempotency_claim_keys"
branch_labels = None
depends_on = None

DEFINER = "streams_definer"
#: Bounds of ``streams_fence_timeline``'s skip: at least as far as PostgreSQL logs a
#: sequence ahead (32) with a wide margin, at most far enough for any replication lag.
MIN_SKIP = 1_000
MAX_SKIP = 1_000_000_000

#: Tables with a ``stream`` column whose rows writers write: row security per stream.
WRITER_TABLES = (
    "streams_writers",
    "streams_idempotency_keys",
    "streams_idempotency_claims",
    "streams_sink_queries",
    "streams_sink_commits",
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


PINNED = "SET search_path = pg_catalog, pg_temp"

#: The timeline WAL is written on (a primary's), as `streams.store.identity.INCARNATION_SQL`.
TIMELINE = (
    "('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), "
    "1, 8))::pg_catalog.bit(32)::pg_catalog.int8"
)


def _functions(s: str, schema: str) -> list[str]:
    """The bodies, for the library's schema ``s`` (quoted) named ``schema``."""
    qualified = _literal(_ident(schema) + ".")
    return [
        f"""
        CREATE OR REPLACE FUNCTION {s}.streams_timeline_switchpoint(
            old_timeline pg_catalog.int8) RETURNS pg_catalog.pg_lsn
        LANGUAGE plpgsql STABLE SECURITY DEFINER {PINNED} AS $$
        DECLARE
            current pg_catalog.int8;
            history pg_catalog.text;
            line pg_catalog.text;
            parts pg_catalog.text[];
        BEGIN
            IF pg_catalog.pg_is_in_recovery() THEN
                SELECT c.timeline_id INTO current FROM pg_catalog.pg_control_checkpoint() c;
            ELSE
                current := {TIMELINE};
            END IF;
            IF current <= old_timeline THEN
                RETURN NULL;
            END IF;
            history := pg_catalog.pg_read_file(
                'pg_wal/' || pg_catalog.lpad(pg_catalog.upper(pg_catalog.to_hex(current)), 8, '0')
                || '.history');
            FOREACH line IN ARRAY pg_catalog.string_to_array(history, E'\\n') LOOP
                parts := pg_catalog.regexp_split_to_array(line, E'\\t');
                IF parts[1] ~ '^[0-9]+$' AND parts[1]::pg_catalog.int8 = old_timeline THEN
                    RETURN parts[2]::pg_catalog.pg_lsn;
                END IF;
            END LOOP;
            RETURN NULL;
        END
        $$
        """,
        f"""
        CREATE OR REPLACE FUNCTION {s}.streams_fence_timeline(skip pg_catalog.int8)
        RETURNS pg_catalog.int8
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {PINNED} AS $$
        DECLARE
            current pg_catalog.int8;
            sequences pg_catalog.regclass[] := '{{}}';
            targets pg_catalog.int8[] := '{{}}';
            r record;
            i pg_catalog.int4;
        BEGIN
            IF skip IS NULL OR skip < {MIN_SKIP} OR skip > {MAX_SKIP} THEN
                RAISE EXCEPTION 'streams_fence_timeline: skip must be between % and %, not %',
                    {MIN_SKIP}, {MAX_SKIP}, skip USING ERRCODE = '22023';
            END IF;
            IF pg_catalog.pg_is_in_recovery() THEN
                RETURN 0;
            END IF;
            current := {TIMELINE};
            -- The row lock makes concurrent callers wait for the first, then find it done.
            UPDATE {s}.streams_incarnation SET fenced_timeline = current
            WHERE fenced_timeline IS NULL OR fenced_timeline < current;
            IF NOT FOUND THEN
                RETURN 0;
            END IF;
            -- All or none (setval is not transactional): every target is checked before the
            -- first sequence moves; a stream dropped meanwhile needs no fence.
            FOR r IN
                SELECT q.seq, COALESCE(pg_catalog.pg_sequence_last_value(q.seq), 0) AS last,
                       p.seqmax
                FROM {s}.streams_registry g
                CROSS JOIN LATERAL (SELECT pg_catalog.to_regclass(
                    {qualified} || pg_catalog.quote_ident(g.sequence_name)) AS seq) q
                JOIN pg_catalog.pg_sequence p ON p.seqrelid = q.seq
                ORDER BY g.id
            LOOP
                IF r.last > r.seqmax - skip THEN
                    RAISE EXCEPTION 'streams_fence_timeline: sequence % is within % of its end',
                        r.seq, skip USING ERRCODE = '2200H';
                END IF;
                sequences := sequences || r.seq;
                targets := targets || (r.last + skip);
            END LOOP;
            FOR i IN 1 .. COALESCE(pg_catalog.array_length(sequences, 1), 0) LOOP
                -- Forward only: at least skip (>= {MIN_SKIP}) past the value just read; nextval
                -- cannot hand out that many in between.
                BEGIN
                    PERFORM pg_catalog.setval(sequences[i], targets[i]);
                EXCEPTION WHEN undefined_table OR internal_error THEN
                    NULL;  -- dropped since it was read
                END;
            END LOOP;
            RETURN COALESCE(pg_catalog.array_length(sequences, 1), 0);
        END
        $$
        """,
        f"""
        CREATE OR REPLACE FUNCTION {s}.streams_repair_sequence(
            p_stream pg_catalog.int4, p_seen pg_catalog.int8 DEFAULT NULL)
        RETURNS pg_catalog.int8
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {PINNED} AS $$
        DECLARE
            seq pg_catalog.regclass;
            part pg_catalog.regclass;
            last pg_catalog.int8;
            stored pg_catalog.int8;
            used pg_catalog.int8;
            seqmax pg_catalog.int8;
        BEGIN
            SELECT pg_catalog.to_regclass({qualified} || pg_catalog.quote_ident(g.sequence_name)),
                   pg_catalog.to_regclass({qualified} || 'streams_facts_' || g.id)
            INTO seq, part
            FROM {s}.streams_registry g WHERE g.id = p_stream;
            IF seq IS NULL THEN
                RAISE EXCEPTION 'streams_repair_sequence: no stream %', p_stream
                    USING ERRCODE = '22023';
            END IF;
            -- Judged by the login (session_user): a writer of this stream, whoever may set the
            -- sequence itself, or an operator.
            IF NOT (COALESCE(pg_catalog.has_table_privilege(session_user, part, 'INSERT'), false)
                    OR pg_catalog.has_sequence_privilege(session_user, seq, 'UPDATE')
                    OR COALESCE(pg_catalog.pg_has_role(session_user,
                        pg_catalog.to_regrole('streams_operator'), 'USAGE'), false)) THEN
                RAISE EXCEPTION 'streams_repair_sequence: % may not repair stream %',
                    session_user, p_stream USING ERRCODE = '42501';
            END IF;
            IF p_seen IS NOT NULL AND p_seen < 0 THEN
                RAISE EXCEPTION 'streams_repair_sequence: seen must not be negative'
                    USING ERRCODE = '22023';
            END IF;
            SELECT pg_catalog.pg_sequence_last_value(seq), p.seqmax INTO last, seqmax
            FROM pg_catalog.pg_sequence p WHERE p.seqrelid = seq;
            -- Planned for this stream's value each time (EXECUTE): a plan cached for any stream
            -- (plpgsql's generic plan, after five calls in a session) would open and lock every
            -- partition of streams_facts, more than the lock table holds at 10^4 streams.
            EXECUTE 'SELECT pg_catalog.max(f.stream_id) FROM {s}.streams_facts f WHERE f.stream = '
                    || p_stream::pg_catalog.text
            INTO stored;
            used := GREATEST(
                stored,
                (SELECT pg_catalog.max(w.position) FROM {s}.streams_writers w
                 WHERE w.stream = p_stream),
                (SELECT pg_catalog.max(r.position) FROM {s}.streams_reader_groups r
                 WHERE r.stream = p_stream),
                (SELECT NULLIF(g.pruned_through, 0) FROM {s}.streams_registry g
                 WHERE g.id = p_stream),
                p_seen);
            -- IDs start at 1; a fresh sequence (never called) has handed out nothing.
            IF used IS NULL OR used < 1 OR (last IS NOT NULL AND last >= used) THEN
                RETURN NULL;
            END IF;
            IF used > seqmax THEN
                RAISE EXCEPTION 'streams_repair_sequence: % is beyond the sequence''s end', used
                    USING ERRCODE = '22003';
            END IF;
            PERFORM pg_catalog.setval(seq, used);
            RETURN used;
        END
        $$
        """,
        f"""
        CREATE OR REPLACE FUNCTION {s}.streams_check_group(p_group pg_catalog.text)
        RETURNS pg_catalog.bool
        LANGUAGE plpgsql STABLE {PINNED} AS $$
        BEGIN
            -- Called by the group functions, so with their owner's rights: judged by the login.
            IF pg_catalog.has_table_privilege(session_user,
                   ({qualified} || 'streams_reader_groups')::pg_catalog.regclass, 'UPDATE')
               OR COALESCE(pg_catalog.pg_has_role(session_user,
                   pg_catalog.to_regrole('streams_group_reader'), 'USAGE'), false)
               OR EXISTS (
                   SELECT FROM {s}.streams_group_grants g
                   WHERE g.group_name = p_group
                     AND COALESCE(pg_catalog.pg_has_role(session_user,
                         pg_catalog.to_regrole(g.grantee), 'USAGE'), false)) THEN
                RETURN true;
            END IF;
            RAISE EXCEPTION 'streams: % may not use reader group %', session_user, p_group
                USING ERRCODE = '42501';
        END
        $$
        """,
        f"""
        CREATE OR REPLACE FUNCTION {s}.streams_open_group(
            p_group pg_catalog.text, p_streams pg_catalog.int4[], p_owner pg_catalog.text)
        RETURNS TABLE (o_stream pg_catalog.int4, o_generation pg_catalog.int8,
                       o_token pg_catalog.uuid)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {PINNED} AS $$
        BEGIN
            PERFORM {s}.streams_check_group(p_group);
            RETURN QUERY
            INSERT INTO {s}.streams_group_generations AS g (stream, group_name, generation, owner)
            SELECT u.stream, p_group, 1, p_owner
            FROM pg_catalog.unnest(p_streams) AS u(stream)
            ORDER BY u.stream
            ON CONFLICT (stream, group_name) DO UPDATE
            SET generation = g.generation + 1, owner = EXCLUDED.owner,
                taken_at = pg_catalog.now(), token = pg_catalog.gen_random_uuid()
            RETURNING g.stream, g.generation, g.token;
        END
        $$
        """,
        # The statement of `streams.store.reader_groups._commit` ("the fencing argument of
        # groups" and "the group argument" there), after the group's check.
        f"""
        CREATE OR REPLACE FUNCTION {s}.streams_commit_group(
            p_group pg_catalog.text, p_streams pg_catalog.int4[], p_positions pg_catalog.int8[],
            p_floors pg_catalog.int8[], p_bases pg_catalog.int8[],
            p_generations pg_catalog.int8[], p_tokens pg_catalog.uuid[],
            p_incarnation pg_catalog.text, p_exact pg_catalog.bool)
        RETURNS TABLE (o_stream pg_catalog.int4, o_position pg_catalog.int8)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {PINNED} AS $$
        BEGIN
            PERFORM {s}.streams_check_group(p_group);
            RETURN QUERY
            WITH c AS (
                SELECT * FROM ROWS FROM (
                    pg_catalog.unnest(p_streams), pg_catalog.unnest(p_positions),
                    pg_catalog.unnest(p_floors), pg_catalog.unnest(p_bases),
                    pg_catalog.unnest(p_generations), pg_catalog.unnest(p_tokens))
                    AS c(stream, position, ts_floor, base, generation, token)
            ), held AS (
                SELECT h.stream, h.generation, h.token FROM {s}.streams_group_generations h
                WHERE h.group_name = p_group AND h.stream = ANY(p_streams)
                ORDER BY h.stream
                FOR SHARE
            ), fenced AS (
                SELECT c.stream, c.generation, held.generation AS current
                FROM c LEFT JOIN held ON held.stream = c.stream
                WHERE held.stream IS NULL OR held.token IS DISTINCT FROM c.token
            ), f AS (
                SELECT * FROM fenced ORDER BY stream LIMIT 1
            ), beyond AS (
                SELECT c.stream, c.position, a.allocated
                FROM c JOIN {s}.streams_registry r ON r.id = c.stream
                CROSS JOIN LATERAL (
                    SELECT COALESCE(pg_catalog.pg_sequence_last_value(pg_catalog.to_regclass(
                        {qualified} || pg_catalog.quote_ident(r.sequence_name))), 0)
                        AS allocated
                ) AS a
                WHERE c.position > a.allocated
                ORDER BY c.stream LIMIT 1
            ), i AS (
                INSERT INTO {s}.streams_reader_groups AS g
                    (stream, group_name, position, ts_floor, incarnation)
                SELECT c.stream, p_group, c.position, c.ts_floor, p_incarnation
                FROM c JOIN held ON held.stream = c.stream AND held.token = c.token
                WHERE NOT EXISTS (SELECT FROM fenced) AND NOT EXISTS (SELECT FROM beyond)
                ON CONFLICT (stream, group_name) DO UPDATE
                SET position = GREATEST(g.position, EXCLUDED.position),
                    ts_floor = GREATEST(g.ts_floor, EXCLUDED.ts_floor),
                    incarnation = EXCLUDED.incarnation,
                    updated_at = pg_catalog.now()
                WHERE NOT p_exact OR g.position = (SELECT c.base FROM c WHERE c.stream = g.stream)
                RETURNING g.stream, g.position
            )
            SELECT c.stream,
                   CASE WHEN f.stream IS NOT NULL THEN
                            ('streams-group-fenced ' || f.stream || ' ' || f.generation || ' '
                             || COALESCE(f.current, -1))::pg_catalog.int8
                        WHEN b.stream IS NOT NULL THEN
                            ('streams-position-beyond ' || b.stream || ' ' || b.position || ' '
                             || b.allocated)::pg_catalog.int8
                        WHEN p_exact AND i.stream IS NULL THEN
                            ('streams-group-moved ' || c.stream || ' '
                             || COALESCE(c.base, -1))::pg_catalog.int8
                        ELSE i.position
                   END
            FROM c LEFT JOIN i ON i.stream = c.stream LEFT JOIN f ON true
            LEFT JOIN beyond b ON true;
        END
        $$
        """,
    ]


#: Each definer function's signature, and which roles of the model execute it (``*``: every
#: one). ``streams_check_group`` runs inside the group functions only: their owner executes it.
FUNCTIONS = {
    "streams_timeline_switchpoint(pg_catalog.int8)": ("*",),
    "streams_fence_timeline(pg_catalog.int8)": (
        "streams_admin",
        "streams_operator",
        "streams_writer",
    ),
    "streams_repair_sequence(pg_catalog.int4, pg_catalog.int8)": (
        "streams_admin",
        "streams_operator",
        "streams_writer",
    ),
    "streams_open_group(pg_catalog.text, pg_catalog.int4[], pg_catalog.text)": (
        "streams_admin",
        "streams_group_reader",
    ),
    "streams_commit_group(pg_catalog.text, pg_catalog.int4[], pg_catalog.int8[], "
    "pg_catalog.int8[], pg_catalog.int8[], pg_catalog.int8[], pg_catalog.uuid[], "
    "pg_catalog.text, pg_catalog.bool)": ("streams_admin", "streams_group_reader"),
}
#: The function that runs with the invoker's rights: the group check (inside the group
#: functions, so with their owner's).
INVOKER_FUNCTIONS = ("streams_check_group(pg_catalog.text)",)
MODEL_ROLES = (
    "streams_admin",
    "streams_operator",
    "streams_prover",
    "streams_writer",
    "streams_reader",
    "streams_group_reader",
)
#: Roles that did a function's work directly before this revision keep doing it: those that
#: could insert facts (fence, repair), update the groups' table (open, commit), read the
#: registry (switchpoint).
_DID_BEFORE = {
    "streams_fence_timeline": ("streams_facts", "INSERT"),
    "streams_repair_sequence": ("streams_facts", "INSERT"),
    "streams_open_group": ("streams_reader_groups", "UPDATE"),
    "streams_commit_group": ("streams_reader_groups", "UPDATE"),
    "streams_timeline_switchpoint": ("streams_registry", "SELECT"),
}


def _grant_execute(s: str, signature: str, who: tuple[str, ...]) -> str:
    name = signature.split("(", maxsplit=1)[0]
    table, privilege = _DID_BEFORE[name]
    roles = MODEL_ROLES if who == ("*",) else who
    return f"""
    DO $$
    DECLARE r record;
    BEGIN
        REVOKE ALL ON FUNCTION {s}.{signature} FROM PUBLIC;
        EXECUTE 'GRANT EXECUTE ON FUNCTION {s}.{signature} TO '
                || pg_catalog.quote_ident(current_user);
        FOR r IN
            SELECT a.rolname FROM pg_catalog.pg_roles a
            WHERE a.rolname = ANY(ARRAY[{", ".join(_literal(x) for x in roles)}])
               OR (a.rolname !~ '^pg_' AND a.rolname <> {_literal(DEFINER)} AND NOT a.rolsuper
                   AND pg_catalog.has_table_privilege(a.oid,
                       ({_literal(s + ".")} || {_literal(table)})::pg_catalog.regclass,
                       {_literal(privilege)}))
        LOOP
            EXECUTE 'GRANT EXECUTE ON FUNCTION {s}.{signature} TO '
                    || pg_catalog.quote_ident(r.rolname);
        END LOOP;
    END $$
    """


def _definer(s: str) -> list[str]:
    """Make ``streams_definer`` (if this role may create roles), and, when a superuser
    migrates, give it the functions and exactly what they need; otherwise the functions stay
    the migrating role's until `streams roles create` runs."""
    owners = "\n".join(
        f"ALTER FUNCTION {s}.{sig} OWNER TO {DEFINER};" for sig in (*FUNCTIONS, *INVOKER_FUNCTIONS)
    )
    return [
        f"""
        DO $$ BEGIN
            IF pg_catalog.to_regrole({_literal(DEFINER)}) IS NULL THEN
                CREATE ROLE {DEFINER} NOLOGIN NOINHERIT;
            END IF;
        EXCEPTION WHEN duplicate_object OR unique_violation OR insufficient_privilege THEN
            NULL;
        END $$
        """,
        f"""
        DO $$
        DECLARE r record;
        BEGIN
            IF pg_catalog.to_regrole({_literal(DEFINER)}) IS NULL
               OR NOT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
            THEN
                RETURN;
            END IF;
            GRANT USAGE ON SCHEMA {s} TO {DEFINER};
            GRANT SELECT ON {s}.streams_registry, {s}.streams_incarnation,
                {s}.streams_writers, {s}.streams_reader_groups,
                {s}.streams_group_generations, {s}.streams_group_grants TO {DEFINER};
            GRANT SELECT (stream, stream_id) ON {s}.streams_facts TO {DEFINER};
            GRANT UPDATE (fenced_timeline) ON {s}.streams_incarnation TO {DEFINER};
            GRANT INSERT, UPDATE ON {s}.streams_reader_groups, {s}.streams_group_generations
                TO {DEFINER};
            FOR r IN
                SELECT pg_catalog.to_regclass({_literal(s + ".")}
                       || pg_catalog.quote_ident(g.sequence_name)) AS seq
                FROM {s}.streams_registry g
            LOOP
                IF r.seq IS NOT NULL THEN
                    EXECUTE 'GRANT SELECT, UPDATE ON SEQUENCE ' || r.seq::pg_catalog.text
                            || ' TO {DEFINER}';
                END IF;
            END LOOP;
            GRANT EXECUTE ON FUNCTION pg_catalog.pg_read_file(pg_catalog.text) TO {DEFINER};
            {owners}
        END $$
        """,
    ]


def _model_partitions(s: str) -> str:
    """Where the role model is in use (``streams_admin`` owns ``streams_facts``), give its
    roles the partitions that writers now name, so they keep working between this migration
    and the next `streams roles create` (which also takes back what they no longer need)."""
    return f"""
    DO $$
    DECLARE p record;
    BEGIN
        IF pg_catalog.to_regrole('streams_admin') IS NULL OR (
            SELECT c.relowner FROM pg_catalog.pg_class c
            WHERE c.oid = ({_literal(s + ".streams_facts")})::pg_catalog.regclass)
            <> pg_catalog.to_regrole('streams_admin') THEN
            RETURN;
        END IF;
        FOR p IN
            SELECT i.inhrelid::pg_catalog.regclass::pg_catalog.text AS name
            FROM pg_catalog.pg_inherits i
            WHERE i.inhparent = ({_literal(s + ".streams_facts")})::pg_catalog.regclass
        LOOP
            IF pg_catalog.to_regrole('streams_writer') IS NOT NULL THEN
                EXECUTE 'GRANT SELECT (stream, stream_id, row_no, instance, ts), INSERT ON '
                        || p.name || ' TO streams_writer';
            END IF;
            FOR r IN 1 .. 4 LOOP
                IF pg_catalog.to_regrole((ARRAY['streams_reader', 'streams_group_reader',
                        'streams_prover', 'streams_operator'])[r]) IS NOT NULL THEN
                    EXECUTE 'GRANT SELECT ON ' || p.name || ' TO '
                            || (ARRAY['streams_reader', 'streams_group_reader',
                                      'streams_prover', 'streams_operator'])[r];
                END IF;
            END LOOP;
        END LOOP;
    END $$
    """


def _may_write(schema: str) -> str:
    """Who may write (or lock) rows of stream ``stream`` (row security of `WRITER_TABLES`):
    a role that may insert into its partition, or an operator or the prover (they retire
    writers and prune keys of every stream). An expression in the policy itself, not a
    function: its names are bound when the policy is made, it runs with the invoker's rights,
    and it is planned with the statement (a SQL function called per row was parsed and planned
    per execution: 0.3 ms an append)."""
    qualified = _literal(_ident(schema) + ".streams_facts_")
    return (
        "(COALESCE(pg_catalog.has_table_privilege(pg_catalog.to_regclass("
        f"{qualified} || stream), 'INSERT'), false) "
        "OR EXISTS (SELECT FROM pg_catalog.pg_roles r "
        "WHERE r.rolname IN ('streams_prover', 'streams_operator') "
        "AND pg_catalog.pg_has_role(r.oid, 'USAGE')))"
    )


def upgrade() -> None:
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    s = _ident(schema)
    op.execute(
        f"""
        CREATE TABLE {s}.streams_group_grants (
            group_name text NOT NULL CHECK (length(group_name) BETWEEN 1 AND 200),
            -- A role name (looked up when checked: a dropped role matches nobody).
            grantee    text NOT NULL,
            granted_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (group_name, grantee)
        )
        """
    )
    op.execute(f"REVOKE ALL ON {s}.streams_group_grants FROM PUBLIC")
    for body in _functions(s, schema):
        op.execute(body)
    may_write = _may_write(schema)
    for table in WRITER_TABLES:
        op.execute(f"ALTER TABLE {s}.{table} ENABLE ROW LEVEL SECURITY")
        op.execute(f"CREATE POLICY streams_read ON {s}.{table} FOR SELECT USING (true)")
        op.execute(
            f"CREATE POLICY streams_write ON {s}.{table} USING {may_write} WITH CHECK {may_write}"
        )
    for statement in _definer(s):
        op.execute(statement)
    for signature, who in FUNCTIONS.items():
        op.execute(_grant_execute(s, signature, who))
    op.execute(_model_partitions(s))
    # The check runs inside the group functions, as their owner (who owns it too, and an owner
    # keeps its own EXECUTE); the row security's test as whoever writes.
    op.execute(f"REVOKE ALL ON FUNCTION {s}.{INVOKER_FUNCTIONS[0]} FROM PUBLIC")


def downgrade() -> None:
    """Back to revision 0014's schema: the new functions, table and row security go; the two
    functions of 0013 keep their hardened bodies (same names, same results for valid calls)
    but return to the migrating role and to PUBLIC's execution, as 0013 made them."""
    schema = str(op.get_bind().exec_driver_sql(_SCHEMA_SQL).scalar())
    s = _ident(schema)
    for table in WRITER_TABLES:
        op.execute(f"DROP POLICY IF EXISTS streams_write ON {s}.{table}")
        op.execute(f"DROP POLICY IF EXISTS streams_read ON {s}.{table}")
        op.execute(f"ALTER TABLE {s}.{table} DISABLE ROW LEVEL SECURITY")
    kept = ("streams_timeline_switchpoint", "streams_fence_timeline")
    for signature in (*FUNCTIONS, *INVOKER_FUNCTIONS):
        if signature.split("(")[0] in kept:
            op.execute(f"ALTER FUNCTION {s}.{signature} OWNER TO CURRENT_USER")
            op.execute(f"GRANT EXECUTE ON FUNCTION {s}.{signature} TO PUBLIC")
        else:
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{signature}")
    op.execute(f"DROP TABLE {s}.streams_group_grants")
