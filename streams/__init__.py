"""streams: ordered multi-writer fact streams on PostgreSQL.

Writers reserve stream IDs from PostgreSQL sequences and append facts in transactions; the
library tracks per-writer and linear positions (Synapse's stream model), fences dead writers
and keeps timestamps monotonic (S2's model). See README.md.
"""

from __future__ import annotations

from .client import AsyncClient, Client, aconnect, connect
from .config import Settings, redact_url
from .core import Ack
from .errors import (
    ConfigurationError,
    InvalidFact,
    InvalidStreamName,
    InvalidTimestamp,
    PayloadNotSerializable,
    PayloadTooLarge,
    SchemaNotReady,
    StoreError,
    StreamExists,
    StreamsError,
    UnknownStream,
    UsageError,
    WriterFenced,
)
from .positions import PositionTracker
from .store import StreamInfo, StreamPositions
from .timestamps import TimestampMode
from .writer import AsyncFact, AsyncWriter, Fact, Writer

__version__ = "0.1.0"

__all__ = [
    "Ack",
    "AsyncClient",
    "AsyncFact",
    "AsyncWriter",
    "Client",
    "ConfigurationError",
    "Fact",
    "InvalidFact",
    "InvalidStreamName",
    "InvalidTimestamp",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "PositionTracker",
    "SchemaNotReady",
    "Settings",
    "StoreError",
    "StreamExists",
    "StreamInfo",
    "StreamPositions",
    "StreamsError",
    "TimestampMode",
    "UnknownStream",
    "UsageError",
    "Writer",
    "WriterFenced",
    "__version__",
    "aconnect",
    "connect",
    "redact_url",
]
