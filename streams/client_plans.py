"""A client's calls, written once as plans of the kernel (`streams.plans`): what each runs on
the client's connection, and how: once (a call that writes is never sent twice: its outcome may
be unknown when the connection breaks under it), or again from the start while it fails
transiently, for up to `READ_RETRY_SECONDS` (a read-only call; see "Riding out a restart" in
`streams.client`). `Client` drives them with `streams.plans.drive`, `AsyncClient` with
`streams.plans.adrive`; both offer the step that runs a store generator on their connection
(`ClientConnection.on_connection`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

from .core.constants import replication_channel
from .core.incarnation import Guard
from .core.protocol import KeysCommand, serialize
from .core.replication import backoff_delay
from .core.timestamps import TimestampMode
from .errors import ConnectionLost, StoreError
from .plans import Io, Plan, Sleep
from .store.driver import Gen, transient_sqlstate
from .store.identity import verify
from .store.keys import describe_keys, rotate_keys
from .store.leases import prune_writers
from .store.overview import Overview, Sort, overview
from .store.reader_groups import delete_group, list_groups, stream_positions, streams_of_group
from .store.registry import (
    CREATE_CHUNK,
    check_schema,
    create_stream,
    create_streams,
    drop_stream,
    list_streams,
    load_stream,
    set_fact_tables,
    set_key_window,
    set_retention,
)
from .store.retention import prune
from .transport.connections import publish_now
from .types import (
    Created,
    FactTableSpec,
    GroupRow,
    PruneResult,
    StreamInfo,
    StreamPositions,
    StreamSpec,
)

log = logging.getLogger("streams.client")

#: Seconds a read-only call of a client keeps trying while PostgreSQL is restarting or the
#: connection broke (see "Riding out a restart" in `streams.client`): as long as a reader's
#: group commit is tried again (`streams.reader_plans.COMMIT_RETRY_SECONDS`), enough for a restart
#: with a short recovery.
READ_RETRY_SECONDS = 30.0

T = TypeVar("T")
_Plan: TypeAlias = Plan[T]


class ClientConnection(Protocol):
    """What the plans need of a client: the step that runs a store generator on its
    connection, (re)opened if needed, by ``deadline`` if given (`time.monotonic`)."""

    def on_connection(self, gen: Gen[T], deadline: float | None) -> Io: ...


# --------------------------------------------------------------------------------------------
# The two ways to run a store generator: once (a call that writes), or tried again (a read)


def _once(client: ClientConnection, gen: Gen[T]) -> _Plan[T]:
    """``gen`` run once on the client's connection: a call that writes is never sent twice (its
    outcome may be unknown when the connection breaks under it)."""
    result: T = yield client.on_connection(gen, None)
    return result


def _retryable(error: StoreError) -> bool:
    """Worth running a read-only call again: the connection broke (a read's ``COMMIT``
    included: it only ends a snapshot), or the server's error is transient."""
    return isinstance(error, ConnectionLost) or transient_sqlstate(error.sqlstate)


def _read_plan(client: ClientConnection, what: str, operation: Callable[[], Gen[T]]) -> _Plan[T]:
    """``operation()`` (a read-only store generator), run again from the start with backoff
    while it fails transiently, for up to `READ_RETRY_SECONDS`; the drivers send back its
    result or throw in its `StoreError`. A connection that cannot be opened (the client waited
    for it until the deadline, or the failure is not transient) ends the call."""
    deadline = time.monotonic() + READ_RETRY_SECONDS
    attempt = 0
    while True:
        try:
            result: T = yield client.on_connection(operation(), deadline)
        except StoreError as error:
            remaining = deadline - time.monotonic()
            if not _retryable(error) or remaining <= 0:
                raise
            if attempt == 0:
                log.warning("%s: PostgreSQL failed (%s); trying again", what, error)
            attempt += 1
            pause = min(remaining, backoff_delay(attempt - 1, jitter=random.random()))
        else:
            if attempt:
                log.warning("%s: PostgreSQL answered again", what)
            return result
        yield Sleep(pause)  # outside the handler: what interrupts the pause is not chained


def _of_stream(stream: str, operation: Callable[[StreamInfo], Gen[T]]) -> Gen[T]:
    """``operation`` on the registry row of ``stream`` (`UnknownStream` if there is none)."""
    info = yield from load_stream(stream)
    return (yield from operation(info))


def checked(guard: Guard) -> Gen[None]:
    """What a client checks when it opens: the schema is migrated, and the database is the one
    ``guard`` knows (the first check teaches it: `streams.store.identity`)."""
    yield from check_schema()
    yield from verify(guard, "client")


# --------------------------------------------------------------------------------------------
# The calls, written once: what each runs, and how (`_once` or `_read_plan`)


