"""Granting the privilege model (`streams.store.privileges`): `streams roles create`, a new
stream's grants, and streams or groups granted to one role (`streams roles grant|revoke`).

`create_roles` applies the model, idempotently, in one transaction (a process running
meanwhile never sees a role without its grants): it makes the roles, hands the library's
tables, sequences and partitions to ``streams_admin`` and its functions to
``streams_definer``, revokes what PUBLIC and the granted roles held on them, then grants the
model. Roles granted some streams or groups keep those; their common privileges are granted
again (a revision may add a table).

New streams (how their objects are covered): `streams.store.registry.create_stream` creates a
stream's sequence and partition as the owner of ``streams_facts`` (``SET LOCAL ROLE`` when the
session is a member of it, as every admin is) and then runs `grant_streams`, which grants them
to the roles of the model that exist (and the sequence to the definer). Explicit grants
rather than ``ALTER DEFAULT PRIVILEGES``: default privileges belong to the role that creates an
object, and would silently not apply to a stream created by anyone else. A role granted some
streams gets a new stream only when it is granted it.

Why a role granted one stream writes no other (the argument): every statement of a writer
that writes a stream's facts names that stream's partition (`streams.store.writer_sql`), and
PostgreSQL checks the privileges of the table a statement names: a grant on the parent
``streams_facts`` (which would reach every partition through routing) is given to nobody but
its owner. IDs come from the stream's sequence, on which only ``USAGE`` (``nextval``) is
granted: ``UPDATE`` (``setval``) is the definer's, behind functions that move a sequence
forward only (revision 0015). The other tables a writer writes hold rows of many streams;
row security lets a role write (or lock) a row of stream ``s`` only if it may insert into
``s``'s partition (revision 0015's policies). Group commits go through functions that check the
login's grant of the group (`streams.store.privileges`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psycopg import sql

from ..errors import UsageError
from .driver import Commit, Gen, Query
from .privileges import (
    ADMIN,
    DEFINER,
    FUNCTIONS,
    GRANTED,
    GROUP_GRANTS,
    GROUP_READER,
    MEMBERSHIPS,
    MODEL,
    PROVER,
    PROVER_GRANTS,
    PROVER_SCHEMA,
    ROLES,
    SIGNING_KEYS,
    STREAM_PRIVILEGES,
    TABLES,
    WRITER,
)
from .stream_objects import FACTS_TREE, StreamObjects, stream_objects

__all__ = [
    "create_roles",
    "grant_scoped",
    "grant_streams",
    "oid_sql",
    "owner_to_create_as",
    "revoke_scoped",
    "scoped_grantees",
]

#: The schema of the library's tables (`streams.store.privileges.TABLES`).
SCHEMA = "public"


def oid_sql(column: str) -> str:
    """SQL: the oid of the relation named by text ``column`` (NULL if none). An unqualified
    name as every statement of the library resolves it (``to_regclass``); a qualified one (the
    prover's schema) from the catalog, because ``to_regclass`` raises for a schema the session
    may not use, and the operator's check must look at the private keys' grants anyway."""
    return (
        f"(CASE WHEN strpos({column}, '.') = 0 THEN to_regclass({column})::oid "
        "ELSE (SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        f"WHERE n.nspname = split_part({column}, '.', 1) "
        f"AND c.relname = split_part({column}, '.', 2)) END)"
    )


def _relation(name: str) -> sql.Identifier:
    return sql.Identifier(*name.split("."))


def _relations(names: Sequence[str]) -> sql.Composed:
    return sql.SQL(", ").join(_relation(n) for n in names)


def _function(signature: str) -> sql.Composed:
    """``public.name(types)``: signatures are the model's constants (never user input)."""
    return sql.SQL("{}.{}").format(sql.Identifier(SCHEMA), sql.SQL(signature))


def _create_role(role: str, options: str = "NOLOGIN") -> Query:
    """``CREATE ROLE ... NOLOGIN`` unless it exists; roles are the cluster's, and two
    databases may set up their roles at the same moment: the loser's error is swallowed."""
    return Query(
        sql.SQL(
            "DO $$ BEGIN IF to_regrole({name}) IS NULL THEN CREATE ROLE {role} {options}; "
            "END IF; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
        ).format(name=sql.Literal(role), role=sql.Identifier(role), options=sql.SQL(options))
    )


def _grant_role(member: str, role: str) -> Query:
    """``GRANT role TO member`` (concurrent identical grants in other databases tolerated)."""
    return Query(
        sql.SQL(
            "DO $$ BEGIN IF NOT pg_has_role({member_name}, {role_name}, 'MEMBER') THEN "
            "GRANT {role} TO {member}; END IF; "
            "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
        ).format(
            member_name=sql.Literal(member),
            role_name=sql.Literal(role),
            role=sql.Identifier(role),
            member=sql.Identifier(member),
        )
    )


def _partitions(leaves: bool) -> Gen[list[str]]:
    """The streams' partitions of ``streams_facts`` (``leaves``), or its buckets (see
    `streams.store.registry`, "Layout")."""
    rows = yield Query(
        f"SELECT c.relname FROM ({FACTS_TREE}) t "
        "JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf = %s ORDER BY c.relname",
        (leaves,),
    )
    return [str(r[0]) for r in rows]


def _existing(names: Sequence[str]) -> Gen[list[str]]:
    """Those of ``names`` (relations) that exist, in order: a revision not run yet, or one
    that dropped a table, leaves nothing to grant or revoke on them."""
    rows = yield Query(
        "SELECT n FROM unnest(%s::text[]) WITH ORDINALITY AS t(n, i) "
        f"WHERE {oid_sql('n')} IS NOT NULL ORDER BY i",
        (list(names),),
    )
    return [str(r[0]) for r in rows]


def _existing_functions() -> Gen[list[str]]:
    """The model's functions present here (revision 0015 run), by signature."""
    rows = yield Query(
        "SELECT f FROM unnest(%s::text[]) AS f WHERE to_regprocedure(%s || '.' || f) IS NOT NULL",
        (list(FUNCTIONS), SCHEMA),
    )
    return [str(r[0]) for r in rows]


def _prover_tables() -> Gen[list[str]]:
    """Every table of the prover's schema (revision 0012: ``signing_keys``), qualified."""
    rows = yield Query(
        "SELECT n.nspname || '.' || c.relname FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind IN ('r', 'p') ORDER BY c.relname",
        (PROVER_SCHEMA,),
    )
    return [str(r[0]) for r in rows]


def has_prover_schema() -> Gen[bool]:
    rows = yield Query(f"SELECT {oid_sql('%(name)s::text')} IS NOT NULL", {"name": SIGNING_KEYS})
    return bool(rows[0][0])


def _is_superuser() -> Gen[bool]:
    rows = yield Query("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    return bool(rows and rows[0][0])


#: Streams whose partition and sequence `create_roles` hands over and grants per transaction:
#: changing an owner locks the object to the end of its transaction, and PostgreSQL's lock
#: table (``max_locks_per_transaction`` x ``max_connections``, 6,400 by default) holds no
#: transaction that locks 10^4 of them.
STREAMS_PER_TRANSACTION = 500


def create_roles(*, restrict_public: bool = False) -> Gen[list[str]]:
    """Create the roles (if missing) and give each exactly the model's privileges on the
    current schema; returns what was done, one line per step. The library's tables and
    functions in one transaction, then the streams' partitions and sequences,
    `STREAMS_PER_TRANSACTION` streams a transaction: a process running meanwhile never sees an
    object without its grants (each object's grants are revoked and granted in one).

    Needs a superuser, or the owner of the library's objects with ``CREATEROLE``: the objects
    pass to ``streams_admin`` (an owner must be a member of the role it hands them to, so such
    an owner is made one), the functions to ``streams_definer``, ``PUBLIC`` loses every
    privilege on them, the other roles lose what they held there and get the model.
    ``restrict_public`` also revokes ``TEMPORARY`` on the database and ``CREATE`` on
    ``public`` from ``PUBLIC`` (every role of the database: only where the operator agrees);
    defence in depth, never the only one: the definer functions are safe without it."""
    done: list[str] = []
    for role in ROLES:
        yield _create_role(role)
    yield _create_role(DEFINER, "NOLOGIN NOINHERIT")
    done.append(f"roles {', '.join(ROLES)} and {DEFINER} (NOLOGIN)")
    rows = yield Query(
        "SELECT rolsuper OR pg_has_role(current_user, %s, 'MEMBER') FROM pg_roles "
        "WHERE rolname = current_user",
        (ADMIN,),
    )
    if not rows[0][0]:
        yield _grant_role_to_current(ADMIN)
        done.append(f"{ADMIN} granted to the current user, who owned the objects")
    objects = yield from _LibraryObjects.read()
    done += yield from objects.hand_over()
    yield from objects.revoke()
    yield from objects.grant()
    if objects.functions:
        yield from _functions_to_definer(objects.functions, objects.superuser)
        done.append(f"{DEFINER} owns {len(objects.functions)} functions")
    yield Commit()
    done += yield from objects.streams_in_batches()
    scoped = yield from scoped_grantees()
    for role, kinds in scoped.items():
        for kind in kinds:
            yield from _grant_base(role, kind, objects.functions)
    if scoped:
        done.append(f"common privileges again to {len(scoped)} role(s) granted streams or groups")
    if restrict_public:
        rows = yield Query("SELECT current_database()")
        yield Query(
            sql.SQL("REVOKE TEMPORARY ON DATABASE {} FROM PUBLIC").format(
                sql.Identifier(str(rows[0][0]))
            )
        )
        yield Query(
            sql.SQL("REVOKE CREATE ON SCHEMA {} FROM PUBLIC").format(sql.Identifier(SCHEMA))
        )
        done.append("PUBLIC may no longer create temporary tables here nor objects in public")
    yield Commit()
    schema = f"and schema {PROVER_SCHEMA} to {PROVER}" if objects.prover else f"no {PROVER_SCHEMA}"
    done.append(f"granted the model to {', '.join(GRANTED)} ({schema})")
    return done


@dataclass(slots=True)
class _LibraryObjects:
    """The library's objects in this database, as `create_roles` handles them."""

    superuser: bool
    tables: list[str]
    streams: list[StreamObjects]
    partitions: list[str]
    buckets: list[str]
    prover: bool
    prover_tables: list[str]
    functions: list[str]

    @classmethod
    def read(cls) -> Gen[_LibraryObjects]:
        superuser = yield from _is_superuser()
        tables = yield from _existing(TABLES)
        streams = yield from stream_objects()
        partitions = yield from _partitions(leaves=True)
        buckets = yield from _partitions(leaves=False)
        prover = yield from has_prover_schema()
        prover_tables = (yield from _prover_tables()) if prover else []
        functions = yield from _existing_functions()
        return cls(
            superuser, tables, streams, partitions, buckets, prover, prover_tables, functions
        )

    @property
    def orphan_partitions(self) -> list[str]:
        """Partitions of ``streams_facts`` of no stream (a drop that crashed half-way)."""
        known = {s.partition for s in self.streams}
        return [p for p in self.partitions if p not in known]

    def hand_over(self) -> Gen[list[str]]:
        """Tables, buckets, orphan partitions and the prover's schema to the admin (the
        streams' own objects: `streams_in_batches`)."""
        admin = sql.Identifier(ADMIN)
        # A new owner must have CREATE on the schema of what it gets (unless a superuser runs
        # this).
        yield Query(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(SCHEMA), sql.SQL(", ").join(sql.Identifier(r) for r in GRANTED)
            )
        )
        yield Query(
            sql.SQL("GRANT CREATE ON SCHEMA {} TO {}").format(sql.Identifier(SCHEMA), admin)
        )
        if self.prover:
            yield Query(
                sql.SQL("ALTER SCHEMA {} OWNER TO {}").format(_relation(PROVER_SCHEMA), admin)
            )
        yield from _own([*self.tables, *self.buckets, *self.orphan_partitions, *self.prover_tables])
        return [
            f"{ADMIN} owns {len(self.tables)} tables"
            + (f" and schema {PROVER_SCHEMA}" if self.prover else "")
        ]

    def streams_in_batches(self) -> Gen[list[str]]:
        """Each stream's partition and sequence: owned by the admin, everything others held on
        them revoked and the model granted, `STREAMS_PER_TRANSACTION` streams a transaction."""
        everyone = _everyone()
        for start in range(0, len(self.streams), STREAMS_PER_TRANSACTION):
            batch = self.streams[start : start + STREAMS_PER_TRANSACTION]
            yield from _own([s.partition for s in batch], [s.sequence for s in batch])
            yield Query(
                sql.SQL("REVOKE ALL ON TABLE {} FROM {}").format(
                    _relations([s.partition for s in batch]), everyone
                )
            )
            yield Query(
                sql.SQL("REVOKE ALL ON SEQUENCE {} FROM {}").format(
                    _relations([s.sequence for s in batch]), everyone
                )
            )
            for role in STREAM_PRIVILEGES:
                yield from _grant_streams(role, batch, role)
            yield Commit()
        return [
            f"{ADMIN} owns {len(self.streams)} streams' partitions and sequences, granted "
            f"{STREAMS_PER_TRANSACTION} streams a transaction"
        ]

    def revoke(self) -> Gen[None]:
        """Everything PUBLIC and the granted roles hold on the objects (the definer keeps
        its own EXECUTE on the functions it owns)."""
        everyone = _everyone()
        objects = [*self.tables, *self.buckets, *self.orphan_partitions, *self.prover_tables]
        yield Query(sql.SQL("REVOKE ALL ON {} FROM {}").format(_relations(objects), everyone))
        relations = yield from _existing(["streams_keys_id_seq", "streams_registry_id_seq"])
        if relations:
            yield Query(
                sql.SQL("REVOKE ALL ON SEQUENCE {} FROM {}").format(_relations(relations), everyone)
            )
        if self.prover:
            yield Query(
                sql.SQL("REVOKE ALL ON SCHEMA {} FROM {}").format(
                    _relation(PROVER_SCHEMA), everyone
                )
            )

    def grant(self) -> Gen[None]:
        """The model: tables, memberships, the prover's schema (the streams' own objects:
        `streams_in_batches`; functions: `_functions_to_definer`)."""
        for role, grants in MODEL.items():
            yield from _grant_model(role, grants)
            for member_of in MEMBERSHIPS.get(role, ()):
                yield _grant_role(role, member_of)
        if self.superuser and self.functions:
            # The switch point's owner reads the timeline's history file: only a superuser
            # may grant that (without it the switch point is "unknown", the safe side).
            yield Query(
                sql.SQL("GRANT EXECUTE ON FUNCTION pg_catalog.pg_read_file(text) TO {}").format(
                    sql.Identifier(DEFINER)
                )
            )
        if self.prover:
            yield Query(
                sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                    _relation(PROVER_SCHEMA), sql.Identifier(PROVER)
                )
            )
            for privileges, names in PROVER_GRANTS:
                present = yield from _existing(names)
                if present:
                    yield _grant(privileges, present, PROVER)


