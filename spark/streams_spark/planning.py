"""Decisions of the Spark source's driver: pure functions, no I/O.

Terms (as in `streams_spark.source`): a stream's *position* ``p`` means the query has
delivered every fact ``<= p``; *complete* ``c`` is what the latest probe proved (every ID
``<= c`` has completed: `streams.store.probe`); a micro-batch reads ``(lower, upper]`` per
stream, where ``lower`` is the previous batch's end. The *budget* is ``maxFactsPerTrigger``:
at most that many facts per batch over all streams. A stream's *timestamp floor* at a
position is the running maximum of the timestamps of every fact up to it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

__all__ = ["lost_streams", "running_floors", "share_budget"]


def share_budget(counts: Mapping[str, int], budget: int, turn: int) -> dict[str, int]:
    """How many of its ``counts[n]`` waiting facts each stream may deliver in one batch.

    With no more facts than ``budget``, all of them. Otherwise each stream gets its share in
    proportion, rounded down (``budget * count // total``), and the rounding remainder goes
    one fact at a time first to streams that got none, then to the others, in stream order
    rotated by ``turn`` (the caller's batch counter): over as many consecutive turns as there
    are streams, every stream with facts is first once, so none starves however small the
    budget. The remainder is always less than the number of streams whose share was rounded
    down, and each of those has a fact left, so one pass gives it all out.
    """
    total = sum(counts.values())
    if total <= budget:
        return dict(counts)
    names = sorted(counts)
    shares = {n: budget * counts[n] // total for n in names}
    spare = budget - sum(shares.values())
    k = len(names)
    order = sorted(range(k), key=lambda i: (shares[names[i]] > 0, (i - turn) % k))
    for i in order:
        if spare == 0:
            break
        name = names[i]
        if shares[name] < counts[name]:
            shares[name] += 1
            spare -= 1
    return shares


def running_floors(floor: int, maxima: Sequence[int | None]) -> list[int]:
    """The timestamp floor at the end of each of consecutive ranges, given the floor before
    the first and each range's greatest timestamp (None: a range without facts)."""
    floors: list[int] = []
    for high in maxima:
        if high is not None and high > floor:
            floor = high
        floors.append(floor)
    return floors


def lost_streams(
    lower: Mapping[str, int], found: Mapping[str, int], waiting: Collection[str]
) -> list[str]:
    """Streams whose complete position went below the query's (sequence rewound, database
    restored): the ``failOnDataLoss`` case. A stream ``waiting`` for the position its start
    set (beyond what was complete then) is not one of them."""
    return sorted(n for n, p in lower.items() if p > found[n] and n not in waiting)
