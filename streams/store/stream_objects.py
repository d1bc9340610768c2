"""Each stream's own objects in PostgreSQL: its partition of ``streams_facts`` and its sequence,
what privileges are granted on (`streams.store.roles`) and checked against
(`streams.store.role_checks`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.constants import facts_partition
from .driver import Gen, Query

__all__ = ["StreamObjects", "stream_objects"]


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