def _everyone() -> sql.Composed:
    """PUBLIC and the roles the model grants to: who loses what it held on an object."""
    return sql.SQL(", ").join([sql.SQL("PUBLIC"), *(sql.Identifier(r) for r in GRANTED)])


def _own(tables: Sequence[str], sequences: Sequence[str] = ()) -> Gen[None]:
    """``ALTER ... OWNER TO streams_admin`` for those of these tables and sequences it does
    not own yet. That takes an ACCESS EXCLUSIVE lock on each, briefly: it waits for the
    transactions using it, and appends and reads wait behind it until this one commits; an
    object the admin owns already is left alone (nor locked)."""
    rows = yield Query(
        "SELECT n, k FROM unnest(%s::text[], %s::text[]) AS t(n, k) "
        f"JOIN pg_class c ON c.oid = {oid_sql('t.n')} "
        "WHERE c.relowner IS DISTINCT FROM to_regrole(%s)",
        (
            [*tables, *sequences],
            ["TABLE"] * len(tables) + ["SEQUENCE"] * len(sequences),
            ADMIN,
        ),
    )
    for name, kind in rows:
        yield Query(
            sql.SQL("ALTER {} {} OWNER TO {}").format(
                sql.SQL(kind), _relation(str(name)), sql.Identifier(ADMIN)
            )
        )


