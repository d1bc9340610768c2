"""Tests for page planning (streams.core.epochs), against a brute-force model of the facts table.

The model is a random set of facts with IDs in ``(after, through]``, each with 1..k rows (row_no
0..n-1), an instance and a raw (possibly skewed) timestamp. A page is the first ``limit`` rows in
(ID, row) order, as ``fetch_rows ... LIMIT`` returns them. `plan_page` is checked page by page,
and by driving it like the reader does over the whole model (refetching oversized facts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.core.epochs import Epoch, Fact, PagePlan, next_position, plan_page

STREAM = "s"


class Row(NamedTuple):
    """A row in the shape `fetch_rows` returns (a tuple), with names for the tests."""

    stream_id: int
    row_no: int
    instance: str
    timestamp: int
    payload: Any


@dataclass(frozen=True, slots=True)
class Model:
    after: int
    through: int
    ts_floor: int
    facts: dict[int, tuple[Row, ...]]  # ID -> its rows, in row order

    @property
    def rows(self) -> list[Row]:
        return [row for i in sorted(self.facts) for row in self.facts[i]]

    def page(self, after: int, limit: int) -> list[Row]:
        return [row for row in self.rows if row.stream_id > after][:limit]

    def raw_ts(self, fact_id: int) -> int:
        return self.facts[fact_id][0].timestamp


@st.composite
def models(draw: st.DrawFn, max_rows: int = 5) -> Model:
    after = draw(st.integers(0, 50))
    through = after + draw(st.integers(0, 30))
    ids = draw(st.sets(st.integers(after + 1, through), max_size=12)) if through > after else set()
    facts: dict[int, tuple[Row, ...]] = {}
    for i in sorted(ids):
        n = draw(st.integers(1, max_rows))
        instance = draw(st.sampled_from(["w1", "w2", "w3"]))
        ts = draw(st.integers(0, 1000))
        facts[i] = tuple(Row(i, r, instance, ts, {"id": i, "row": r}) for r in range(n))
    return Model(after, through, draw(st.integers(0, 1000)), facts)


def check_facts(model: Model, facts: Sequence[Fact], ts_floor: int) -> int:
    """Each fact whole and correct, IDs increasing, timestamps the running maximum."""
    ids = [f.stream_id for f in facts]
    assert ids == sorted(set(ids))
    floor = ts_floor
    for fact in facts:
        rows = model.facts[fact.stream_id]
        assert fact.stream == STREAM
        assert fact.instance == rows[0].instance
        assert fact.payloads == tuple(row.payload for row in rows)
        floor = max(floor, model.raw_ts(fact.stream_id))
        assert fact.timestamp == floor
    return floor


# --- one page ---------------------------------------------------------------------------------


@given(models(), st.integers(1, 12))
def test_single_page(model: Model, limit: int) -> None:
    page = model.page(model.after, limit)
    plan = plan_page(
        STREAM, page, after=model.after, through=model.through, limit=limit,
        ts_floor=model.ts_floor,
    )  # fmt: skip
    page_ids = sorted({row.stream_id for row in page})
    if len(page) < limit:
        assert plan.refetch is None
        assert plan.position == model.through
        assert [f.stream_id for f in plan.facts] == sorted(model.facts)
    elif len(page_ids) == 1:
        assert plan == PagePlan((), model.after, model.ts_floor, refetch=page_ids[0])
    else:
        assert plan.refetch is None
        assert [f.stream_id for f in plan.facts] == page_ids[:-1]  # the possibly cut fact is left
        assert plan.position == page_ids[-2]
    # No fact skipped, none beyond the position returned.
    assert model.after <= plan.position <= model.through
    expected = [i for i in sorted(model.facts) if model.after < i <= plan.position]
    assert [f.stream_id for f in plan.facts] == expected
    floor = check_facts(model, plan.facts, model.ts_floor)
    assert plan.ts_floor == floor
    if plan.facts:
        assert plan.ts_floor == plan.facts[-1].timestamp
    assert all(f.timestamp >= model.ts_floor for f in plan.facts)


@given(models(), st.integers(1, 12))
def test_next_position_is_where_the_plan_goes(model: Model, limit: int) -> None:
    """A reader sends the read of its next page from `next_position` before planning this one:
    it must be exactly the plan's position (None exactly when the plan asks to refetch)."""
    page = model.page(model.after, limit)
    plan = plan_page(
        STREAM, page, after=model.after, through=model.through, limit=limit,
        ts_floor=model.ts_floor,
    )  # fmt: skip
    found = next_position(page, through=model.through, limit=limit)
    assert found == (None if plan.refetch is not None else plan.position)


