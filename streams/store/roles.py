"""The role model: which PostgreSQL roles may run which of the library's statements.

Six group roles (``NOLOGIN``; people and services log in as users granted one or more of them):

* ``streams_admin`` *owns* the library's objects (its tables, each stream's sequence and
  partition, the prover's schema ``streams_prover``): it migrates, creates and drops streams,
  declares tables and rotates keys. Owning is what those statements need (``ATTACH PARTITION``
  and dropping a partition or a sequence are the owner's alone), so the objects belong to the
  group, not to whichever member made them: any admin can drop what another created.
* ``streams_operator``: ``streams doctor [--repair]``, ``streams prune``, ``streams writers
  prune``, ``streams groups delete``, ``streams incarnation accept``, retention settings. It
  reads every table but the prover's schema, retires writers, moves sequences forward
  (``setval``), deletes pruned facts, old keys and groups, and ends sessions
  (``pg_signal_backend``: a writer frozen past its lease holds its stream back until someone
  does).
* ``streams_prover``: what a reader reads, plus what only the prover may write: proofs
  (``streams_proofs``), the replication keys (``streams_keys``, and its private keys in
  ``streams_prover.signing_keys``, which it alone reads); retiring writers whose lease expired
  and ending the sessions of such writers, of frozen provers and of any session holding a
  stream back past the lease (``pg_signal_backend``), the jobs that bound how long a stream
  stalls (`streams.store.leases`, "the liveness argument" and "the holding argument";
  `streams.store.probe.end_stale_provers`).
* ``streams_writer``: appends (facts, its writer row, idempotency keys, the Spark sink's
  commits) and the sequence work a starting writer does (``nextval``, repair's ``setval``). It
  reads the columns of ``streams_facts`` that repair and timestamps need, never ``payload``.
* ``streams_reader``: reads: facts, proofs, the readers' keys, positions. It writes nothing.
* ``streams_group_reader``: a reader that may also write its groups' rows
  (``streams_reader_groups``, ``streams_group_generations``) and nothing else.

`MODEL` says it statement by statement; `create_roles` applies it (idempotent: it revokes what
the five roles below the admin hold on the library's objects, then grants the model, in one
transaction, so a process running meanwhile never sees a role without its grants).

New streams (how their objects are covered): a stream's sequence is the only per-stream object
a role needs a grant on (its partition of ``streams_facts`` is only ever reached through the
parent, whose privileges PostgreSQL checks instead). `streams.store.registry.create_stream`
creates a stream's objects as the owner of ``streams_facts`` (``SET LOCAL ROLE`` when the
session is a member of it, as every admin is) and then runs `grant_stream_sequence`, which
grants the sequence to the roles of the model that exist. Explicit grants rather than
``ALTER DEFAULT PRIVILEGES``: default privileges belong to the role that creates an object, and
would silently not apply to a stream created by anyone else (a superuser, a migrating owner).

Over-broad grants (`overbroad_grants`): a role that can sign (read the private keys), write
proofs or write keys can make followers deliver facts PostgreSQL never held; one that reads
the readers' keys without being in the model can, with access to Redis, decrypt every payload
the prover publishes. ``GRANT SELECT ON ALL TABLES IN SCHEMA public TO bi`` reaches
``streams_keys`` (never ``streams_prover``: that is why the private keys live in a schema of
their own), and membership of ``pg_read_all_data`` / ``pg_write_all_data`` reaches everything:
`overbroad_grants` finds all of them, by the privileges PostgreSQL itself would grant
(``has_table_privilege``), not by reading ACLs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from .driver import Commit, Gen, Query

__all__ = [
    "ADMIN",
    "GROUP_READER",
    "MODEL",
    "OPERATOR",
    "PROVER",
    "READER",
    "ROLES",
    "WRITER",
    "Finding",
    "RoleGrants",
    "connections_by_role",
    "create_roles",
    "grant_stream_sequence",
    "missing_grants",
    "overbroad_grants",
    "role_grants",
]

ADMIN = "streams_admin"
OPERATOR = "streams_operator"
PROVER = "streams_prover"
WRITER = "streams_writer"
READER = "streams_reader"
GROUP_READER = "streams_group_reader"
#: Every role of the model, the owner first.
ROLES = (ADMIN, OPERATOR, PROVER, WRITER, READER, GROUP_READER)
#: The roles `MODEL` grants to (the admin owns instead).
GRANTED = ROLES[1:]

#: The library's tables, all in ``public`` (revisions 0001-0011).
TABLES = (
    "streams_alembic_version",
    "streams_registry",
    "streams_incarnation",
    "streams_facts",
    "streams_writers",
    "streams_reader_groups",
    "streams_group_generations",
    "streams_proofs",
    "streams_keys",
    "streams_idempotency_keys",
    "streams_idempotency_claims",
    "streams_sink_queries",
    "streams_sink_commits",
)
#: The prover's schema and its table of private keys (revision 0012); granted only where the
#: schema exists.
PROVER_SCHEMA = "streams_prover"
SIGNING_KEYS = "streams_prover.signing_keys"

#: What every role reads to open a session: the schema's revision, the registry, the
#: database's incarnation.
_OPEN = ("streams_alembic_version", "streams_registry", "streams_incarnation")
#: What a reader reads: facts, the shared proofs and the readers' keys, positions.
_READ = (
    *_OPEN,
    "streams_facts",
    "streams_proofs",
    "streams_keys",
    "streams_writers",
    "streams_reader_groups",
    "streams_group_generations",
)
_GROUPS = ("streams_reader_groups", "streams_group_generations")

#: One grant: privileges (as SQL, column lists included) on relations.
Grant = tuple[str, tuple[str, ...]]

#: What each role may do, as the grants `create_roles` makes (every relation in ``public``
#: unless qualified). Beside these: stream sequences (`SEQUENCE_PRIVILEGES`), role
#: memberships (`MEMBERSHIPS`) and the prover's schema (`PROVER_GRANTS`).
MODEL: dict[str, tuple[Grant, ...]] = {
    READER: (("SELECT", _READ),),
    GROUP_READER: (
        ("SELECT", _READ),
        # take_generations (ON CONFLICT DO UPDATE), commit_group (FOR SHARE needs UPDATE).
        ("INSERT, UPDATE", _GROUPS),
    ),
    PROVER: (
        ("SELECT", _READ),
        # prove: the forward-only upsert of streams_proofs.
        ("INSERT, UPDATE", ("streams_proofs",)),
        # rotation, automatic after an incarnation change: a new key, the others retired.
        ("INSERT, UPDATE", ("streams_keys",)),
        ("USAGE", ("streams_keys_id_seq",)),
        # retire_expired_writers (FOR UPDATE SKIP LOCKED, then retired and generation only).
        ("UPDATE (retired, generation)", ("streams_writers",)),
    ),
    WRITER: (
        # repair reads group positions; everything else it reads is its own.
        ("SELECT", (*_OPEN, "streams_reader_groups")),
        # Every column but payload: repair's max(stream_id), the timestamp floor's max(ts),
        # RETURNING stream_id. A writer never reads what others wrote.
        ("SELECT (stream, stream_id, row_no, instance, ts), INSERT", ("streams_facts",)),
        (
            "SELECT, INSERT, UPDATE",
            ("streams_writers", "streams_idempotency_keys", "streams_idempotency_claims"),
        ),
        # The Spark sink: the query's row (FOR SHARE by tasks, FOR UPDATE SKIP LOCKED and
        # deleted by retention), task commits (inserted, deleted once the batch committed).
        ("SELECT, INSERT, UPDATE, DELETE", ("streams_sink_queries",)),
        ("SELECT, INSERT, DELETE", ("streams_sink_commits",)),
    ),
    OPERATOR: (
        ("SELECT", TABLES),
        # doctor --repair retires writers; writers prune deletes retired rows.
        ("UPDATE (retired, generation), DELETE", ("streams_writers",)),
        # prune moves pruned_through (FOR NO KEY UPDATE) and sets retention and key windows.
        ("UPDATE (pruned_through, retention_ms, key_window_ms)", ("streams_registry",)),
        ("DELETE", ("streams_facts", "streams_group_generations")),
        # prune_keys: FOR UPDATE SKIP LOCKED (one column's UPDATE suffices), then DELETE.
        ("UPDATE (claim), DELETE", ("streams_idempotency_keys", "streams_idempotency_claims")),
        # groups delete, incarnation accept.
        ("UPDATE (incarnation), DELETE", ("streams_reader_groups",)),
    ),
}

#: Privileges on each stream's sequence: ``pg_sequence_last_value`` needs SELECT (the probe,
#: positions), ``nextval`` USAGE, ``setval`` UPDATE (repair).
SEQUENCE_PRIVILEGES: dict[str, str] = {
    READER: "SELECT",
    GROUP_READER: "SELECT",
    PROVER: "SELECT",
    WRITER: "SELECT, USAGE, UPDATE",
    OPERATOR: "SELECT, UPDATE",
}

#: Predefined roles each role is made a member of.
MEMBERSHIPS: dict[str, tuple[str, ...]] = {
    OPERATOR: ("pg_signal_backend",),
    PROVER: ("pg_signal_backend",),
}

#: The prover's schema: it alone reads the private keys (and writes them when it rotates).
PROVER_GRANTS: tuple[Grant, ...] = (("SELECT, INSERT", (SIGNING_KEYS,)),)


def _oid(column: str) -> str:
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


def _create_role(role: str) -> Query:
    """``CREATE ROLE ... NOLOGIN`` unless it exists; roles are the cluster's, and two
    databases may set up their roles at the same moment: the loser's error is swallowed."""
    return Query(
        sql.SQL(
            "DO $$ BEGIN IF to_regrole({name}) IS NULL THEN CREATE ROLE {role} NOLOGIN; END IF; "
            "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
        ).format(name=sql.Literal(role), role=sql.Identifier(role))
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


def _stream_sequences() -> Gen[list[str]]:
    rows = yield Query(
        "SELECT sequence_name FROM streams_registry "
        "WHERE to_regclass(quote_ident(sequence_name)) IS NOT NULL ORDER BY id"
    )
    return [str(r[0]) for r in rows]


def _partitions() -> Gen[list[str]]:
    rows = yield Query(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'streams_facts'::regclass ORDER BY c.relname"
    )
    return [str(r[0]) for r in rows]


def _existing(names: Sequence[str]) -> Gen[list[str]]:
    """Those of ``names`` (relations) that exist, in order: a revision not run yet, or one
    that dropped a table, leaves nothing to grant or revoke on them."""
    rows = yield Query(
        "SELECT n FROM unnest(%s::text[]) WITH ORDINALITY AS t(n, i) "
        f"WHERE {_oid('n')} IS NOT NULL ORDER BY i",
        (list(names),),
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


def _has_prover_schema() -> Gen[bool]:
    rows = yield Query(
        f"SELECT {_oid('%(name)s::text')} IS NOT NULL",
        {"name": SIGNING_KEYS},
    )
    return bool(rows[0][0])


def create_roles() -> Gen[list[str]]:
    """Create the six roles (if missing) and give each exactly the model's privileges on the
    current schema, in one transaction; returns what was done, one line per step.

    Needs a superuser, or the owner of the library's objects with ``CREATEROLE``: the objects
    pass to ``streams_admin`` (an owner must be a member of the role it hands them to, so such
    an owner is made one), ``PUBLIC`` loses every privilege on them, the five other roles
    lose what they held there and get the model."""
    done: list[str] = []
    for role in ROLES:
        yield _create_role(role)
    done.append(f"roles {', '.join(ROLES)} (NOLOGIN)")
    rows = yield Query(
        "SELECT rolsuper OR pg_has_role(current_user, %s, 'MEMBER') FROM pg_roles "
        "WHERE rolname = current_user",
        (ADMIN,),
    )
    if not rows[0][0]:
        yield _grant_role_to_current(ADMIN)
        done.append(f"{ADMIN} granted to the current user, who owned the objects")
    tables = yield from _existing(TABLES)
    sequences = yield from _stream_sequences()
    partitions = yield from _partitions()
    prover = yield from _has_prover_schema()
    prover_tables = (yield from _prover_tables()) if prover else []
    admin = sql.Identifier(ADMIN)
    # A new owner must have CREATE on the schema of what it gets (unless a superuser runs this).
    yield Query(
        sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(
            sql.SQL(", ").join(sql.Identifier(r) for r in ROLES)
        )
    )
    yield Query(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(admin))
    if prover:
        yield Query(sql.SQL("ALTER SCHEMA {} OWNER TO {}").format(_relation(PROVER_SCHEMA), admin))
    # ALTER ... OWNER takes an ACCESS EXCLUSIVE lock on each table, briefly: it waits for the
    # transactions using it, and appends and reads wait behind it until this one commits.
    for table in [*tables, *partitions, *prover_tables]:
        yield Query(sql.SQL("ALTER TABLE {} OWNER TO {}").format(_relation(table), admin))
    for sequence in sequences:
        yield Query(sql.SQL("ALTER SEQUENCE {} OWNER TO {}").format(_relation(sequence), admin))
    done.append(
        f"{ADMIN} owns {len(tables)} tables, {len(partitions)} partitions, "
        f"{len(sequences)} stream sequences" + (f" and schema {PROVER_SCHEMA}" if prover else "")
    )
    everyone = sql.SQL(", ").join([sql.SQL("PUBLIC"), *(sql.Identifier(r) for r in GRANTED)])
    objects = [*tables, *partitions, *prover_tables]
    yield Query(sql.SQL("REVOKE ALL ON {} FROM {}").format(_relations(objects), everyone))
    relations = yield from _existing([*sequences, "streams_keys_id_seq", "streams_registry_id_seq"])
    if relations:
        yield Query(
            sql.SQL("REVOKE ALL ON SEQUENCE {} FROM {}").format(_relations(relations), everyone)
        )
    if prover:
        yield Query(
            sql.SQL("REVOKE ALL ON SCHEMA {} FROM {}").format(_relation(PROVER_SCHEMA), everyone)
        )
    for role, grants in MODEL.items():
        for privileges, names in grants:
            present = yield from _existing(names)
            if present:
                yield _grant(privileges, present, role)
        for member_of in MEMBERSHIPS.get(role, ()):
            yield _grant_role(role, member_of)
    if sequences:
        yield from _grant_sequences(sequences, SEQUENCE_PRIVILEGES)
    if prover:
        yield Query(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                _relation(PROVER_SCHEMA), sql.Identifier(PROVER)
            )
        )
        for privileges, names in PROVER_GRANTS:
            present = yield from _existing(names)
            if present:
                yield _grant(privileges, present, PROVER)
    yield Commit()
    schema = f"and schema {PROVER_SCHEMA} to {PROVER}" if prover else f"no {PROVER_SCHEMA}"
    done.append(f"granted the model to {', '.join(GRANTED)} ({schema})")
    return done


def _grant_role_to_current(role: str) -> Query:
    return Query(sql.SQL("GRANT {} TO CURRENT_USER").format(sql.Identifier(role)))


def _grant(privileges: str, names: Sequence[str], role: str) -> Query:
    """``GRANT privileges ON TABLE names TO role``: privileges are the model's own text
    (constants of this module), relations and role identifiers."""
    kind = "SEQUENCE" if all(n.endswith("_seq") for n in names) else "TABLE"
    return Query(
        sql.SQL("GRANT {privileges} ON {kind} {names} TO {role}").format(
            privileges=sql.SQL(privileges),
            kind=sql.SQL(kind),
            names=_relations(names),
            role=sql.Identifier(role),
        )
    )


def _grant_sequences(sequences: Sequence[str], privileges: dict[str, str]) -> Gen[None]:
    for role, granted in privileges.items():
        yield Query(
            sql.SQL("GRANT {} ON SEQUENCE {} TO {}").format(
                sql.SQL(granted), _relations(sequences), sql.Identifier(role)
            )
        )


def grant_stream_sequence(sequence: str) -> Gen[None]:
    """Grant a new stream's sequence to the roles of the model, in the caller's transaction,
    which created it (`streams.store.registry.create_stream`: its owner may grant on it). Only
    where the model is in use (`model_in_use`): the roles are the cluster's, and another
    database's roles say nothing about this one."""
    rows = yield Query(
        "SELECT r FROM unnest(%s::text[]) AS r WHERE to_regrole(r) IS NOT NULL "
        "AND (SELECT relowner FROM pg_class WHERE oid = 'streams_facts'::regclass) "
        "= to_regrole(%s)",
        (list(SEQUENCE_PRIVILEGES), ADMIN),
    )
    present = {str(r[0]) for r in rows}
    if present:
        wanted = {r: p for r, p in SEQUENCE_PRIVILEGES.items() if r in present}
        yield from _grant_sequences([sequence], wanted)


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


@dataclass(frozen=True, slots=True)
class Finding:
    """A grant the model does not allow: ``role`` (``PUBLIC`` too) may ``privileges`` on
    ``relation``; ``why`` says what that lets it do."""

    role: str
    relation: str
    privileges: tuple[str, ...]
    why: str

    def describe(self) -> str:
        return f"{self.role} may {', '.join(self.privileges)} {self.relation}: {self.why}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "relation": self.relation,
            "privileges": list(self.privileges),
            "why": self.why,
        }