def _functions_to_definer(functions: Sequence[str], superuser: bool) -> Gen[None]:
    """Give the library's functions to ``streams_definer`` and their ``EXECUTE`` to the
    model (`FUNCTIONS`; the admin with the grant option, to grant them on). A role that is
    not a superuser must be a member of the functions' owner to change them, and the new
    owner must have ``CREATE`` on the schema: both are given for these statements and taken
    back at once (the definer never keeps ``CREATE``, nobody stays its member)."""
    definer, schema = sql.Identifier(DEFINER), sql.Identifier(SCHEMA)
    if not superuser:
        yield _grant_role_to_current(DEFINER)
        yield Query(sql.SQL("GRANT CREATE ON SCHEMA {} TO {}").format(schema, definer))
    rows = yield Query(
        "SELECT f FROM unnest(%s::text[]) AS f JOIN pg_proc p "
        "ON p.oid = to_regprocedure(%s || '.' || f) WHERE p.proowner <> to_regrole(%s)",
        (list(functions), SCHEMA, DEFINER),
    )
    for (signature,) in rows:
        yield Query(
            sql.SQL("ALTER FUNCTION {} OWNER TO {}").format(_function(str(signature)), definer)
        )
    others = sql.SQL(", ").join(
        [sql.SQL("PUBLIC"), *(sql.Identifier(r) for r in GRANTED if r != DEFINER)]
    )
    for signature in functions:
        yield Query(
            sql.SQL("REVOKE ALL ON FUNCTION {} FROM {}").format(_function(signature), others)
        )
    yield from _grant_functions(functions)
    if not superuser:
        yield Query(sql.SQL("REVOKE CREATE ON SCHEMA {} FROM {}").format(schema, definer))
        yield Query(sql.SQL("REVOKE {} FROM CURRENT_USER").format(definer))


