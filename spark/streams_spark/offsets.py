"""Offsets of the Spark source: versioned, canonical JSON frontiers. Pure; no I/O.

An offset ``{"v": 1, "streams": {"orders": 1203}}`` means: every fact of ``orders`` with a
stream ID ``<= 1203`` has been delivered (the reader's frontier there is ``{1204}``). With several
streams the offset is a vector frontier, compared pointwise. Keys are sorted, so two equal
frontiers always serialise to the same JSON text (Spark compares offsets as text to decide
whether a micro-batch has new data).

A query started by time (``startingTimestamp``/``startingAgo``) may have to start below facts
that were still pending when it started; those that commit later with an earlier timestamp are
not the query's (the Python reader drops them too). Until a stream's first fact at or after the
start time is inside the frontier, its offset carries that time: ``{"v": 1, "streams":
{"orders": 1203}, "since": {"orders": 1763900000000}}``, and the batches planned from it drop
facts whose running-maximum timestamp is earlier. The key is fixed when the offset is logged,
so a replayed batch drops exactly the same facts, and a restart with a relative start
(``startingAgo``) cannot change what an old batch meant.

Two more keys, both optional, so that offsets logged before they existed still read:

* ``"floors": {"orders": 1763900000000}``: each stream's *timestamp floor* at its position,
  the running maximum of the timestamps of every fact ``<=`` it (the readers report a fact's
  timestamp raised to it: `streams.core.timestamps`). Computed once, exactly, from the facts
  of each batch, it makes a fact's timestamp the Python reader's, the same on every replay,
  whatever retention removed since. An offset without it (an older checkpoint) falls back to
  the floor from the facts before the position (`streams.store.rows.ts_floor_at`).
* ``"waiting": ["orders"]``: streams whose position was set by the start (``startingPosition``
  an ID or frontier beyond what is complete) and not reached yet: the query waits there, as
  the Python reader does, rather than take it for a stream that went backwards.
* ``"incarnation": "<token>"``: the database history the positions belong to
  (`streams.core.incarnation`): a checkpoint whose offsets name another one (the database was
  recreated, restored or failed over since) stops the query with `streams.DatabaseChanged`
  instead of reading on from positions that history never had.
* ``"lsn": 50331648``: the primary's WAL position taken with the proof behind the positions
  ("the standby fence" of `streams.store.probe`). After a failover (a later timeline of the
  same database) the offset still holds if that position is at or below where the new
  timeline left the old one (`streams.store.identity.holds_across_failover`). Kept from the
  start offset while the positions do not move, so that an offset with nothing new stays
  equal to its start (Spark compares them to decide whether there is a batch).
* ``"ids": {"orders_1": 17}``: with ``streamPattern``, each stream's registry id. The streams
  of a pattern query change as they are created and dropped: an offset names the ones it held
  (a new one enters at the position retention kept, usually 0, and is read from the next
  batch on), and a position belongs to the stream of that id only (one dropped and created
  again under its name is another stream, read from its first fact).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from streams.errors import ConfigurationError

__all__ = [
    "OFFSET_VERSION",
    "floors_of",
    "frontier_from_json",
    "frontier_offset",
    "ids_of",
    "incarnation_of",
    "lsn_of",
    "offset_streams",
    "positions_of",
    "since_of",
    "waiting_of",
]

OFFSET_VERSION = 1


def frontier_offset(
    positions: Mapping[str, int],
    since: Mapping[str, int] | None = None,
    *,
    floors: Mapping[str, int] | None = None,
    waiting: Collection[str] = (),
    incarnation: str | None = None,
    lsn: int | None = None,
    ids: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The canonical offset of ``positions`` (keys sorted), with the start times ``since``
    still in force, the timestamp ``floors`` and the streams ``waiting`` for their start
    (each omitted when empty, so plain offsets stay as they were)."""
    offset: dict[str, Any] = {
        "v": OFFSET_VERSION,
        "streams": {name: int(positions[name]) for name in sorted(positions)},
    }
    if since:
        offset["since"] = {name: int(since[name]) for name in sorted(since)}
    if floors:
        offset["floors"] = {name: int(floors[name]) for name in sorted(floors)}
    if waiting:
        offset["waiting"] = sorted(waiting)
    if incarnation:
        offset["incarnation"] = incarnation
    if lsn:
        offset["lsn"] = int(lsn)
    if ids:
        offset["ids"] = {name: int(ids[name]) for name in sorted(ids)}
    return offset


