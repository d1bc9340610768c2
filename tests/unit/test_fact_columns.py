"""A fact's columns are defined once (`streams.core.fact_columns`) and read by name.

Everything else derives from the definition: a spelled-out list of a fact's columns outside it
(a SQL text naming ``stream_id, row_no``, a tuple of the column names), or an Arrow column read
by position (``.column(3)``, ``.column(i)`` in a loop over ``range``), fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from streams.core.epochs import Fact
from streams.core.fact_columns import (
    EXPOSED_NAMES,
    FACT_COLUMNS,
    FACT_FIELDS,
    ROW_COLUMNS,
    ROW_INDEX,
    STORED_NAMES,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFINITION = REPO_ROOT / "streams" / "core" / "fact_columns.py"
SOURCES = tuple(
    sorted(
        [
            *(REPO_ROOT / "streams").rglob("*.py"),
            *(REPO_ROOT / "spark" / "streams_spark").rglob("*.py"),
        ]
    )
)
#: Two consecutive fact columns in a SQL text: a spelled-out column list (or key).
SPELLED = re.compile(r"\bstream_id\s*,\s*row_no\b|\brow_no\s*,\s*instance\b|\binstance\s*,\s*ts\b")
NAMES = frozenset(STORED_NAMES) | frozenset(EXPOSED_NAMES)
#: ``.column(...)`` calls whose argument is an index but not a fact column's, with the reason.
_SINK = "the sink reads the columns of the user's DataFrame, not a fact's columns"
EXEMPT_POSITIONS = {
    ("spark/streams_spark/sink.py", "plan.payload_index"): _SINK,
    ("spark/streams_spark/sink.py", "plan.timestamp_index"): _SINK,
    ("spark/streams_spark/sink.py", "plan.key_index"): _SINK,
    ("spark/streams_spark/sink.py", "index"): _SINK + " (``plan.payload_object``'s fields)",
}
#: Files that spell fact columns, with the reason. Not fact columns: the demo's sink table.
EXEMPT_SPELLED = {
    "spark/streams_spark/demo_query.py": "the demo's sink table (a user's table), not facts",
    "streams/ops/demo.py": "the demo's sink table (a user's table), not facts",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes (prose may name the columns)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def spelled_lists(path: Path) -> list[str]:
    """Where ``path`` spells a list of a fact's columns instead of deriving it."""
    tree = ast.parse(path.read_text(), str(path))
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if SPELLED.search(node.value):
                found.append(f"{path.name}:{node.lineno}: {node.value.strip()[:60]!r}")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES]
            if len(names) >= 3:
                found.append(f"{path.name}:{node.lineno}: {names}")
    return found


def positional_reads(path: Path) -> list[str]:
    """Where ``path`` reads an Arrow column by position (`EXEMPT_POSITIONS` aside)."""
    tree = ast.parse(path.read_text(), str(path))
    relative = path.relative_to(REPO_ROOT).as_posix()
    counters: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For | ast.comprehension)
            and isinstance(node.iter, ast.Call)
            and isinstance(node.iter.func, ast.Name)
            and node.iter.func.id in ("range", "enumerate")
        ):
            counters |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "column"
            and node.args
        ):
            continue
        arg = node.args[0]
        text = ast.unparse(arg)
        if (relative, text) in EXEMPT_POSITIONS:
            continue
        if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
            found.append(f"{relative}:{node.lineno}: .column({text})")
        elif isinstance(arg, ast.Name) and arg.id in counters:
            found.append(f"{relative}:{node.lineno}: .column({text}) in a loop over positions")
        elif "index" in text or "idx" in text:
            found.append(f"{relative}:{node.lineno}: .column({text})")
    return found


def test_the_definition_is_consistent() -> None:
    assert FACT_COLUMNS[1:] == ROW_COLUMNS
    assert {c.stored: ROW_INDEX[c.stored] for c in ROW_COLUMNS} == dict(ROW_INDEX)
    assert len(set(STORED_NAMES)) == len(set(EXPOSED_NAMES)) == len(FACT_COLUMNS)


def test_fact_fields_follow_the_definition() -> None:
    assert Fact._fields == FACT_FIELDS


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_fact_column_list_is_spelled_outside_the_definition(path: Path) -> None:
    if path == DEFINITION or path.relative_to(REPO_ROOT).as_posix() in EXEMPT_SPELLED:
        return
    assert spelled_lists(path) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_arrow_column_is_read_by_position(path: Path) -> None:
    assert positional_reads(path) == []


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    source = (
        'SQL = "SELECT stream_id, row_no FROM t"\n'
        'NAMES = ("stream", "stream_id", "row_no")\n'
        "def f(batch):\n"
        "    x = batch.column(3)\n"
        "    return [batch.column(i) for i in range(5)]\n"
    )
    path = REPO_ROOT / "streams" / "core" / "_probe_fact_columns.py"
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert len(spelled_lists(probe)) == 2
    try:
        path.write_text(source)
        assert len(positional_reads(path)) == 2
    finally:
        path.unlink()
