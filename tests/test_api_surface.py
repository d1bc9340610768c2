"""The public surface of `streams`: exported names, the error tree, pure modules, packaging,
and the Alembic migration run the way an operator runs it (``alembic upgrade head`` in a
checkout) as well as programmatically (`streams.migrate.upgrade`).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from servers import create_database, drop_database

import streams
import streams.errors
from streams.migrate import current_revision, upgrade

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = Path(streams.__file__).resolve().parent

PURE_MODULES = (
    "positions",
    "timestamps",
    "protocol",
    "frontier",
    "config",
    "epochs",
    "replication",
    "constants",
)
#: Pure modules may import these `streams` modules (themselves free of I/O) and nothing else.
PURE_SIBLINGS = frozenset({*PURE_MODULES, "errors"})
IO_MODULES = frozenset(
    {
        "socket",
        "asyncio",
        "psycopg",
        "redis",
        "sqlalchemy",
        "alembic",
        "subprocess",
        "select",
        "selectors",
        "ssl",
        "http",
        "urllib.request",
        "multiprocessing",
    }
)
TABLES = (
    "streams_facts",
    "streams_proofs",
    "streams_reader_groups",
    "streams_registry",
    "streams_writers",
)
VERSION_TABLE = "streams_alembic_version"
HEAD = "0006_partitions"


# ---------------------------------------------------------------------------------------------
# Exported names


def test_all_names_exist() -> None:
    missing = [name for name in streams.__all__ if not hasattr(streams, name)]
    assert missing == []


def test_all_is_sorted_and_unique() -> None:
    assert list(streams.__all__) == sorted(set(streams.__all__))


def test_errors_all_are_streams_errors() -> None:
    assert list(streams.errors.__all__) == sorted(set(streams.errors.__all__))
    for name in streams.errors.__all__:
        cls = getattr(streams.errors, name)
        assert isinstance(cls, type), name
        assert issubclass(cls, streams.StreamsError), name
        # Every error is also reachable from the top-level package.
        assert getattr(streams, name) is cls, name


def _drawn_tree(doc: str) -> dict[str, str]:
    """Child -> parent, as drawn in the box-drawing tree of the errors module docstring."""
    lines = doc.splitlines()
    (root_index,) = [i for i, line in enumerate(lines) if line.strip() == "StreamsError"]
    indent = len(lines[root_index]) - len(lines[root_index].lstrip())
    parents: dict[str, str] = {}
    stack = ["StreamsError"]
    for line in lines[root_index + 1 :]:
        if not line.strip():
            break
        match = re.match(r"((?:[│ ]   )*)[├└]── (\w+)", line[indent:])
        if match is None:
            continue  # a continuation line of a description
        depth = len(match.group(1)) // 4 + 1
        name = match.group(2)
        del stack[depth:]
        assert len(stack) == depth, f"tree line skips a level: {line!r}"
        parents[name] = stack[-1]
        stack.append(name)
    return parents


def test_error_tree_docstring_is_true() -> None:
    doc = streams.errors.__doc__
    assert doc is not None
    for name in streams.errors.__all__:
        assert re.search(rf"\b{name}\b", doc), f"{name} missing from the drawn error tree"
    drawn = _drawn_tree(doc)
    assert set(drawn) == set(streams.errors.__all__) - {"StreamsError"}
    for name, parent in drawn.items():
        cls = getattr(streams.errors, name)
        bases = [b.__name__ for b in cls.__bases__ if issubclass(b, streams.StreamsError)]
        assert bases == [parent], f"{name} is drawn under {parent} but derives from {bases}"


# ---------------------------------------------------------------------------------------------
# Pure modules


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(level, dotted name) of everything a module imports, at any depth of its code."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            yield node.level, module
            for alias in node.names:
                yield node.level, f"{module}.{alias.name}" if module else alias.name


def _is_io(name: str) -> bool:
    return any(name == bad or name.startswith(f"{bad}.") for bad in IO_MODULES)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_no_io(module: str) -> None:
    path = PACKAGE_DIR / f"{module}.py"
    seen = list(_imports(path))
    assert seen, "no imports found: is the parser looking at the right file?"
    io = sorted(name for level, name in seen if level == 0 and _is_io(name))
    assert io == [], f"{path.name} imports I/O modules"
    siblings = {name for level, name in seen if level and name} | {
        name.removeprefix("streams.") for level, name in seen if name.startswith("streams.")
    }
    for name in siblings:
        assert name.split(".")[0] in PURE_SIBLINGS, f"{path.name} imports streams.{name}"


def test_io_check_catches_io_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nfrom urllib import request\ndef f():\n    import asyncio.tasks\n",
        encoding="utf-8",
    )
    names = [name for _, name in _imports(sample) if _is_io(name)]
    assert names == ["urllib.request", "asyncio.tasks"]
    assert not _is_io("urllib.parse")
    assert not _is_io("sslx")


# ---------------------------------------------------------------------------------------------
# Packaging


def test_py_typed_is_installed() -> None:
    assert (PACKAGE_DIR / "py.typed").is_file()


def test_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", streams.__version__)


# ---------------------------------------------------------------------------------------------
# Alembic in a checkout vs `streams.migrate`


@pytest.fixture
def empty_database(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url, prefix="streams_alembic")
    yield url
    drop_database(postgres_admin_url, urlsplit(url).path.lstrip("/"))


def _alembic(url: str, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_")}
    env["STREAMS_DATABASE_URL"] = url
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"alembic {' '.join(args)}: {proc.stdout}\n{proc.stderr}"


def _tables(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = current_schema() AND table_name LIKE 'streams%'"
        ).fetchall()
    return {row[0] for row in rows}


def _sequences(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT sequence_name FROM information_schema.sequences "
            "WHERE sequence_schema = current_schema()"
        ).fetchall()
    return {row[0] for row in rows}


def test_alembic_upgrade_downgrade_and_streams_migrate(empty_database: str) -> None:
    url = empty_database
    assert _tables(url) == set()

    _alembic(url, "upgrade", "head")
    assert _tables(url) == {*TABLES, VERSION_TABLE}
    assert current_revision(url) == HEAD
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(HEAD,)]

    # A stream's sequence is part of the schema too: downgrade must remove it.
    with streams.connect(url) as client:
        info = client.create_stream("alembic-check")
        with client.writer("alembic-check", instance="alembic-test") as writer:
            assert writer.append({"n": 1}).first_id == 1
    assert info.sequence_name in _sequences(url)

    _alembic(url, "downgrade", "base")
    assert set(TABLES).isdisjoint(_tables(url))
    assert current_revision(url) is None
    assert _sequences(url) == set()

    upgrade(url)
    assert set(TABLES) <= _tables(url)
    assert current_revision(url) == HEAD
    upgrade(url)  # idempotent
    assert current_revision(url) == HEAD
    with streams.connect(url) as client:
        assert client.streams() == []