def _grant_role_to_current(role: str) -> Query:
    return Query(sql.SQL("GRANT {} TO CURRENT_USER").format(sql.Identifier(role)))


def _grant(privileges: str, names: Sequence[str], role: str) -> Query:
    """``GRANT privileges ON TABLE names TO role``: privileges are the model's own text
    (constants of `streams.store.privileges`), relations and role identifiers."""
    kind = "SEQUENCE" if all(n.endswith("_seq") for n in names) else "TABLE"
    return Query(
        sql.SQL("GRANT {privileges} ON {kind} {names} TO {role}").format(
            privileges=sql.SQL(privileges),
            kind=sql.SQL(kind),
            names=_relations(names),
            role=sql.Identifier(role),
        )
    )


def _grant_model(
    role: str, grants: Sequence[tuple[str, tuple[str, ...]]], to: str = ""
) -> Gen[None]:
    """The table grants of ``role`` in the model, to ``to`` (default: ``role`` itself)."""
    for privileges, names in grants:
        present = yield from _existing(names)
        if present:
            yield _grant(privileges, present, to or role)


def _grant_streams(kind: str, streams: Sequence[StreamObjects], to: str) -> Gen[None]:
    """`STREAM_PRIVILEGES` of ``kind`` on these streams' partitions and sequences, to ``to``."""
    if not streams:
        return
    on_partition, on_sequence = STREAM_PRIVILEGES[kind]
    grantee = sql.Identifier(to)
    if on_partition is not None:
        yield Query(
            sql.SQL("GRANT {} ON TABLE {} TO {}").format(
                sql.SQL(on_partition), _relations([s.partition for s in streams]), grantee
            )
        )
    yield Query(
        sql.SQL("GRANT {} ON SEQUENCE {} TO {}").format(
            sql.SQL(on_sequence), _relations([s.sequence for s in streams]), grantee
        )
    )


