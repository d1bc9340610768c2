"""`streams.core.page_cut.cut_page` against `streams.core.epochs.plan_page` (the row path's
decision, which the columnar one must take too), and a reader driven page by page over a random
facts table delivers every fact once, whole, in order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.epochs import plan_page
from streams.core.page_cut import PageCut, cut_page


@st.composite
def tables(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """``(after, through, ids)``: the stream-ID column of every row of a random set of facts in
    ``(after, through]``, each with 1..6 rows, in (stream ID, row) order."""
    after = draw(st.integers(0, 40))
    through = after + draw(st.integers(0, 40))
    facts = (
        sorted(draw(st.sets(st.integers(after + 1, through), max_size=15)))
        if through > after
        else []
    )
    ids: list[int] = []
    for fact in facts:
        ids += [fact] * draw(st.integers(1, 6))
    return after, through, ids


@given(tables(), st.integers(1, 12))
def test_cut_takes_plan_pages_decision(table: tuple[int, int, list[int]], limit: int) -> None:
    after, through, ids = table
    page = ids[:limit]
    rows = [(i, 0, "w", 1, "null") for i in page]
    plan = plan_page("s", rows, after=after, through=through, limit=limit, ts_floor=0)
    cut = cut_page(page, after=after, through=through, limit=limit)
    assert cut.refetch == plan.refetch
    assert cut.position == plan.position
    if cut.refetch is None:
        assert cut.rows == sum(1 for i in page if i <= plan.position)
        assert sorted({*page[: cut.rows]}) == [f.stream_id for f in plan.facts]


@given(tables(), st.integers(1, 8))
def test_paging_delivers_every_fact_once_and_whole(
    table: tuple[int, int, list[int]], limit: int
) -> None:
    """Drive the cut as `streams.arrow` does: each page the first ``limit`` rows after the
    position, a refetched fact read alone; the concatenated delivered rows are the table."""
    after, through, ids = table
    position, delivered = after, []
    while position < through:
        page = [i for i in ids if i > position][:limit]
        cut = cut_page(page, after=position, through=through, limit=limit)
        if cut.refetch is not None:
            whole = [i for i in ids if i == cut.refetch]
            assert len(whole) >= limit
            delivered += whole
            position = cut.refetch
            continue
        kept = page[: cut.rows]
        assert kept == [i for i in ids if position < i <= cut.position]  # whole facts only
        assert cut.position > position or not page  # progress
        delivered += kept
        position = cut.position
    assert delivered == ids


def test_cut_refuses_rows_outside_the_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        cut_page([3, 4], after=3, through=9, limit=5)
    with pytest.raises(ValueError, match="longer"):
        cut_page([4, 5, 6], after=3, through=9, limit=2)
    with pytest.raises(ValueError, match="positive"):
        cut_page([], after=3, through=9, limit=0)
    assert cut_page([], after=3, through=9, limit=5) == PageCut(0, 9)
