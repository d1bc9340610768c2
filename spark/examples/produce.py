"""Write facts to a stream with Spark: a batch job, or a streaming query that copies a stream.

    spark-submit --master spark://127.0.0.1:7077 spark/examples/produce.py orders --rows 10000
    spark-submit ... spark/examples/produce.py orders-copy --from-stream orders --available-now
    spark-submit ... spark/examples/produce.py ticks --rate 100

Batch (the default): ``--rows`` rows ``{"n": i, "order": i // lines, "line": i % lines}``, the
``--lines`` rows of one order forming one multi-row fact (``keyColumn``). ``--from-stream``: a
streaming query that reads another stream with the ``streams`` source and writes each of its
facts as a fact (each row's payload as it is); ``--rate``: a streaming query that writes that many
rows per micro-batch from Spark's ``rate-micro-batch`` source until stopped. Streaming writes are
exactly once: stop them (Ctrl-C, a killed driver) and submit them again with the same
``--checkpoint``, and every row is written once.

Reads ``STREAMS_DATABASE_URL`` on the driver (or ``--database-url``); the options travel to the
executors with the query, so they need only the ``streams`` package with its ``spark`` extra.
"""

from __future__ import annotations

import argparse
import logging
import os

import streams_spark
from pyspark.sql import DataFrame, SparkSession


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stream", help="the stream to write to (it must exist)")
    parser.add_argument("--database-url", default=os.environ.get("STREAMS_DATABASE_URL"))
    parser.add_argument("--rows", type=int, default=1000, help="batch: rows to write")
    parser.add_argument("--lines", type=int, default=1, help="batch: rows per fact")
    parser.add_argument("--partitions", type=int, default=2, help="batch: Spark partitions")
    parser.add_argument("--from-stream", help="streaming: copy this stream's facts")
    parser.add_argument("--rate", type=int, help="streaming: rows per micro-batch")
    parser.add_argument("--available-now", action="store_true", help="stop when caught up")
    parser.add_argument("--checkpoint", default="checkpoints/streams-produce")
    parser.add_argument("--instance-prefix", help="writer instances: <prefix>-<partition>")
    args = parser.parse_args()
    if not args.database_url:
        parser.error("set STREAMS_DATABASE_URL or pass --database-url")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spark = SparkSession.builder.appName("streams-produce").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    streams_spark.register(spark)
    options = {"stream": args.stream, "databaseUrl": args.database_url}
    if args.instance_prefix:
        options["instancePrefix"] = args.instance_prefix

    if args.from_stream is None and args.rate is None:
        lines = max(1, args.lines)
        rows = spark.range(args.rows, numPartitions=args.partitions).selectExpr(
            "id AS n", f"id DIV {lines} AS order", f"id % {lines} AS line"
        )
        # Rows of one fact must be in one task: partition by the key.
        rows = rows.repartition(args.partitions, "order").sortWithinPartitions("n")
        rows.write.format("streams").mode("append").options(**options, keyColumn="order").save()
        print(f"wrote {args.rows} rows as {-(-args.rows // lines)} facts to {args.stream}")
        return

    source: DataFrame
    if args.from_stream is not None:
        source = (
            spark.readStream.format("streams")
            .option("stream", args.from_stream)
            .option("databaseUrl", args.database_url)
            .option("maxFactsPerTrigger", "10000")
            .load()
            .select("stream_id", "payload")
        )
        # Each row's payload as it is (JSON text); the rows of one fact stay one fact.
        options.update(payloadColumn="payload", keyColumn="stream_id")
    else:
        source = (
            spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", str(args.rate))
            .load()
            .selectExpr("value AS n")
        )
    writer = (
        source.writeStream.format("streams")
        .options(**options)
        .option("checkpointLocation", args.checkpoint)
    )
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    writer.start().awaitTermination()


if __name__ == "__main__":
    main()