def _grant_functions(functions: Sequence[str]) -> Gen[None]:
    present = set(functions)
    for signature, who in FUNCTIONS.items():
        if signature not in present:
            continue
        for role in who:
            grantee = sql.SQL("PUBLIC") if role == "PUBLIC" else sql.Identifier(role)
            # The admin grants them on to roles granted some streams or groups.
            option = " WITH GRANT OPTION" if role == ADMIN else ""
            yield Query(
                sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}{}").format(
                    _function(signature), grantee, sql.SQL(option)
                )
            )


def _grant_base(role: str, kind: str, functions: Sequence[str]) -> Gen[None]:
    """What every role of ``kind`` (`WRITER`, `GROUP_READER`) holds whatever its streams or
    groups: the model's table privileges of ``kind`` and its functions, to ``role``."""
    yield Query(
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            sql.Identifier(SCHEMA), sql.Identifier(role)
        )
    )
    yield from _grant_model(kind, MODEL[kind], role)
    for signature in functions:
        if kind in FUNCTIONS[signature]:
            yield Query(
                sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
                    _function(signature), sql.Identifier(role)
                )
            )


def model_in_use() -> Gen[bool]:
    """Whether this database follows the model: ``streams_admin`` owns ``streams_facts``
    (`create_roles` ran here). The roles are the cluster's: that they exist says nothing about
    this database."""
    rows = yield Query(
        "SELECT c.relowner = to_regrole(%s) FROM pg_class c "
        "WHERE c.oid = 'streams_facts'::regclass",
        (ADMIN,),
    )
    return bool(rows and rows[0][0])


