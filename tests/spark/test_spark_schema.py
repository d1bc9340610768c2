"""The Spark source's ``schema`` option (typed columns) against real facts, in each ``mode``.

Shares the session's SparkSession (`tests/conftest.py`); three short reads of one small stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_spark_source import stream_batches

from streams import Client

pytestmark = pytest.mark.timeout(240)

DDL = "order_id BIGINT, amount DOUBLE, tags ARRAY<STRING>, at TIMESTAMP, _corrupt_record STRING"

GOOD = {"order_id": 1, "amount": 2.5, "tags": ["a"], "at": "2026-11-26T10:00:00Z", "x": 0}
BAD_TYPE = {"order_id": "seven", "amount": 3}  # order_id does not parse, amount does
NOT_OBJECT = [1, 2]


def _write(client: Client, stream: str, url: str) -> dict[str, int]:
    """Facts: a good one, a bad type, a non-object, and a fact of three rows whose middle row
    is bad; returns their stream IDs."""
    writer = client.writer(stream, instance="w-typed")
    try:
        ids = {
            "good": writer.append(GOOD).first_id,
            "bad_type": writer.append(BAD_TYPE).first_id,
            "not_object": writer.append(NOT_OBJECT).first_id,
        }
        with psycopg.connect(url) as conn, writer.fact(conn) as fact:
            fact.add({"order_id": 10}, {"order_id": 1.5}, {"order_id": 12})
        ids["multi"] = fact.stream_id
    finally:
        writer.close()
    return ids


def _rows(df: Any) -> list[dict[str, Any]]:
    return sorted(
        (r.asDict(recursive=True) for r in df.collect()),
        key=lambda r: (r["stream_id"], r["row_no"]),
    )


def test_permissive_batch_read_types_columns_and_keeps_bad_rows(
    spark: Any, client: Client, stream: str, streams_url: str
) -> None:
    from pyspark.sql.types import StructType

    ids = _write(client, stream, streams_url)
    df = (
        spark.read.format("streams")
        .options(stream=stream, databaseUrl=streams_url, schema=DDL)
        .load()
    )
    # Parsed without Spark, the schema is the one Spark itself makes of the DDL.
    own = ["stream", "stream_id", "row_no", "instance", "timestamp", "epoch_upper"]
    assert df.columns == [*own, "order_id", "amount", "tags", "at", "_corrupt_record"]
    expected = StructType.fromDDL(DDL)
    assert isinstance(expected, StructType)
    assert [f.dataType for f in df.schema.fields[len(own) :]] == [
        f.dataType for f in expected.fields
    ]
    rows = _rows(df)
    assert len(rows) == 6
    by_id = {(r["stream_id"], r["row_no"]): r for r in rows}
    good = by_id[(ids["good"], 0)]
    assert (good["order_id"], good["amount"], good["tags"]) == (1, 2.5, ["a"])
    assert good["at"].isoformat().startswith("2026-11-26")
    assert good["_corrupt_record"] is None
    bad = by_id[(ids["bad_type"], 0)]
    assert (bad["order_id"], bad["amount"]) == (None, 3.0)  # partial results, as Spark 3
    assert json.loads(bad["_corrupt_record"]) == BAD_TYPE
    odd = by_id[(ids["not_object"], 0)]
    assert odd["order_id"] is None and json.loads(odd["_corrupt_record"]) == NOT_OBJECT
    assert [by_id[(ids["multi"], i)]["order_id"] for i in range(3)] == [10, None, 12]


def test_dropmalformed_stream_read_drops_only_the_bad_rows(
    spark: Any, client: Client, stream: str, streams_url: str, tmp_path: Path
) -> None:
    from pyspark.sql.types import StructType

    ids = _write(client, stream, streams_url)
    schema = StructType.fromDDL("order_id BIGINT, amount DOUBLE")  # in the test's driver
    options = {
        "stream": stream,
        "databaseUrl": streams_url,
        "schema": schema.json(),  # a StructType's JSON
        "mode": "dropMalformed",
    }
    rows = [row for _, batch in stream_batches(spark, options, tmp_path / "cp") for row in batch]
    kept = sorted((r["stream_id"], r["row_no"], r["order_id"]) for r in rows)
    assert kept == [
        (ids["good"], 0, 1),
        (ids["multi"], 0, 10),
        (ids["multi"], 2, 12),  # the fact's bad row 1 is dropped, its other rows stay
    ]
    assert "payload" not in rows[0] and "_corrupt_record" not in rows[0]


def test_failfast_fails_the_query_naming_the_row(
    spark: Any, client: Client, stream: str, streams_url: str
) -> None:
    ids = _write(client, stream, streams_url)
    df = (
        spark.read.format("streams")
        .options(stream=stream, databaseUrl=streams_url, schema="order_id BIGINT", mode="FAILFAST")
        .load()
    )
    with pytest.raises(Exception) as info:
        df.collect()
    text = str(info.value)
    assert "MalformedPayload" in text
    assert f"stream {stream!r}, stream ID {ids['bad_type']}, row 0" in text
    assert "'order_id'" in text and "seven" in text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schema": "a BIGINT,"}, "option schema: DDL"),
        ({"schema": "a NUMBERS"}, "a Spark SQL type"),
        ({"schema": '{"type": "struct", "fields": [{"name": "a", "type": "nope"}]}'}, "unknown"),
        ({"schema": "{nope"}, "not valid JSON"),
        ({"schema": "stream STRING"}, "clash with the rows' own columns"),
        ({"schema": "a INT, a INT"}, "more than once"),
        ({"schema": "a MAP<INT, INT>"}, "map keys must be strings"),
        ({"schema": "a INT", "mode": "lenient"}, "option mode"),
        ({"mode": "FAILFAST"}, "option mode applies only with option schema"),
        ({"schema": "a INT, bad INT", "columnNameOfCorruptRecord": "bad"}, "must be a string"),
    ],
)
def test_bad_schema_options(options: dict[str, str], message: str) -> None:
    from streams_spark.options import parse_options

    from streams.errors import ConfigurationError

    with pytest.raises(ConfigurationError) as info:
        parse_options({"stream": "a", "databaseUrl": "postgresql://h/db", **options}, {})
    assert message in str(info.value)
