"""`streams bench spark`: the Spark source beside Spark's own sources, all in one run.

* **throughput**: 10^6 facts (one epoch) read by the ``streams`` source and by Spark's JDBC
  source (PostgreSQL driver jar, the same rows with the payload as text, the same number of
  partitions), both into Spark's ``noop`` sink; rounds alternate (which source goes first too),
  each read after a pause (`SETTLE_SECONDS`) so that what one leaves running (a Python worker's
  garbage collection, the JVM's compiler) is not timed in the next; medians reported. Also the
  running-maximum timestamp computed by pyarrow (the default) vs in SQL (``timestampIn=sql``).
  Without the JDBC driver jar the baseline is skipped, and the run says so first and last.
* **overhead**: micro-batches of one row beside the built-in ``rate-micro-batch`` and an empty
  Python data source, with where the time goes (`streams_spark.benchmarks.spark_overhead`).
* **latency**: commit (the append returned) to the ``foreachBatch`` call that holds the fact,
  with ``trigger(processingTime="0 seconds")`` (Redis hints when a Redis URL is given).
* **probe rate**: probes per second of the source's driver logic when Spark calls
  ``latestOffset`` every 10 ms on an idle stream (Spark's default polling delay).
* **sink**: rows/s written with ``df.write.format("streams")`` beside ``append_batch`` from
  plain Python processes, the same rows with the same parallelism
  (`streams_spark.benchmarks.spark_sink`; target, issue 20: >= 0.8x).

Targets (issues 8 and 20): throughput >= 1.0x JDBC; overhead <= 1.5x built-in, or <= 1.1x the
empty Python source where that is out of a Python source's reach; latency p50 within 2x the
overhead of an empty micro-batch.

Every stream is the run's own (`streams.bench.common.scratch_streams`): they are dropped (with
the reader groups the Spark source commits) when it ends, also on Ctrl-C or an error, after the
Spark session stops.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click

from streams.bench.common import PAYLOAD, scratch_streams
from streams.cli_params import common_options
from streams.config import Settings, redact_url
from streams.core.fact_columns import ROW_COLUMNS

from ..options import parse_options
from ..session import register
from ..source import StreamsStreamReader
from .spark_overhead import micro_batch_overhead
from .spark_sink import sink_throughput

__all__ = ["JDBC_JAR", "bench_spark_command", "find_jdbc_jar", "jdbc_missing", "run_spark_bench"]

JDBC_JAR = "/usr/share/java/postgresql.jar"

#: Seconds between two timed reads of the throughput rounds (see the module doc).
SETTLE_SECONDS = 1.0

#: What the JDBC baseline selects: a fact's row columns, named as stored.
_JDBC_COLUMNS = ", ".join(
    c.stored if c.read == c.stored else f"{c.read} AS {c.stored}" for c in ROW_COLUMNS
)


def find_jdbc_jar(explicit: str | None = None) -> str | None:
    """The PostgreSQL JDBC driver jar: ``--jdbc-jar``, ``$STREAMS_JDBC_JAR`` or Debian's."""
    for candidate in (explicit, os.environ.get("STREAMS_JDBC_JAR"), JDBC_JAR):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def jdbc_missing() -> str:
    """What the run says when it has no JDBC driver jar."""
    return (
        "no PostgreSQL JDBC driver jar, so no JDBC baseline: install Debian's "
        f"libpostgresql-jdbc-java (apt-get install libpostgresql-jdbc-java gives {JDBC_JAR}), "
        "or pass --jdbc-jar / set STREAMS_JDBC_JAR to a postgresql-*.jar"
    )


def _jdbc_url(url: str) -> tuple[str, dict[str, str]]:
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = parts.port or 5432
    props = {}
    if parts.username:
        props["user"] = unquote(parts.username)
    if parts.password:
        props["password"] = unquote(parts.password)
    return f"jdbc:postgresql://{host}:{port}{parts.path}", props


def _load(url: str, stream: str, facts: int, report: Callable[[str], None]) -> None:
    import streams

    with streams.connect(url) as client:
        writer = client.writer(stream, instance="bench-spark")
        t0 = time.perf_counter()
        try:
            chunk = 20_000
            for start in range(0, facts, chunk):
                writer.append_batch([PAYLOAD] * min(chunk, facts - start))
        finally:
            writer.close()
        report(f"loaded {facts} facts in {time.perf_counter() - t0:.1f}s")


def _session(jar: str | None) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("streams-bench-spark")
        .config("spark.ui.enabled", "false")
        # A Python worker that takes longer than Spark's 15 s to connect back (on a loaded
        # machine) fails the query with "Python worker failed to connect back".
        .config("spark.python.authenticate.socketTimeout", "120s")
        .config("spark.sql.shuffle.partitions", "2")
        # Every micro-batch of the overhead queries, not only the last 100.
        .config("spark.sql.streaming.numRecentProgressUpdates", "100000")
    )
    if jar:
        builder = builder.config("spark.jars", jar)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def _timed_noop(df: Any) -> float:
    time.sleep(SETTLE_SECONDS)
    t0 = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t0


