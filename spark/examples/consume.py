"""Consume a stream with Spark Structured Streaming and print each epoch's per-writer counts.

    spark-submit --master spark://127.0.0.1:7077 spark/examples/consume.py orders

Reads ``STREAMS_DATABASE_URL`` (and ``STREAMS_REDIS_URL`` / ``STREAMS_PREFIX`` if set) on the
driver; the options travel to the executors with the query, so they need only the ``streams``
package with its ``spark-executor`` extra, not the environment. Stop it with Ctrl-C: restarted
with the same ``--checkpoint``, it continues exactly where it stopped (one micro-batch = one
epoch).

``--output DIR`` also writes every micro-batch's rows as Parquet to ``DIR/batch=<id>``, replacing
that folder when Spark replays the batch after a crash: the same batch ID always holds the same
facts, so the folder ends with every fact exactly once (``spark.read.parquet(DIR)`` reads them
all, with a ``batch`` column). The executors write it, so on a real cluster ``DIR`` must be
storage they all share (HDFS, S3, NFS). ``--available-now`` stops once every fact that was
complete at the start has been read, instead of following the stream.
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
    parser.add_argument("--output", help="also write each batch as Parquet to OUTPUT/batch=<id>")
    parser.add_argument(
        "--available-now", action="store_true", help="stop when caught up (availableNow)"
    )
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
        if args.output:
            # Overwrite, not append: a batch replayed after a crash has the same ID and the same
            # facts, so its folder is replaced and nothing is written twice.
            batch = batch.persist()  # read the source once for both the files and the summary
            batch.write.mode("overwrite").parquet(f"{args.output}/batch={batch_id}")
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
        if args.output:
            batch.unpersist()

    writer = facts.writeStream.foreachBatch(show).option("checkpointLocation", args.checkpoint)
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="1 second")
    query = writer.start()
    query.awaitTermination()


if __name__ == "__main__":
    main()
