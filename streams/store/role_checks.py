"""Comparing a database with the privilege model (`streams.store.privileges`): what an
attacker with a login would look for (`overbroad_grants`, `definer_findings`), what the model
grants but a role lacks (`missing_grants`), and what each role holds (`role_grants`).

What is flagged, and why each matters:

* ``PUBLIC`` with any privilege on a library table: every login may.
* A role that may read or write the private keys, or write ``streams_proofs`` or
  ``streams_keys``, other than the prover's and the admin's (and their members, superusers,
  the owner): it can make followers deliver facts PostgreSQL never held.
* A role outside the model that may read ``streams_keys``: with access to Redis, it decrypts
  every payload the prover publishes there.
* ``INSERT`` on ``streams_facts`` itself (it reaches every stream's partition), ``UPDATE`` or
  ``TRUNCATE`` of facts (facts never change), by anyone but the owner.
* ``UPDATE`` on a stream's sequence (``setval``: IDs handed out again) by anyone but the
  definer and the owner; membership of ``pg_write_all_data`` (every table and sequence).
* Writing a reader group's position or generation directly (anyone but the definer and the
  owner): a group commit must go through ``streams_commit_group``, which checks the
  consumer's token and the bound.
* Functions that run with another role's rights (``SECURITY DEFINER``; trigger functions on
  the library's tables; event triggers) that resolve names through a ``search_path`` not
  pinned to ``pg_catalog, pg_temp``, that ``PUBLIC`` may execute (definer functions), or
  that a superuser owns; under the model, library objects a superuser owns.

Judged by what PostgreSQL would allow each role (inheritance, column privileges, the
predefined ``pg_read_all_data`` / ``pg_write_all_data``), not only by reading ACLs, except for
the per-stream objects, read from their ACLs (there may be 10^4 of them): a grant to a role is
reported once for that role.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .driver import Commit, Gen, Query
from .privileges import (
    ADMIN,
    DEFINER,
    FUNCTIONS,
    GROUP_GRANTS,
    PROVER,
    PROVER_SCHEMA,
    ROLES,
    SIGNING_KEYS,
    STREAM_PRIVILEGES,
    TABLES,
    model_privileges,
)
from .roles import SCHEMA, has_prover_schema, model_in_use, oid_sql, scoped_grantees
from .stream_objects import FACTS_TREE

__all__ = [
    "Finding",
    "RoleGrants",
    "connections_by_role",
    "definer_findings",
    "missing_grants",
    "overbroad_grants",
    "role_grants",
]

#: Every stream's partition and sequence, as ``(oid, relname, kind)`` rows, from the catalog
#: (joins, not arrays of names: there may be 10^4 streams). ``kind``: ``partition``, ``sequence``.
_STREAM_OBJECTS = """
    SELECT t.relid AS oid, c.relname::text AS relname, 'partition' AS kind
    FROM ({FACTS_TREE}) t JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf
    UNION ALL
    SELECT s.oid, s.relname::text, 'sequence' FROM streams_registry r
    JOIN pg_class s ON s.oid = to_regclass(quote_ident(r.sequence_name))
""".replace("{FACTS_TREE}", FACTS_TREE)

#: Privileges on a bucket of streams' partitions (`streams.store.registry`, "Layout") held by
#: PUBLIC, or by anyone but its owner (and its owner's members) beyond reading (a role that
#: reads every table, as a BI login does, reads the parent anyway): nobody is granted one.
_BUCKET_GRANTS_SQL = """
SELECT COALESCE(a.grantee::regrole::text, 'public'), c.relname::text,
       array_agg(DISTINCT a.privilege_type ORDER BY a.privilege_type)
FROM ({FACTS_TREE}) t JOIN pg_class c ON c.oid = t.relid
CROSS JOIN aclexplode(c.relacl) a
WHERE NOT t.isleaf AND a.grantee <> c.relowner
  AND (a.grantee = 0 OR (a.privilege_type <> 'SELECT'
                         AND NOT pg_has_role(a.grantee, c.relowner, 'USAGE')))
