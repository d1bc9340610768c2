"""The face connectors build on: what an engine's source and sink need beyond the public API.

A *connector* plugs `streams` into another engine: Spark's source and sink (`streams_spark`),
or any other engine's. It imports the public package (`streams`, with `streams.errors` and
`streams.config`) and this module, nothing else of the library: what it needs of the internals
is re-exported here, so that the store's modules can change without a connector noticing, and
so that a connector reads facts by the store's own plans instead of copying their order.

Reading facts (`streams.store.reads`: the read sequence, incarnation -> probe -> rows ->
retention, and why its order is the proof; a connector runs these plans, never its own order):

* `read_range`, `RangeGen`, `fetch_all`: a range planned earlier, read one statement at a
  time by any driver (Spark executors, over ADBC), which answers the plan's operations:
  `Query` (plain text), `Commit` and `StreamRows` (the rows statement, its rows streamed);
* `probe`, `Probe`, `pruned_positions`: steps 2 and 4 alone, for planners that decide
  positions without reading rows (the Spark source's offsets); a `Probe` carries its proof's
  LSN (``wal_lsn``), which `read_range` with ``proof_lsn`` waits for on a hot standby (a read
  URL), and `StandbyRoute` says how long to wait before reading from the primary;
* `deliverable` (`streams.core.delivery`): what may be delivered after a position, given a
  proof and the read's bound: the one decision of every reader;
* `READER_SESSION_SETUP`, `set_up_reader_session`, `statement_timeout_setup`: the settings of a
  reading session;
* `ReaderCore`: the Python reader's own start logic (a group's position, earliest, latest, an
  ID, a time), for a connector that resolves starts as Python readers do.

Planning batch ranges (`streams.store.rows`): `count_facts`, `split_range`,
`range_ts_maxima`, `ts_floor_at`, `first_fact_since`.

Sessions and drivers (`streams.store.sessions`, `streams.store.driver`): `open_session`,
`with_client_tcp_settings`, `run` (drives any store plan on a psycopg connection), `Gen`,
`transient_sqlstate`, `backoff_delay`.

The database's history (`streams.core.incarnation`, `streams.store.identity`): `Guard`,
`Incarnation`, `written_elsewhere`, `verify`, `read_incarnation`, `read_incarnation_at`,
`rewound`.

Streams and groups (`streams.store.registry`, `streams.store.reader_groups`): `load_stream`,
`load_streams`, `Generation`, `take_generations`, `group_position`, `commit_group`.

Writers (`streams.store.writer_core`, `streams.writer`, `streams.store.leases`): `WriterCore`,
`FactChunk`, `Writer`, `encode_payload`; `retire_where_held` and `HeldStreams` (a reader that
sees a stream held back ends an expired writer's sessions, and any session that has held it
back past the lease, as Python readers do).

Sinks (`streams.store.sinks`, "the exactly-once argument"): `TaskKey`, `BatchCommit`,
`claim_task`, `commit_batch`, `SINK_COMMIT_RETENTION_SECONDS`.

Redis (`streams.transport`): `RedisLink`, `Hint`, `default_instance_name`.

Defaults (`streams.devservers.background`): `with_running_servers`, the URLs of the servers
``streams up`` keeps running when none is configured (as `streams.connect` finds them).

Typed columns from payloads (`streams.core.typed_payloads`, imported on first use: it needs
pyarrow): `PayloadSchema`, `SchemaError`, `DEFAULT_CORRUPT_COLUMN`, `parse_schema_text`,
`payload_schema`, `typed_columns`, `failfast_message`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .client import default_instance_name
from .core.delivery import deliverable
from .core.incarnation import Guard, Incarnation, rewound, written_elsewhere
from .core.payloads import encode_payload
from .core.replication import Hint, backoff_delay
from .core.stalls import HeldStreams
from .core.standby_fence import StandbyRoute
from .core.stream_patterns import RegistryCursor, Subscription, compile_pattern
from .devservers.background import with_running_servers
from .store.driver import Commit, Gen, Query, run, transient_sqlstate
from .store.failover import replicated
from .store.holders import retire_where_held
from .store.identity import holds_across_failover, read_incarnation, read_incarnation_at, verify
from .store.probe import set_up_reader_session
from .store.reader_core import ReaderCore
from .store.reader_groups import Generation, commit_group, group_position, take_generations
from .store.reads import (
    READER_SESSION_SETUP,
    Probe,
    RangeGen,
    StreamRows,
    fetch_all,
    probe,
    pruned_positions,
    read_range,
    statement_timeout_setup,
)
from .store.registry import load_stream, load_streams
from .store.rows import count_facts, first_fact_since, range_ts_maxima, split_range, ts_floor_at
from .store.sessions import connect as open_session
from .store.sessions import with_client_tcp_settings
from .store.sinks import DEFAULT_RETENTION_SECONDS as SINK_COMMIT_RETENTION_SECONDS
from .store.sinks import BatchCommit, TaskKey, claim_task, commit_batch
from .store.subscriptions import (
    DROPPED_SQLSTATES,
    load_listed,
    registry_after,
    registry_has,
    registry_ids,
)
from .store.writer_core import WriterCore
from .transport.link import RedisLink
from .types import FactChunk
from .writer import Writer

if TYPE_CHECKING:
    from .core.typed_payloads import (
        DEFAULT_CORRUPT_COLUMN,
        PayloadSchema,
        SchemaError,
        failfast_message,
        parse_schema_text,
        payload_schema,
        typed_columns,
    )

#: Re-exported lazily (`__getattr__`): importing this module must not need pyarrow.
_TYPED = frozenset(
    {
        "DEFAULT_CORRUPT_COLUMN",
        "PayloadSchema",
        "SchemaError",
        "failfast_message",
        "parse_schema_text",
        "payload_schema",
        "typed_columns",
    }
)


def __getattr__(name: str) -> Any:
    if name in _TYPED:
        from .core import typed_payloads

        return getattr(typed_payloads, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_CORRUPT_COLUMN",
    "DROPPED_SQLSTATES",
    "READER_SESSION_SETUP",
    "SINK_COMMIT_RETENTION_SECONDS",
    "BatchCommit",
    "Commit",
    "FactChunk",
    "Gen",
    "Generation",
    "Guard",
    "HeldStreams",
    "Hint",
    "Incarnation",
    "PayloadSchema",
    "Probe",
    "Query",
    "RangeGen",
    "ReaderCore",
    "RedisLink",
    "RegistryCursor",
    "SchemaError",
    "StandbyRoute",
    "StreamRows",
    "Subscription",
    "TaskKey",
    "Writer",
    "WriterCore",
    "backoff_delay",
    "claim_task",
    "commit_batch",
    "commit_group",
    "compile_pattern",
    "count_facts",
    "default_instance_name",
    "deliverable",
    "encode_payload",
    "failfast_message",
    "fetch_all",
    "first_fact_since",
    "group_position",
    "holds_across_failover",
    "load_listed",
    "load_stream",
    "load_streams",
    "open_session",
    "parse_schema_text",
    "payload_schema",
    "probe",
    "pruned_positions",
    "range_ts_maxima",
    "read_incarnation",
    "read_incarnation_at",
    "read_range",
    "registry_after",
    "registry_has",
    "registry_ids",
    "replicated",
    "retire_where_held",
    "rewound",
    "run",
    "set_up_reader_session",
    "split_range",
    "statement_timeout_setup",
    "take_generations",
    "transient_sqlstate",
    "ts_floor_at",
    "typed_columns",
    "verify",
    "with_client_tcp_settings",
    "with_running_servers",
    "written_elsewhere",
]
