"""The one error tree of `streams`.

Every error this library raises on purpose is a subclass of `StreamsError`, so a service can
catch everything with one clause and still tell the cases apart::

    StreamsError
    ├── ConfigurationError          bad URL, bad option, missing setting
    │   └── InvalidPattern          a reader's stream pattern is not a regex, or came with
    │                               stream names (also a ValueError)
    ├── InvalidStreamName           a stream or writer name that is not allowed
    ├── UnknownStream               the stream was never created (or was dropped)
    ├── StreamExists                create_stream() on a name already taken, with other settings
    ├── InvalidFact                 the append itself is wrong; nothing was written
    │   ├── PayloadNotSerializable  not JSON (or NaN/Infinity, or non-str keys)
    │   ├── PayloadTooLarge         larger than the configured maximum (default 1 MiB)
    │   └── InvalidTimestamp        missing under client-require, negative, or not an int
    ├── WriterFenced                this writer was declared dead (lease expired or replaced);
    │                               it may not reserve or complete IDs any more
    ├── UsageError                  the API was used in a way it cannot honour
    │   └── InvalidPosition         a position beyond the stream's max allocated ID (a forged
    │                               line or proof, a restore): a commit of it moves nothing
    ├── WaitTimeout                 wait_for_position() gave up (also a TimeoutError)
    ├── FactsPruned                 the facts asked for were removed by the stream's retention
    ├── MalformedPayload            a payload does not parse with the typed-columns schema
    │                               (mode FAILFAST); also a ValueError
    ├── GroupMoved                  commit(conn=...) found the group moved by another consumer
    ├── GroupFenced                 another consumer opened the group since this one did: a
    │                               commit from this (older) generation moves nothing
    ├── DatabaseChanged             the database is not the one this process, group row or Spark
    │   │                           offset started on (recreated, restored, failed over)
    │   └── FailoverLoss            after a failover the new primary lacks facts or commits this
    │                               process saw acknowledged or delivered (asynchronous standby)
    ├── RedisUnavailable            Redis is needed here and failed (down, refused, bad password)
    └── StoreError                  PostgreSQL failed underneath us (down, timed out, ...)
        ├── ConnectionLost          the connection broke mid-operation (restart, network)
        │   └── CommitUnknown       ... while committing: it may or may not have committed
        ├── SchemaNotReady          the schema is missing or older than this library's
        ├── SequenceRewound         a stream's sequence was set back below IDs already used
        ├── ReservationBlocked      another session holds the stream's reservation lock
        │                           exclusively (no writer of ours does): nothing was written
        ├── StandbyBehind           a read URL's standby has not replayed a proof yet, or is on
        │                           another timeline: the read waits, or goes to the primary
        └── InvalidFactTables       a declared user table / ID column does not exist or fits not

Errors never carry passwords: anything that renders a URL goes through `redact_url`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CommitUnknown",
    "ConfigurationError",
    "ConnectionLost",
    "DatabaseChanged",
    "FactsPruned",
    "FailoverLoss",
    "GroupFenced",
    "GroupMoved",
    "InvalidFact",
    "InvalidFactTables",
    "InvalidPattern",
    "InvalidPosition",
    "InvalidStreamName",
    "InvalidTimestamp",
    "MalformedPayload",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "RedisUnavailable",
    "ReservationBlocked",
    "SchemaNotReady",
    "SequenceRewound",
    "StandbyBehind",
    "StoreError",
    "StreamExists",
    "StreamsError",
    "UnknownStream",
    "UsageError",
    "WaitTimeout",
    "WriterFenced",
]


class StreamsError(Exception):
    """Base class of every error `streams` raises on purpose."""


class ConfigurationError(StreamsError):
    """A setting is missing or malformed (database URL, Redis URL, an option)."""


class InvalidPattern(ConfigurationError, ValueError):
    """A reader's stream pattern is not a valid regular expression, or a reader was given both
    stream names and a pattern (or neither)."""


class InvalidStreamName(StreamsError, ValueError):
    """A stream or writer-instance name does not match the allowed pattern."""


class UnknownStream(StreamsError, LookupError):
    """The named stream does not exist."""

    def __init__(self, stream: str) -> None:
        super().__init__(
            f"unknown stream {stream!r} (create it with create_stream or `streams create`)"
        )
        self.stream = stream


class StreamExists(StreamsError):
    """The stream exists already with different settings."""


class InvalidFact(StreamsError, ValueError):
    """The fact given to append cannot be written; nothing was written and no ID leaked."""


class PayloadNotSerializable(InvalidFact, TypeError):
    """The payload is not representable as strict JSON."""


class PayloadTooLarge(InvalidFact):
    """The serialised payload is larger than the configured maximum."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"payload is {size} bytes, larger than the maximum of {limit} bytes")
        self.size = size
        self.limit = limit


class InvalidTimestamp(InvalidFact):
    """A client timestamp is missing (under client-require), negative or not an integer."""


