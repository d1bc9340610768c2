"""The shape of `streams`: exported names, the error tree, the pure core, the layers of the
import graph, and the package list of the wheel. No servers: this is the fast loop's too.

The layers, from the bottom (a module imports only from its own layer or below; the two I/O
packages never import each other; there are no import cycles):

0. `streams.errors`, `streams.config`, `streams._aio`: foundations;
1. `streams.core`: the pure model (sans-IO);
2. `streams.store` (PostgreSQL) and `streams.transport` (Redis): the I/O;
3. `streams.writer` (with `streams.heartbeat`, `streams.fact_blocks`, `streams.plans`),
   `streams.reader`, `streams.proofs`, `streams.migrate`: the shells that drive them;
4. `streams.client`, `streams.metrics`, `streams` itself: the entry points;
5. `streams.ops`, `streams.bench`, `streams.__main__`: the operator's surface.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT

import streams
import streams.errors

PACKAGE_DIR = Path(streams.__file__).resolve().parent

#: The pure core: every module of `streams.core` (sans-IO), and `streams.config`.
PURE_FILES = (
    *sorted(p for p in (PACKAGE_DIR / "core").glob("*.py") if p.name != "__init__.py"),
    PACKAGE_DIR / "config.py",
)
PURE_MODULES = tuple(path.stem for path in PURE_FILES)
#: What a pure module may import of `streams`: the core itself and the error tree.
PURE_ALLOWED = frozenset({"streams.core", "streams.errors"})
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
    "streams_sink_commits",
    "streams_sink_queries",
    "streams_writers",
)
VERSION_TABLE = "streams_alembic_version"
HEAD = "0011_incarnation_generations"


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


@pytest.mark.parametrize("path", PURE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_pure_module_imports_no_io(path: Path) -> None:
    seen = list(_imports(path))
    assert seen, "no imports found: is the parser looking at the right file?"
    io = sorted(name for level, name in seen if level == 0 and _is_io(name))
    assert io == [], f"{path.name} imports I/O modules"
    package = "streams.core" if path.parent.name == "core" else "streams"
    for level, name in seen:
        if level == 0 and not name.startswith("streams"):
            continue
        absolute = (
            name
            if level == 0
            else ".".join(
                [*package.split(".")[: len(package.split(".")) - level + 1], name]
            ).rstrip(".")
        )
        assert any(
            absolute == allowed or absolute.startswith(f"{allowed}.") for allowed in PURE_ALLOWED
        ), f"{path.name} imports {absolute}"


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
# Layers and cycles

LAYERS = (
    ("streams.errors", "streams.config", "streams._aio"),
    ("streams.core",),
    ("streams.store", "streams.transport"),
    (
        "streams.writer",
        "streams.heartbeat",
        "streams.fact_blocks",
        "streams.plans",
        "streams.reader",
        "streams.proofs",
        "streams.migrate",
        "streams.orm",
    ),
    ("streams.client", "streams.metrics", "streams"),
    ("streams.ops", "streams.bench", "streams.__main__"),
)
#: Packages of one layer that must not import each other.
APART = (("streams.store", "streams.transport"),)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _group(module: str) -> str:
    """The layer entry a module belongs to (its package, or itself at the top level)."""
    for layer in LAYERS:
        for entry in sorted(layer, key=len, reverse=True):
            if module == entry or (entry != "streams" and module.startswith(f"{entry}.")):
                return entry
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _layer(module: str) -> int:
    group = _group(module)
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    """module -> the `streams` modules it imports (at any depth, or at module level only)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        found: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                if module == "streams" or module.startswith("streams."):
                    for alias in node.names:  # `from . import x`: x may be a module
                        candidate = f"{module}.{alias.name}"
                        is_module = (PACKAGE_DIR.parent / candidate.replace(".", "/")).with_suffix(
                            ".py"
                        ).exists() or (PACKAGE_DIR.parent / candidate.replace(".", "/")).is_dir()
                        found.add(candidate if is_module else module)
            elif isinstance(node, ast.Import):
                found |= {
                    a.name
                    for a in node.names
                    if a.name == "streams" or a.name.startswith("streams.")
                }
        graph[name] = found - {name}
    return graph


def test_every_module_is_in_a_layer_below_what_imports_it() -> None:
    wrong = []
    for module, imported in _graph(top_level_only=False).items():
        for target in imported:
            if target == "streams" and module != "streams":
                continue  # `from streams import __version__`: a constant, not a layer
            if _layer(target) > _layer(module):
                wrong.append(f"{module} (layer {_layer(module)}) imports {target}")
            for a, b in APART:
                if {_group(module), _group(target)} == {a, b}:
                    wrong.append(f"{module} imports {target}: {a} and {b} stay apart")
    assert wrong == []


def test_no_import_cycles() -> None:
    graph = _graph(top_level_only=True)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # `streams/__init__` re-exports from its subpackages, which Python imports first anyway.
    assert [c for c in cycles if "streams" not in c] == []


def test_the_wheel_lists_every_package() -> None:
    """`pyproject.toml` names each package (setuptools ships only those): a new package
    directory without its line would be missing from the wheel."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        _module_name(init)
        for init in PACKAGE_DIR.rglob("__init__.py")
        if "_migrations" not in str(init)
    }
    found |= {"streams._migrations", "streams_spark"}
    assert listed == found
