"""Small helpers shared by the integration tests (imported as ``from helpers import ...``)."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

#: The checkout: the repository root, and the folder of the tests and their shared modules.
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.01)


def fill_stream(url: str, stream: str, count: int) -> None:
    """Create ``stream`` and append ``count`` facts ``{"n": 0..count-1}`` in one batch."""
    import streams

    with streams.connect(url) as client:
        client.create_stream(stream)
        with client.writer(stream) as writer:
            writer.append_batch([{"n": n} for n in range(count)])


def rows_returned(url: str) -> int:
    """Rows the scans of every session of ``url``'s database returned (``pg_stat_database``'s
    ``tup_returned + tup_fetched``; backends report at most every second and when idle): how a
    test tells which server a read ran on."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT tup_returned + tup_fetched FROM pg_stat_database "
            "WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def fact_rows(url: str, stream: str) -> list[tuple[Any, ...]]:
    """``(stream_id, row_no, instance, ts, payload)`` of every row of ``stream``, in order."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT f.stream_id, f.row_no, f.instance, f.ts, f.payload FROM streams_facts f "
            "JOIN streams_registry r ON r.id = f.stream WHERE r.name = %s "
            "ORDER BY f.stream_id, f.row_no",
            (stream,),
        ).fetchall()


def write_user_fact(client: Any, url: str, stream: str, table: str, instance: str = "w") -> int:
    """One fact written only in a user table (``writer.fact``): its stream ID."""
    with client.writer(stream, instance=instance) as writer, psycopg.connect(url) as conn:
        with writer.fact(conn) as fact:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'apple')", (fact.stream_id,))
        return int(fact.stream_id)


_BLOCK = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.S | re.M)


def doc_blocks(path: Path, info: str) -> list[str]:
    """The fenced blocks of a Markdown file whose info string is exactly ``info``, in order."""
    return [body for tag, body in _BLOCK.findall(path.read_text()) if tag.strip() == info]


def readme_blocks(info: str) -> list[str]:
    """The fenced blocks of README.md whose info string is exactly ``info``, in order."""
    return doc_blocks(REPO_ROOT / "README.md", info)


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test stops with SIGINT: a shell that started the suite
    in the background (``cmd &`` without job control, ``nohup``) makes children inherit SIGINT
    ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_through(reader: Any, through: int, timeout: float = 30.0) -> list[int]:
    """Poll ``reader`` until its position reaches ``through``: the fact IDs it delivered."""
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while reader.position() < through:
        assert time.monotonic() < deadline, f"stuck at {reader.position()} (want {through})"
        epoch = reader.poll(timeout=0.5)
        if epoch is not None:
            got += [f.stream_id for f in epoch.facts]
    return got


def assert_image(path: Path) -> None:
    """``path`` is a picture a viewer opens: a PNG that decodes to pixels (its magic bytes,
    then matplotlib's decoder), or an SVG document (XML whose root is ``<svg>``)."""
    data = path.read_bytes()
    if path.suffix == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), data[:16]
        from matplotlib.image import imread

        pixels = imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.shape[2] in (3, 4) and pixels.std() > 0  # not one flat colour
    else:
        import xml.etree.ElementTree as ET

        root = ET.fromstring(data)
        assert root.tag == "{http://www.w3.org/2000/svg}svg", root.tag
        assert len(list(root.iter())) > 50  # drawn, not an empty document


def partition_parents(url: str) -> dict[str, str]:
    """Each stream partition's parent (a bucket, or the root)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname, p.relname FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE c.relname ~ '^streams_facts_[0-9]+$'"
        ).fetchall()
    return {str(child): str(parent) for child, parent in rows}


def partition_bound(url: str, relation: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = %s", (relation,)
        ).fetchone()
    assert row is not None
    return str(row[0])
