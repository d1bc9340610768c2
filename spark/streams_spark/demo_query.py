"""The Spark step of `streams demo`: a local Spark session running the ``streams`` source into
the demo's sink table, which the demo then checks (`streams.ops.demo`).

`streams demo` finds `SparkQuery` through the entry point ``spark`` of the group
``streams.demo`` (``pyproject.toml``, `streams.plugins`), so that the library never imports
the connector.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import psycopg

from streams.config import Settings
from streams.errors import ConfigurationError

from .session import register

__all__ = ["SparkQuery", "require_java"]


def require_java() -> None:
    """Spark runs on Java 17 or later: without it, say so (pyspark says "Java gateway process
    exited before sending its port number")."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise ConfigurationError(
            "Spark needs Java 17, and there is no `java` on PATH and no JAVA_HOME: install "
            "it (e.g. apt install openjdk-17-jre-headless), or run `streams demo --no-spark`"
        )


@contextlib.contextmanager
def _stderr_to(log: str | None) -> Iterator[None]:
    """File descriptor 2 goes to ``log`` while the block runs: the JVM that pyspark starts
    inherits it, so Spark's warnings land in the log, not in the demo's view."""
    if log is None:
        yield
        return
    saved = os.dup(2)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


class SparkQuery:
    """A local Spark session running the streams source into `table` (an idempotent upsert
    keyed by stream, stream ID and row), counting its micro-batches."""

    def __init__(
        self, settings: Settings, stream: str, checkpoint: str, table: str, log: str | None = None
    ) -> None:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        require_java()
        from pyspark.sql import SparkSession

        builder = (
            SparkSession.builder.master("local[2]")
            .appName("streams-demo")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")  # no "[Stage 0:>" in the view
            # A Python worker that takes longer than Spark's 15 s to connect back (on a loaded
            # machine) fails the query with "Python worker failed to connect back".
            .config("spark.python.authenticate.socketTimeout", "120s")
            .config("spark.sql.shuffle.partitions", "2")
        )
        try:
            with _stderr_to(log):  # the JVM (and its Python workers) keep writing there
                self.spark = builder.getOrCreate()
        except Exception as exc:  # PySparkRuntimeError: the JVM did not start
            where = f"; its log: {log}" if log else ""
            raise ConfigurationError(
                f"Spark did not start ({type(exc).__name__}{where}): it needs Java 17 "
                "(`java -version`); without it, run `streams demo --no-spark`"
            ) from None
        self.spark.sparkContext.setLogLevel("ERROR")
        register(self.spark)
        self.batches = 0
        url = settings.database_url
        reader = (
            self.spark.readStream.format("streams")
            .option("stream", stream)
            .option("databaseUrl", url)
            .option("group", "demo-spark")
            .option("startingPosition", "earliest")
        )
        if settings.redis_url:
            reader = reader.option("redisUrl", settings.redis_url).option("prefix", settings.prefix)

        def sink(batch: Any, batch_id: int) -> None:
            rows = batch.select("stream_id", "row_no", "epoch_upper").collect()
            with psycopg.connect(url) as conn, conn.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO {table} (stream, stream_id, row_no, batch_id, "
                    "epoch_upper) VALUES (%s, %s, %s, %s, %s) "
                    "ON CONFLICT (stream, stream_id, row_no) DO UPDATE "
                    "SET batch_id = EXCLUDED.batch_id, epoch_upper = EXCLUDED.epoch_upper",
                    [(stream, r[0], r[1], batch_id, r[2]) for r in rows],
                )
            self.batches += 1

        self.query = (
            reader.load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime="500 milliseconds")
            .start()
        )

    def drain(self) -> None:
        self.query.processAllAvailable()
        self.query.stop()
        self.spark.stop()
