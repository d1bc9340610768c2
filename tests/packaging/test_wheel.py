"""The wheel is the product: built from the checkout, installed alone in a fresh virtualenv.

It must hold every package (setuptools ships only the packages `pyproject.toml` lists; the
layout test compares that list with the directories, this test with what actually installs),
the migrations (``streams migrate`` works from the installed package, with no checkout in
sight), the ``streams`` command and the entry points through which it finds what the Spark
connector adds (`streams.plugins`). The virtualenv gets the library's dependencies from the
package index (pip's cache makes that quick after the first run), none of its extras.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT
from servers import create_database, database_name, drop_database

#: Modules that need an extra the fresh virtualenv does not have (checked present, not imported).
NEEDS_EXTRAS = {"streams_spark": "spark"}
#: Modules of `streams` itself that import an extra's package when imported (the rest import
#: theirs on first use): in the wheel, not imported here.
STREAMS_NEEDING_EXTRAS = {
    "streams.core.payload_schemas": "arrow",
    "streams.core.typed_payloads": "arrow",
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of a fresh virtualenv with the freshly built wheel installed."""
    work = tmp_path_factory.mktemp("wheel")
    dist = work / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO_ROOT)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("streams-*.whl")
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    yield python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # -I: isolated mode, so nothing of the checkout (cwd, PYTHONPATH, user site) is importable.
    return subprocess.run(
        [str(python), "-I", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip


def test_every_module_of_the_checkout_is_in_the_wheel_and_imports(
    installed: Path, tmp_path: Path
) -> None:
    expected = sorted(
        ".".join(p.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (REPO_ROOT / "streams").rglob("*.py")
    )
    script = (
        "import importlib, json, pkgutil, streams\n"
        "names = ['streams', *(m.name for m in pkgutil.walk_packages(streams.__path__, "
        "'streams.'))]\n"
        f"skip = {sorted(STREAMS_NEEDING_EXTRAS)!r}\n"
        "for name in names:\n"
        "    if name != 'streams.__main__' and not name.startswith('streams._migrations.') \\\n"
        "            and name not in skip:\n"
        "        importlib.import_module(name)\n"
        "print(json.dumps(sorted(names)))\n"
    )  # (importing __main__ runs the command; a migration needs alembic's context)
    result = _run(installed, "-c", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    found = [n for n in json.loads(result.stdout) if not n.startswith("streams._migrations")]
    assert found == expected
    for package in NEEDS_EXTRAS:
        probe = f"import importlib.util as u; print(u.find_spec({package!r}) is not None)"
        check = _run(installed, "-c", probe, cwd=tmp_path)
        assert check.stdout.strip() == "True", f"{package} is not in the wheel"


def test_the_command_runs_and_migrates_from_the_wheel(
    installed: Path, tmp_path: Path, postgres_admin_url: str
) -> None:
    for args in (["--help"], ["migrate", "--help"], ["--version"]):
        result = _run(installed, "-m", "streams", *args, cwd=tmp_path)
        assert result.returncode == 0, (args, result.stderr)
    script = installed.parent / "streams"
    assert script.exists(), "the console script is missing"
    url = create_database(postgres_admin_url, prefix="streams_wheel")
    try:
        result = _run(installed, "-m", "streams", "migrate", "--database-url", url, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "schema at" in result.stdout
    finally:
        drop_database(postgres_admin_url, database_name(url))


def test_the_plugins_are_declared_and_found_without_their_extra(
    installed: Path, tmp_path: Path
) -> None:
    """The library finds the connector's benchmark and demo step only through the entry points
    (`streams.plugins`): the wheel declares them, holds their modules, and without the spark
    extra `streams bench` still lists ``spark``, which then says what it lacks."""
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    script = (
        "import importlib.metadata as m, importlib.util as u, json, pathlib\n"
        "root = pathlib.Path(u.find_spec('streams_spark').submodule_search_locations[0]).parent\n"
        f"groups = {sorted(declared)!r}\n"
        "found = {g: {e.name: e.value for e in m.entry_points(group=g)} for g in groups}\n"
        "modules = [v.partition(':')[0] for g in found.values() for v in g.values()]\n"
        "missing = [n for n in modules if not (root / (n.replace('.', '/') + '.py')).is_file()]\n"
        "print(json.dumps([found, missing]))\n"
    )
    result = _run(installed, "-c", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    found, missing = json.loads(result.stdout)
    assert found == declared
    assert missing == []
    listing = _run(installed, "-m", "streams", "bench", "--help", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert ["spark"] in [line.split()[:1] for line in listing.stdout.splitlines()]
    run = _run(installed, "-m", "streams", "bench", "spark", cwd=tmp_path)
    assert run.returncode == 1
    assert "cannot run here: ModuleNotFoundError: No module named 'pyspark'" in run.stderr