GROUP BY 1, 2 ORDER BY 1, 2
""".replace("{FACTS_TREE}", FACTS_TREE)

#: The ``search_path`` a function that runs with another role's rights must have.
PINNED_PATH = "search_path=pg_catalog, pg_temp"


@dataclass(frozen=True, slots=True)
class Finding:
    """Something the model does not allow: ``role`` (``PUBLIC`` too) may ``privileges`` on
    ``relation`` (or a function, or owns it); ``why`` says what that lets it do."""

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
#: superuser; a member of the prover or admin role, or of the relation's owner), and whether
#: it is in the model (a member of one of its roles, or granted some of its groups). Roles
#: are every role but the predefined ``pg_*`` ones (their members are judged instead), and
#: PUBLIC.
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
       r.oid IS NOT NULL AND (EXISTS (
           SELECT FROM unnest(%(model)s::text[]) AS m(role)
           WHERE COALESCE(pg_has_role(r.oid, to_regrole(m.role), 'USAGE'), false))
           OR r.name = ANY(%(granted)s::text[])),
       r.super OR (r.oid IS NOT NULL AND pg_has_role(r.oid, rels.relowner, 'USAGE'))
FROM roles r CROSS JOIN rels CROSS JOIN unnest(%(privileges)s::text[]) AS p(priv)
WHERE CASE WHEN p.priv IN ('SELECT', 'INSERT', 'UPDATE')
           THEN has_any_column_privilege(r.name, rels.oid, p.priv)
           ELSE has_table_privilege(r.name, rels.oid, p.priv) END
ORDER BY r.name, rels.name, array_position(%(privileges)s::text[], p.priv)
""".replace("{oid}", oid_sql("t.name"))

#: Roles (and PUBLIC) that may write a group's position or generation directly, but for the
#: definer, superusers and members of the tables' owner.
_GROUP_WRITERS_SQL = """
WITH roles AS (
    SELECT r.rolname AS name, r.oid, r.rolsuper AS super FROM pg_roles r
    WHERE r.rolname NOT LIKE 'pg\\_%%' AND r.rolname <> %(definer)s
    UNION ALL SELECT 'public', NULL, false
), cols AS (
    SELECT * FROM (VALUES ('streams_reader_groups', 'position', 'INSERT'),
                          ('streams_reader_groups', 'position', 'UPDATE'),
                          ('streams_group_generations', 'token', 'INSERT'),
                          ('streams_group_generations', 'token', 'UPDATE')) AS v(rel, col, priv)
    WHERE to_regclass(v.rel) IS NOT NULL
)
SELECT r.name, c.rel, array_agg(DISTINCT c.priv ORDER BY c.priv)
FROM roles r CROSS JOIN cols c
JOIN pg_class t ON t.oid = to_regclass(c.rel)
WHERE has_column_privilege(r.name, t.oid, c.col, c.priv)
  AND NOT r.super AND NOT (r.oid IS NOT NULL AND pg_has_role(r.oid, t.relowner, 'USAGE'))
GROUP BY r.name, c.rel ORDER BY 1, 2
"""

#: Direct grants of UPDATE on stream sequences (their ACLs), but to the definer and to a
#: member of the sequence's owner; and members of pg_write_all_data.
_SEQUENCE_SETTERS_SQL = """
SELECT COALESCE(a.grantee::regrole::text, 'PUBLIC'), count(*)
FROM ({objects}) o JOIN pg_class c ON c.oid = o.oid CROSS JOIN aclexplode(c.relacl) a
WHERE o.kind = 'sequence' AND a.privilege_type = 'UPDATE'
  AND a.grantee <> c.relowner
  AND (a.grantee = 0 OR (a.grantee <> to_regrole(%(definer)s)
       AND NOT pg_has_role(a.grantee, c.relowner, 'USAGE')
       AND NOT (SELECT rolsuper FROM pg_roles WHERE oid = a.grantee)))
GROUP BY 1
UNION ALL
SELECT m.rolname, -1 FROM pg_roles m
WHERE m.rolname NOT LIKE 'pg\\_%%' AND NOT m.rolsuper
  AND pg_has_role(m.oid, 'pg_write_all_data', 'MEMBER')
ORDER BY 1
""".replace("{objects}", _STREAM_OBJECTS)