def grant_streams(objects: Sequence[StreamObjects]) -> Gen[None]:
    """Grant new streams' partitions and sequences to the roles of the model that exist, in
    the caller's transaction, which created them (`streams.store.registry.create_streams`:
    their owner may grant on them). The model's roles only where the model is in use
    (`model_in_use`: the roles are the cluster's, and another database's roles say nothing
    about this one); the definer wherever it exists (it moves sequences forward)."""
    in_use = yield from model_in_use()
    rows = yield Query(
        "SELECT r FROM unnest(%s::text[]) AS r WHERE to_regrole(r) IS NOT NULL",
        (list(STREAM_PRIVILEGES),),
    )
    for (role,) in rows:
        if in_use or role == DEFINER:
            yield from _grant_streams(str(role), objects, str(role))


def scoped_grantees() -> Gen[dict[str, list[str]]]:
    """Roles outside the model granted some streams (``INSERT`` on a stream's partition:
    `WRITER`) or some groups (a row of ``streams_group_grants``: `GROUP_READER`), each with
    the kinds it holds."""
    rows = yield Query(
        """
        SELECT DISTINCT a.grantee::regrole::text, %(writer)s
        FROM ({FACTS_TREE}) t JOIN pg_class c ON c.oid = t.relid
        CROSS JOIN aclexplode(c.relacl) a
        WHERE t.isleaf AND a.privilege_type = 'INSERT'
          AND a.grantee <> 0 AND a.grantee <> c.relowner
          AND NOT (a.grantee::regrole::text = ANY(%(model)s))
        UNION
        SELECT g.grantee, %(group_reader)s FROM streams_group_grants g
        WHERE to_regrole(g.grantee) IS NOT NULL
        ORDER BY 1, 2
        """.replace("{FACTS_TREE}", FACTS_TREE),
        {"writer": WRITER, "group_reader": GROUP_READER, "model": [*ROLES, "streams_definer"]},
    )
    found: dict[str, list[str]] = {}
    for role, kind in rows:
        found.setdefault(str(role), []).append(str(kind))
    return found


def _check_grantee(role: str, kind: str) -> Gen[None]:
    """A role may be granted some streams (groups) only if it exists, is not a superuser nor a
    role of the model, and does not already hold every stream (group) through the model."""
    if role in (*ROLES, DEFINER) or role.startswith("pg_"):
        raise UsageError(f"{role} is a role of the model or a predefined role: grant it to users")
    rows = yield Query(
        "SELECT rolsuper, pg_has_role(oid, %s, 'USAGE') FROM pg_roles WHERE rolname = %s",
        (kind, role),
    )
    if not rows:
        raise UsageError(f"role {role!r} does not exist (CREATE ROLE {role} LOGIN first)")
    if rows[0][0]:
        raise UsageError(f"{role} is a superuser: it may do anything already")
    if rows[0][1]:
        every = "stream" if kind == WRITER else "group"
        raise UsageError(
            f"{role} is a member of {kind}, which holds every {every}: revoke that "
            f"membership (REVOKE {kind} FROM {role}) to give it some {every}s only"
        )
    in_use = yield from model_in_use()
    if not in_use:
        raise UsageError("the role model is not in use here: run `streams roles create` first")