_WRITES = ("INSERT", "UPDATE", "DELETE", "TRUNCATE", "TRIGGER")
_PRIVILEGES = ("SELECT", *_WRITES)

#: Per (role, relation, privilege): whether the role holds it (a column's privilege counts:
#: ``has_any_column_privilege``) and whether the role is *trusted* with the key tables (a
#: superuser; a member of the prover or admin role, or of the relation's owner). Roles are
#: every role but the predefined ``pg_*`` ones (their members are judged instead), and PUBLIC.
_HELD_SQL = """
WITH roles AS (
    SELECT r.rolname AS name, r.oid, r.rolsuper AS super FROM pg_roles r
    WHERE r.rolname NOT LIKE 'pg\\_%%'
    UNION ALL SELECT 'public', NULL, false
), rels AS (
    SELECT t.name, c.oid, c.relowner FROM unnest(%(relations)s::text[]) AS t(name)
    JOIN pg_class c ON c.oid = {oid}
)
SELECT r.name, rels.name, p.priv,
       r.super OR (r.oid IS NOT NULL AND (
           pg_has_role(r.oid, rels.relowner, 'USAGE')
           OR COALESCE(pg_has_role(r.oid, to_regrole(%(prover)s), 'USAGE'), false)
           OR COALESCE(pg_has_role(r.oid, to_regrole(%(admin)s), 'USAGE'), false))),
       r.oid IS NOT NULL AND EXISTS (
           SELECT FROM unnest(%(model)s::text[]) AS m(role)
           WHERE COALESCE(pg_has_role(r.oid, to_regrole(m.role), 'USAGE'), false))
FROM roles r CROSS JOIN rels CROSS JOIN unnest(%(privileges)s::text[]) AS p(priv)
WHERE CASE WHEN p.priv IN ('SELECT', 'INSERT', 'UPDATE')
           THEN has_any_column_privilege(r.name, rels.oid, p.priv)
           ELSE has_table_privilege(r.name, rels.oid, p.priv) END
ORDER BY r.name, rels.name, array_position(%(privileges)s::text[], p.priv)
""".replace("{oid}", _oid("t.name"))


