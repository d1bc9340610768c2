"""The privilege model is one description (`streams.store.privileges`): the docs' table is
rendered from it, and revisions 0015 and 0019 create exactly the functions it grants."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from helpers import REPO_ROOT

from streams.store import privileges
from streams.store.privileges import (
    ACTIONS,
    DEFINER_FUNCTIONS,
    FUNCTIONS,
    LOGINS,
    MODEL,
    ROLES,
    STREAM_PRIVILEGES,
    privilege_matrix,
    privilege_table,
)


def _revision(name: str) -> object:
    path = REPO_ROOT / "migrations" / "versions" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"revision_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normal(signature: str) -> str:
    """``f(pg_catalog.int8, pg_catalog.int4[])`` -> ``f(bigint, integer[])``, as PostgreSQL
    prints a ``regprocedure``."""
    names = {"int8": "bigint", "int4": "integer", "bool": "boolean", "text": "text", "uuid": "uuid"}
    return re.sub(
        r"pg_catalog\.(\w+)", lambda m: names[m.group(1)], signature.replace(" ", "")
    ).replace(",", ", ")


def test_the_docs_table_is_the_models() -> None:
    operations = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert privilege_table() in operations


def test_revisions_0015_and_0019_create_the_functions_the_model_grants() -> None:
    revision = _revision("0015_enforced_privileges")
    fences = _revision("0019_stream_fences")
    definer = {_normal(s) for s in revision.FUNCTIONS} | {  # type: ignore[attr-defined]
        _normal(fences.SIGNATURE)  # type: ignore[attr-defined]
    }
    made = definer | {_normal(s) for s in revision.INVOKER_FUNCTIONS}  # type: ignore[attr-defined]
    assert made == set(FUNCTIONS)
    assert definer == set(DEFINER_FUNCTIONS)
    assert revision.DEFINER == privileges.DEFINER  # type: ignore[attr-defined]
    assert fences.DEFINER == privileges.DEFINER  # type: ignore[attr-defined]


def test_every_role_named_is_a_role_of_the_model() -> None:
    known = {*ROLES, privileges.DEFINER, "PUBLIC"}
    assert set(MODEL) <= known and set(STREAM_PRIVILEGES) <= known
    assert all(set(who) <= known for who in FUNCTIONS.values())
    assert all(set(a.allowed) <= set(LOGINS) for a in ACTIONS)
    # Nobody but the definer may set a sequence; only writers reserve IDs.
    for role, (_, on_sequence) in STREAM_PRIVILEGES.items():
        assert ("UPDATE" in on_sequence) == (role == privileges.DEFINER), role
        assert ("USAGE" in on_sequence) == (role == privileges.WRITER), role
    # No table privilege of the model lets a role write the groups' tables but the definer.
    for role, grants in MODEL.items():
        for privilege, names in grants:
            writes = {"INSERT", "UPDATE"} & set(re.split(r"[ ,()]+", privilege))
            if writes and {"streams_reader_groups", "streams_group_generations"} & set(names):
                assert role in (privileges.DEFINER, privileges.OPERATOR), role
                if role == privileges.OPERATOR:
                    assert privilege.startswith("UPDATE (incarnation)"), privilege


def test_the_matrix_renders_every_action_and_login() -> None:
    lines = privilege_matrix().splitlines()
    assert len(lines) == len(ACTIONS) + 2
    assert all(line.count("|") == len(LOGINS) + 2 for line in lines)


def test_revision_0020_refuses_what_the_lock_table_cannot_hold() -> None:
    """The upgrade locks every table of streams_facts's tree at once: at PostgreSQL's defaults
    (64 locks per transaction, 100 connections) a few hundred streams pass, 10,000 do not, and
    the setting it asks for then is enough."""
    revision: Any = _revision("0020_domain_checks")
    needed = revision.needed_locks_setting
    assert needed(1 + 500, 64, 100) is None
    asked = needed(1 + 10_000 + 40, 64, 100)
    assert asked is not None and asked > 64
    assert needed(1 + 10_000 + 40, asked, 100) is None
    assert needed(1 + 10_000 + 40, asked - 1, 100) is not None
