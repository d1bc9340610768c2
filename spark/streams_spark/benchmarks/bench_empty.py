"""An empty Python streaming data source, the floor of `streams bench spark`'s overhead.

``format("streams_bench_empty")`` does no I/O at all: its offsets are a counter held in the
planner process, each micro-batch is one partition of one row (``value``, long) made in the
Python worker, and ``commit`` does nothing. What a micro-batch of it costs is what Spark charges
*any* Python data source: the calls to the planner process (``latestOffset``, ``partitions``,
``commit``), the offset and commit logs of the checkpoint, one Python task (the worker, the
pickled reader, the Arrow stream back to the JVM). The ``streams`` source's overhead beside it
is what the source itself adds.

Options: ``batches``, how many one-row micro-batches there are (it supports
``trigger(availableNow=True)``, which then runs them all and stops, as the ``streams`` source
does in the bench).

Only `streams bench spark` uses this module; executors import it to unpickle the
reader, so it lives in the installed package, not in a script.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import LongType, StructField, StructType

__all__ = ["EmptySource", "EmptyStreamReader"]

SCHEMA = StructType([StructField("value", LongType())])


class EmptySource(DataSource):
    """``spark.readStream.format("streams_bench_empty").option("batches", n)``."""

    @classmethod
    def name(cls) -> str:
        return "streams_bench_empty"

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return EmptyStreamReader(int(self.options.get("batches", "40")))


class _Range(InputPartition):
    def __init__(self, low: int, high: int) -> None:
        super().__init__((low, high))
        self.low, self.high = low, high


class EmptyStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"n": rows so far}``, one row per micro-batch, ``batches`` rows in all."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def initialOffset(self) -> dict[str, Any]:
        return {"n": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(1)

    def prepareForTriggerAvailableNow(self) -> None:
        pass  # the end is fixed: ``batches`` rows

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        step = self.batches if isinstance(limit, ReadAllAvailable) else 1
        return {"n": min(self.batches, int(start["n"]) + step)}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return [_Range(int(start["n"]), int(end["n"]))]

    def read(self, partition: InputPartition) -> Iterator[tuple[int]]:
        assert isinstance(partition, _Range)
        for value in range(partition.low, partition.high):
            yield (value,)

    def commit(self, end: dict[str, Any]) -> None:
        pass
