"""Where a page of rows may be cut into whole facts, decided on its stream-ID column. Pure.

The columnar twin of `streams.core.epochs.plan_page`'s decision (its module doc defines
*page*, *fact* and *position*), for readers that keep a page as columns (Arrow record batches:
`streams.arrow`) and never build a row tuple: given the stream IDs of a page of at most
``limit`` rows of ``(after, through]`` in (stream ID, row) order,

* a page shorter than ``limit`` holds everything up to ``through``: every row is kept and the
  position jumps to ``through`` (over gaps too);
* a full page may have cut its last fact's rows short: that fact's rows are left for the next
  page (``rows`` stops before them) and the position stops at the fact before it;
* a full page of one single fact means the fact has at least ``limit`` rows: nothing is kept,
  and the caller reads that ID alone, whole (``refetch``).

Only the last fact's rows are looked at (one backwards walk from the end), so the cost does not
grow with the page; ``ids`` is anything indexable with ``len`` (a list, a NumPy view of an
Arrow column: its items need only compare with ``==`` and convert with ``int``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PageCut", "cut_page"]


@dataclass(frozen=True, slots=True)
class PageCut:
    """What a page allows: deliver its first ``rows`` rows and move to ``position``; or, with
    ``refetch``, nothing (``rows`` 0, ``position`` the page's ``after``): read that ID alone."""

    rows: int
    position: int
    refetch: int | None = None


def cut_page(ids: Sequence[Any], *, after: int, through: int, limit: int) -> PageCut:
    """The cut of a page whose stream-ID column is ``ids`` (see the module doc).

    ``ValueError`` for a ``limit`` below 1, an empty range, or a first or last ID outside
    ``(after, through]`` (the rows were not read as the plan says)."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    if through < after:
        raise ValueError(f"empty range ({after}, {through}]")
    n = len(ids)
    if n > limit:
        raise ValueError(f"a page of {n} rows is longer than its limit {limit}")
    if n and not (after < int(ids[0]) and int(ids[n - 1]) <= through):
        bad = int(ids[0]) if int(ids[0]) <= after else int(ids[n - 1])
        raise ValueError(f"row {bad} outside ({after}, {through}]")
    if n < limit:
        return PageCut(n, through)
    last = ids[n - 1]
    if ids[0] == last:
        # One fact with at least `limit` rows: nothing can be delivered from this page.
        return PageCut(0, after, refetch=int(last))
    cut = n - 1
    while ids[cut - 1] == last:
        cut -= 1
    return PageCut(cut, int(ids[cut - 1]))
