"""The registry reads of a pattern reader (`streams.core.stream_patterns` decides what they
mean): the rows above a registry id, and the settings of the streams that join."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UnknownStream
from ..types import StreamInfo
from .driver import Commit, Gen, Query
from .registry import load_streams

__all__ = ["DROPPED_SQLSTATES", "load_listed", "registry_after", "registry_has", "registry_ids"]

#: What a read of a stream dropped under it fails with: its partition or sequence gone
#: (undefined_table; a prepared statement names the partition), or the probe's session
#: setting never set on this session for it (undefined_object).
DROPPED_SQLSTATES = ("42P01", "42704")


def registry_after(low: int) -> Gen[list[tuple[int, str]]]:
    """``(id, name)`` of every stream with a registry id above ``low``: one statement on the
    primary key's index, however many streams there are below it."""
    rows = yield Query("SELECT id, name FROM streams_registry WHERE id > %s", (low,))
    yield Commit()
    return [(int(key), str(name)) for key, name in rows]


def load_listed(listed: Sequence[tuple[int, str]]) -> Gen[list[StreamInfo]]:
    """The settings of the listed ``(id, name)`` streams that still exist under that id (one
    dropped since it was listed is left out; one created again under its name is another
    stream, which a later listing finds)."""
    names = [name for _, name in listed]
    while names:
        try:
            infos = yield from load_streams(names)
        except UnknownStream as exc:
            names.remove(exc.stream)
            continue
        wanted = set(listed)
        return [info for info in infos if (info.id, info.name) in wanted]
    return []


def registry_ids(ids: Sequence[int]) -> Gen[set[int]]:
    """Which of these registry ids still exist (a stream dropped has none)."""
    rows = yield Query("SELECT id FROM streams_registry WHERE id = ANY(%s)", (list(ids),))
    yield Commit()
    return {int(key) for (key,) in rows}


def registry_has(key: int) -> Gen[bool]:
    """Whether registry id ``key`` still exists (a stream dropped has none), as a plain
    statement (the int inlined) that any driver runs: a Spark executor over ADBC."""
    rows = yield Query(f"SELECT 1 FROM streams_registry WHERE id = {int(key)}")
    yield Commit()
    return bool(rows)
