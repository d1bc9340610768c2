"""`Client` and `AsyncClient` are twins: the same calls, the same signatures, the same behaviour.

Both drive the same plans (`streams.client`, "Plans and drivers"); what could still make them
diverge is a driver, a delegation that passes an argument wrongly, or a call one of them lacks.
Two checks, both generic:

* every public name of `Client` has its asyncio twin on `AsyncClient` (a coroutine where the
  sync one is a method) with the same parameters, defaults and annotations, and the other way
  round; the few differences that are meant are listed in `SYNC_ONLY_PARAMETERS` /
  `ASYNC_ONLY`, and the test fails when one of them is no longer true;
* one scripted scenario (`SCENARIO`: data, not code) runs through a `Client` and an
  `AsyncClient` on the real PostgreSQL and Redis, each on streams and groups of its own, and
  every step's result or exception (type and message) must be the same, once the names of the
  run and what the clock decides are taken out (`_shape`). The scenario must call every public
  method (`test_the_scenario_calls_every_public_method`), so a new call gets compared too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import pytest

import streams
from streams import AsyncClient, Client

# --------------------------------------------------------------------------------------------
# The same calls, the same signatures

#: The sync name of an asyncio twin whose name differs.
TWIN_NAMES = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}
#: Parameters only the sync call has: shared proofs run a prover on a thread (`streams.proofs`).
SYNC_ONLY_PARAMETERS = {"reader": {"shared_proofs"}}
#: Public names only `AsyncClient` has: opening is a coroutine, `Client.__init__` opens.
ASYNC_ONLY = {"open"}
#: Return annotations that differ only by the asyncio classes they name.
ASYNC_RETURNS = {
    "Writer": "AsyncWriter",
    "Reader": "AsyncReader",
    "Client": "AsyncClient",
    "RedisLink | None": "AsyncRedisLink | None",
}


def _public(cls: type) -> dict[str, Any]:
    """The public names a class defines (not those of `object`), with the context protocol."""
    names = {name for name in vars(cls) if not name.startswith("_")}
    names |= {
        name for name in ("__enter__", "__exit__", "__aenter__", "__aexit__") if name in vars(cls)
    }
    return {name: inspect.getattr_static(cls, name) for name in sorted(names)}


def _parameters(function: Callable[..., Any], drop: set[str]) -> list[tuple[Any, ...]]:
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in inspect.signature(function).parameters.values()
        if p.name not in drop
    ]


def test_every_call_has_an_asyncio_twin_with_the_same_signature() -> None:
    sync, twins = _public(Client), _public(AsyncClient)
    for name, found in sync.items():
        twin_name = TWIN_NAMES.get(name, name)
        assert twin_name in twins, f"Client.{name} has no twin AsyncClient.{twin_name}"
        attribute, twin = found, twins[twin_name]
        if isinstance(attribute, property):
            assert isinstance(twin, property), name
            attribute, twin = attribute.fget, twin.fget
        else:
            assert inspect.isfunction(attribute) and not inspect.iscoroutinefunction(attribute)
            assert inspect.iscoroutinefunction(twin), f"AsyncClient.{twin_name} is no coroutine"
        drop = SYNC_ONLY_PARAMETERS.get(name, set())
        assert drop <= set(inspect.signature(attribute).parameters), f"{name}: update the table"
        assert not drop & set(inspect.signature(twin).parameters), f"{name}: update the table"
        assert _parameters(attribute, drop) == _parameters(twin, set()), name
        returns = inspect.signature(attribute).return_annotation
        assert ASYNC_RETURNS.get(returns, returns) == inspect.signature(twin).return_annotation
    extra = set(twins) - {TWIN_NAMES.get(name, name) for name in sync}
    assert extra == ASYNC_ONLY


# --------------------------------------------------------------------------------------------
# The same behaviour: one scenario through both


class Names(NamedTuple):
    """The names one run uses (each client has its own), and their placeholders."""

    stream: str
    unknown: str
    group: str
    table: str

    def placeholders(self) -> dict[str, str]:
        return {
            self.stream: "<stream>",
            self.unknown: "<unknown>",
            self.group: "<group>",
            self.table: "<table>",
        }


class Call(NamedTuple):
    """``client.<method>(*args, **kwargs)``, the strings of ``args`` formatted with the run's
    `Names` (``"{stream}"``); ``view`` picks what to compare of the result (the part that does
    not depend on the rest of the shared test database)."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = {}
    view: Callable[[Any, Names], Any] | None = None
    #: The exception the step raises (its class name); None: it returns.
    raises: str | None = None


