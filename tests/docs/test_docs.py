"""The documentation's examples run as written, and the site builds.

Every fenced block whose info string is exactly ``python`` is run, in order, in one namespace
per page (README.md, then each page of ``docs/`` that has any), against a fresh database
migrated to head, with ``STREAMS_DATABASE_URL``, ``STREAMS_REDIS_URL`` and ``STREAMS_PREFIX``
set as a user would set them. Blocks for other tools (``sh``; ``python spark`` for the Spark
example, which the Spark tests run) are left alone here. ``mkdocs build --strict`` fails on any
broken link, missing page or docstring the API reference cannot render.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT, doc_blocks, readme_blocks
from servers import create_database, database_name, drop_database

from streams.migrate import upgrade

DOCS = REPO_ROOT / "docs"
PAGES = ["README.md", *sorted(str(p.relative_to(REPO_ROOT)) for p in DOCS.glob("*.md"))]
RUNNABLE = [page for page in PAGES if doc_blocks(REPO_ROOT / page, "python")]


@pytest.fixture
def fresh_url(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url)
    upgrade(url)
    yield url
    drop_database(postgres_admin_url, database_name(url))


def test_readme_and_the_python_page_have_examples() -> None:
    assert len(readme_blocks("python")) >= 2
    assert "docs/python.md" in RUNNABLE


@pytest.mark.parametrize("page", RUNNABLE)
def test_python_examples_run_as_written(
    page: str,
    fresh_url: str,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("STREAMS_DATABASE_URL", fresh_url)
    monkeypatch.setenv("STREAMS_REDIS_URL", redis_url)
    monkeypatch.setenv("STREAMS_PREFIX", redis_prefix)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs"}
    for number, block in enumerate(doc_blocks(REPO_ROOT / page, "python"), 1):
        code = compile(block, f"{page} python block {number}", "exec")
        exec(code, namespace)


def test_the_spark_page_shows_the_example_the_spark_tests_run() -> None:
    """tests/spark runs README's Spark example; the Spark page must show that very code."""
    (readme_example,) = readme_blocks("python spark")
    assert doc_blocks(DOCS / "spark.md", "python spark") == [readme_example]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference = (tmp_path / "reference" / "index.html").read_text()
    for name in ("Writer.append", "Reader.epochs", "StreamsError", "connect"):
        assert name in reference, f"the API reference lacks {name}"