def overbroad_grants() -> Gen[list[Finding]]:
    """Every grant on the library's objects beyond the model (see the module's docstring),
    and every function that runs with another role's rights without the defences
    (`definer_findings`)."""
    prover = yield from has_prover_schema()
    relations = [*TABLES, *((SIGNING_KEYS,) if prover else ())]
    granted: list[str] = []
    if (yield from _exists(GROUP_GRANTS)):
        rows = yield Query(f"SELECT DISTINCT grantee FROM {GROUP_GRANTS}")
        granted = [str(r[0]) for r in rows]
    rows = yield Query(
        _HELD_SQL,
        {
            "relations": relations,
            "privileges": list(_PRIVILEGES),
            "prover": PROVER,
            "admin": ADMIN,
            "model": list(ROLES),
            "granted": granted,
        },
    )
    findings = _table_findings(rows)
    rows = yield Query(_GROUP_WRITERS_SQL, {"definer": DEFINER})
    for role, relation, privileges in rows:
        findings.append(
            Finding(
                "PUBLIC" if role == "public" else str(role),
                str(relation),
                tuple(privileges),
                "it can move a reader group without its consumer's token or past max "
                "allocated, and the group's consumer then skips facts it never consumed "
                "(group commits go through streams_commit_group)",
            )
        )
    for role, relation, privileges in (yield Query(_BUCKET_GRANTS_SQL)):
        findings.append(
            Finding(
                "PUBLIC" if role == "public" else str(role),
                str(relation),
                tuple(privileges),
                "a bucket reaches the facts of every stream whose partition hangs under it: "
                "a writer is granted its streams' partitions instead",
            )
        )
    rows = yield Query(_SEQUENCE_SETTERS_SQL, {"definer": DEFINER})
    for role, count in rows:
        if count == -1:
            findings.append(
                Finding(
                    str(role),
                    "every table and sequence",
                    ("INSERT", "UPDATE", "DELETE"),
                    "a member of pg_write_all_data writes every stream, group and key, and "
                    "sets sequences back",
                )
            )
        else:
            findings.append(
                Finding(
                    str(role),
                    f"{count} stream sequence(s)",
                    ("UPDATE",),
                    "it can set a stream's sequence back (setval), and IDs readers passed are "
                    "handed out again: writers need USAGE only, repairs go through the "
                    "database's functions",
                )
            )
    findings += yield from definer_findings()
    yield Commit()
    return findings


def _exists(relation: str) -> Gen[bool]:
    rows = yield Query("SELECT to_regclass(%s) IS NOT NULL", (relation,))
    return bool(rows[0][0])


def _table_findings(rows: list[Any]) -> list[Finding]:
    held: dict[tuple[str, str], list[str]] = {}
    trusted: dict[str, bool] = {}
    owner: dict[str, bool] = {}
    in_model: dict[str, bool] = {}
    for role, relation, privilege, is_trusted, member, is_owner in rows:
        held.setdefault((str(role), str(relation)), []).append(str(privilege))
        trusted[f"{role}/{relation}"] = bool(is_trusted)
        owner[f"{role}/{relation}"] = bool(is_owner)
        in_model[str(role)] = bool(member)
    findings: list[Finding] = []
    for (role, relation), privileges in held.items():
        if role == "public":
            findings.append(
                Finding("PUBLIC", relation, tuple(privileges), "every role may (REVOKE it)")
            )
            continue
        if relation == "streams_facts" and not owner[f"{role}/{relation}"]:
            changes = tuple(p for p in privileges if p in ("INSERT", "UPDATE", "TRUNCATE"))
            if changes:
                findings.append(
                    Finding(
                        role,
                        relation,
                        changes,
                        "it writes (or changes) every stream's facts through the parent table: "
                        "a writer is granted its streams' partitions instead",
                    )
                )
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


