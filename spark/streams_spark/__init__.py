"""streams_spark: the ``streams`` Spark Structured Streaming (and batch) source.

    import streams_spark
    streams_spark.register(spark)
    df = (spark.readStream.format("streams")
          .option("stream", "orders")
          .option("databaseUrl", "postgresql://...")
          .load())

One micro-batch is one epoch of every stream read: every fact with an ID in (previous offset,
new offset], each fact whole, never past what PostgreSQL proved complete. See
`streams_spark.source` for the design and the README for the options.
"""

from __future__ import annotations

from .listener import LagListener, lag_from_progress
from .offsets import frontier_offset
from .options import SourceOptions, parse_options
from .session import register
from .source import SCHEMA, RangePartition, StreamsDataSource, read_partition

__all__ = [
    "SCHEMA",
    "LagListener",
    "RangePartition",
    "SourceOptions",
    "StreamsDataSource",
    "frontier_offset",
    "lag_from_progress",
    "parse_options",
    "read_partition",
    "register",
]
