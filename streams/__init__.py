"""streams: ordered multi-writer fact streams on PostgreSQL.

Writers reserve stream IDs from PostgreSQL sequences and append facts in transactions; the
library tracks per-writer and linear positions (Synapse's stream model), fences dead writers
and keeps timestamps monotonic (S2's model). Readers consume facts in stream-ID order as whole
epochs with frontiers (Timely's model), woken over Redis and proven complete by PostgreSQL.
See README.md.
"""

from __future__ import annotations

from .client import AsyncClient, Client, aconnect, connect
from .config import Settings, redact_url
from .core.epochs import Epoch, Fact
from .core.frontier import Antichain, FrontierProbe, MutableAntichain
from .core.positions import PositionTracker
from .core.timestamps import TimestampMode
from .errors import (
    CommitUnknown,
    ConfigurationError,
    ConnectionLost,
    DatabaseChanged,
    FactsPruned,
    FailoverLoss,
    GroupFenced,
    GroupMoved,
    InvalidFact,
    InvalidFactTables,
    InvalidPattern,
    InvalidPosition,
    InvalidStreamName,
    InvalidTimestamp,
    MalformedPayload,
    PayloadNotSerializable,
    PayloadTooLarge,
    RedisUnavailable,
    ReservationBlocked,
    SchemaNotReady,
    SequenceRewound,
    StandbyBehind,
    StoreError,
    StreamExists,
    StreamsError,
    UnknownStream,
    UsageError,
    WaitTimeout,
    WriterFenced,
)
from .reader import AsyncReader, Reader
from .types import Ack, Created, FactTable, GroupRow, StreamInfo, StreamPositions, StreamSpec
from .writer import AsyncOpenFact, AsyncWriter, OpenFact, Writer

__version__ = "0.1.0"

__all__ = [
    "Ack",
    "Antichain",
    "AsyncClient",
    "AsyncOpenFact",
    "AsyncReader",
    "AsyncWriter",
    "Client",
    "CommitUnknown",
    "ConfigurationError",
    "ConnectionLost",
    "Created",
    "DatabaseChanged",
    "Epoch",
    "Fact",
    "FactTable",
    "FactsPruned",
    "FailoverLoss",
    "FrontierProbe",
    "GroupFenced",
    "GroupMoved",
    "GroupRow",
    "InvalidFact",
    "InvalidFactTables",
    "InvalidPattern",
    "InvalidPosition",
    "InvalidStreamName",
    "InvalidTimestamp",
    "MalformedPayload",
    "MutableAntichain",
    "OpenFact",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "PositionTracker",
    "Reader",
    "RedisUnavailable",
    "ReservationBlocked",
    "SchemaNotReady",
    "SequenceRewound",
    "Settings",
    "StandbyBehind",
    "StoreError",
    "StreamExists",
    "StreamInfo",
    "StreamPositions",
    "StreamSpec",
    "StreamsError",
    "TimestampMode",
    "UnknownStream",
    "UsageError",
    "WaitTimeout",
    "Writer",
    "WriterFenced",
    "__version__",
    "aconnect",
    "connect",
    "redact_url",
]