#: Functions that run with another role's rights: SECURITY DEFINER functions outside the
#: system's schemas, trigger functions of triggers on the library's tables (they run as
#: whoever writes the table: the prover, an operator) and event triggers' functions.
_RUNS_AS_OTHERS_SQL = """
WITH f AS (
    SELECT p.oid, 'SECURITY DEFINER' AS how FROM pg_proc p
    JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE p.prosecdef AND n.nspname NOT IN ('pg_catalog', 'information_schema')
    UNION
    SELECT t.tgfoid, 'trigger on ' || t.tgrelid::regclass::text FROM pg_trigger t
    WHERE NOT t.tgisinternal AND t.tgrelid = ANY(%(tables)s::regclass[])
    UNION
    SELECT e.evtfoid, 'event trigger ' || e.evtname FROM pg_event_trigger e
)
SELECT p.oid::regprocedure::text, f.how, o.rolname, o.rolsuper,
       COALESCE(EXISTS (SELECT FROM unnest(p.proconfig) c WHERE c = %(pinned)s), false),
       p.prosecdef AND (p.proacl IS NULL OR EXISTS (
           SELECT FROM aclexplode(p.proacl) a
           WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')),
       p.prolang = (SELECT oid FROM pg_language WHERE lanname = 'sql') AND p.prosqlbody IS NOT NULL
FROM f JOIN pg_proc p ON p.oid = f.oid JOIN pg_roles o ON o.oid = p.proowner
ORDER BY 1
"""


def definer_findings() -> Gen[list[Finding]]:
    """Functions that run with another role's rights without the defences: a ``search_path``
    not pinned to ``pg_catalog, pg_temp`` (a login shadows a table or a type in ``pg_temp``,
    or a function in a schema it may create in, and its code runs with the function's
    rights), a definer function ``PUBLIC`` may execute, one a superuser owns."""
    tables = yield Query(
        "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL", (list(TABLES),)
    )
    rows = yield Query(
        _RUNS_AS_OTHERS_SQL, {"tables": [str(t[0]) for t in tables], "pinned": PINNED_PATH}
    )
    findings: list[Finding] = []
    for function, how, owner, superuser, pinned, public, bound in rows:
        what = f"{how} function {function} (owner {owner})"
        if not pinned and not bound:
            findings.append(
                Finding(
                    "any login",
                    what,
                    ("run code as its owner",),
                    "its search_path is not pinned to pg_catalog, pg_temp: a temporary table, "
                    "type or a function in a writable schema shadows what it names "
                    "(ALTER FUNCTION ... SET search_path = pg_catalog, pg_temp)",
                )
            )
        if public:
            findings.append(
                Finding(
                    "PUBLIC",
                    what,
                    ("EXECUTE",),
                    "every login may call it (REVOKE EXECUTE ... FROM PUBLIC)",
                )
            )
        if superuser:
            findings.append(
                Finding(
                    str(owner),
                    what,
                    ("own",),
                    "a superuser owns it: any flaw in it is a superuser's (give it a NOLOGIN "
                    f"owner: `streams roles create` gives the library's to {DEFINER})",
                )
            )
    in_use = yield from model_in_use()
    if in_use:
        rows = yield Query(
            "SELECT c.oid::regclass::text, o.rolname FROM pg_class c "
            "JOIN pg_roles o ON o.oid = c.relowner JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE o.rolsuper AND (c.relname LIKE 'streams\\_%%' AND n.nspname = %s "
            "OR n.nspname = %s) AND c.relkind IN ('r', 'p', 'S') ORDER BY 1",
            (SCHEMA, PROVER_SCHEMA),
        )
        for relation, owner in rows:
            findings.append(
                Finding(
                    str(owner),
                    str(relation),
                    ("own",),
                    f"a superuser owns it, not {ADMIN} (`streams roles create` hands it over)",
                )
            )
    return findings


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
""".replace("{oid}", oid_sql("m.rel"))


#: Which per-stream privileges of the model a role lacks, object by object (one pass over the
#: catalog, whatever the number of streams).
_STREAM_LACKS_SQL = """
SELECT m.role, o.relname, m.priv
FROM unnest(%(roles)s::text[], %(kinds)s::text[], %(privs)s::text[]) AS m(role, kind, priv)
JOIN ({objects}) o ON o.kind = m.kind
WHERE to_regrole(m.role) IS NOT NULL
  AND NOT CASE WHEN o.kind = 'sequence' THEN has_sequence_privilege(m.role, o.oid, m.priv)
               WHEN m.priv IN ('SELECT', 'INSERT', 'UPDATE')
               THEN has_any_column_privilege(m.role, o.oid, m.priv)
               ELSE has_table_privilege(m.role, o.oid, m.priv) END