class Act(NamedTuple):
    """Something done with a writer or reader of the client (named in `_SYNC_ACTS` /
    `_ASYNC_ACTS`): only its outcome is compared."""

    name: str
    raises: str | None = None


def _ours(infos: list[Any], names: Names) -> list[Any]:
    return [info for info in infos if info.name in (names.stream, names.unknown)]


def _newest_key_alone_live(keys: list[dict[str, object]], names: Names) -> Any:
    return sorted(keys[0]), keys[0]["live"], [key["live"] for key in keys[1:]].count(True)


def _type(value: Any, names: Names) -> str:
    return type(value).__name__


def _overview_positions(found: Any, names: Names) -> Any:
    return [s.positions for s in found.streams], found.matched  # not total: the shared database


def _created(created: Any, names: Names) -> Any:
    return [(c.info.name, c.new) for c in created]


def _arrow_rows(table: Any, names: Names) -> Any:
    return (
        table.schema.names,
        table.column("stream_id").to_pylist(),
        table.column("payload").to_pylist(),
    )


SCENARIO: tuple[Call | Act, ...] = (
    Call("create_stream", ("{stream}",)),
    Call("create_stream", ("{stream}",)),  # the same settings: idempotent
    Call("create_stream", ("{stream}",), {"uncapped": True}, raises="StreamExists"),
    Call("create_stream", ("not a name!",), raises="InvalidStreamName"),
    Call("create_streams", (["{stream}", "{unknown}"],), view=_created),
    Call("create_streams", (["{unknown}"],), {"exist_ok": False}, raises="StreamExists"),
    Call("drop_streams", (["{unknown}"],)),
    Call("drop_streams", (["{unknown}"],)),  # gone already: named by nobody
    Call("set_fact_tables", ("{stream}", ["{table}.stream_id"])),
    Call("set_fact_tables", ("{stream}", ["{table}.no_such_column"]), raises="InvalidFactTables"),
    Call("set_fact_tables", ("{stream}", [])),
    Call("stream", ("{stream}",)),
    Call("streams", view=_ours),
    Call("positions", ("{stream}",)),
    Act("write five facts"),
    Call("read_arrow", ("{stream}",), {"start": 2, "end": 5}, view=_arrow_rows),
    Call("read_arrow", ("{stream}",), {"end": 0}, raises="UsageError"),
    Act("read them in a group and commit the first"),
    Call("set_retention", ("{stream}", 1)),
    Act("wait past the retention"),
    # The group holds retention back: stale at once with ``stale_after_ms=0``.
    Call("positions", ("{stream}",)),
    Call("positions", ("{stream}",), {"stale_after_ms": 0}),
    Call("overview", ("{stream}",), {"stale_after_ms": 0}, view=_overview_positions),
    Call("groups", ("{stream}",)),
    Call("groups", ("{stream}",), {"stale_after_ms": 0}),
    Call("group_streams", ("{group}",)),
    Call("group_streams", ("nobody",)),
    Call("prune", ("{stream}",), {"batch": 2}),  # up to the group's position
    Call("delete_group", ("{stream}", "{group}")),
    Call("delete_group", ("{stream}", "{group}")),  # gone already: False
    Call("groups", ("{stream}",)),
    Call("set_key_window", ("{stream}", 1000)),
    Call("set_key_window", ("{stream}", -1), raises="ValueError"),
    Call("prune", ("{stream}",), {"batch": 2}),  # the rest
    Call("prune", ("{stream}",)),  # nothing left
    Call("positions", ("{stream}",)),
    Call("prune_writers", ("{stream}", 3_600_000)),  # none retired that long ago
    Call("prune_writers", ("{stream}", 0)),
    Call("set_retention", ("{stream}", None)),
    Call("replication_keys", view=_newest_key_alone_live),
    Call("rotate_replication_keys", view=_type),
    Call("replication_keys", view=_newest_key_alone_live),
    # A stream nobody created.
    Call("stream", ("{unknown}",), raises="UnknownStream"),
    Call("positions", ("{unknown}",), raises="UnknownStream"),
    Call("groups", ("{unknown}",), raises="UnknownStream"),
    Call("delete_group", ("{unknown}", "{group}"), raises="UnknownStream"),
    Call("prune_writers", ("{unknown}", 0), raises="UnknownStream"),
    Call("set_retention", ("{unknown}", None), raises="UnknownStream"),
    Call("set_key_window", ("{unknown}", 1000), raises="UnknownStream"),
    Call("set_fact_tables", ("{unknown}", []), raises="UnknownStream"),
    Call("prune", ("{unknown}",), raises="UnknownStream"),
    Call("read_arrow", ("{unknown}",), raises="UnknownStream"),
    # Closed (twice), then used again: the client opens a connection again.
    Call("close"),
    Call("close"),
    Call("stream", ("{stream}",)),
    Call("streams", view=_ours),
    Call("close"),
)