def overbroad_grants() -> Gen[list[Finding]]:
    """Every grant on the library's objects beyond the model (see the module's docstring):

    * PUBLIC with any privilege on any of the library's tables;
    * a role other than the prover's and the admin's (and their members, superusers and the
      owner) that may read or write the private keys, or write ``streams_proofs`` or
      ``streams_keys``: it can make followers deliver facts PostgreSQL does not have;
    * a role outside the model (no member of any of its roles) that may read ``streams_keys``:
      with Redis, it reads every payload the prover publishes.

    Judged by what PostgreSQL would allow each role (inheritance, column privileges, the
    predefined ``pg_read_all_data`` / ``pg_write_all_data``), not by reading ACLs."""
    prover = yield from _has_prover_schema()
    relations = [*TABLES, *((SIGNING_KEYS,) if prover else ())]
    rows = yield Query(
        _HELD_SQL,
        {
            "relations": relations,
            "privileges": list(_PRIVILEGES),
            "prover": PROVER,
            "admin": ADMIN,
            "model": list(ROLES),
        },
    )
    yield Commit()
    held: dict[tuple[str, str], list[str]] = {}
    trusted: dict[str, bool] = {}
    in_model: dict[str, bool] = {}
    for role, relation, privilege, is_trusted, member in rows:
        held.setdefault((str(role), str(relation)), []).append(str(privilege))
        trusted[f"{role}/{relation}"] = bool(is_trusted)
        in_model[str(role)] = bool(member)
    findings: list[Finding] = []
    for (role, relation), privileges in held.items():
        if role == "public":
            findings.append(
                Finding("PUBLIC", relation, tuple(privileges), "every role may (REVOKE it)")
            )
            continue
        if trusted[f"{role}/{relation}"]:
            continue
        writes = tuple(p for p in privileges if p in _WRITES)
        if relation == SIGNING_KEYS:
            findings.append(
                Finding(role, relation, tuple(privileges), "it can sign ranges of invented facts")
            )
        elif relation in ("streams_proofs", "streams_keys") and writes:
            findings.append(
                Finding(
                    role,
                    relation,
                    writes,
                    "it can make followers skip or invent facts (only the prover may write it)",
                )
            )
        if relation == "streams_keys" and "SELECT" in privileges and not in_model[role]:
            findings.append(
                Finding(
                    role,
                    relation,
                    ("SELECT",),
                    "it reads the readers' keys outside the role model: with access to Redis "
                    "it decrypts every payload published there",
                )
            )
    return findings


