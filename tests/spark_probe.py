"""A Spark job whose tasks say where their Python runs: the cluster test's deterministic signal
that executors run the shipped archive (sampling processes misses short-lived workers).

``spark_probe.py STREAM OUTPUT`` reads STREAM through the ``streams`` source (a batch read, on
the executors), then runs one task per core that reports its interpreter, its working
directory and where it imported ``streams`` and ``streams_spark`` from; the driver writes it
all to OUTPUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession


def _where(_: Iterable[int]) -> Iterator[dict[str, Any]]:
    import streams_spark

    import streams

    yield {
        "executable": sys.executable,
        "prefix": sys.prefix,
        "cwd": os.getcwd(),
        "streams": streams.__file__,
        "streams_spark": streams_spark.__file__,
        "pid": os.getpid(),
    }


def main() -> None:
    stream, output = sys.argv[1], Path(sys.argv[2])
    spark = SparkSession.builder.appName("streams-probe").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    import streams_spark

    streams_spark.register(spark)
    facts = (
        spark.read.format("streams")
        .option("streams", stream)
        .option("databaseUrl", os.environ["STREAMS_DATABASE_URL"])
        .load()
        .count()
    )
    slots = spark.sparkContext.defaultParallelism
    tasks = spark.sparkContext.parallelize(range(slots), slots).mapPartitions(_where).collect()
    output.write_text(json.dumps({"rows": facts, "tasks": tasks}))
    spark.stop()


if __name__ == "__main__":
    main()