#: Fields whose values the clock or the rest of the shared database decides: compared by type.
VOLATILE = frozenset(
    {
        "id",
        "sequence_name",
        "updated_at",
        "ts_floor",
        "lag_ms",
        "idle_ms",
        "taken_at",
        "taken_age_ms",
        "oldest_pending_ms",
        "lease_expires_in_ms",
        "heartbeat_age_ms",
    }
)


def _shape(value: Any, names: Names) -> Any:
    """``value`` with the run's names replaced by placeholders and the volatile fields by their
    types, as plain data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, _shape(dataclasses.asdict(value), names))
    if isinstance(value, enum.Enum):
        return str(value)
    if isinstance(value, Mapping):
        return {
            _shape(key, names): type(item).__name__ if key in VOLATILE else _shape(item, names)
            for key, item in sorted(value.items())
        }
    if isinstance(value, list | tuple):
        return [_shape(item, names) for item in value]
    if isinstance(value, str):
        for name, placeholder in names.placeholders().items():
            value = value.replace(name, placeholder)
    return value


def _format(value: Any, names: Names) -> Any:
    if isinstance(value, str):
        return value.format(**names._asdict())
    if isinstance(value, list):
        return [_format(item, names) for item in value]
    return value


def _outcome(result: Any, call: Call | Act, names: Names) -> tuple[str, Any]:
    if isinstance(result, BaseException):
        return "raised", (type(result).__qualname__, _shape(str(result), names))
    if isinstance(call, Call) and call.view is not None:
        result = call.view(result, names)
    return "returned", _shape(result, names)


def _sync_write(client: Client, names: Names) -> Any:
    with client.writer(names.stream, instance="twin") as writer:
        return [writer.append({"n": n}).last_id for n in range(5)]


def _sync_read(client: Client, names: Names) -> Any:
    with client.reader(names.stream, group=names.group) as reader:
        facts = list(reader.facts())
        return [fact.payload for fact in facts], reader.commit(facts[0])


async def _async_write(client: AsyncClient, names: Names) -> Any:
    async with await client.writer(names.stream, instance="twin") as writer:
        return [(await writer.append({"n": n})).last_id for n in range(5)]


async def _async_read(client: AsyncClient, names: Names) -> Any:
    async with await client.reader(names.stream, group=names.group) as reader:
        facts = [fact async for fact in reader.facts()]
        return [fact.payload for fact in facts], await reader.commit(facts[0])


def _pause(client: Any, names: Names) -> None:
    time.sleep(0.05)  # the facts are older than the 1 ms retention


async def _apause(client: Any, names: Names) -> None:
    await asyncio.sleep(0.05)


_SYNC_ACTS: dict[str, Callable[[Client, Names], Any]] = {
    "write five facts": _sync_write,
    "read them in a group and commit the first": _sync_read,
    "wait past the retention": _pause,
}
_ASYNC_ACTS: dict[str, Callable[[AsyncClient, Names], Any]] = {
    "write five facts": _async_write,
    "read them in a group and commit the first": _async_read,
    "wait past the retention": _apause,
}


def _arguments(call: Call, names: Names) -> tuple[list[Any], dict[str, Any]]:
    return [_format(arg, names) for arg in call.args], dict(call.kwargs)


def _run_sync(url: str, redis_url: str, prefix: str, names: Names) -> list[Any]:
    outcomes = []
    with streams.connect(url, redis_url, prefix, lease_seconds=2.0) as client:
        for step in SCENARIO:
            try:
                if isinstance(step, Act):
                    result = _SYNC_ACTS[step.name](client, names)
                else:
                    args, kwargs = _arguments(step, names)
                    result = getattr(client, step.method)(*args, **kwargs)
            except Exception as exc:
                result = exc
            outcomes.append((step, _outcome(result, step, names)))
    return outcomes


async def _run_async(url: str, redis_url: str, prefix: str, names: Names) -> list[Any]:
    outcomes = []
    async with await streams.aconnect(url, redis_url, prefix, lease_seconds=2.0) as client:
        for step in SCENARIO:
            try:
                if isinstance(step, Act):
                    result = await _ASYNC_ACTS[step.name](client, names)
                else:
                    args, kwargs = _arguments(step, names)
                    twin = getattr(client, TWIN_NAMES.get(step.method, step.method))
                    result = await twin(*args, **kwargs)
            except Exception as exc:
                result = exc
            outcomes.append((step, _outcome(result, step, names)))
    return outcomes


def _names(unique_name: str, table: str) -> Names:
    return Names(
        stream=f"{unique_name}_{secrets.token_hex(3)}",
        unknown=f"{unique_name}_none_{secrets.token_hex(3)}",
        group=f"g_{secrets.token_hex(6)}",
        table=table,
    )


def test_the_scenario_calls_every_public_method() -> None:
    called = {step.method for step in SCENARIO if isinstance(step, Call)}
    # `writer`, `reader` and `link` (through them) are used by the acts.
    uncalled = set(_public(Client)) - called - {"writer", "reader", "link"}
    assert uncalled == {"__enter__", "__exit__"}


def test_client_and_async_client_behave_alike(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str, declared_table: str
) -> None:
    sync = _run_sync(streams_url, redis_url, redis_prefix, _names(unique_name, declared_table))
    twin = asyncio.run(
        _run_async(streams_url, redis_url, redis_prefix, _names(unique_name, declared_table))
    )
    assert len(sync) == len(twin) == len(SCENARIO)
    for (step, ours), (_, theirs) in zip(sync, twin, strict=True):
        assert ours == theirs, f"{step}: Client {ours} != AsyncClient {theirs}"
    # The scenario did what it says (so that "alike" is not "alike in failing").
    for step, (kind, what) in sync:
        assert (what[0] if kind == "raised" else None) == step.raises, (step, what)
    returned = {str(step): what for step, (_, what) in sync}
    assert returned[str(Act("write five facts"))] == [1, 2, 3, 4, 5]
    deleted = [what for step, (_, what) in sync if getattr(step, "method", "") == "delete_group"]
    assert deleted[:2] == [True, False]


@pytest.mark.parametrize("flavor", ["sync", "async"])
def test_the_scenario_is_stable(
    flavor: str,
    streams_url: str,
    redis_url: str,
    redis_prefix: str,
    unique_name: str,
    declared_table: str,
) -> None:
    """Two runs of one flavor give the same outcomes: what the twins test compares is what the
    clients do, not the clock (else `VOLATILE` misses a field)."""

    def once() -> list[Any]:
        names = _names(unique_name, declared_table)
        if flavor == "sync":
            return _run_sync(streams_url, redis_url, redis_prefix, names)
        return asyncio.run(_run_async(streams_url, redis_url, redis_prefix, names))

    assert once() == once()
