"""Consume a stream with Spark Structured Streaming and print each epoch's per-writer counts.

    spark-submit --master spark://127.0.0.1:7077 spark/examples/consume.py orders

Reads ``STREAMS_DATABASE_URL`` (and ``STREAMS_REDIS_URL`` / ``STREAMS_PREFIX`` if set) on the
driver; the options travel to the executors with the query, so they need only the ``streams``
package with its ``spark`` extra, not the environment. Stop it with Ctrl-C: restarted with the same
``--checkpoint``, it continues exactly where it stopped (one micro-batch = one epoch).
"""

from __future__ import annotations

import argparse
import logging
import os

import streams_spark
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("streams", help="stream name(s), comma-separated")
    parser.add_argument("--checkpoint", default="checkpoints/streams-consume")
    parser.add_argument("--group", default="spark-consume")
    parser.add_argument("--max-facts", default="10000", help="maxFactsPerTrigger")
    parser.add_argument("--starting-position", default="earliest")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spark = SparkSession.builder.appName("streams-consume").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    streams_spark.register(spark)
    spark.streams.addListener(streams_spark.LagListener())  # logs lag per stream per batch

    reader = (
        spark.readStream.format("streams")
        .option("streams", args.streams)
        .option("group", args.group)
        .option("maxFactsPerTrigger", args.max_facts)
        .option("startingPosition", args.starting_position)
    )
    if os.environ.get("STREAMS_DATABASE_URL"):
        reader = reader.option("databaseUrl", os.environ["STREAMS_DATABASE_URL"])
    if os.environ.get("STREAMS_REDIS_URL"):
        reader = reader.option("redisUrl", os.environ["STREAMS_REDIS_URL"])
    if os.environ.get("STREAMS_PREFIX"):
        reader = reader.option("prefix", os.environ["STREAMS_PREFIX"])
    facts = reader.load()

    def show(batch: DataFrame, batch_id: int) -> None:
        summary = (
            batch.groupBy("stream", "instance")
            .agg(
                F.countDistinct("stream_id").alias("facts"),
                F.count("*").alias("rows"),
                F.max("stream_id").alias("last_id"),
                F.max("timestamp").alias("last_timestamp"),
                F.max("epoch_upper").alias("epoch_upper"),
            )
            .orderBy("stream", "instance")
        )
        print(f"--- batch {batch_id}")
        summary.show(truncate=False)

    query = (
        facts.writeStream.foreachBatch(show)
        .option("checkpointLocation", args.checkpoint)
        .trigger(processingTime="1 second")
        .start()
    )
    query.awaitTermination()


if __name__ == "__main__":
    main()
