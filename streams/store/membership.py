"""A reader's hold on its group (`streams.store.reader_groups`; docs/design/fencing.md), as
the reader keeps it between commits: no I/O here."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import UsageError
from .reader_groups import Generation

__all__ = ["GroupMembership"]


@dataclass(slots=True)
class GroupMembership:
    """``committed``: the group's position on each stream as this reader last knew it (when it
    opened the group, or its last commit; None: no row), where `commit_in` expects to find it.
    ``generations``: the generation of the group it took on each stream when it opened it
    (`take_generations`): its commits are fenced by it. ``owner``: who it is, in the group's
    generation rows (``streams positions`` shows it)."""

    committed: dict[str, int | None] = field(default_factory=dict)
    generations: dict[str, Generation] = field(default_factory=dict)
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

    def check_forward(self, group: str, commits: Sequence[tuple[str, int]]) -> None:
        """`UsageError` if a commit of ``(stream, position)`` would move the group back from
        where this reader knows it."""
        for name, position in commits:
            base = self.committed.get(name)
            if base is not None and position < base:
                raise UsageError(
                    f"group {group!r} is at {base} on {name!r}: a commit "
                    f"through {position} would move it back"
                )

    def took(self, committed: Mapping[str, int | None]) -> None:
        """The group is at ``committed`` now (opened there, or committed there)."""
        self.committed.update(committed)