ORDER BY m.role, o.relname, m.priv
""".replace("{objects}", _STREAM_OBJECTS)


def _plain(privileges: str) -> list[str]:
    """``"SELECT (a, b), INSERT"`` -> ``["SELECT", "INSERT"]``."""
    return [p.strip() for p in re.sub(r"\s*\([^)]*\)", "", privileges).split(",")]


def missing_grants() -> Gen[list[str]]:
    """What the model grants but a role lacks here (a table a later migration added, a stream
    made outside `create_stream`, functions a revision added): run `create_roles` again.
    Empty where the model is not in use (`model_in_use`)."""
    in_use = yield from model_in_use()
    if not in_use:
        yield Commit()
        return []
    wanted = model_privileges()
    rows = yield Query(
        _LACKS_SQL,
        {
            "roles": [w[0] for w in wanted],
            "rels": [w[1] for w in wanted],
            "privs": [w[2] for w in wanted],
        },
    )
    missing = [f"{role} lacks {privilege} on {relation}" for role, relation, privilege in rows]
    per_stream = [
        (role, kind, privilege)
        for role, objects in STREAM_PRIVILEGES.items()
        for kind, granted in zip(("partition", "sequence"), objects, strict=True)
        if granted is not None
        for privilege in _plain(granted)
    ]
    rows = yield Query(
        _STREAM_LACKS_SQL,
        {
            "roles": [w[0] for w in per_stream],
            "kinds": [w[1] for w in per_stream],
            "privs": [w[2] for w in per_stream],
        },
    )
    missing += [f"{role} lacks {privilege} on {relation}" for role, relation, privilege in rows]
    calls = [(role, signature) for signature, who in FUNCTIONS.items() for role in who]
    rows = yield Query(
        "SELECT c.role, c.f, p.proowner = to_regrole(%(definer)s) "
        "FROM unnest(%(roles)s::text[], %(functions)s::text[]) AS c(role, f) "
        "JOIN pg_proc p ON p.oid = to_regprocedure(%(schema)s || '.' || c.f) "
        "WHERE c.role = 'PUBLIC' OR to_regrole(c.role) IS NOT NULL",
        {
            "roles": [c[0] for c in calls] + [DEFINER] * len(FUNCTIONS),
            "functions": [c[1] for c in calls] + list(FUNCTIONS),
            "definer": DEFINER,
            "schema": SCHEMA,
        },
    )
    for role, function, owned in rows:
        if role == DEFINER and not owned:
            missing.append(f"{DEFINER} does not own {function}")
    rows = yield Query(
        "SELECT c.role, c.f FROM unnest(%(roles)s::text[], %(functions)s::text[]) AS c(role, f) "
        "JOIN pg_proc p ON p.oid = to_regprocedure(%(schema)s || '.' || c.f) "
        "WHERE c.role <> 'PUBLIC' AND to_regrole(c.role) IS NOT NULL "
        "AND NOT has_function_privilege(c.role, p.oid, 'EXECUTE')",
        {"roles": [c[0] for c in calls], "functions": [c[1] for c in calls], "schema": SCHEMA},
    )
    missing += [f"{role} lacks EXECUTE on {function}" for role, function in rows]
    yield Commit()
    return missing


@dataclass(frozen=True, slots=True)
class RoleGrants:
    """What one role holds (`role_grants`): whether it exists, who is granted it, which roles
    it is a member of, and its privileges on the library's objects (stream partitions and
    sequences counted by privilege, functions it may execute)."""

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
    #: privilege -> how many of the stream partitions it holds it on.
    stream_partitions: dict[str, int]
    #: The library's functions it may execute (or owns).
    functions: tuple[str, ...] = ()
    #: For a role granted some streams or groups (not a member of the every-stream role).
    streams: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "exists": self.exists,
            "members": list(self.members),
            "member_of": list(self.member_of),
            "privileges": {k: list(v) for k, v in self.privileges.items()},
            "owns": list(self.owns),
            "stream_sequences": {"count": self.sequences, "privileges": self.stream_sequences},
            "stream_partitions": {"count": self.sequences, "privileges": self.stream_partitions},
            "functions": list(self.functions),
            "streams": list(self.streams),
            "groups": list(self.groups),
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
""".replace("{oid}", oid_sql("t.name"))

