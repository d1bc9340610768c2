"""The reader's fast paths (a part of `streams.store.reader_core.ReaderCore`): a step on the
shared proofs a prober wrote (a follower: one statement per stream instead of a probe of its
own), and a step on the signed ranges Redis brought (no PostgreSQL at all), with the replication
keys they are verified with. Why neither can make a reader skip or invent a fact:
docs/design/reader.md and docs/design/trust.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ..core.constants import STALE_AFTER
from ..core.epochs import Fact, Row, plan_page
from ..core.payloads import decode_payloads
from ..core.reader_state import ProofFollowing, Proven, ReaderCounters, SignedRangeInbox
from ..errors import ConnectionLost, StoreError
from ..types import StreamInfo
from .driver import Gen
from .keys import live_keys
from .reads import Probe, read_proofs

__all__ = ["FastPaths", "Planned"]

log = logging.getLogger("streams.reader")


class Planned(NamedTuple):
    """What one step read of one stream: its facts (before the ``live`` and time-start
    filters) and where the stream's position and timestamp floor go once they are delivered."""

    name: str
    facts: Sequence[Fact]
    position: int
    ts_floor: int


class FastPaths:
    """The fast paths of `ReaderCore`, which holds the state they read and move."""

    names: tuple[str, ...]
    infos: dict[str, StreamInfo]
    positions: dict[str, int]
    ts_floors: dict[str, int]
    page_size: int
    incarnation: str | None
    counters: ReaderCounters
    proven: Proven
    inbox: SignedRangeInbox
    following: ProofFollowing

    def _plan(self, name: str, rows: list[Row], target: int) -> Gen[Planned]:
        raise NotImplementedError

    def _note_probe(self, probes: Mapping[str, Probe], *, shared: bool = False) -> None:
        raise NotImplementedError

    def _step_on_proofs(
        self, lower: Mapping[str, int], with_rows: bool = True
    ) -> Gen[list[Planned] | None]:
        """`step` as a follower: every stream's shared proof and its first page, one statement
        each, one round trip; None (nothing delivered) when a proof is missing or stale, and
        the caller probes itself. ``with_rows`` False: the proofs only (nothing planned)."""
        infos = [self.infos[n] for n in self.names]
        results, lsn = yield from read_proofs(
            infos, lower, self.page_size if with_rows else 0, self.incarnation
        )
        refused = {
            i.name: int(rows[0][0])
            for i, rows in zip(infos, results, strict=True)
            if rows and not rows[0][2]
        }
        if refused:
            self._refuse_proofs(refused)
        fresh = not refused and all(rows and int(rows[0][1]) <= STALE_AFTER for rows in results)
        if not self.following.read(fresh):
            return None
        self.counters.proof_reads += 1
        proven = {i.name: int(rows[0][0]) for i, rows in zip(infos, results, strict=True)}
        if self.following.late(proven, time.monotonic()):
            return None  # the prober is late: probe for ourselves this once
        self._note_probe({n: Probe(n, c, c, lsn) for n, c in proven.items()}, shared=True)
        planned: list[Planned] = []
        if not with_rows:
            return planned
        for info, found in zip(infos, results, strict=True):
            if proven[info.name] > lower[info.name]:
                page = [tuple(r[3:]) for r in found if r[3] is not None]
                planned.append((yield from self._plan(info.name, page, proven[info.name])))
        return planned

    def _refuse_proofs(self, refused: Mapping[str, int]) -> None:
        """Shared proofs above their stream's max allocated ID (``stream -> complete``, as
        `read_after_proof` finds them): no prober wrote them, so this reader probes for
        itself. Counted, and logged the first time."""
        first = not self.counters.refused_proofs
        self.counters.refused_proofs += len(refused)
        if first:
            log.warning(
                "refused the shared proof of %s: beyond the stream's max allocated ID, so no "
                "prober wrote it (a role that may write streams_proofs did); probing PostgreSQL "
                "instead (further refusals are counted, not logged)",
                ", ".join(f"{name!r} (complete {c})" for name, c in refused.items()),
            )

    def _step_on_signed_ranges(self) -> Gen[list[Planned]]:
        """`step` from the signed ranges Redis brought (`streams.core.signing`): every stream
        a verified range fits (``after <= position < through``) moves, without PostgreSQL
        (except to read the key table now and then). Nothing moves here (`_advance` does)."""
        inbox = self.inbox
        if inbox.keys_retry_due(time.monotonic()):
            yield from self.read_keys()
        if inbox.keys_stale:  # told the keys changed, not read since: apply nothing
            return []
        inbox.accept(self.incarnation)
        planned: list[Planned] = []
        for name in self.names:
            start = self.positions[name]
            position, floor = start, self.ts_floors[name]
            facts: list[Fact] = []
            while (signed := inbox.take(name, position)) is not None:
                rows = [row for row in signed.rows if row[0] > position]
                plan = plan_page(
                    name, rows, after=position, through=signed.through, limit=len(rows) + 1,
                    ts_floor=floor, decode=decode_payloads,
                )  # fmt: skip
                facts += plan.facts
                position, floor = plan.position, plan.ts_floor
                self.counters.signed_ranges += 1
            if position > start:
                self.proven.raise_target(name, position)
                planned.append(Planned(name, tuple(facts), position, floor))
        if planned:
            self.following.covered({**self.positions, **{p.name: p.position for p in planned}})
        return planned

    def keys_due(self) -> bool:
        """Time to read the keys again (`KEY_REFRESH`: retired keys are dropped then)."""
        return self.inbox.keys_due(time.monotonic())

    def read_keys(self) -> Gen[None]:
        """Read the live keys; a reader that may not read them takes nothing from Redis."""
        self.inbox.reading_keys(time.monotonic())
        try:
            self.inbox.keys_read((yield from live_keys()))
        except ConnectionLost:
            raise
        except StoreError as exc:
            if self.inbox.keys_unreadable() == 1:
                log.warning("cannot read the replication keys (%s): reading PostgreSQL only", exc)
