"""Epoch planning: turning pages of fact rows into whole facts and epochs. Pure; no I/O.

Terms (see also `streams.core.frontier`):

* A **position** ``p`` of a reader on a stream means it has delivered every fact with a stream
  ID ``<= p``; its frontier on that stream is ``{p + 1}``.
* A **fact** is every row sharing one stream ID (a fact written with `Writer.fact` may have
  several rows; one with none is a gap and is never seen).
* A **page** is at most ``limit`` rows with IDs in ``(after, through]`` in (ID, row) order, as
  `streams.store.rows.fetch_rows` returns them. ``through`` is a position PostgreSQL has proven
  complete, so the rows of every fact in that range are all committed and visible.
* An **epoch** is what a reader yields in one step: for each stream it advanced, every fact in
  ``(previous position, new position]``, each fact whole, in stream-ID order.

`plan_page` decides how far one page lets a reader advance. A page shorter than ``limit`` holds
everything up to ``through``, so the position may jump to ``through`` (skipping gaps). A full
page may have cut the last fact's rows short: that fact is left for the next page and the
position stops at the fact before it. A full page of one single fact means the fact has more
rows than a page: the caller must fetch that ID alone (`PagePlan.refetch`).

Timestamps are raised to their running maximum (``ts_floor``) as readers see them, so they never
decrease in stream-ID order even when clients sent skewed ones (S2's rule).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice, repeat
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from .fact_columns import INSTANCE, PAYLOAD, ROW_INDEX, STREAM_ID, TIMESTAMP, Row

__all__ = ["Epoch", "Fact", "PagePlan", "Row", "next_position", "plan_page"]


# A row's columns (`Row`: `streams.core.fact_columns.ROW_COLUMNS`, as the store reads them).
# Plain tuples, not objects: catching up touches every row, and building an object per row
# cost a fifth of the read throughput.
_ID: Final = ROW_INDEX[STREAM_ID.stored]
_INSTANCE: Final = ROW_INDEX[INSTANCE.stored]
_TS: Final = ROW_INDEX[TIMESTAMP.stored]
_PAYLOAD: Final = ROW_INDEX[PAYLOAD.stored]
# A row's columns, for ``map`` (C getters: no Python frame per row).
_id_of = operator.itemgetter(_ID)
_instance_of = operator.itemgetter(_INSTANCE)
_ts_of = operator.itemgetter(_TS)
_payload_of = operator.itemgetter(_PAYLOAD)


class Fact(NamedTuple):
    """One fact as a reader sees it: every row it has, its writer and its timestamp.

    ``stream_id`` is the fact's stream ID (its logical timestamp), as in the CLI's JSON and
    Spark's columns. A named tuple because readers build one per fact (it is several times
    cheaper than a frozen dataclass) and it is immutable all the same.
    """

    stream: str
    stream_id: int
    instance: str
    #: ms since the Unix epoch, raised to the running maximum of the stream.
    timestamp: int
    payloads: tuple[Any, ...]

    @property
    def payload(self) -> Any:
        """The payload of the fact's first row (most facts have exactly one)."""
        return self.payloads[0] if self.payloads else None

    @property
    def id(self) -> int:
        """Deprecated alias of `stream_id` (the name of version 0.1; it will be removed)."""
        warnings.warn("Fact.id is deprecated: use Fact.stream_id", DeprecationWarning, stacklevel=2)
        return self.stream_id

    def as_dict(self) -> dict[str, Any]:
        """The fact as JSON-ready data (``id`` is a deprecated copy of ``stream_id``)."""
        data: dict[str, Any] = {
            "stream": self.stream,
            "stream_id": self.stream_id,
            "id": self.stream_id,
            "instance": self.instance,
            "timestamp": self.timestamp,
            "payload": self.payload,
        }
        if len(self.payloads) != 1:
            data["payloads"] = list(self.payloads)
        return data

    def __repr__(self) -> str:
        return (
            f"Fact(stream={self.stream!r}, stream_id={self.stream_id}, "
            f"instance={self.instance!r}, timestamp={self.timestamp}, rows={len(self.payloads)})"
        )


@dataclass(frozen=True, slots=True)
class PagePlan:
    """What one page lets a reader deliver."""

    facts: tuple[Fact, ...]
    #: The new position: every fact ``<=`` it is in ``facts`` or was delivered before.
    position: int
    #: The running maximum timestamp at ``position``.
    ts_floor: int
    #: Set when a single fact filled the page: fetch the rows of this ID alone, then plan again.
    refetch: int | None = None