def ids_of(offset: Mapping[str, Any]) -> dict[str, int]:
    """The registry ids of a pattern query's offset (empty: a query that names its streams)."""
    ids = offset.get("ids", {})
    if not isinstance(ids, Mapping) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in ids.values()
    ):
        raise ConfigurationError(f"offset {json.dumps(offset)}: 'ids' must map streams to ids")
    return {str(n): int(v) for n, v in ids.items()}


def offset_streams(offset: Mapping[str, Any]) -> tuple[str, ...]:
    """The streams an offset names (a pattern query's, which change from batch to batch)."""
    _check_version(offset)
    return tuple(sorted(offset["streams"]))


def lsn_of(offset: Mapping[str, Any]) -> int | None:
    """The WAL position of the proof behind an offset (None: logged before offsets carried
    it)."""
    lsn = offset.get("lsn")
    if lsn is not None and (not isinstance(lsn, int) or isinstance(lsn, bool) or lsn < 0):
        raise ConfigurationError(f"offset {json.dumps(offset)}: 'lsn' must be an integer >= 0")
    return lsn


def incarnation_of(offset: Mapping[str, Any]) -> str | None:
    """The database incarnation an offset was logged under (None: logged before offsets
    carried it)."""
    token = offset.get("incarnation")
    if token is not None and not isinstance(token, str):
        raise ConfigurationError(f"offset {json.dumps(offset)}: 'incarnation' must be a string")
    return token


def floors_of(offset: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, int] | None:
    """The timestamp floors of an offset, or None if it has none (logged by an older
    version: the caller computes them as that version did)."""
    floors = offset.get("floors")
    if floors is None:
        return None
    if not isinstance(floors, Mapping) or set(floors) != set(names):
        raise ConfigurationError(
            f"offset {json.dumps(offset)}: 'floors' must map every stream of this query to a time"
        )
    return {str(n): _position(v, str(n)) for n, v in floors.items()}


def waiting_of(offset: Mapping[str, Any], names: tuple[str, ...]) -> frozenset[str]:
    """The streams of an offset still waiting for the position their start set."""
    waiting = offset.get("waiting", [])
    if not isinstance(waiting, list) or any(n not in names for n in waiting):
        raise ConfigurationError(
            f"offset {json.dumps(offset)}: 'waiting' must list streams of this query"
        )
    return frozenset(str(n) for n in waiting)


def since_of(offset: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, int]:
    """The start times still in force in an offset (empty for most offsets)."""
    since = offset.get("since", {})
    if not isinstance(since, Mapping) or any(n not in names for n in since):
        raise ConfigurationError(
            f"offset {json.dumps(offset)}: 'since' must map streams of this query to times"
        )
    return {str(n): _position(v, str(n)) for n, v in since.items()}


def positions_of(offset: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, int]:
    """The positions of ``names`` in an offset Spark hands back (from this source's own log)."""
    streams = _check_version(offset)
    missing = [n for n in names if n not in streams]
    extra = sorted(set(streams) - set(names))
    if missing or extra:
        raise ConfigurationError(
            f"the checkpoint's offset covers streams {sorted(streams)}, this query reads "
            f"{sorted(names)}: the set of streams of a query cannot change across restarts "
            "(start a new checkpoint)"
        )
    return {n: _position(streams[n], n) for n in names}


def _check_version(offset: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``streams`` object of a version-1 offset."""
    if not isinstance(offset, Mapping) or offset.get("v") != OFFSET_VERSION:
        raise ConfigurationError(
            f"offset {json.dumps(offset)!s} is not a version-{OFFSET_VERSION} streams frontier: "
            "was the checkpoint written by another source or a newer streams_spark?"
        )
    streams = offset.get("streams")
    if not isinstance(streams, Mapping):
        raise ConfigurationError(f"offset {json.dumps(offset)} has no 'streams' object")
    return streams


def _position(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"position of stream {name!r} must be an integer >= 0")
    return value


def frontier_from_json(text: str, option: str) -> dict[str, int]:
    """Positions from a user-given frontier JSON (an option value): ``{"v": 1, "streams":
    {...}}``, or the bare ``{"orders": 1203}`` form."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigurationError(f"option {option}: {text!r} is not valid JSON") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"option {option}: a frontier must be a JSON object")
    if "streams" in data or "v" in data:
        if data.get("v") != OFFSET_VERSION or not isinstance(data.get("streams"), dict):
            raise ConfigurationError(
                f'option {option}: expected {{"v": {OFFSET_VERSION}, "streams": {{...}}}}'
            )
        data = data["streams"]
    out: dict[str, int] = {}
    for name, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(
                f"option {option}: the position of stream {name!r} must be an integer >= 0"
            )
        out[str(name)] = value
    return out
