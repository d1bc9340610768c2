"""Shared proofs: one process per stream proves its complete position for every reader.

Each `streams.Client` with a Redis link runs one `ProofService` (a thread) once it has a
reader: it stands for election as the prober of the streams its readers follow (only with the
prover role), proves them (`streams.store.probe.prove`), and publishes each proof on the
stream's proof channel, as signed ranges (`streams.core.signing`) and ``POSITION`` lines.

Theory of operation: docs/design/trust.md; why a shared proof is as safe as one's own probe:
docs/design/probe.md.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import psycopg

from .config import DEFAULT_LEASE_SECONDS, scrub_secrets, url_passwords
from .core.constants import PROOF_INSTANCE_PREFIX, STALE_AFTER, proof_channel
from .core.incarnation import Guard
from .core.protocol import (
    Command,
    KeysCommand,
    PositionCommand,
    ProtocolError,
    RdataCommand,
    serialize,
)
from .core.replication import Hint, is_keys_hint, is_proof_hint
from .core.signing import KEY_REFRESH, MAX_SIGNED_ROWS, SigningKey, sign_range, split_for_signing
from .core.stalls import HeldStreams
from .errors import ConnectionLost, StoreError
from .store import sessions
from .store.driver import Gen, Row, run
from .store.holders import end_exclusive_holders, exclusive_streams, retire_where_held
from .store.identity import verify
from .store.keys import may_sign, renew_keys, signing_key
from .store.probe import (
    PROVER_SESSION_SETUP,
    Probe,
    end_stale_provers,
    resign_prover,
    set_up_reader_session,
    try_become_prover,
)
from .store.reads import prove_with_rows
from .store.registry import load_streams
from .transport.faces import ProverLink
from .types import StreamInfo

__all__ = [
    "ELECTION_INTERVAL",
    "FOLLOWER_LINES_PER_SECOND",
    "MAX_PROOF_GAP",
    "MIN_PROOF_GAP",
    "REFRESH_INTERVAL",
    "ProofService",
    "proof_gap",
]

log = logging.getLogger(__name__)

#: Seconds between attempts to become the prober of followed streams nobody proves.
ELECTION_INTERVAL = 0.5
#: Seconds between proofs of a quiet stream (so that the record's age shows the prober lives).
REFRESH_INTERVAL = 1.0
#: Least seconds between two proofs. At high append rates a proof then covers the appends of
#: this long: readers get one signed line per 5 ms, not one per append (each line costs every
#: reader process two thread wake-ups, ~100 us each on a small VM), for at most 5 ms of latency.
#: After a quiet spell the first hint is proved at once.
MIN_PROOF_GAP = 0.005
#: Proof lines per second that all follower processes of the proven streams may receive
#: together before proofs are spaced further than `MIN_PROOF_GAP` (`proof_gap`): 8 followers
#: get a line every 5 ms, 32 every 20 ms. With 32 readers and a line every 5 ms, the
#: followers' wake-ups took most of two cores and the writers' throughput with them.
FOLLOWER_LINES_PER_SECOND = 1600.0
#: The widest gap between proofs, whatever the number of followers (it adds to latency).
MAX_PROOF_GAP = 0.05
#: Seconds between two counts of the followers (``PUBSUB NUMSUB``).
FOLLOWER_COUNT_INTERVAL = 1.0
#: A followed stream whose proof lines (from another process) were heard this recently (s) has
#: a live prover: this process holds no election for it, and no connection for it.
PROVER_ALIVE_WINDOW = STALE_AFTER / 1000


def proof_gap(followers: int) -> float:
    """Least seconds between two proofs when ``followers`` processes receive the proof lines:
    `MIN_PROOF_GAP`, or more so that they receive `FOLLOWER_LINES_PER_SECOND` lines per
    second together, at most `MAX_PROOF_GAP`."""
    return min(MAX_PROOF_GAP, max(MIN_PROOF_GAP, followers / FOLLOWER_LINES_PER_SECOND))


class ProofService:
    """The prober side of shared proofs for one process (see the module docstring).

    ``link``: the process's `streams.transport.link.RedisLink` (hints in, proof lines out:
    `streams.transport.faces.ProverLink`).
    Thread-safe; the thread starts with the first `follow`.
    """

    def __init__(
        self,
        database_url: str,
        link: ProverLink,
        name: str,
        guard: Guard | None = None,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        self._url = database_url
        self._link = link
        #: The database history this process proves for (its client's).
        self.guard = guard or Guard()
        self.instance = f"{PROOF_INSTANCE_PREFIX}{name}"
        self._cond = threading.Condition()
        self._followed: dict[str, int] = {}  # stream -> number of local readers
        self._held: set[str] = set()  # streams this process proves
        self._hinted: set[str] = set()
        self._proven: dict[str, int] = {}
        self._heard: dict[str, float] = {}  # stream -> when another prover's line was heard
        self._infos: dict[str, StreamInfo] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._last_election = self._last_refresh = self._last_proof = 0.0
        self._gap, self._counted_at = MIN_PROOF_GAP, -FOLLOWER_COUNT_INTERVAL
        self.proofs = 0  # probes run as prober (for tests and metrics)
        self.signed = 0  # signed ranges published
        self._key: SigningKey | None = None
        self._keys_at = -KEY_REFRESH
        self._warned_keys = False
        # Whether this process's role may read the private seeds (None: not asked yet on
        # this connection); a process that may not never stands for election.
        self._may_sign: bool | None = None
        self._said_cannot_sign = False
        # Stall checks of the streams it proves; ``lease_seconds``: this process's own lease,
        # the least time a session may hold a stream back (docs/design/liveness.md).
        self._stalls = HeldStreams(lease=lease_seconds)

    def __repr__(self) -> str:
        return f"<ProofService {self.instance} proving {sorted(self._held)}>"

    @property
    def proving(self) -> frozenset[str]:
        """The streams this process is the prober of."""
        with self._cond:
            return frozenset(self._held)

    def follow(self, names: Iterable[str]) -> None:
        with self._cond:
            for name in names:
                self._followed[name] = self._followed.get(name, 0) + 1
            if self._thread is None and not self._stopped:
                self._link.add_listener(self)
                self._thread = threading.Thread(
                    target=self._run, name="streams-prover", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def unfollow(self, names: Iterable[str]) -> None:
        with self._cond:
            for name in names:
                left = self._followed.get(name, 0) - 1
                if left > 0:
                    self._followed[name] = left
                else:
                    self._followed.pop(name, None)
            self._cond.notify()

    # LinkListener
    def on_hint(self, hint: Hint) -> None:
        if is_keys_hint(hint):  # the keys changed: read them before the next signature
            with self._cond:
                self._keys_at = -KEY_REFRESH
            return
        if is_proof_hint(hint):
            # Another process proves this stream (or a Redis client says so: then nobody here
            # holds elections for it and readers fall back to probing themselves once the
            # record goes stale; slower, never wrong).
            if hint.instance != self.instance:
                with self._cond:
                    self._heard[hint.stream] = time.monotonic()
            return
        with self._cond:
            if hint.stream in self._held and hint.token > self._proven.get(hint.stream, 0):
                self._hinted.add(hint.stream)
                self._cond.notify()

    def on_link_state(self, connected: bool) -> None:
        with self._cond:
            self._hinted.update(self._held)  # prove at once after a reconnect
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            self._link.remove_listener(self)
            thread.join(timeout=5)
            self._hold(set())

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        self._last_election = self._last_refresh = self._last_proof = 0.0
        while True:
            work = self._wait_for_work()
            if work is None:
                break
            try:
                if conn is None or conn.closed:
                    conn = self._connect()
                    self._may_sign = None
                    self._hold(set())  # a new session holds no lock
                self._work(conn, *work)
                if not self._held:
                    # A follower keeps no connection: it needs one only to hold an election,
                    # when no prover is heard (`PROVER_ALIVE_WINDOW`).
                    conn.close()
                    conn = None
            except Exception as exc:  # the thread must outlive a dropped stream or server
                message = scrub_secrets(str(exc), url_passwords(self._url))[:300]
                log.warning("shared prover: %s: %s; retrying in 1s", type(exc).__name__, message)
                if conn is not None:
                    conn.close()
                conn = None
                self._hold(set())
                with self._cond:
                    self._cond.wait(1.0)
        if conn is not None:
            conn.close()  # releases the election locks

    def _unproved(self, now: float) -> set[str]:
        """Followed streams this process does not prove and no other is heard proving."""
        return {
            name
            for name in self._followed
            if name not in self._held
            and now - self._heard.get(name, -PROVER_ALIVE_WINDOW) >= PROVER_ALIVE_WINDOW
        }

    def _wait_for_work(self) -> tuple[set[str], set[str], set[str], bool] | None:
        """Sleep until there is something to do: (hinted streams, followed streams, streams
        to try to take over, whether to hold an election), or None once closed."""
        with self._cond:
            while not self._stopped and not self._hinted:
                now = time.monotonic()
                waits = [5.0]
                if self._unproved(now) or self._held - set(self._followed):
                    waits.append(self._last_election + ELECTION_INTERVAL - now)
                # When a prover heard of goes quiet for long enough to count as gone.
                waits += [
                    self._heard[n] + PROVER_ALIVE_WINDOW - now
                    for n in self._followed
                    if n in self._heard and n not in self._held
                ]
                if self._held:
                    waits.append(self._last_refresh + REFRESH_INTERVAL - now)
                if min(waits) <= 0:
                    break
                self._cond.wait(min(waits))
            if self._stopped:
                return None
            now = time.monotonic()
            hinted, self._hinted = self._hinted, set()
            followed = set(self._followed)
            candidates = self._unproved(now)
            return hinted, followed, candidates, bool(candidates or self._held - followed)

    def _work(
        self,
        conn: psycopg.Connection[Any],
        hinted: set[str],
        followed: set[str],
        candidates: set[str],
        elect: bool,
    ) -> None:
        now = time.monotonic()
        if elect and now - self._last_election >= ELECTION_INTERVAL:
            self._last_election = now
            self._elect(conn, followed, candidates)
        with self._cond:
            held = set(self._held)
        refresh = now - self._last_refresh >= REFRESH_INTERVAL
        if refresh:
            self._last_refresh = now
            due = held
        else:
            due = hinted & held
        if due:
            if now - self._counted_at >= FOLLOWER_COUNT_INTERVAL:
                self._counted_at = now
                self._gap = self._count_followers(held)
            gap = self._last_proof + self._gap - time.monotonic()
            if gap > 0:
                time.sleep(gap)
            self._last_proof = time.monotonic()
            self._prove(conn, due, refresh)

    def _count_followers(self, held: set[str]) -> float:
        """The gap between proofs for the followers of ``held`` now (`proof_gap`); the
        current one if Redis cannot say."""
        prefix = self._link.prefix
        counts = self._link.subscribers([proof_channel(prefix, name) for name in sorted(held)])
        if counts is None:
            return self._gap
        return proof_gap(max(counts.values(), default=0))

    def _hold(self, names: set[str]) -> None:
        """The streams this process proves are now ``names``: hear writers' hints of those
        (their data channels, `streams.core.constants`), and of no other."""
        with self._cond:
            gained, lost = names - self._held, self._held - names
            self._held = set(names)
        if gained:
            self._link.watch(sorted(gained), writers=True)
        if lost:
            self._link.unwatch(sorted(lost), writers=True)

    def _connect(self) -> psycopg.Connection[Any]:
        return sessions.connect(
            self._url,
            autocommit=True,
            connect_timeout=10,
            purpose="prober",
            opening=self._opening,
        )

    def _opening(self) -> Gen[None]:
        yield from set_up_reader_session(*PROVER_SESSION_SETUP)
        # Proving in another database history would sign its ranges for this one's readers.
        yield from verify(self.guard, "the prover")

    def _info_of(self, conn: psycopg.Connection[Any], names: set[str]) -> list[StreamInfo]:
        missing = sorted(n for n in names if n not in self._infos)
        if missing:
            self._infos.update((i.name, i) for i in run(conn, load_streams(missing)))
        return [self._infos[n] for n in sorted(names)]

    def _elect(
        self, conn: psycopg.Connection[Any], followed: set[str], candidates: set[str]
    ) -> None:
        """Resign what no local reader follows any more; try to take ``candidates`` over
        (streams nobody is heard proving), ending a prover that stopped proving."""
        with self._cond:
            resign = self._held - followed
            candidates = candidates - self._held
        if resign:
            run(conn, resign_prover(self._info_of(conn, resign)))
            self._hold(self._held - resign)
            with self._cond:
                for name in resign:
                    self._proven.pop(name, None)
        if candidates and not self._stands(conn):
            candidates = set()
        if candidates:
            infos = self._info_of(conn, candidates)
            won = run(conn, try_become_prover(infos))
            if won:
                log.info("%s now proves %s", self.instance, ", ".join(won))
                self._hold(self._held | set(won))
            lost = [info for info in infos if info.name not in won]
            if lost:  # someone proves them: unless it stopped proving (frozen, cut off)
                ended = run(conn, end_stale_provers(lost))
                if ended:
                    log.warning("ended the stalled prover of %s", ", ".join(ended))

    def _stands(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether this process stands for election: only if its role may read the private
        seeds (`streams.store.keys.may_sign`). Otherwise it says so once and proves nothing;
        its readers follow another process's proofs, or probe for themselves."""
        if self._may_sign is None:
            self._may_sign = run(conn, may_sign())
        if not self._may_sign and not self._said_cannot_sign:
            self._said_cannot_sign = True
            log.info(
                "%s does not stand for election as a prover: its database role may not read "
                "streams_prover.signing_keys (grant it the prover role to prove for others)",
                self.instance,
            )
        return self._may_sign

    def _token(self) -> str | None:
        expected = self.guard.expected
        return None if expected is None else expected.token

    def _signing_key(self, conn: psycopg.Connection[Any]) -> SigningKey | None:
        """The key to sign with: the newest live one, if it was made in this process's
        database incarnation; else a new one (`renew_keys`: after a restore or a failover
        the old keys must verify nowhere), announced with ``KEYS``. None: sign nothing."""
        token = self._token()
        try:
            key = run(conn, signing_key())
            if key is not None and key.incarnation == token:
                return key
            if token is None or not run(conn, may_sign()):
                return None
            # Its own transaction (this session is in autocommit), on this process's history.
            with sessions.connect(
                self._url,
                autocommit=False,
                connect_timeout=10,
                purpose="prover keys",
                opening=functools.partial(verify, self.guard, "the prover renewing keys"),
            ) as keys_conn:
                new = run(keys_conn, renew_keys(token))
            log.info("replication key %d made for database incarnation %s", new, token)
            self._link.publish([KeysCommand(new)])
            key = run(conn, signing_key())
        except ConnectionLost:
            raise
        except StoreError as exc:  # a role that may not read or make keys: prove unsigned
            if not self._warned_keys:
                log.warning("cannot read or renew the replication keys (%s): proofs unsigned", exc)
            self._warned_keys = True
            return None
        return key if key is not None and key.incarnation == token else None

    def _prove(self, conn: psycopg.Connection[Any], names: set[str], refresh: bool) -> None:
        """Prove ``names``; announce what moved (with ``refresh``, also what did not: other
        processes hear that this one still proves, `PROVER_ALIVE_WINDOW`)."""
        infos = self._info_of(conn, names)
        now = time.monotonic()
        with self._cond:
            keys_due = now - self._keys_at >= KEY_REFRESH
            if keys_due:
                self._keys_at = now
        if keys_due:
            self._key = self._signing_key(conn)
        with self._cond:
            # Rows to sign: after what this process proved last (a stream it just took over
            # is announced without rows: readers are somewhere below, and read PostgreSQL).
            after = {n: self._proven[n] for n in names if n in self._proven}
        if self._key is None:
            after = {}
        probes, rows = run(conn, prove_with_rows(infos, after, MAX_SIGNED_ROWS + 1, self._token()))
        self.proofs += 1
        # Followers see only proofs: the prover is the reader that notices a stream held back
        # by an expired writer (docs/design/liveness.md).
        observed = [(name, p.complete, p.max_allocated) for name, p in probes.items()]
        by_name = {info.name: info for info in infos}
        run(conn, retire_where_held(by_name, self._stalls, time.monotonic(), observed))
        if refresh:
            # Once a second: a session holding a reservation lock exclusively blocks every
            # writer of the stream and holds no reader back, so no stall check sees it; the
            # prover ends it ("exclusive holders" in streams.store.holders).
            for info in run(conn, exclusive_streams(infos)):
                run(conn, end_exclusive_holders(info))
        commands: list[Command] = []
        with self._cond:
            for name, found in probes.items():
                prev = self._proven.get(name, 0)
                if found.complete > prev or name not in self._proven:
                    self._proven[name] = max(prev, found.complete)
                    commands += self._announcement(name, prev, found, rows.get(name))
                elif refresh:
                    commands.append(PositionCommand(name, self.instance, prev, prev))
        if commands:
            self._link.publish(commands)

    def _announcement(
        self, name: str, prev: int, found: Probe, rows: list[Row] | None
    ) -> list[Command]:
        """The lines that say ``name`` is proven through ``found.complete``: a signed range
        with its rows, as far as one line may carry them, and a ``POSITION`` for the rest."""
        complete = found.complete
        if rows is None or self._key is None or complete <= prev:
            return [PositionCommand(name, self.instance, prev, complete)]
        full = len(rows) > MAX_SIGNED_ROWS
        end, count = split_for_signing(rows[:MAX_SIGNED_ROWS], prev, complete, full)
        commands: list[Command] = []
        if end > prev:
            row = sign_range(name, self.instance, prev, end, rows[:count], self._key)
            signed = RdataCommand(name, self.instance, end, row)
            try:
                serialize(signed)  # too long for one line (escaped payloads): announce only
            except ProtocolError:
                end = prev
            else:
                commands.append(signed)
                self.signed += 1
        if complete > end:
            commands.append(PositionCommand(name, self.instance, end, complete))
        return commands
