"""Fact timestamps, S2's way (pure; no I/O).

Terms:

* A **client timestamp** is what the caller passed to ``append(..., timestamp=)``, in
  milliseconds since the Unix epoch.
* The **arrival time** is when the append reached the stream, read from one clock for every
  writer: the database's (see `streams.store.DatabaseClock`), so hosts with skewed clocks cannot
  reorder time.
* The stream's **timestamping mode** decides which one a fact gets:
  ``client-prefer`` (default: the client's if given, else arrival), ``client-require`` (an
  append without one is rejected) or ``arrival`` (the client's is ignored).
* Unless the stream is **uncapped**, a timestamp later than arrival is lowered to arrival, so a
  wrong clock cannot push the stream's time into the future.
* Timestamps are **non-decreasing in stream-ID order**: a smaller one is raised to the running
  maximum (the *floor*). A writer applies this to what it writes (so its acknowledgement is
  exact on single-writer streams); readers apply it again across writers, because facts from
  different writers can complete in an order their timestamps do not follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from ..errors import InvalidTimestamp

__all__ = ["MAX_TIMESTAMP", "TimestampMode", "resolve_timestamps", "validate_client_timestamp"]

MAX_TIMESTAMP = 2**63 - 1


class TimestampMode(StrEnum):
    CLIENT_PREFER = "client-prefer"
    CLIENT_REQUIRE = "client-require"
    ARRIVAL = "arrival"


def validate_client_timestamp(value: object) -> int | None:
    """Check one client timestamp: None, or an int in [0, 2**63). Bools are not timestamps."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTimestamp(
            f"timestamp must be an integer number of milliseconds, not {type(value).__name__}"
        )
    if value < 0 or value > MAX_TIMESTAMP:
        raise InvalidTimestamp(f"timestamp {value} is outside [0, 2**63)")
    return value


def resolve_timestamps(
    client: Sequence[int | None],
    *,
    mode: TimestampMode,
    uncapped: bool,
    arrival_ms: int,
    floor: int,
) -> list[int]:
    """The timestamps a batch of facts gets, in batch (= stream-ID) order.

    `floor` is the running maximum of what was written before; the result never goes below it
    and never decreases. Raises `InvalidTimestamp` (before anything is written) for a missing
    timestamp under client-require or an invalid one.
    """
    if mode is TimestampMode.ARRIVAL or all(raw is None for raw in client):
        for raw in client:
            validate_client_timestamp(raw)  # ignored, but still not accepted if malformed
        if mode is TimestampMode.CLIENT_REQUIRE and client:
            raise InvalidTimestamp("fact 0 has no timestamp and the stream is client-require")
        return [max(floor, arrival_ms)] * len(client)
    resolved: list[int] = []
    running = floor
    for position, raw in enumerate(client):
        given = validate_client_timestamp(raw)
        if given is None:
            if mode is TimestampMode.CLIENT_REQUIRE:
                raise InvalidTimestamp(
                    f"fact {position} has no timestamp and the stream is client-require"
                )
            chosen = arrival_ms
        else:
            chosen = given if uncapped else min(given, arrival_ms)
        running = max(running, chosen)
        resolved.append(running)
    return resolved
