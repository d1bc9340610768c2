"""What a reader may deliver now: the one decision of every reader (the Python reader, its
Arrow batches and the Spark source), so that none of them decides it apart.

A reader at ``lower`` (every fact of a stream at or below it delivered) may deliver the facts of
``(lower, end]``, where ``end`` is what a proof showed complete (never beyond: a pending ID
below it could still commit, docs/design/probe.md), capped by the read's own bound if it has one
(``until``: Spark's ``availableNow`` target, `Client.read_arrow`'s end), and never below
``lower`` (an older proof delivers nothing; it never takes a position back).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["behind", "deliverable"]


def deliverable(
    lower: Mapping[str, int],
    proven: Mapping[str, int],
    until: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """For each stream of ``lower``, the last ID that may be delivered now (see the module
    docstring); a stream no proof covers yet (absent from ``proven``) stays where it is."""
    ends = {}
    for name, position in lower.items():
        end = proven.get(name, position)
        if until is not None:
            end = min(end, until[name])
        ends[name] = max(position, end)
    return ends


def behind(lower: Mapping[str, int], ends: Mapping[str, int]) -> bool:
    """Is anything deliverable: some stream's ``end`` above its position?"""
    return any(ends[name] > position for name, position in lower.items())