class WriterFenced(StreamsError):
    """This writer was retired (its lease expired, or another process took its name).

    A fenced writer can never again complete an ID, so it can never make a fact appear below a
    linear position that was already published. Create a new writer to continue.
    """


class UsageError(StreamsError):
    """The API was called in a way it cannot honour (e.g. a fact inside an open transaction)."""


class InvalidPosition(UsageError):
    """A position beyond anything the stream ever had: above its *max allocated* ID (its
    sequence's last value), so it names facts that were never written. Nothing was committed.

    A reader's position never gets there by itself (it only passes IDs PostgreSQL proved
    complete); one that does came from a forged signed range or proof, or from a database
    restored or failed over to an older state since. Committed, it would make the group skip
    every fact written up to it (and one near the bigint limit would make the stream's next
    append fail). ``where``: what tried it (a group); ``max_allocated``: the stream's.
    """

    def __init__(self, where: str, stream: str, position: int, max_allocated: int) -> None:
        self.where = where
        self.stream = stream
        self.position = position
        self.max_allocated = max_allocated
        super().__init__(
            f"{where} on stream {stream!r}: position {position} is beyond the stream's max "
            f"allocated ID {max_allocated} (no fact above it was ever written), so nothing was "
            "committed; such a position comes from a forged line or proof, or from a database "
            "restored or failed over to an older state: reopen the reader from the group's "
            "position (`streams positions` shows it)"
        )


class RedisUnavailable(StreamsError):
    """Redis is required by this operation and cannot be used (down, refused, bad password).

    Only operations that need Redis raise it (observing a channel, for one): readers and
    writers never do, they fall back to PostgreSQL while their link reconnects.
    """


class StoreError(StreamsError):
    """PostgreSQL failed underneath an operation (unreachable, crashed, timed out).

    ``sqlstate`` is the server's error code when there is one (e.g. ``23505`` for a unique
    violation), so callers can tell failures apart without parsing messages.
    """

    sqlstate: str | None = None


class ConnectionLost(StoreError):
    """The connection to PostgreSQL broke in the middle of an operation (the server restarted or
    ended the session, the network failed). A transaction that had not sent its ``COMMIT`` did
    not commit; readers and the prover retry by themselves, on a new connection."""


class CommitUnknown(ConnectionLost):
    """The connection broke while a ``COMMIT`` (or a single-statement append, which commits by
    itself) was in flight: it may or may not have committed, and nothing can tell this client.

    Do not retry such an append blindly: it would be written twice if the first one committed.
    Its ID is counted as complete either way; a reader learns the fact from PostgreSQL if it
    exists. Check for it (by your own key in the payload, for one) before writing it again.
    """


class SchemaNotReady(StoreError):
    """The database has no `streams` schema, or an older one: run `streams migrate`."""


class StandbyBehind(StoreError):
    """The standby of a read URL cannot serve this read yet: it has replayed only to
    ``replayed`` (an LSN as an int), below the proof's ``proof_lsn`` (`streams.core.standby_fence`),
    or it is on another timeline than the primary (``timeline`` True). Nothing was read; the
    reader waits and looks again, or reads from the primary. Never a fact skipped."""

    def __init__(self, message: str, *, replayed: int = 0, proof_lsn: int = 0,
                 timeline: bool = False) -> None:  # fmt: skip
        super().__init__(message)
        self.replayed = replayed
        self.proof_lsn = proof_lsn
        self.timeline = timeline


class SequenceRewound(StoreError):
    """A stream's sequence handed out an ID at or below one already allocated or used.

    The sequence was set back (restored from a backup, a bad migration, ``setval`` by hand). The
    append was rolled back, so nothing was written twice. A writer repairs the sequence when it
    starts (past every stored fact, declared table, writer and reader-group position): close this
    writer and open a new one, or run ``streams doctor --repair``.
    """


class ReservationBlocked(StoreError):
    """Another session holds the stream's reservation lock exclusively, which no session of
    this library ever does, so no ID can be reserved behind it: nothing was written, and the
    append may be tried again. The writer's next heartbeat ends that session if its role may (a
    member of the session's role or of ``pg_signal_backend``); ``streams doctor`` names it and
    ``streams doctor --repair`` ends it (`streams.store.holders`, "exclusive holders")."""


class InvalidFactTables(StoreError):
    """A table declared to hold a stream's facts does not exist or has no such integer column."""


class FactsPruned(StreamsError):
    """A read needs facts that the stream's retention has removed (``streams prune``).

    ``position``: where the reader stands (it has every fact ``<=`` it); ``pruned_through``:
    every fact ``<=`` it may be gone. Nothing was delivered past the gap: start again from
    ``"earliest"`` (the oldest fact kept) or later, knowing that facts in between were lost.
    Reader groups never lose facts this way: retention stops at their committed positions.
    """

    def __init__(self, stream: str, position: int, pruned_through: int) -> None:
        self.stream = stream
        self.position = position
        self.pruned_through = pruned_through
        super().__init__(
            f"stream {stream!r}: facts {position + 1}..{pruned_through} were removed by "
            f"retention (every fact <= {pruned_through} may be gone) and this read starts "
            f"after {position}; start from 'earliest' (the oldest fact kept) or later, or "
            "commit a reader group so retention waits for it"
        )


