"""The shape of `streams`: exported names, the error tree, the pure core, the layers of the
import graph, module names, and the package list of the wheel. No servers: this is the fast
loop's too.

The layers, from the bottom (a module imports only from its own layer or below; the two I/O
packages never import each other; there are no import cycles, imports inside functions
counted; and no two modules share a file name):

0. `streams.errors`, `streams.config`, `streams.redis_urls`, `streams._aio`, `streams._gc`, and
   `streams.plans`, the kernel of steps and drivers every I/O component is written on:
   foundations;
1. `streams.core`: the pure model (sans-IO);
2. `streams.types`: the data types callers see, made and read by the store;
3. `streams.store` (PostgreSQL) and `streams.transport` (Redis): the I/O;
4. `streams.writer` (with `streams.heartbeat`, `streams.fact_blocks`),
   `streams.reader`, `streams.proofs`, `streams.migrate`: the shells that drive them;
5. `streams.client` (with `streams.client_plans`), `streams.metrics`, `streams.connector`,
   `streams` itself: the entry points; and `streams.devservers`, the embedded servers that
   the entry points find when no URL is configured (`streams up`);
6. `streams.cli_params`, `streams.plugins`: what every command shares;
7. `streams.ops`, `streams.bench`: the operator's commands and the benchmarks, kept apart;
8. `streams.command`, `streams.__main__`: the `streams` command, composed of both.

The library never imports the Spark connector (`streams_spark`): the command finds what the
connector adds through entry points. Outside the package: the Spark connector imports of
`streams` only the public API (`streams`, `streams.errors`, `streams.config`) and the
connectors' face (`streams.connector`), never a module of the store, the transport or the core
(its benchmarks, a ``bench*`` module or sub-package, may also import `streams.bench` and
`streams.cli_params`); the examples (`examples/`, `spark/examples/`) import only the public
API, `streams` and `streams_spark`.
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
    PACKAGE_DIR / "redis_urls.py",
)
PURE_MODULES = tuple(path.stem for path in PURE_FILES)
#: What a pure module may import of `streams`: the core itself, the error tree, the URL parser.
PURE_ALLOWED = frozenset({"streams.core", "streams.errors", "streams.redis_urls"})
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
HEAD = "0020_domain_checks"


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
    (
        "streams.errors",
        "streams.config",
        "streams.redis_urls",
        "streams._aio",
        "streams._gc",
        "streams.plans",
    ),
    ("streams.core",),
    ("streams.types",),
    ("streams.store", "streams.transport"),
    (
        "streams.writer",
        "streams.heartbeat",
        "streams.fact_blocks",
        "streams.reader",
        "streams.reader_plans",
        "streams.arrow",
        "streams.proofs",
        "streams.migrate",
        "streams.orm",
    ),
    (
        "streams.client",
        "streams.client_plans",
        "streams.metrics",
        "streams.connector",
        "streams",
        "streams.devservers",
    ),
    ("streams.cli_params", "streams.plugins"),
    ("streams.ops", "streams.bench"),
    ("streams.command", "streams.__main__"),
)
#: Packages of one layer that must not import each other.
APART = (("streams.store", "streams.transport"), ("streams.ops", "streams.bench"))


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


#: How a module writes ``if TYPE_CHECKING:``.
TYPING_ONLY = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _run(nodes: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of the code that runs, at any depth (functions and classes included), but
    not the bodies of ``if TYPE_CHECKING:`` (typing only: their ``else`` runs)."""
    for node in nodes:
        if isinstance(node, ast.If) and ast.unparse(node.test) in TYPING_ONLY:
            yield node.test
            yield from _run(node.orelse)
            continue
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _run([child])
            else:
                yield from ast.walk(child)