def plan_create_stream(
    client: ClientConnection,
    name: str,
    timestamping: TimestampMode | str,
    uncapped: bool,
    retention_ms: int | None,
    fact_tables: Sequence[FactTableSpec] | None,
    key_window_ms: int | None,
) -> _Plan[StreamInfo]:
    return _once(
        client,
        create_stream(
            name,
            timestamping=timestamping,
            uncapped=uncapped,
            retention_ms=retention_ms,
            fact_tables=fact_tables,
            key_window_ms=key_window_ms,
        ),
    )


def plan_create_streams(
    client: ClientConnection, specs: Sequence[StreamSpec | str | Mapping[str, Any]], exist_ok: bool
) -> _Plan[list[Created]]:
    """`CREATE_CHUNK` streams per transaction (all of a chunk or none of it; a chunk is what
    PostgreSQL's lock table holds beside everybody else's locks). A chunk is idempotent, so a
    call broken between chunks is finished by calling it again."""
    parsed = [StreamSpec.parse(spec) for spec in specs]
    if len({spec.name for spec in parsed}) != len(parsed):
        raise ValueError("a stream is named twice")
    created: list[Created] = []
    for start in range(0, len(parsed), CREATE_CHUNK):
        chunk = parsed[start : start + CREATE_CHUNK]
        created += yield from _once(client, create_streams(chunk, exist_ok=exist_ok))
    return created


def plan_drop_streams(client: ClientConnection, names: Sequence[str]) -> _Plan[list[str]]:
    """Drop each of these streams (`drop_stream`), the ones that existed in the answer."""
    dropped = []
    for name in names:
        if (yield from _once(client, drop_stream(name))):
            dropped.append(name)
    return dropped


def plan_set_fact_tables(
    client: ClientConnection, name: str, fact_tables: Sequence[FactTableSpec]
) -> _Plan[StreamInfo]:
    return _once(client, set_fact_tables(name, fact_tables))


def plan_stream(client: ClientConnection, name: str) -> _Plan[StreamInfo]:
    return _read_plan(client, "stream", lambda: load_stream(name))


def plan_streams(client: ClientConnection) -> _Plan[list[StreamInfo]]:
    return _read_plan(client, "streams", list_streams)


def plan_positions(
    client: ClientConnection, stream: str, stale_after_ms: int
) -> _Plan[StreamPositions]:
    return _read_plan(
        client,
        "positions",
        lambda: _of_stream(
            stream, lambda info: stream_positions(info, stale_after_ms=stale_after_ms)
        ),
    )


def plan_groups(
    client: ClientConnection, stream: str, stale_after_ms: int
) -> _Plan[list[GroupRow]]:
    return _read_plan(
        client,
        "groups",
        lambda: _of_stream(stream, lambda info: list_groups(info, stale_after_ms=stale_after_ms)),
    )


def plan_overview(
    client: ClientConnection,
    like: str | None,
    limit: int | None,
    sort: Sort,
    stale_after_ms: int,
    grouped: bool,
) -> _Plan[Overview]:
    """Every stream at once (`streams.store.overview`): a constant number of statements."""
    return _read_plan(
        client,
        "overview",
        lambda: overview(
            like, limit=limit, sort=sort, stale_after_ms=stale_after_ms, grouped=grouped
        ),
    )


def plan_group_streams(client: ClientConnection, group: str) -> _Plan[list[str]]:
    return _read_plan(client, "group_streams", lambda: streams_of_group(group))


def plan_delete_group(client: ClientConnection, stream: str, group: str) -> _Plan[bool]:
    return _once(client, _of_stream(stream, lambda info: delete_group(info, group)))


def plan_prune_writers(
    client: ClientConnection, stream: str, older_than_ms: int
) -> _Plan[list[str]]:
    return _once(client, _of_stream(stream, lambda info: prune_writers(info, older_than_ms)))


def plan_replication_keys(client: ClientConnection) -> _Plan[list[dict[str, object]]]:
    return _read_plan(client, "replication_keys", describe_keys)


def plan_rotate_replication_keys(client: ClientConnection) -> _Plan[int]:
    return _once(client, rotate_keys())


def announce_keys(redis_url: str, prefix: str, key_id: int) -> None:
    """``KEYS <key_id>`` on the replication channel, before the rotation returns: readers and
    provers that hear it read the keys again at once (a retired key stops verifying)."""
    publish_now(redis_url, replication_channel(prefix), serialize(KeysCommand(key_id)))


def plan_set_retention(
    client: ClientConnection, stream: str, retention_ms: int | None
) -> _Plan[StreamInfo]:
    return _once(client, set_retention(stream, retention_ms))


def plan_set_key_window(
    client: ClientConnection, stream: str, key_window_ms: int
) -> _Plan[StreamInfo]:
    return _once(client, set_key_window(stream, key_window_ms))


def plan_prune(client: ClientConnection, stream: str, batch: int) -> _Plan[PruneResult]:
    return _once(client, _of_stream(stream, lambda info: prune(info, batch=batch)))