def model_in_use() -> Gen[bool]:
    """Whether this database follows the model: ``streams_admin`` owns ``streams_facts``
    (`create_roles` ran here). The roles are the cluster's: that they exist says nothing about
    this database."""
    rows = yield Query(
        "SELECT c.relowner = to_regrole(%s) FROM pg_class c "
        "WHERE c.oid = 'streams_facts'::regclass",
        (ADMIN,),
    )
    yield Commit()
    return bool(rows and rows[0][0])


def _model_privileges() -> list[tuple[str, str, str]]:
    """Every ``(role, relation, privilege)`` of `MODEL`, a column privilege as the privilege
    (what ``has_any_column_privilege`` tells)."""
    found: list[tuple[str, str, str]] = []
    for role, grants in MODEL.items():
        for privileges, names in grants:
            # "SELECT (a, b), INSERT" -> SELECT, INSERT
            plain = re.sub(r"\s*\([^)]*\)", "", privileges)
            for privilege in plain.split(","):
                found += [(role, name, privilege.strip()) for name in names]
    return found


#: Which of the given ``(role, relation, privilege)`` a role lacks (a relation that does not
#: exist is not counted: a migration not run yet).
_LACKS_SQL = """
SELECT m.role, m.rel, m.priv
FROM unnest(%(roles)s::text[], %(rels)s::text[], %(privs)s::text[]) AS m(role, rel, priv)
CROSS JOIN LATERAL (SELECT {oid} AS oid) o
WHERE to_regrole(m.role) IS NOT NULL AND o.oid IS NOT NULL
  AND NOT CASE
      WHEN (SELECT relkind FROM pg_class WHERE oid = o.oid) = 'S'
          THEN has_sequence_privilege(m.role, o.oid, m.priv)
      WHEN m.priv IN ('SELECT', 'INSERT', 'UPDATE')
          THEN has_any_column_privilege(m.role, o.oid, m.priv)
      ELSE has_table_privilege(m.role, o.oid, m.priv)
  END
""".replace("{oid}", _oid("m.rel"))


