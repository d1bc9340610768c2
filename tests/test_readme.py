"""The README's examples run as written.

Every fenced block whose info string is exactly ``python`` is run, in order, in one namespace,
against a fresh database migrated to head, with ``STREAMS_DATABASE_URL``, ``STREAMS_REDIS_URL``
and ``STREAMS_PREFIX`` set as a user would set them. Blocks for other tools (``sh``, ``python
spark`` for the Spark example, run by the Spark tests) are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import create_database, database_name, drop_database

from streams.migrate import upgrade

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.S | re.M)


def readme_blocks(info: str) -> list[str]:
    return [body for tag, body in _BLOCK.findall(README.read_text()) if tag.strip() == info]


@pytest.fixture
def fresh_url(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url)
    upgrade(url)
    yield url
    drop_database(postgres_admin_url, database_name(url))


def test_readme_has_python_examples() -> None:
    assert len(readme_blocks("python")) >= 2


def test_readme_python_examples_run_as_written(
    fresh_url: str, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMS_DATABASE_URL", fresh_url)
    monkeypatch.setenv("STREAMS_REDIS_URL", redis_url)
    monkeypatch.setenv("STREAMS_PREFIX", redis_prefix)
    namespace: dict[str, object] = {"__name__": "readme"}
    for number, block in enumerate(readme_blocks("python"), 1):
        code = compile(block, f"README.md python block {number}", "exec")
        exec(code, namespace)