def _graph(*, typing: bool) -> dict[str, set[str]]:
    """module -> the `streams` modules it imports, at any depth (functions included); with
    ``typing``, also those under ``if TYPE_CHECKING:`` (else: `_run`)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = list(ast.walk(tree)) if typing else list(_run(tree.body))
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
    for module, imported in _graph(typing=True).items():
        for target in imported:
            if target == "streams" and module != "streams":
                continue  # `from streams import __version__`: a constant, not a layer
            if _layer(target) > _layer(module):
                wrong.append(f"{module} (layer {_layer(module)}) imports {target}")
            for a, b in APART:
                if {_group(module), _group(target)} == {a, b}:
                    wrong.append(f"{module} imports {target}: {a} and {b} stay apart")
    assert wrong == []


def test_the_library_never_imports_the_connector() -> None:
    """`streams_spark` is found through entry points (`streams.plugins`), never imported."""
    wrong = [
        f"{_module_name(path)} imports {name}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for level, name in _imports(path)
        if level == 0 and (name == "streams_spark" or name.startswith("streams_spark."))
    ]
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The cycles of ``graph``, each as the modules it runs through (a strongly connected
    component: a module on a cycle with every module it reaches and is reached from)."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    return {
        frozenset({m} | {n for n in reach[m] if m in reach.get(n, ())})
        for m in graph
        if m in reach[m]
    }


def test_no_import_cycles() -> None:
    """No cycle among the imports of the modules (relative ones resolved; those inside
    functions counted, those under ``if TYPE_CHECKING:`` left out)."""
    assert sorted(sorted(c) for c in _cycles(_graph(typing=False))) == []


def test_cycle_check_catches_cycles() -> None:
    code = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
        "try:\n    import b\nexcept ImportError:\n    import c\n"
        "def f():\n    import d\n"
    )
    found = [
        alias.name
        for node in _run(ast.parse(code).body)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    assert found == ["b", "c", "d"]
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": set(), "d": {"d", "e"}}
    assert _cycles(graph) == {frozenset({"a", "b"}), frozenset({"d"})}


def test_no_two_modules_share_a_file_name() -> None:
    """A module's file name says which one it is (in a traceback, a search, a diff)."""
    names = [p.name for p in PACKAGE_DIR.rglob("*.py") if p.name != "__init__.py"]
    assert sorted({name for name in names if names.count(name) > 1}) == []


#: The modules that advance generators by hand: the kernel's two drivers, and the store's
#: statement level below them (a session's statements: psycopg's and ADBC's drivers, and the
#: adapter that runs a range plan as plain queries).
GENERATOR_DRIVERS = {
    "streams/plans.py",
    "streams/store/driver.py",
    "streams/store/arrow_reads.py",
    "streams/store/reads.py",
}


def _drives_by_hand(source: str) -> list[int]:
    """Lines that resume a generator: ``x.throw(...)``, or ``plan.send(...)``/``gen.send(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, node.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if attr == "throw" or (attr == "send" and ("plan" in name or "gen" in name)):
                found.append(node.lineno)
    return found


def test_only_the_kernel_drives_plans() -> None:
    """Every I/O component is plans run by `streams.plans.drive`/`adrive` (issue 39): a new
    hand-written driver loop here is a second copy of the error and cancellation policy."""
    roots = (PACKAGE_DIR, SPARK_DIR)
    found = [
        f"{path.relative_to(REPO_ROOT if root is SPARK_DIR else PACKAGE_DIR.parent)}:{line}"
        for root in roots
        for path in sorted(root.rglob("*.py"))
        for line in _drives_by_hand(path.read_text())
    ]
    assert [f for f in found if f.split(":")[0] not in GENERATOR_DRIVERS] == []


def test_the_driver_check_catches_a_loop() -> None:
    loop = "def f(plan):\n    while True:\n        op = plan.send(None)\n        plan.throw(E)\n"
    assert _drives_by_hand(loop) == [3, 4]
    assert _drives_by_hand("sock.send(b'x')\n") == []


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
    found |= {"streams._migrations"}
    found |= {
        ".".join(init.parent.relative_to(REPO_ROOT / "spark").parts)
        for init in (REPO_ROOT / "spark" / "streams_spark").rglob("__init__.py")
    }
    assert listed == found


# ---------------------------------------------------------------------------------------------
# The Spark connector and the examples: the public API and the connectors' face only

SPARK_DIR = REPO_ROOT / "spark" / "streams_spark"
EXAMPLE_FILES = tuple(
    sorted(
        [*(REPO_ROOT / "examples").rglob("*.py"), *(REPO_ROOT / "spark" / "examples").rglob("*.py")]
    )
)
#: The modules of `streams` that are public besides the package itself (its errors and
#: settings are re-exported by it), and the face connectors build on.
#: (`streams.core.fact_columns`: the one definition of a fact's columns, pure, which the
#: connector's schema is derived from; `streams.store.arrow_reads`: the one Arrow read path,
#: which the executors drive the store's plans by.)
CONNECTOR_ALLOWED = (
    "streams.errors",
    "streams.config",
    "streams.connector",
    "streams.core.fact_columns",
    "streams.store.arrow_reads",
)
#: What a connector's benchmarks may import besides: the benchmarks' toolkit and the parameter
#: types every command of `streams` shares (they are commands of `streams bench`).
BENCH_ALLOWED = ("streams.bench", "streams.cli_params")


def _public(package: str) -> frozenset[str]:
    """``package`` and ``package.<name>`` for every name of its ``__all__``."""
    module = __import__(package)
    return frozenset({package, *(f"{package}.{name}" for name in module.__all__)})


def _within(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == module or name.startswith(f"{module}.") for module in modules)


def _is_bench(path: Path) -> bool:
    """A connector's benchmark: a ``bench*`` module or anything in a ``bench*`` sub-package."""
    parts = path.relative_to(SPARK_DIR).parts
    return any(part.startswith("bench") for part in parts)