def missing_grants() -> Gen[list[str]]:
    """What the model grants but a role lacks here (a table a later migration added, a stream
    sequence made outside `create_stream`): run `create_roles` again. Empty where the model is
    not in use (`model_in_use`)."""
    in_use = yield from model_in_use()
    if not in_use:
        return []
    wanted = _model_privileges()
    sequences = yield from _stream_sequences()
    for role, granted in SEQUENCE_PRIVILEGES.items():
        for privilege in granted.split(", "):
            wanted += [(role, sequence, privilege) for sequence in sequences]
    rows = yield Query(
        _LACKS_SQL,
        {
            "roles": [w[0] for w in wanted],
            "rels": [w[1] for w in wanted],
            "privs": [w[2] for w in wanted],
        },
    )
    yield Commit()
    return [f"{role} lacks {privilege} on {relation}" for role, relation, privilege in rows]


@dataclass(frozen=True, slots=True)
class RoleGrants:
    """What one role of the model holds (`role_grants`): whether it exists, who is granted it,
    which roles it is a member of, and its privileges on the library's objects (stream
    sequences counted by privilege)."""

    role: str
    exists: bool
    members: tuple[str, ...]
    member_of: tuple[str, ...]
    #: relation -> privileges, a column list after a column privilege (``UPDATE (retired)``);
    #: not the relations it owns (every privilege).
    privileges: dict[str, tuple[str, ...]]
    #: The relations (and the prover's schema) it owns.
    owns: tuple[str, ...]
    #: privilege -> how many of the stream sequences it holds it on.
    stream_sequences: dict[str, int]
    sequences: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "exists": self.exists,
            "members": list(self.members),
            "member_of": list(self.member_of),
            "privileges": {k: list(v) for k, v in self.privileges.items()},
            "owns": list(self.owns),
            "stream_sequences": {"count": self.sequences, "privileges": self.stream_sequences},
        }


