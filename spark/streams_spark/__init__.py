"""streams_spark: the ``streams`` Spark Structured Streaming (and batch) source and sink.

    import streams_spark
    streams_spark.register(spark)
    df = (spark.readStream.format("streams")
          .option("stream", "orders")
          .option("databaseUrl", "postgresql://...")
          .load())
    (other.writeStream.format("streams").option("stream", "orders")
          .option("checkpointLocation", "...").start())

One micro-batch is one epoch of every stream read: every fact with an ID in (previous offset,
new offset], each fact whole, never past what PostgreSQL proved complete. Writes append rows as
facts, exactly once per streaming micro-batch. See `streams_spark.source` and
`streams_spark.sink` for the design and docs/spark.md for the options.

The package rule: of the `streams` library this package imports only the public API (`streams`,
`streams.errors`, `streams.config`) and the face connectors build on (`streams.connector`). It
reads facts by the store's read sequence (`streams.store.reads`: the executors run its plan
over ADBC), never by an order of its own; `tests/unit/test_layout.py` checks the imports.
"""

from __future__ import annotations

from .listener import LagListener, lag_from_progress
from .offsets import frontier_offset
from .options import SourceOptions, parse_options
from .session import register
from .sink import StreamsDataSource
from .sink_options import SinkOptions, parse_sink_options
from .source import SCHEMA, RangePartition, read_partition

__all__ = [
    "SCHEMA",
    "LagListener",
    "RangePartition",
    "SinkOptions",
    "SourceOptions",
    "StreamsDataSource",
    "frontier_offset",
    "lag_from_progress",
    "parse_options",
    "parse_sink_options",
    "read_partition",
    "register",
]
