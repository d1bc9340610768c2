"""The privilege model, as data: who may do what on the library's objects (no I/O).

This is the one description of the model. `streams.store.roles` grants it
(`streams roles create`, new streams, ``streams roles grant``), `streams.store.role_checks`
compares a database with it (`streams roles check`, `streams roles show`, `streams doctor`),
the table of docs/operations.md is `privilege_table` (a test holds the two together), and the
tests log in as each role (and as `NOBODY`, `SOME_STREAMS`, `SOME_GROUPS`) and try each action
of `ACTIONS`, the privilege matrix (`privilege_matrix` renders it).

Seven group roles, all ``NOLOGIN``; people and services log in as users granted one or more
of the first six:

* ``streams_admin`` owns the library's tables, sequences, partitions and the prover's schema.
* ``streams_operator``, ``streams_prover``, ``streams_writer``, ``streams_reader``,
  ``streams_group_reader``: what `MODEL` grants (tables), `STREAM_PRIVILEGES` (each stream's
  partition and sequence), `FUNCTIONS` (the database's functions of revision 0015) and
  `MEMBERSHIPS` (predefined roles).
* ``streams_definer`` owns the ``SECURITY DEFINER`` functions and holds only what they need
  (`MODEL`, `STREAM_PRIVILEGES`): no person or service is ever granted it.

Streams and groups of one's own: ``streams_writer`` writes every stream, ``streams_group_reader``
uses every group. A role granted *some* streams (``streams roles grant ROLE --stream S``) gets
the writer's `MODEL` privileges and `FUNCTIONS`, and `STREAM_PRIVILEGES` on those streams only;
one granted some groups (``--group G``) gets the group reader's, and a row of
``streams_group_grants`` per group, which the group functions check. Such a role must not be a
member of the every-stream (every-group) role, or it would have them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from ..core.fact_columns import FACT_COLUMNS, PAYLOAD

__all__ = [
    "ACTIONS",
    "ADMIN",
    "DEFINER",
    "DEFINER_FUNCTIONS",
    "FUNCTIONS",
    "GRANTED",
    "GROUP_GRANTS",
    "GROUP_READER",
    "INVOKER_FUNCTIONS",
    "LOGINS",
    "MEMBERSHIPS",
    "MODEL",
    "NOBODY",
    "OPERATOR",
    "PROVER",
    "PROVER_GRANTS",
    "PROVER_SCHEMA",
    "READER",
    "ROLES",
    "ROLE_DOCS",
    "SIGNING_KEYS",
    "SOME_GROUPS",
    "SOME_STREAMS",
    "STREAM_PRIVILEGES",
    "TABLES",
    "WRITER",
    "Action",
    "Grant",
    "model_privileges",
    "privilege_table",
]

ADMIN: Final = "streams_admin"
OPERATOR: Final = "streams_operator"
PROVER: Final = "streams_prover"
WRITER: Final = "streams_writer"
READER: Final = "streams_reader"
GROUP_READER: Final = "streams_group_reader"
DEFINER: Final = "streams_definer"
#: Every role people log in through, the owner first.
ROLES: Final = (ADMIN, OPERATOR, PROVER, WRITER, READER, GROUP_READER)
#: The roles `MODEL` grants to (the admin owns instead).
GRANTED: Final = (OPERATOR, PROVER, WRITER, READER, GROUP_READER, DEFINER)

#: The library's tables, all in its schema (``public``).
TABLES: Final = (
    "streams_alembic_version",
    "streams_registry",
    "streams_incarnation",
    "streams_facts",
    "streams_writers",
    "streams_reader_groups",
    "streams_group_generations",
    "streams_group_grants",
    "streams_proofs",
    "streams_keys",
    "streams_idempotency_keys",
    "streams_idempotency_claims",
    "streams_sink_queries",
    "streams_sink_commits",
)
#: The table of groups granted to roles outside ``streams_group_reader`` (revision 0015).
GROUP_GRANTS: Final = "streams_group_grants"
#: The prover's schema and its table of private keys (revision 0012).
PROVER_SCHEMA: Final = "streams_prover"
SIGNING_KEYS: Final = "streams_prover.signing_keys"

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

#: Table privileges of each role (every relation in the library's schema unless qualified).
MODEL: Final[dict[str, tuple[Grant, ...]]] = {
    READER: (("SELECT", _READ),),
    # Opens and commits its groups through the database's functions (`FUNCTIONS`): it writes
    # no table, so a raw UPDATE of a group's row is refused.
    GROUP_READER: (("SELECT", _READ),),
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
        # repair reads group positions; its streams' facts come with their partitions.
        ("SELECT", (*_OPEN, "streams_reader_groups")),
        # Rows of its streams only (row security, revision 0015).
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
    # Exactly what the definer functions touch (revision 0015).
    DEFINER: (
        (
            "SELECT",
            (
                "streams_registry",
                "streams_incarnation",
                "streams_writers",
                *_GROUPS,
                GROUP_GRANTS,
            ),
        ),
        ("SELECT (stream, stream_id)", ("streams_facts",)),
        ("UPDATE (fenced_timeline)", ("streams_incarnation", "streams_registry")),
        ("INSERT, UPDATE", _GROUPS),
    ),
}

#: Privileges on each stream's own objects: ``(partition, sequence)``. ``pg_sequence_last_value``
#: needs SELECT on the sequence, ``nextval`` USAGE, ``setval`` UPDATE (the definer's alone:
#: UPDATE would let any other role set a sequence back, and also allows nextval).
#: The columns a writer may read back on its partition: all but the payload.
_ALL_BUT_PAYLOAD: Final = ", ".join(c.stored for c in FACT_COLUMNS if c is not PAYLOAD)
STREAM_PRIVILEGES: Final[dict[str, tuple[str | None, str]]] = {
    OPERATOR: ("SELECT", "SELECT"),
    PROVER: ("SELECT", "SELECT"),
    WRITER: (f"SELECT ({_ALL_BUT_PAYLOAD}), INSERT", "SELECT, USAGE"),
    READER: ("SELECT", "SELECT"),
    GROUP_READER: ("SELECT", "SELECT"),
    DEFINER: ("SELECT (stream, stream_id)", "SELECT, UPDATE"),
}

#: The functions of revisions 0015 and 0019 that run with their owner's (``streams_definer``)
#: rights, by signature, and who executes each (nobody else: not PUBLIC).
DEFINER_FUNCTIONS: Final[dict[str, tuple[str, ...]]] = {
    "streams_timeline_switchpoint(bigint)": ROLES,
    "streams_fence_timeline(bigint)": (ADMIN, OPERATOR, WRITER),
    "streams_fence_stream(integer, bigint)": (ADMIN, OPERATOR, WRITER),
    "streams_repair_sequence(integer, bigint)": (ADMIN, OPERATOR, WRITER),
    "streams_open_group(text, integer[], text)": (ADMIN, GROUP_READER),
    "streams_commit_group(text, integer[], bigint[], bigint[], bigint[], bigint[], uuid[], "
    "text, boolean)": (ADMIN, GROUP_READER),
}
#: The function that runs with the invoker's rights, owned by the definer too: the group
#: check, called inside the group functions, so executed by their owner only.
INVOKER_FUNCTIONS: Final[dict[str, tuple[str, ...]]] = {"streams_check_group(text)": ()}
#: Every function of the library and who executes it.
FUNCTIONS: Final = {**DEFINER_FUNCTIONS, **INVOKER_FUNCTIONS}

#: Predefined roles each role is made a member of: ending other roles' sessions, and for the
#: operator seeing their state, times and address (`streams doctor` names what holds a stream).
MEMBERSHIPS: Final[dict[str, tuple[str, ...]]] = {
    OPERATOR: ("pg_signal_backend", "pg_read_all_stats"),
    PROVER: ("pg_signal_backend",),
}

#: The prover's schema: it alone reads the private keys (and writes them when it rotates).
PROVER_GRANTS: Final[tuple[Grant, ...]] = (("SELECT, INSERT", (SIGNING_KEYS,)),)


def model_privileges() -> list[tuple[str, str, str]]:
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


#: Logins the matrix is tried with besides the model's roles: one with no streams role, one
#: granted some streams (``streams roles grant L --stream A``: not B), one granted some groups
#: (``--group g``: not h).
NOBODY: Final = "no streams role"
SOME_STREAMS: Final = "granted stream A"
SOME_GROUPS: Final = "granted group g"
LOGINS: Final = (*ROLES, NOBODY, SOME_STREAMS, SOME_GROUPS)


@dataclass(frozen=True, slots=True)
class Action:
    """Something a login may try, and the logins (`LOGINS`) allowed it: every other one is
    refused, by the library and by raw SQL alike (`tests/integration/test_no_escalation.py`
    tries every cell)."""

    name: str
    allowed: tuple[str, ...]


#: The privilege matrix.
ACTIONS: Final = (
    Action("read facts' payloads", (ADMIN, OPERATOR, PROVER, READER, GROUP_READER, SOME_GROUPS)),
    Action("append to stream A", (ADMIN, WRITER, SOME_STREAMS)),
    Action("append to stream B", (ADMIN, WRITER)),
    Action("insert through streams_facts (any stream)", (ADMIN,)),
    Action("insert through stream B's bucket", (ADMIN,)),
    Action("reserve IDs of stream B (nextval)", (ADMIN, WRITER)),
    Action("set a sequence (setval, back too)", (ADMIN,)),
    Action("repair stream A's sequence forward", (ADMIN, OPERATOR, WRITER, SOME_STREAMS)),
    Action("fence a new timeline (bounded skip)", (ADMIN, OPERATOR, WRITER, SOME_STREAMS)),
    Action("fence with a negative skip", ()),
    Action("fence stream A (bounded skip)", (ADMIN, OPERATOR, WRITER, SOME_STREAMS)),
    Action("fence stream B (bounded skip)", (ADMIN, OPERATOR, WRITER)),
    Action("register a writer of stream B", (ADMIN, WRITER)),
    Action("retire stream B's writers", (ADMIN, OPERATOR, PROVER, WRITER)),
    Action("commit group g (token, bound)", (ADMIN, GROUP_READER, SOME_GROUPS)),
    Action("commit group h", (ADMIN, GROUP_READER)),
    Action("commit a group past max allocated", ()),
    Action("update a group's row directly", (ADMIN,)),
    Action("delete a group", (ADMIN, OPERATOR)),
    Action("write proofs", (ADMIN, PROVER)),
    Action("read the private keys (sign)", (ADMIN, PROVER)),
    Action("end another role's session", (OPERATOR, PROVER)),
    Action("create a stream", (ADMIN,)),
)

#: For the docs' table: what each role may and may not do, and how it is granted.
ROLE_DOCS: Final[dict[str, tuple[str, str, str]]] = {
    ADMIN: (
        "everything on the library's objects, which it owns: `streams migrate`, create and "
        "drop streams, declare tables, rotate keys, read the prover's private keys, grant "
        "streams and groups (`streams roles grant`)",
        "(a superuser's powers)",
        "`GRANT streams_admin TO alice`",
    ),
    OPERATOR: (
        "`streams doctor [--repair]` (retire expired writers, repair sequences forward through "
        "the database's function, end sessions: `pg_signal_backend`; see every session's state "
        "and address: `pg_read_all_stats`), `streams prune`, "
        "`streams writers prune`, `streams groups delete`, `streams incarnation accept`, "
        "set retention and key windows; read every table of `public`",
        "read the private keys, write proofs or keys, append, reserve IDs or set a sequence, "
        "commit groups, create or drop streams",
        "`GRANT streams_operator TO ops`",
    ),
    PROVER: (
        "what a reader may, plus: write `streams_proofs`, add and retire keys (`streams_keys`, "
        "`streams_prover.signing_keys`, which it alone reads), retire writers whose lease "
        "expired and end the sessions of those writers, of frozen provers and of any session "
        "holding a stream past the lease (`pg_signal_backend`)",
        "append, commit groups, delete anything, reserve IDs or set a sequence",
        "`GRANT streams_prover TO prover`",
    ),
    WRITER: (
        "append to every stream (its partition of `streams_facts`, its writer rows, "
        "idempotency keys, the Spark sink's commits), `nextval` on every stream's sequence, "
        "repair a sequence forward and fence a new timeline through the database's functions; "
        "read the columns of its streams' facts that repair and timestamps need, never "
        "`payload`",
        "`setval` (set a sequence back), read payloads, proofs or keys, write proofs, keys "
        "or groups",
        "`GRANT streams_writer TO orders_api`; some streams only: "
        "`streams roles grant orders_api --stream orders`",
    ),
    READER: (
        "read facts, proofs, the readers' keys, writers' and groups' rows",
        "write anything: facts, proofs, keys, groups, writer rows, sequences",
        "`GRANT streams_reader TO dashboard`",
    ),
    GROUP_READER: (
        "what a reader may, plus open and commit every group through the database's "
        "functions (which check the consumer's generation token, forward only, at most max "
        "allocated)",
        "write a group's row directly; write facts, proofs, keys; delete groups",
        "`GRANT streams_group_reader TO billing`; some groups only: "
        "`streams roles grant billing --group invoices`",
    ),
    DEFINER: (
        "own the database's `SECURITY DEFINER` functions, with just what they need "
        "(`setval` on stream sequences, the groups' tables, the timeline's history file)",
        "log in; be granted to anyone",
        "(nobody: `streams roles create` makes it)",
    ),
}


def privilege_table() -> str:
    """The docs' table of roles (docs/operations.md, "Roles and privileges")."""
    lines = ["| role | may | may not | grant |", "|---|---|---|---|"]
    for role in (*ROLES, DEFINER):
        may, may_not, grant = ROLE_DOCS[role]
        lines.append(f"| `{role}` | {may} | {may_not} | {grant} |")
    return "\n".join(lines)


def privilege_matrix() -> str:
    """`ACTIONS` as a markdown table: a row per action, a column per login."""
    short = [login.removeprefix("streams_") for login in LOGINS]
    lines = ["| action | " + " | ".join(short) + " |", "|---" * (len(LOGINS) + 1) + "|"]
    for action in ACTIONS:
        cells = ["yes" if login in action.allowed else "-" for login in LOGINS]
        lines.append(f"| {action.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