def connector_violations(path: Path, *, bench: bool = False) -> list[str]:
    """The imports of a `streams_spark` module that reach past the public API and the face."""
    allowed = CONNECTOR_ALLOWED + (BENCH_ALLOWED if bench else ())
    public = _public("streams")
    return sorted(
        {
            name
            for level, name in _imports(path)
            if level == 0
            and _within(name, ("streams",))
            and name not in public
            and not _within(name, allowed)
        }
    )


def example_violations(path: Path) -> list[str]:
    """The imports of an example that reach past the public API (`streams`, `streams_spark`)."""
    public = _public("streams") | _public("streams_spark")
    return sorted(
        {
            name
            for level, name in _imports(path)
            if level == 0 and _within(name, ("streams", "streams_spark")) and name not in public
        }
    )


@pytest.mark.parametrize(
    "path", sorted(SPARK_DIR.rglob("*.py")), ids=lambda p: str(p.relative_to(SPARK_DIR))
)
def test_spark_imports_only_the_public_api_and_the_face(path: Path) -> None:
    assert connector_violations(path, bench=_is_bench(path)) == []


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_examples_import_only_the_public_api(path: Path) -> None:
    assert list(_imports(path)), "no imports found: is the parser looking at the right file?"
    assert example_violations(path) == []


def test_the_spark_walk_covers_the_connector_and_the_examples() -> None:
    found = {p.name for p in SPARK_DIR.rglob("*.py")}
    assert {"source.py", "executor.py", "sink.py", "sink_options.py"} <= found
    assert {p.name for p in EXAMPLE_FILES} >= {"consume.py", "produce.py", "consumer.py"}


def test_connector_check_catches_internal_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from streams.store import probe\n"
        "import streams.store.rows\n"
        "from streams import Writer, connector, transport\n"
        "from streams.errors import FactsPruned\n"
        "from streams.connector import read_range\n"
        "from . import options\n"
        "import pyarrow\n"
        "def f():\n"
        "    from streams.bench.common import drop_streams\n",
        encoding="utf-8",
    )
    assert connector_violations(sample) == [
        "streams.bench.common",
        "streams.bench.common.drop_streams",
        "streams.store",
        "streams.store.probe",
        "streams.store.rows",
        "streams.transport",
    ]
    bench = connector_violations(sample, bench=True)
    assert bench == [
        "streams.store",
        "streams.store.probe",
        "streams.store.rows",
        "streams.transport",
    ]
    assert example_violations(sample) == [
        "streams.bench.common",
        "streams.bench.common.drop_streams",
        "streams.connector",
        "streams.connector.read_range",
        "streams.errors",
        "streams.errors.FactsPruned",
        "streams.store",
        "streams.store.probe",
        "streams.store.rows",
        "streams.transport",
    ]
    sample.write_text("import streams\nimport streams_spark\nfrom streams import connect\n")
    assert example_violations(sample) == []
    sample.write_text("from streams_spark.source import read_partition\n")
    assert example_violations(sample) == [
        "streams_spark.source",
        "streams_spark.source.read_partition",
    ]