class MalformedPayload(StreamsError, ValueError):
    """A row's payload does not parse with the schema given for typed columns, in mode
    FAILFAST (`streams.core.typed_payloads`): the message names the stream, the stream ID,
    the row and what did not parse."""

    def __init__(self, message: str, stream: str = "", stream_id: int = 0, row_no: int = 0):
        self.stream, self.stream_id, self.row_no = stream, stream_id, row_no
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # Spark pickles a task's error
        return (type(self), (str(self), self.stream, self.stream_id, self.row_no))


class GroupMoved(StreamsError):
    """``reader.commit(conn=...)`` found the group's position no longer where this reader left
    it (when it opened the group or last committed it): another consumer of the group committed
    meanwhile (this one is stale), or the transaction of this reader's previous commit rolled
    back. Nothing was committed, and the caller's transaction can only roll back (its effects
    must not commit: they may repeat another consumer's). Roll it back, close the reader and
    open a new one of the group: it resumes at the group's position.
    """

    def __init__(self, group: str, stream: str, base: int | None) -> None:
        self.group = group
        self.stream = stream
        self.base = base
        where = "had no position" if base is None else f"was at {base}"
        super().__init__(
            f"group {group!r} on stream {stream!r} moved since this reader found it (it {where}):"
            " another consumer committed it, or the transaction of this reader's last commit "
            "rolled back; roll back, then reopen the reader (it resumes at the group's position)"
        )


class GroupFenced(StreamsError):
    """A newer consumer opened this reader's group since this one did (it took a higher
    *generation*, `streams.store.reader_groups`): this consumer is a zombie (a stalled or
    partitioned process, an orphan that outlived its replacement). Its commit moved nothing (with
    ``commit(conn=...)`` the caller's transaction failed too, its effects with it). Stop
    consuming: the group's live consumer owns it now; to take it back, open a new reader.

    ``generation``: the one this reader holds; ``current``: the group's now (None if the group's
    generation row is gone: the group was deleted or the stream dropped).
    """

    def __init__(self, group: str, stream: str, generation: int, current: int | None) -> None:
        self.group = group
        self.stream = stream
        self.generation = generation
        self.current = current
        now = "was deleted" if current is None else f"is at generation {current}"
        super().__init__(
            f"group {group!r} on stream {stream!r}: this consumer holds generation {generation}"
            f" but the group {now}: another consumer opened it since, so nothing was "
            "committed; stop this consumer (open a new reader to take the group back)"
        )


class DatabaseChanged(StreamsError):
    """The database is not the one this process (or a group row, or a Spark offset) started on.

    A database's *incarnation* (`streams.store.identity`) is its system identifier, its OID,
    the OID of its incarnation table and that table's random id (`streams migrate` writes it),
    and its timeline. A database dropped and recreated, restored from a dump or a backup, or a
    server failed over to a standby changes it: positions learned before then may name facts the
    database no longer has, or skip facts written since under the same IDs. Nothing is delivered
    or committed across the change. ``changed`` names what changed; ``where`` what noticed it.
    What to do: see `streams incarnation` (docs/operations.md, "Restores and failovers").
    """

    def __init__(self, where: str, changed: str) -> None:
        self.where = where
        self.changed = changed
        super().__init__(
            f"{where}: the database changed under it ({changed}); positions from before the "
            "change may skip or repeat facts, so nothing more is read or committed: see "
            "`streams incarnation` for what changed and how to go on"
        )


class FailoverLoss(DatabaseChanged):
    """After a failover (a new timeline of the same database), the new primary lacks what this
    process saw on the old one: facts it acknowledged (a writer) or delivered (a reader), a
    group commit it made, or IDs it passed that the stream's sequence would hand out again.

    PostgreSQL's standby holds a prefix of its primary's WAL: what it lacks is the last things
    the old primary did, which an asynchronous standby had not received yet. ``stream`` and
    the IDs ``first``..``last`` name the range (``missing`` of them are facts or commits this
    process saw that are gone). A writer raises it once, on its next call, and goes on; a reader
    stops (its consumer holds facts the database no longer has). What to do: `streams failover
    check` and `streams failover repair` (docs/operations.md, "Failover").
    """

    def __init__(
        self, where: str, stream: str, first: int, last: int, missing: int, what: str
    ) -> None:
        self.stream = stream
        self.first = first
        self.last = last
        self.missing = missing
        DatabaseChanged.__init__(
            self,
            where,
            f"a failover lost {what}: stream {stream!r}, IDs {first}..{last}; the new primary "
            "lacks what the old one acknowledged (an asynchronous standby); run `streams "
            "failover check`",
        )


class WaitTimeout(StreamsError, TimeoutError):
    """A wait for a stream position ran out of time; nothing was lost, the stream is behind."""
