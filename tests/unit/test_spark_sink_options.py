"""The Spark sink's pure parts: options, which columns make a payload, rows grouped into facts,
and facts cut into chunks (laws checked with Hypothesis against brute force)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)
from streams_spark.sink_options import chunked, group_rows, parse_sink_options, plan_columns

from streams.errors import ConfigurationError

URL = "postgresql://u:hunter2@db.example/streams"
ENV = {"STREAMS_DATABASE_URL": URL}


def options(**raw: str) -> Any:
    return parse_sink_options({"stream": "orders", **raw}, ENV)


SCHEMA = StructType(
    [
        StructField("order", StringType()),
        StructField("amount", DoubleType()),
        StructField("at", TimestampType()),
        StructField("ms", LongType()),
        StructField("tags", ArrayType(StringType())),
        StructField("raw", BinaryType()),
        StructField("attrs", MapType(StringType(), BinaryType())),
    ]
)


def test_defaults_and_spark_options_are_ignored() -> None:
    parsed = parse_sink_options(
        {"STREAM": "orders", "checkpointlocation": "/tmp/x", "path": "p"}, ENV
    )
    assert (parsed.stream, parsed.database_url, parsed.instance_prefix) == ("orders", URL, None)
    assert "hunter2" not in repr(parsed)
    assert parsed.commit_retention == 7 * 86400


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"stream": ""}, "option stream"),
        ({"stream": "a b"}, "option stream"),
        ({"group": "g"}, "option group applies to reads"),
        ({"colour": "red"}, "unknown option 'colour'"),
        ({"instancePrefix": "x" * 101}, "instancePrefix"),
        ({"instancePrefix": "a/b"}, "instancePrefix"),
        ({"payloadColumn": "a", "payloadColumns": "b"}, "give one of them"),
        ({"payloadColumns": "a, A"}, "named twice"),
        ({"payloadColumns": " , "}, "name one or more"),
        ({"keyColumn": " "}, "keyColumn: name a column"),
        ({"keyColumn": "a", "timestampColumn": "A"}, "different columns"),
        ({"commitRetention": "59m"}, "at least 1h"),
        ({"commitRetention": "soon"}, "not a duration"),
    ],
)
def test_bad_options(raw: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_sink_options({"stream": "orders", **raw}, ENV)


def test_missing_database_url_names_the_option() -> None:
    with pytest.raises(ConfigurationError, match="option databaseUrl"):
        parse_sink_options({"stream": "orders"}, {})


def test_columns_plan() -> None:
    chosen = options(keyColumn="ORDER", timestampColumn="at", payloadColumns="amount,tags")
    plan = plan_columns(chosen, SCHEMA)
    assert (plan.key_index, plan.timestamp_index, plan.timestamp_is_time) == (0, 2, True)
    assert plan.payload_object == (("amount", 1), ("tags", 4))
    text = plan_columns(options(payloadColumn="order", timestampColumn="ms"), SCHEMA)
    assert (text.payload_index, text.payload_is_text, text.timestamp_is_time) == (0, True, False)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "'raw' is binary"),  # the default payload takes every other column
        ({"payloadColumn": "attrs"}, "'attrs' is map<string,binary>"),
        ({"payloadColumn": "nope"}, "'nope' is not a column"),
        ({"keyColumn": "tags", "payloadColumn": "order"}, "keyColumn: column 'tags' is array"),
        ({"timestampColumn": "amount", "payloadColumn": "order"}, "'amount' is double"),
    ],
)
def test_bad_columns(raw: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        plan_columns(options(**raw), SCHEMA)


rows = st.lists(
    st.tuples(st.none() | st.integers(0, 5), st.none() | st.integers(0, 10**6)), max_size=60
)


@given(rows)
def test_group_rows_law(data: list[tuple[int | None, int | None]]) -> None:
    keys = [k for k, _ in data]
    texts = [f"r{i}" for i in range(len(data))]
    stamps = [s for _, s in data]
    facts, fact_stamps = group_rows(keys, texts, stamps)
    # Brute force: every row once; one fact per key (null keys: one per row), in the order
    # keys first appear; rows in input order; a fact's timestamp the latest of its rows'.
    expected: list[list[int]] = []
    for i, key in enumerate(keys):
        same = [j for j, k in enumerate(keys) if k == key] if key is not None else [i]
        if same[0] == i:
            expected.append(same)
    assert facts == [[texts[j] for j in group] for group in expected]
    assert fact_stamps == [
        max((s for j in group if (s := stamps[j]) is not None), default=None) for group in expected
    ]


@given(st.lists(st.integers(1, 7), max_size=50), st.integers(1, 12), st.booleans())
def test_chunks_keep_facts_whole_and_in_order(
    sizes: list[int], per_chunk: int, single: bool
) -> None:
    if single:
        sizes = [1] * len(sizes)
    facts = [[f"{n}.{r}" for r in range(size)] for n, size in enumerate(sizes)]
    rows = [text for fact in facts for text in fact]
    stamps: list[int | None] = list(range(len(sizes)))
    chunks = chunked(rows, stamps, per_chunk, None if single else sizes)
    assert [r for c in chunks for r in c.rows] == rows
    assert [s for c in chunks for s in c.timestamps] == stamps
    if not single:
        assert [n for c in chunks for n in c.sizes or ()] == sizes
    for c in chunks[:-1]:  # each chunk but the last reaches the size, and no fact before
        counts = list(c.sizes or [1] * len(c.rows))
        assert sum(counts) >= per_chunk > sum(counts[:-1])


# ------------------------------------------------------------------------------ Arrow's JSON

flat = st.fixed_dictionaries(
    {
        "s": st.none() | st.text(max_size=12),
        "i": st.none() | st.integers(-(2**63), 2**63 - 1),
        "b": st.none() | st.booleans(),
        "f": st.none() | st.floats(width=64),
        "tiny": st.none() | st.floats(width=32, allow_nan=False, allow_infinity=False),
    }
)


@given(st.lists(flat, min_size=1, max_size=20))
def test_arrow_json_is_python_json(records: list[dict[str, Any]]) -> None:
    import json
    import math

    import pyarrow as pa
    from streams_spark.sink import _arrow_texts
    from streams_spark.sink_options import ColumnPlan

    from streams.core.payloads import encode_payload

    schema = pa.schema([("s", pa.string()), ("i", pa.int64()), ("b", pa.bool_()),
                        ("f", pa.float64()), ("tiny", pa.float32())])  # fmt: skip
    batch = pa.RecordBatch.from_pylist(records, schema=schema)
    for names in (("s", "i", "b"), ("s", "i", "b", "f", "tiny")):
        plan = ColumnPlan(None, False, tuple((n, schema.names.index(n)) for n in names),
                          None, False, None)  # fmt: skip
        fast = _arrow_texts(batch, plan, 1 << 20)
        rows = batch.select(list(names)).to_pylist()
        refused = any(
            (isinstance(r["s"], str) and any(ord(c) < 32 for c in r["s"]))
            or (isinstance(r.get("f"), float) and not math.isfinite(r["f"]))
            for r in rows
        )
        assert (fast is None) == refused  # Python's path then escapes, or refuses, the value
        if fast is None:
            continue
        python = [encode_payload(r, 1 << 20) for r in rows]
        if "f" not in names:
            assert fast == python  # the same text, byte for byte
        else:  # the same numbers, floats still floats (Arrow may spell them differently)
            for a, b in zip(fast, python, strict=True):
                loaded, expected = json.loads(a), json.loads(b)
                assert loaded == expected
                assert [type(v) for v in loaded.values()] == [type(v) for v in expected.values()]


def test_arrow_json_of_large_strings() -> None:
    import pyarrow as pa
    from streams_spark.sink import _arrow_texts
    from streams_spark.sink_options import ColumnPlan

    batch = pa.RecordBatch.from_pydict(
        {"s": pa.array(['a"b\\', None], pa.large_string()), "i": pa.array([1, None])}
    )
    plan = ColumnPlan(None, False, (("s", 0), ("i", 1)), None, False, None)
    assert _arrow_texts(batch, plan, 1 << 20) == ['{"s":"a\\"b\\\\","i":1}', '{"s":null,"i":null}']
