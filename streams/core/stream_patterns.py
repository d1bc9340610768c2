"""A reader that follows streams by pattern: which streams join it and which leave, decided
here without I/O (`streams.store.reader_core` asks the registry and applies the changes).

A pattern reader follows every stream whose name matches a regular expression in full
(`re.fullmatch`, Python's syntax): the names are filtered here, in Python, never by
PostgreSQL's ``~`` (a POSIX dialect: the same text may match other names there).

New streams are found by listing the registry rows above a watermark of registry ids. Ids are
handed out in order but become visible in commit order: a stream created in a transaction that
commits after one with a higher id appears *below* ids already seen. So the ids skipped between
two seen ones are *holes*, listed again until they appear (a late commit: the stream joins) or
`HOLE_WAIT` seconds pass (an aborted create, or a stream dropped before it was seen: neither
ever appears). At most `MAX_HOLES` are kept, the highest ones.

A stream leaves when a probe no longer finds its registry row (it was dropped), or when a stream
of the same name but a new registry id is listed (dropped and created again: the old one leaves,
the new one joins, read from its first fact).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import InvalidPattern

__all__ = ["HOLE_WAIT", "MAX_HOLES", "Changes", "RegistryCursor", "Subscription", "compile_pattern"]

#: Seconds an id skipped in the registry is listed again, waiting for its transaction to commit
#: (a create of `streams.store.registry.CREATE_CHUNK` streams takes a few seconds at most).
HOLE_WAIT = 120.0
#: Most holes kept (the highest): a burst of aborted creates costs a bounded listing.
MAX_HOLES = 1000


def compile_pattern(pattern: object) -> re.Pattern[str]:
    """The compiled pattern; `InvalidPattern` for anything but a valid, non-empty regex."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidPattern(f"a stream pattern is a non-empty string, not {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InvalidPattern(f"invalid stream pattern {pattern!r}: {exc}") from None


@dataclass(slots=True)
class RegistryCursor:
    """Which registry ids a listing has seen: every id ``<= top`` except the ``holes`` (id ->
    when first missed, monotonic seconds)."""

    top: int = 0
    holes: dict[int, float] = field(default_factory=dict)

    def low(self) -> int:
        """List the rows with an id above this: the lowest hole, or everything new."""
        return min(self.holes) - 1 if self.holes else self.top

    def take(self, rows: Iterable[tuple[int, str]], now: float) -> list[tuple[int, str]]:
        """The ``(id, name)`` rows of a listing (ids above `low`) not seen before, in id order;
        the cursor moves past them."""
        new: list[tuple[int, str]] = []
        for key, name in sorted(rows):
            if key > self.top:
                self.holes.update(
                    dict.fromkeys(range(max(self.top + 1, key - MAX_HOLES), key), now)
                )
                self.top = key
                new.append((key, name))
            elif self.holes.pop(key, None) is not None:
                new.append((key, name))
        for key in [k for k, since in self.holes.items() if now - since >= HOLE_WAIT]:
            del self.holes[key]
        if len(self.holes) > MAX_HOLES:
            for key in sorted(self.holes)[: len(self.holes) - MAX_HOLES]:
                del self.holes[key]
        return new


class Changes(NamedTuple):
    """What a listing changes: streams that leave (names), then streams that join (id,
    name), in id order."""

    leaves: list[str]
    joins: list[tuple[int, str]]


@dataclass(slots=True)
class Subscription:
    """The streams a pattern reader follows, as it learns of them (see the module doc).

    ``due``: list the registry at the next step (the reader's poll cycle sets it, at most once
    per poll interval: `poll_started`)."""

    pattern: re.Pattern[str]
    cursor: RegistryCursor = field(default_factory=RegistryCursor)
    due: bool = True
    polled_at: float = -math.inf

    def matches(self, name: str) -> bool:
        return self.pattern.fullmatch(name) is not None

    def poll_started(self, now: float, interval: float) -> None:
        """A poll cycle starts: list the registry in it if ``interval`` passed since the last
        cycle that did (so at most once per poll interval, and within one poll)."""
        if now - self.polled_at >= interval:
            self.polled_at = now
            self.due = True

    def listed(
        self, rows: Iterable[tuple[int, str]], followed: Mapping[str, int], now: float
    ) -> Changes:
        """A listing of the registry rows above `RegistryCursor.low` (``followed``: the
        registry id of each stream followed now): the streams that leave and join."""
        self.due = False
        leaves: list[str] = []
        joins: list[tuple[int, str]] = []
        for key, name in self.cursor.take(rows, now):
            if not self.matches(name):
                continue
            known = followed.get(name)
            if known == key:
                continue
            if known is not None:
                leaves.append(name)  # dropped and created again under the same name
            joins.append((key, name))
        return Changes(leaves, joins)

    @staticmethod
    def gone(followed: Collection[str], probed: Collection[str]) -> list[str]:
        """The streams followed that a probe did not find (their registry rows are gone)."""
        return [name for name in followed if name not in probed]
