"""Each stream's own objects in PostgreSQL: its partition of ``streams_facts`` and its sequence,
what privileges are granted on (`streams.store.roles`) and checked against
(`streams.store.role_checks`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.constants import facts_partition
from .driver import Gen, Query

__all__ = ["FACTS_TREE", "StreamObjects", "stream_objects"]

#: ``streams_facts``'s partitions as ``(relid, isleaf)`` rows: every stream's partition
#: (``isleaf``), under the root or under a bucket (`streams.store.registry`, "Layout"), and the
#: buckets. From the catalog alone: ``pg_partition_tree`` locks every partition it lists, more
#: locks than PostgreSQL's lock table holds at 10^4 streams.
FACTS_TREE = """
    SELECT i.inhrelid AS relid, c.relkind <> 'p' AS isleaf
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'streams_facts'::regclass
    UNION ALL
    SELECT i.inhrelid, true FROM pg_inherits b
    JOIN pg_class c ON c.oid = b.inhrelid AND c.relkind = 'p'
    JOIN pg_inherits i ON i.inhparent = b.inhrelid
    WHERE b.inhparent = 'streams_facts'::regclass
"""


@dataclass(frozen=True, slots=True)
class StreamObjects:
    """A stream's name, partition and sequence (both unqualified, in the library's schema)."""

    name: str
    partition: str
    sequence: str

    @classmethod
    def of(cls, stream_id: int, name: str, sequence: str) -> StreamObjects:
        return cls(name, facts_partition(stream_id), sequence)


def stream_objects(names: Sequence[str] | None = None) -> Gen[list[StreamObjects]]:
    """The objects of these streams (every stream when None) whose sequence exists, in
    registry order; an unknown name is left out (the caller names what it missed)."""
    rows = yield Query(
        "SELECT id, name, sequence_name FROM streams_registry "
        "WHERE to_regclass(quote_ident(sequence_name)) IS NOT NULL "
        "AND (%(names)s::text[] IS NULL OR name = ANY(%(names)s::text[])) ORDER BY id",
        {"names": None if names is None else list(names)},
    )
    return [StreamObjects.of(int(i), str(n), str(s)) for i, n, s in rows]
