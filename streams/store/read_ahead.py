"""What a reader read ahead (`ReaderCore._read_pages`): the pages it sent on its session and
has not received, then the pages received, kept for the next step. No I/O here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..core.epochs import Row
from ..errors import FactsPruned
from .reads import PagesAhead

__all__ = ["ReadAhead", "Received"]


class Received(NamedTuple):
    """A page read ahead: the range it was read for, its rows, and the stream's
    ``pruned_through`` read after them."""

    after: int
    through: int
    rows: list[Row]
    pruned: int

    def rows_for(self, name: str, after: int, through: int) -> list[Row] | None:
        """The rows, if the page was read for exactly ``(after, through]`` of ``name`` (a
        target that moved since, or a position that did not, asks for another range: None,
        read it anew), with its retention check (`FactsPruned`, as `read_proven` would)."""
        if self.after != after or self.through != through:
            return None
        if self.pruned > after:
            raise FactsPruned(name, after, self.pruned)
        return self.rows


@dataclass(slots=True)
class ReadAhead:
    """``sent``: pages sent on the session, not received yet (the session is busy with them);
    ``received``: pages received, by stream, for the next step only."""

    sent: PagesAhead | None = None
    received: dict[str, Received] = field(default_factory=dict)

    def take_received(self) -> dict[str, Received]:
        """The pages received, for this step: the next one reads afresh what it does not use."""
        received, self.received = self.received, {}
        return received

    def took_in(
        self, ahead: PagesAhead, pages: Sequence[list[Row]], pruned: Mapping[str, int]
    ) -> None:
        """The pages of ``ahead`` came back, with each stream's ``pruned_through``."""
        for (name, after, through), rows in zip(ahead.ranges, pages, strict=True):
            self.received[name] = Received(after, through, rows, pruned.get(name, 0))

    def forget(self) -> None:
        """The session closed: what was sent on it is gone, what was received is dropped."""
        self.sent = None
        self.received = {}