def plan_page(
    stream: str,
    rows: Sequence[Row],
    *,
    after: int,
    through: int,
    limit: int,
    ts_floor: int,
    decode: Callable[[list[Any]], list[Any]] | None = None,
) -> PagePlan:
    """Plan the facts and new position that a page of rows allows (see the module docstring).

    ``decode``, if given, turns the page's payload column into the payloads (the reader reads
    them as JSON text and decodes a whole column in one call: cheaper than a loader per value).
    """
    if limit <= 0:
        raise ValueError("limit must be positive")
    if through < after:
        raise ValueError(f"empty range ({after}, {through}]")
    if rows and not (after < rows[0][_ID] and rows[-1][_ID] <= through):
        bad = rows[0][_ID] if rows[0][_ID] <= after else rows[-1][_ID]
        raise ValueError(f"row {bad} outside ({after}, {through}]")
    keep = _kept(rows, limit)
    if keep is None:
        # One fact with at least `limit` rows: nothing can be delivered from this page.
        return PagePlan((), after, ts_floor, refetch=rows[-1][_ID])
    if keep < len(rows):
        rows = rows[:keep]
        position = rows[-1][_ID]
    else:
        position = through
    column = list(map(_payload_of, rows))
    payload_column = column if decode is None else decode(column)
    fast = _single_row_facts(stream, rows, ts_floor, payload_column)
    if fast is not None:
        return PagePlan(tuple(fast), position, fast[-1].timestamp if fast else ts_floor)
    facts: list[Fact] = []
    append = facts.append
    floor = ts_floor
    previous = after
    n = len(rows)
    i = 0
    while i < n:
        row = rows[i]
        stream_id = row[_ID]
        if stream_id <= previous:
            raise ValueError(f"rows out of order: {stream_id} after {previous}")
        ts = row[_TS]
        floor = max(floor, ts)
        j = i + 1
        if j < n and rows[j][_ID] == stream_id:  # a multi-row fact (rare)
            while j < n and rows[j][_ID] == stream_id:
                j += 1
            payloads = tuple(payload_column[i:j])
        else:
            payloads = (payload_column[i],)
        append(Fact(stream, stream_id, row[_INSTANCE], floor, payloads))
        previous = stream_id
        i = j
    return PagePlan(tuple(facts), position, floor)


def _kept(rows: Sequence[Row], limit: int) -> int | None:
    """How many rows of a page `plan_page` plans: all of a page that is not full; of a full
    one, all but the last fact's rows (it may continue on the next page); None when a single
    fact filled the page (it is read alone, whole)."""
    if len(rows) < limit:
        return len(rows)
    last_id = rows[-1][_ID]
    if rows[0][_ID] == last_id:
        return None
    cut = len(rows) - 1
    while rows[cut - 1][_ID] == last_id:
        cut -= 1
    return cut


def next_position(rows: Sequence[Row], *, through: int, limit: int) -> int | None:
    """The position `plan_page` moves to with this page (``through`` when the page is not
    full), found without planning it; None when it would ask to read one fact alone (its
    ``refetch``). A reader catching up sends the read of its next page from here on while it
    plans this one."""
    keep = _kept(rows, limit)
    if keep is None:
        return None
    return through if keep == len(rows) else rows[keep - 1][_ID]


def _single_row_facts(
    stream: str, rows: Sequence[Row], ts_floor: int, payloads: list[Any]
) -> list[Fact] | None:
    """`plan_page`'s facts when every fact of ``rows`` has one row (IDs strictly increasing),
    built column by column in C loops (``map``, ``zip``, ``accumulate``) instead of a Python
    loop per row: catching up touches every row, and this made planning several times cheaper
    (measured); None when some fact has several rows (or rows are out of order: the general
    loop then says which)."""
    ids = list(map(_id_of, rows))
    if not all(map(operator.lt, ids, islice(ids, 1, None))):
        return None
    floors = accumulate(map(_ts_of, rows), max, initial=ts_floor)
    next(floors)  # the initial value
    columns = zip(
        repeat(stream),
        ids,
        map(_instance_of, rows),
        floors,
        zip(payloads),  # 1-tuples: each fact's payloads
    )
    facts: list[Fact] = list(map(tuple.__new__, repeat(Fact), columns))
    return facts


@dataclass(frozen=True, slots=True)
class Epoch:
    """Everything a reader delivers in one step.

    ``lower[s]`` and ``upper[s]`` are the reader's positions on stream ``s`` before and after:
    the epoch holds every fact of ``s`` in ``(lower[s], upper[s]]``, and the reader's frontier on
    ``s`` moves from ``{lower[s] + 1}`` to ``{upper[s] + 1}``. ``facts`` are grouped by stream in
    the reader's stream order, each stream's in stream-ID order. An epoch may hold no facts (the
    frontier moved over gaps only).
    """

    lower: Mapping[str, int]
    upper: Mapping[str, int]
    facts: tuple[Fact, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", MappingProxyType(dict(self.lower)))
        object.__setattr__(self, "upper", MappingProxyType(dict(self.upper)))

    def __iter__(self) -> Iterator[Fact]:
        return iter(self.facts)

    def __len__(self) -> int:
        return len(self.facts)

    def __repr__(self) -> str:
        ranges = ", ".join(f"{s}: ({self.lower.get(s)}, {self.upper[s]}]" for s in self.upper)
        return f"Epoch({ranges}; {len(self.facts)} facts)"