@given(models(max_rows=8), st.integers(1, 10))
def test_reader_loop_delivers_every_fact_once(model: Model, limit: int) -> None:
    position, floor = model.after, model.ts_floor
    delivered: list[Fact] = []
    while position < model.through:
        plan = plan_page(
            STREAM, model.page(position, limit), after=position, through=model.through,
            limit=limit, ts_floor=floor,
        )  # fmt: skip
        if plan.refetch is not None:
            assert plan.facts == ()
            assert plan.position == position
            assert plan.ts_floor == floor
            assert plan.refetch == min(i for i in model.facts if i > position)
            whole = model.facts[plan.refetch]
            assert len(whole) >= limit
            plan = plan_page(
                STREAM, whole, after=position, through=plan.refetch, limit=len(whole) + 1,
                ts_floor=floor,
            )  # fmt: skip
            assert [f.stream_id for f in plan.facts] == [whole[0].stream_id]
        assert plan.position > position  # progress, so the loop ends
        delivered.extend(plan.facts)
        position, floor = plan.position, plan.ts_floor
    assert position == model.through
    assert [f.stream_id for f in delivered] == sorted(model.facts)
    assert check_facts(model, delivered, model.ts_floor) == floor


@given(models())
def test_empty_range_and_gaps(model: Model) -> None:
    plan = plan_page(STREAM, [], after=model.after, through=model.through, limit=1, ts_floor=7)
    assert plan == PagePlan((), model.through, 7)


# --- errors -----------------------------------------------------------------------------------


@given(models(), st.integers(-5, 0))
def test_non_positive_limit(model: Model, limit: int) -> None:
    with pytest.raises(ValueError, match="limit"):
        plan_page(STREAM, model.rows, after=model.after, through=model.through, limit=limit,
                  ts_floor=0)  # fmt: skip


@given(st.integers(0, 100), st.integers(1, 10))
def test_inverted_range(after: int, back: int) -> None:
    with pytest.raises(ValueError, match="empty range"):
        plan_page(STREAM, [], after=after, through=after - back, limit=5, ts_floor=0)


def _outside(model: Model, below: bool, n: int, distance: int) -> list[Row]:
    """``n`` rows of one fact just outside the range: ``after - distance`` (boundary included)
    or ``through + 1 + distance``."""
    bad_id = model.after - distance if below else model.through + 1 + distance
    return [Row(bad_id, r, "w1", 0, None) for r in range(n)]


@given(models(), st.booleans(), st.integers(1, 3), st.integers(0, 2), st.data())
def test_row_outside_range_in_short_page(
    model: Model, below: bool, n: int, distance: int, data: st.DataObject
) -> None:
    # A page shorter than the limit, with one fact outside (after, through] somewhere in it.
    rows = model.rows
    bad = _outside(model, below, n, distance)
    rows = bad + rows if below else rows + bad
    with pytest.raises(ValueError, match="outside"):
        plan_page(STREAM, rows, after=model.after, through=model.through,
                  limit=len(rows) + data.draw(st.integers(1, 3)), ts_floor=0)  # fmt: skip


@given(models(), st.booleans(), st.integers(1, 3), st.integers(0, 2))
def test_row_outside_range_in_full_page(model: Model, below: bool, n: int, distance: int) -> None:
    # BUG (kept failing on purpose): a *full* page is not checked against (after, through] when
    # the out-of-range fact is the one left for the next page, or the single oversized fact.
    # E.g. rows of ID through+1 alone filling the page give refetch=through+1, and the reader
    # then plans that fact with through=refetch, moving past the proven-complete position.
    rows = model.rows
    bad = _outside(model, below, n, distance)
    rows = bad + rows if below else rows + bad
    with pytest.raises(ValueError, match="outside"):
        plan_page(STREAM, rows, after=model.after, through=model.through, limit=len(rows),
                  ts_floor=0)  # fmt: skip