def grant_scoped(
    role: str, streams: Sequence[StreamObjects] = (), groups: Sequence[str] = ()
) -> Gen[list[str]]:
    """Let ``role`` write these streams (and reserve their IDs) and use these groups, and no
    others: the common privileges of a writer (a group reader), the streams' partitions and
    sequences, a row of ``streams_group_grants`` per group. One transaction; as the owner
    (an admin). Returns what was done."""
    done: list[str] = []
    functions = yield from _existing_functions()
    if streams:
        yield from _check_grantee(role, WRITER)
        yield from _grant_base(role, WRITER, functions)
        yield from _grant_streams(WRITER, streams, role)
        done.append(f"{role} may write {', '.join(s.name for s in streams)}")
    if groups:
        yield from _check_grantee(role, GROUP_READER)
        yield from _grant_base(role, GROUP_READER, functions)
        yield from _grant_streams(GROUP_READER, (yield from stream_objects()), role)
        yield Query(
            f"INSERT INTO {GROUP_GRANTS} (group_name, grantee) "
            "SELECT g, %s FROM unnest(%s::text[]) AS g ON CONFLICT DO NOTHING",
            (role, list(groups)),
        )
        done.append(f"{role} may open and commit groups {', '.join(groups)}")
    yield Commit()
    return done


def revoke_scoped(
    role: str,
    streams: Sequence[StreamObjects] = (),
    groups: Sequence[str] = (),
    *,
    everything: bool = False,
) -> Gen[list[str]]:
    """Undo `grant_scoped` for these streams and groups (``everything``: all of them, and the
    common privileges too). Returns what was done."""
    done: list[str] = []
    grantee = sql.Identifier(role)
    if everything:
        streams = yield from stream_objects()
    for start in range(0, len(streams), STREAMS_PER_TRANSACTION):
        batch = streams[start : start + STREAMS_PER_TRANSACTION]
        yield Query(
            sql.SQL("REVOKE ALL ON TABLE {} FROM {}").format(
                _relations([s.partition for s in batch]), grantee
            )
        )
        yield Query(
            sql.SQL("REVOKE ALL ON SEQUENCE {} FROM {}").format(
                _relations([s.sequence for s in batch]), grantee
            )
        )
    if streams and not everything:
        done.append(f"{role} may no longer write {', '.join(s.name for s in streams)}")
    rows = yield Query(
        f"DELETE FROM {GROUP_GRANTS} WHERE grantee = %s AND (%s OR group_name = ANY(%s)) "
        "RETURNING group_name",
        (role, everything, list(groups)),
    )
    if rows and not everything:
        done.append(f"{role} may no longer use groups {', '.join(str(r[0]) for r in rows)}")
    if everything:
        tables = yield from _existing(TABLES)
        yield Query(sql.SQL("REVOKE ALL ON {} FROM {}").format(_relations(tables), grantee))
        for signature in (yield from _existing_functions()):
            yield Query(
                sql.SQL("REVOKE ALL ON FUNCTION {} FROM {}").format(_function(signature), grantee)
            )
        done.append(f"{role} holds nothing on the library's objects any more")
    yield Commit()
    return done


def owner_to_create_as() -> Gen[str | None]:
    """The role a new stream's objects must belong to, when this session should take it for
    the rest of its transaction (``SET LOCAL ROLE``): the owner of ``streams_facts`` (the one
    role that may attach a partition to it), if that is not the current user but a role it is
    a member of (an admin of the model: `streams_admin`). None: create them as who we are."""
    rows = yield Query(
        "SELECT r.rolname FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner "
        "WHERE c.oid = 'streams_facts'::regclass AND r.rolname <> current_user "
        "AND pg_has_role(current_user, r.oid, 'MEMBER')"
    )
    return str(rows[0][0]) if rows else None