def run_spark_bench(
    settings: Settings,
    *,
    facts: int = 1_000_000,
    partitions: int = 2,
    rounds: int = 5,
    batches: int = 40,
    latency_samples: int = 30,
    jdbc_jar: str | None = None,
    sink_rows: int = 500_000,
    report: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every measurement; returns the figures (also reported line by line)."""
    url = settings.database_url
    jar = find_jdbc_jar(jdbc_jar)
    result: dict[str, Any] = {
        "facts": facts,
        "partitions": partitions,
        "rounds": rounds,
        "jdbc_jar": jar,
    }
    if jar is None:
        report(jdbc_missing())
    with scratch_streams(url, "spark") as scratch:
        info = scratch.create()
        stream, key = info.name, info.id
        _load(url, stream, facts, report)
        idle = scratch.create("idle").name
        spark = _session(jar)
        work = Path(tempfile.mkdtemp(prefix="streams-bench-spark-"))
        try:
            result["throughput"] = _throughput(
                spark, url, stream, key, facts, partitions, rounds, jar, report
            )
            result["overhead"] = micro_batch_overhead(spark, scratch, url, batches, work, report)
            result["latency"] = _latency(spark, settings, idle, latency_samples, work, report)
            result["probe_rate"] = _probe_rate(settings, idle, report)
            if sink_rows:
                result["sink"] = sink_throughput(
                    spark, scratch, url, sink_rows, partitions, rounds, report
                )
        finally:
            spark.stop()
            shutil.rmtree(work, ignore_errors=True)
    overhead = result["overhead"]
    result["latency"]["p50_vs_overhead"] = result["latency"]["p50_ms"] / overhead["streams_ms"]
    report(
        f"latency p50 / streams micro-batch overhead: {result['latency']['p50_vs_overhead']:.2f}x "
        "(target <= 2x)"
    )
    if jar is None:
        report(jdbc_missing())
    return result


def _throughput(
    spark: Any,
    url: str,
    stream: str,
    key: int,
    facts: int,
    partitions: int,
    rounds: int,
    jar: str | None,
    report: Callable[[str], None],
) -> dict[str, Any]:
    def source(timestamp_in: str) -> Any:
        return (
            spark.read.format("streams")
            .option("stream", stream)
            .option("databaseUrl", url)
            .option("partitions", str(partitions))
            .option("timestampIn", timestamp_in)
            .load()
        )

    def jdbc() -> Any:
        jdbc_url, props = _jdbc_url(url)
        reader = (
            spark.read.format("jdbc")
            .option("url", jdbc_url)
            .option("driver", "org.postgresql.Driver")
            .option(
                "dbtable",
                f"(SELECT {_JDBC_COLUMNS} FROM streams_facts WHERE stream = {int(key)}) AS facts",
            )
            .option("partitionColumn", "stream_id")
            .option("lowerBound", "1")
            .option("upperBound", str(facts + 1))
            .option("numPartitions", str(partitions))
            .option("fetchsize", "10000")
        )
        for k, v in props.items():
            reader = reader.option(k, v)
        return reader.load()

    rows = source("arrow").count()
    if rows != facts:
        raise click.ClickException(f"the streams source read {rows} rows, expected {facts}")
    times: dict[str, list[float]] = {"streams": [], "streams_sql_ts": [], "jdbc": []}
    reads: dict[str, Callable[[], Any]] = {
        "streams": lambda: source("arrow"),
        "jdbc": jdbc,
        "streams_sql_ts": lambda: source("sql"),
    }
    if not jar:
        del reads["jdbc"]
    for read in reads.values():  # warm the Python workers and the JVM's compiled code
        _timed_noop(read())
    for n in range(rounds):
        order = list(reads) if n % 2 == 0 else list(reversed(reads))
        for name in order:
            times[name].append(_timed_noop(reads[name]()))
    out: dict[str, Any] = {}
    for name, values in times.items():
        if values:
            out[f"{name}_rows_per_s"] = facts / statistics.median(values)
            runs = ", ".join(f"{v:.2f}s" for v in values)
            rate = out[f"{name}_rows_per_s"] / 1e6
            report(f"throughput {name}: {rate:.3f}M rows/s (median of {len(values)}: {runs})")
    if jar:
        out["ratio_vs_jdbc"] = out["streams_rows_per_s"] / out["jdbc_rows_per_s"]
        report(f"throughput streams / JDBC: {out['ratio_vs_jdbc']:.2f}x (target >= 1.0x)")
    else:
        report("throughput streams / JDBC: skipped (no JDBC driver jar; see the first line)")
    out["sql_ts_vs_arrow_ts"] = out["streams_sql_ts_rows_per_s"] / out["streams_rows_per_s"]
    report(f"running-max timestamp in SQL / in pyarrow: {out['sql_ts_vs_arrow_ts']:.2f}x")
    return out


def _latency(
    spark: Any,
    settings: Settings,
    stream: str,
    samples: int,
    work: Path,
    report: Callable[[str], None],
) -> dict[str, Any]:
    import streams

    seen: dict[int, float] = {}
    lock = threading.Lock()

    def sink(df: Any, _batch: int) -> None:
        now = time.perf_counter()
        ids = [r.stream_id for r in df.select("stream_id").collect()]
        with lock:
            for i in ids:
                seen.setdefault(i, now)

    reader = (
        spark.readStream.format("streams")
        .option("stream", stream)
        .option("databaseUrl", settings.database_url)
    )
    if settings.redis_url:
        reader = reader.option("redisUrl", settings.redis_url).option("prefix", settings.prefix)
    query = (
        reader.load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(work / "latency"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    latencies: list[float] = []
    try:
        with streams.connect(settings.database_url, settings.redis_url, settings.prefix) as client:
            writer = client.writer(stream, instance="bench-latency")
            # Warm up: the first batches pay for Python worker start-up.
            ack = writer.append({"warm": True})
            _wait(lambda: ack.last_id in seen, 120)
            for n in range(samples):
                ack = writer.append({"n": n})
                committed = time.perf_counter()
                _wait(lambda a=ack: a.last_id in seen, 30)  # type: ignore[misc]
                latencies.append((seen[ack.last_id] - committed) * 1000)
                time.sleep(0.05)
            writer.close()
    finally:
        query.stop()
    latencies.sort()
    out = {
        "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "samples": len(latencies),
        "redis": settings.redis_url is not None,
    }
    report(
        f"commit-to-foreachBatch latency: p50 {out['p50_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms "
        f"({len(latencies)} facts, Redis hints {'on' if out['redis'] else 'off'})"
    )
    return out


def _wait(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise click.ClickException("timed out waiting for the Spark query")
        time.sleep(0.002)


def _probe_rate(settings: Settings, stream: str, report: Callable[[str], None]) -> dict[str, Any]:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    out: dict[str, Any] = {}
    for label, redis_url in (("redis", settings.redis_url), ("no_redis", None)):
        if label == "redis" and redis_url is None:
            continue
        options = {"stream": stream, "databaseUrl": settings.database_url}
        if redis_url:
            options.update(redisUrl=redis_url, prefix=settings.prefix)
        reader = StreamsStreamReader(parse_options(options))
        try:
            start = reader.initialOffset()
            time.sleep(0.5)  # let the Redis link come up
            reader.latestOffset(start, ReadAllAvailable())
            before, t0, calls = reader.probes, time.monotonic(), 0
            while time.monotonic() - t0 < 3.0:
                reader.latestOffset(start, ReadAllAvailable())
                calls += 1
                time.sleep(0.01)  # spark.sql.streaming.pollingDelay
            elapsed = time.monotonic() - t0
            out[f"{label}_probes_per_s"] = (reader.probes - before) / elapsed
            out[f"{label}_calls_per_s"] = calls / elapsed
        finally:
            reader.stop()
        report(
            f"idle probe rate ({label.replace('_', ' ')}): "
            f"{out[f'{label}_probes_per_s']:.1f} probes/s for "
            f"{out[f'{label}_calls_per_s']:.0f} latestOffset calls/s"
        )
    return out


@click.command(name="spark")
@click.option("--facts", type=click.IntRange(1000, 10**9), default=1_000_000, show_default=True)
@click.option("--partitions", type=click.IntRange(1, 256), default=2, show_default=True)
@click.option("--rounds", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Throughput rounds (the sink's too).")  # fmt: skip
@click.option("--batches", type=click.IntRange(5, 10_000), default=40, show_default=True,
              help="Micro-batches per query of the overhead measurement.")  # fmt: skip
@click.option("--latency-samples", type=click.IntRange(5, 10_000), default=30, show_default=True)
@click.option("--sink-rows", type=click.IntRange(0, 10**9), default=500_000, show_default=True,
              help="Rows written by the sink and by append_batch (0: no sink).")  # fmt: skip
@click.option(
    "--jdbc-jar",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help=f"PostgreSQL JDBC driver jar (default: $STREAMS_JDBC_JAR or {JDBC_JAR}).",
)
@click.option("--json", "as_json", is_flag=True, help="Also print the results as one JSON line.")
@common_options
def bench_spark_command(
    facts: int,
    partitions: int,
    rounds: int,
    batches: int,
    latency_samples: int,
    jdbc_jar: str | None,
    sink_rows: int,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Spark source: throughput vs JDBC, micro-batch overhead vs rate-micro-batch and an empty
    Python source (and where it goes), latency, idle probe rate; Spark sink: rows/s vs
    append_batch (needs the spark extra, Java 17 and, for the JDBC baseline, the PostgreSQL JDBC
    driver: apt-get install libpostgresql-jdbc-java)."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    click.echo(f"database {redact_url(settings.database_url)}; {facts} facts, "
               f"{partitions} partitions, medians of {rounds} rounds")  # fmt: skip
    result = run_spark_bench(
        settings,
        facts=facts,
        partitions=partitions,
        rounds=rounds,
        batches=batches,
        latency_samples=latency_samples,
        jdbc_jar=jdbc_jar,
        sink_rows=sink_rows,
        report=click.echo,
    )
    if as_json:
        click.echo(json.dumps(result, sort_keys=True, separators=(",", ":")))


if __name__ == "__main__":
    bench_spark_command()