def test_row_outside_range_examples() -> None:
    row = Row(11, 0, "w", 0, None)
    with pytest.raises(ValueError, match="outside"):  # short page: checked
        plan_page(STREAM, [row], after=0, through=10, limit=2, ts_floor=0)
    with pytest.raises(ValueError, match="outside"):  # at the boundary: `after` itself
        plan_page(STREAM, [Row(5, 0, "w", 0, None)], after=5, through=10, limit=2, ts_floor=0)


def test_row_outside_range_refetch_example() -> None:
    # BUG (kept failing on purpose): a single fact beyond `through` filling the page returns
    # PagePlan((), 0, 0, refetch=11) instead of raising.
    with pytest.raises(ValueError, match="outside"):
        plan_page(STREAM, [Row(11, 0, "w", 0, None)], after=0, through=10, limit=1, ts_floor=0)


def test_row_outside_range_cut_example() -> None:
    # BUG (kept failing on purpose): a cut last fact beyond `through` is dropped silently:
    # returns facts=(Fact 1,), position=1 instead of raising.
    rows = [Row(1, 0, "w", 0, None), Row(11, 0, "w", 0, None)]
    with pytest.raises(ValueError, match="outside"):
        plan_page(STREAM, rows, after=0, through=10, limit=2, ts_floor=0)


# --- Fact and Epoch ---------------------------------------------------------------------------

payloads = st.lists(st.none() | st.integers() | st.text(max_size=3), max_size=3).map(tuple)


@given(payloads, st.integers(0, 2**40))
def test_fact_payload_and_as_dict(values: tuple[Any, ...], ts: int) -> None:
    fact = Fact(STREAM, 3, "w1", ts, values)
    assert fact.payload == (values[0] if values else None)
    data = fact.as_dict()
    expected: dict[str, Any] = {
        "stream": STREAM, "stream_id": 3, "id": 3, "instance": "w1", "timestamp": ts,
        "payload": fact.payload,
    }  # fmt: skip
    if len(values) != 1:
        expected["payloads"] = list(values)
    assert data == expected
    assert ("payloads" in data) == (len(values) != 1)
    assert "payloads" not in repr(fact)  # payloads are repr=False
    with pytest.raises(AttributeError):  # immutable (a named tuple)
        fact.stream_id = 4  # type: ignore[misc]


@given(st.dictionaries(st.sampled_from("abcd"), st.integers(0, 50), min_size=1), st.data())
def test_epoch(lower_in: dict[str, int], data: st.DataObject) -> None:
    upper_in = {s: p + data.draw(st.integers(0, 5)) for s, p in lower_in.items()}
    facts = tuple(Fact(s, upper_in[s], "w", 0, (1,)) for s in upper_in if upper_in[s] > lower_in[s])
    epoch = Epoch(lower_in, upper_in, facts)
    lower_in["zz"] = 1  # the epoch holds copies
    upper_in.clear()
    assert "zz" not in epoch.lower
    assert len(epoch.upper) == len(epoch.lower)
    assert len(epoch) == len(facts)
    assert list(epoch) == list(facts)
    with pytest.raises(TypeError):
        epoch.lower["a"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        epoch.upper["a"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        epoch.facts = ()  # type: ignore[misc]
    ranges = ", ".join(f"{s}: ({epoch.lower[s]}, {epoch.upper[s]}]" for s in epoch.upper)
    assert repr(epoch) == f"Epoch({ranges}; {len(facts)} facts)"


def test_epoch_repr_example() -> None:
    epoch = Epoch({"a": 1, "b": 2}, {"a": 5, "b": 2}, (Fact("a", 4, "w", 0, (None,)),))
    assert repr(epoch) == "Epoch(a: (1, 5], b: (2, 2]; 1 facts)"


def test_fact_id_is_a_deprecated_alias_of_stream_id() -> None:
    fact = Fact("s", 7, "w", 1000, ({"n": 1},))
    assert fact.stream_id == 7
    with pytest.warns(DeprecationWarning, match="stream_id"):
        assert fact.id == 7
    assert fact.as_dict()["stream_id"] == fact.as_dict()["id"] == 7
    assert "stream_id=7" in repr(fact)