#: Per role, kind of stream object and privilege, on how many objects the role holds it
#: directly (their ACLs, table or column level): one pass over the catalog for every role.
_COUNT_SQL = """
SELECT g.grantee::regrole::text, o.kind, g.p, count(DISTINCT c.oid)
FROM ({objects}) o JOIN pg_class c ON c.oid = o.oid CROSS JOIN LATERAL (
    SELECT a.grantee, a.privilege_type AS p FROM aclexplode(c.relacl) a
    UNION
    SELECT a.grantee, a.privilege_type FROM pg_attribute att CROSS JOIN aclexplode(att.attacl) a
    WHERE att.attrelid = c.oid AND att.attnum > 0 AND att.attacl IS NOT NULL
) g
WHERE g.grantee <> 0
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
""".replace("{objects}", _STREAM_OBJECTS)


def role_grants(extra: list[str] | None = None) -> Gen[list[RoleGrants]]:
    """What each role of the model holds here (`RoleGrants`), in `ROLES` order, then the
    definer, then the roles granted some streams or groups (and ``extra`` roles)."""
    prover = yield from has_prover_schema()
    rows = yield Query("SELECT count(*) FROM streams_registry")
    streams = int(rows[0][0])
    scoped = yield from scoped_grantees()
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for grantee, kind, privilege, n in (yield Query(_COUNT_SQL)):
        counts.setdefault((str(grantee), str(kind)), {})[str(privilege)] = int(n)
    relations = [
        *TABLES,
        "streams_keys_id_seq",
        "streams_registry_id_seq",
        *((SIGNING_KEYS,) if prover else ()),
    ]
    found: list[RoleGrants] = []
    for role in [*ROLES, DEFINER, *scoped, *(extra or [])]:
        rows = yield Query("SELECT to_regrole(%s) IS NOT NULL", (role,))
        if not rows[0][0]:
            found.append(RoleGrants(role, False, (), (), {}, (), {}, streams, {}))
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
            f"JOIN pg_class c ON c.oid = {oid_sql('t.name')} "
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
        on_sequences = counts.get((role, "sequence"), {})
        on_partitions = counts.get((role, "partition"), {})
        functions = yield Query(
            "SELECT f FROM unnest(%(functions)s::text[]) AS f "
            "JOIN pg_proc p ON p.oid = to_regprocedure(%(schema)s || '.' || f) "
            "WHERE p.proowner = to_regrole(%(role)s) OR EXISTS (SELECT FROM aclexplode(p.proacl) a "
            "WHERE a.grantee = to_regrole(%(role)s) AND a.privilege_type = 'EXECUTE')",
            {"functions": list(FUNCTIONS), "schema": SCHEMA, "role": role},
        )
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
        mine: tuple[str, ...] = ()
        groups: tuple[str, ...] = ()
        if role in scoped:
            held = yield Query(
                "SELECT r.name FROM streams_registry r "
                "JOIN pg_inherits i ON i.inhrelid = to_regclass('streams_facts_' || r.id) "
                "WHERE has_table_privilege(%s, i.inhrelid, 'INSERT') ORDER BY 1",
                (role,),
            )
            mine = tuple(str(r[0]) for r in held)
            held = yield Query(
                f"SELECT group_name FROM {GROUP_GRANTS} WHERE grantee = %s ORDER BY 1", (role,)
            )
            groups = tuple(str(r[0]) for r in held)
        found.append(
            RoleGrants(
                role,
                True,
                tuple(str(r[0]) for r in members),
                tuple(str(r[0]) for r in member_of),
                {k: tuple(v) for k, v in sorted(table.items())},
                tuple(owns),
                on_sequences,
                streams,
                on_partitions,
                tuple(str(r[0]) for r in functions),
                mine,
                groups,
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
