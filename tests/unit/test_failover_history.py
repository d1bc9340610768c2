"""Whether something planned before a failover holds after it (`identity.holds_across_failover`),
driven by hand: the switch point is the only statement it runs."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from streams.core.incarnation import Incarnation
from streams.errors import DatabaseChanged
from streams.store.driver import Commit, Query
from streams.store.identity import holds_across_failover

OLD = Incarnation("a", 1, 2, 3, 1)
NEW = Incarnation("a", 1, 2, 3, 2)


def drive(gen: Generator[Any, Any, None], switchpoint: str | None) -> list[str]:
    """Run ``gen``, answering the switch point query; the statements it ran."""
    ran: list[str] = []
    answer: Any = None
    while True:
        try:
            op = gen.send(answer)
        except StopIteration:
            return ran
        if isinstance(op, Query):
            ran.append(str(op.statement))
            answer = [(switchpoint,)]
        else:
            assert isinstance(op, Commit)
            answer = []


def test_the_same_history_runs_nothing() -> None:
    assert drive(holds_across_failover(NEW.token, NEW, "w", None), None) == []


def test_a_proof_at_or_below_the_switch_point_holds() -> None:
    for lsn in (0x3000000, 0x3000100):
        ran = drive(holds_across_failover(OLD.token, NEW, "w", lsn), "0/3000100")
        assert ran == ["SELECT streams_timeline_switchpoint(1)::text"]


@pytest.mark.parametrize(
    ("proof_lsn", "switchpoint", "why"),
    [
        (0x3000101, "0/3000100", "proven at WAL 0/3000101, after the switch point 0/3000100"),
        (None, "0/3000100", "its proof's WAL position is not known"),
        (0x10, None, "switch point of timeline 1 cannot be read here"),
    ],
)
def test_otherwise_it_stops_and_says_why(
    proof_lsn: int | None, switchpoint: str | None, why: str
) -> None:
    with pytest.raises(DatabaseChanged, match="timeline 1 -> 2") as caught:
        drive(holds_across_failover(OLD.token, NEW, "the end offset", proof_lsn), switchpoint)
    assert why in caught.value.changed and caught.value.where == "the end offset"


@pytest.mark.parametrize("token", ["a/1/9/3/1", "b/1/2/3/1", "a/1/2/3/3", "a/x/2/3/1", "junk"])
def test_another_history_or_a_later_branch_stops_without_asking(token: str) -> None:
    with pytest.raises(DatabaseChanged):
        drive(holds_across_failover(token, NEW, "w", 0), "0/3000100")