#: Direct grants to a role on the library's relations: table and column privileges
#: (``aclexplode`` of ``relacl`` and ``attacl``).
_GRANTS_SQL = """
WITH rels AS (
    SELECT t.name, o.oid FROM unnest(%(relations)s::text[]) AS t(name)
    CROSS JOIN LATERAL (SELECT {oid} AS oid) o WHERE o.oid IS NOT NULL
)
SELECT rels.name, a.privilege_type, NULL::text, 0
FROM rels JOIN pg_class c ON c.oid = rels.oid CROSS JOIN aclexplode(c.relacl) a
WHERE a.grantee = to_regrole(%(role)s)
UNION ALL
SELECT rels.name, a.privilege_type, att.attname::text, att.attnum
FROM rels JOIN pg_attribute att ON att.attrelid = rels.oid AND att.attnum > 0
 AND NOT att.attisdropped AND att.attacl IS NOT NULL
CROSS JOIN aclexplode(att.attacl) a
WHERE a.grantee = to_regrole(%(role)s)
ORDER BY 1, 2, 4
""".replace("{oid}", _oid("t.name"))


def role_grants() -> Gen[list[RoleGrants]]:
    """What each role of the model holds here (`RoleGrants`), in `ROLES` order."""
    prover = yield from _has_prover_schema()
    sequences = yield from _stream_sequences()
    relations = [
        *TABLES,
        "streams_keys_id_seq",
        "streams_registry_id_seq",
        *((SIGNING_KEYS,) if prover else ()),
    ]
    found: list[RoleGrants] = []
    for role in ROLES:
        rows = yield Query("SELECT to_regrole(%s) IS NOT NULL", (role,))
        if not rows[0][0]:
            found.append(RoleGrants(role, False, (), (), {}, (), {}, len(sequences)))
            continue
        members = yield Query(
            "SELECT m.rolname FROM pg_auth_members a JOIN pg_roles m ON m.oid = a.member "
            "WHERE a.roleid = to_regrole(%s) ORDER BY 1",
            (role,),
        )
        member_of = yield Query(
            "SELECT g.rolname FROM pg_auth_members a JOIN pg_roles g ON g.oid = a.roleid "
            "WHERE a.member = to_regrole(%s) ORDER BY 1",
            (role,),
        )
        owned = yield Query(
            "SELECT t.name FROM unnest(%s::text[]) WITH ORDINALITY AS t(name, i) "
            f"JOIN pg_class c ON c.oid = {_oid('t.name')} "
            "WHERE c.relowner = to_regrole(%s) ORDER BY t.i",
            (relations, role),
        )
        owns = [str(r[0]) for r in owned]
        rows = yield Query(_GRANTS_SQL, {"relations": relations, "role": role})
        table: dict[str, list[str]] = {}
        columns: dict[tuple[str, str], list[str]] = {}
        for relation, privilege, column, _ in rows:
            if relation in owns:
                continue
            if column is None:
                table.setdefault(str(relation), []).append(str(privilege))
            else:
                columns.setdefault((str(relation), str(privilege)), []).append(str(column))
        for (relation, privilege), names in columns.items():
            table.setdefault(relation, []).append(f"{privilege} ({', '.join(names)})")
        counts: dict[str, int] = {}
        if sequences:
            held = yield Query(
                "SELECT p, count(*) FILTER (WHERE has_sequence_privilege(%s, quote_ident(s), p)) "
                "FROM unnest(%s::text[]) AS s, unnest(ARRAY['SELECT', 'USAGE', 'UPDATE']) AS p "
                "GROUP BY p ORDER BY p",
                (role, sequences),
            )
            counts = {str(p): int(n) for p, n in held if n}
        if prover:
            usage = yield Query(
                "SELECT has_schema_privilege(%s, %s, 'USAGE')", (role, PROVER_SCHEMA)
            )
            owner = yield Query(
                "SELECT nspowner = to_regrole(%s) FROM pg_namespace WHERE nspname = %s",
                (role, PROVER_SCHEMA),
            )
            if owner and owner[0][0]:
                owns.append(PROVER_SCHEMA)
            elif usage[0][0]:
                table.setdefault(PROVER_SCHEMA, []).append("USAGE")
        found.append(
            RoleGrants(
                role,
                True,
                tuple(str(r[0]) for r in members),
                tuple(str(r[0]) for r in member_of),
                {k: tuple(v) for k, v in sorted(table.items())},
                tuple(owns),
                counts,
                len(sequences),
            )
        )
    yield Commit()
    return found


def connections_by_role() -> Gen[list[tuple[str, str, int]]]:
    """The sessions connected to this database by login role and state (``active``, ``idle``,
    ``idle in transaction``...), as ``(role, state, count)`` rows: what the connection limits
    of each role (and the server's ``max_connections``) are spent on.

    ``pg_stat_activity`` shows every session's role to anyone, but the state of another role's
    session only to a superuser or a member of ``pg_read_all_stats`` (or of that role): for
    the others it is reported as ``unknown``. Background processes (no role) are left out.
    """
    rows = yield Query(
        "SELECT usename::text, COALESCE(state, 'unknown'), count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND usename IS NOT NULL "
        "GROUP BY 1, 2 ORDER BY 1, 2"
    )
    yield Commit()
    return [(str(role), str(state), int(n)) for role, state, n in rows]
