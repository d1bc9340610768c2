"""Typed columns in Arrow batches (`Reader.batches(schema=...)`, `read_arrow(schema=...)`)
against real facts: each mode, the corrupt-record column, a multi-row fact with a bad row."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pyarrow as pa
import pytest

import streams
from streams import Client, MalformedPayload, UsageError

SCHEMA = pa.schema(
    [
        ("order_id", pa.int64()),
        ("amount", pa.float64()),
        ("tags", pa.list_(pa.string())),
        ("_corrupt_record", pa.string()),
    ]
)


def _write(client: Client, url: str, stream: str) -> dict[str, int]:
    with client.writer(stream, instance="w") as writer:
        ids = {
            "good": writer.append({"order_id": 1, "amount": 2, "tags": ["a"]}).first_id,
            "bad": writer.append({"order_id": "seven", "amount": 3.5}).first_id,
            "scalar": writer.append(5).first_id,
        }
        with psycopg.connect(url) as conn, writer.fact(conn) as fact:
            fact.add({"order_id": 10}, {"order_id": [1]}, {"order_id": 12})
        ids["multi"] = fact.stream_id
    return ids


def _rows(table: pa.Table) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["stream_id"], r["row_no"]): r for r in table.to_pylist()}


def test_permissive_batches_and_read_arrow(client: Client, stream: str, streams_url: str) -> None:
    ids = _write(client, streams_url, stream)
    with client.reader([stream]) as reader:
        batches = list(reader.batches(schema=SCHEMA, max_rows=2))
    table = pa.Table.from_batches(batches)
    assert table.column_names == [
        "stream", "stream_id", "row_no", "instance", "timestamp",
        "order_id", "amount", "tags", "_corrupt_record",
    ]  # fmt: skip
    assert table.equals(client.read_arrow(stream, schema=SCHEMA))
    rows = _rows(table)
    assert len(rows) == 6
    good = rows[(ids["good"], 0)]
    assert (good["order_id"], good["amount"], good["tags"], good["_corrupt_record"]) == (
        1, 2.0, ["a"], None,
    )  # fmt: skip
    bad = rows[(ids["bad"], 0)]
    assert (bad["order_id"], bad["amount"]) == (None, 3.5)
    assert json.loads(bad["_corrupt_record"]) == {"order_id": "seven", "amount": 3.5}
    assert rows[(ids["scalar"], 0)]["_corrupt_record"] == "5"
    assert [rows[(ids["multi"], i)]["order_id"] for i in range(3)] == [10, None, 12]


def test_dropmalformed_and_a_ddl_string(client: Client, stream: str, streams_url: str) -> None:
    ids = _write(client, streams_url, stream)
    table = client.read_arrow(stream, schema="order_id BIGINT", mode="dropmalformed")
    assert table.column_names[-1] == "order_id" and "payload" not in table.column_names
    columns = [table.column(c).to_pylist() for c in ("stream_id", "row_no", "order_id")]
    kept = sorted(zip(*columns, strict=True))
    assert kept == [(ids["good"], 0, 1), (ids["multi"], 0, 10), (ids["multi"], 2, 12)]


def test_failfast_names_the_row(client: Client, stream: str, streams_url: str) -> None:
    ids = _write(client, streams_url, stream)
    with pytest.raises(MalformedPayload) as info:
        client.read_arrow(stream, schema="order_id BIGINT", mode="FAILFAST")
    assert (info.value.stream, info.value.stream_id, info.value.row_no) == (stream, ids["bad"], 0)
    assert f"stream {stream!r}, stream ID {ids['bad']}, row 0" in str(info.value)


def test_async_read_arrow_with_a_schema(streams_url: str, stream: str, client: Client) -> None:
    _write(client, streams_url, stream)

    async def main() -> tuple[pa.Table, list[pa.RecordBatch]]:
        async with await streams.aconnect(streams_url) as aclient:
            table = await aclient.read_arrow(stream, schema=SCHEMA, mode="DROPMALFORMED")
            async with await aclient.reader(stream) as reader:
                batches = [b async for b in reader.batches(schema="order_id INT")]
            return table, batches

    table, batches = asyncio.run(main())
    assert table.column("order_id").to_pylist() == [1, 10, 12]
    assert table.column("_corrupt_record").null_count == 3
    typed = pa.Table.from_batches(batches)
    assert typed.schema.field("order_id").type == pa.int32()
    assert typed.column("order_id").to_pylist() == [1, None, None, 10, None, 12]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schema": "a BIGINT,"}, "DDL"),
        ({"schema": pa.schema([("stream", pa.string())])}, "clash"),
        ({"schema": "a INT", "mode": "lenient"}, "mode 'lenient'"),
        ({"mode": "FAILFAST"}, "only with a schema"),
        ({"schema": "a INT", "corrupt_column": "a"}, "must be a string field"),
        ({"schema": 5}, "pyarrow.Schema"),
    ],
)
def test_bad_arguments_are_usage_errors(
    client: Client, stream: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        client.read_arrow(stream, **kwargs)
