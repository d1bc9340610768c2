"""`streams.core.typed_payloads`: schema texts, conversions, modes and inference (pure)."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.core.typed_payloads import (
    PayloadSchema,
    SchemaError,
    _fast,
    _slow,
    infer_schema,
    parse_ddl,
    parse_mode,
    parse_schema_text,
    parse_spark_json,
    payload_schema,
    to_arrow_text,
    to_ddl,
    to_spark_json,
    typed_columns,
)

LEAVES = [
    pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(), pa.float64(),
    pa.string(), pa.binary(), pa.date32(), pa.timestamp("us", tz="UTC"), pa.timestamp("us"),
    pa.decimal128(10, 2), pa.decimal128(38, 0),
]  # fmt: skip
FAST_LEAVES = [pa.bool_(), pa.int8(), pa.int32(), pa.int64(), pa.float64(), pa.string()]

names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=8)


def types(leaves: list[pa.DataType], maps: bool = True) -> st.SearchStrategy[pa.DataType]:
    def extend(inner: st.SearchStrategy[pa.DataType]) -> st.SearchStrategy[pa.DataType]:
        options = [
            inner.map(pa.list_),
            st.lists(st.tuples(names, inner), min_size=1, max_size=3, unique_by=lambda t: t[0])
            .map(lambda fs: pa.struct([pa.field(n, t) for n, t in fs])),
        ]  # fmt: skip
        if maps:
            options.append(inner.map(lambda t: pa.map_(pa.string(), t)))
        return st.one_of(options)

    return st.recursive(st.sampled_from(leaves), extend, max_leaves=5)


def schemas(leaves: list[pa.DataType] = LEAVES, maps: bool = True) -> st.SearchStrategy[pa.Schema]:
    return st.lists(
        st.tuples(names, types(leaves, maps)), min_size=1, max_size=4, unique_by=lambda t: t[0]
    ).map(lambda fs: pa.schema([pa.field(n, t) for n, t in fs]))


# ------------------------------------------------------------------------------ schema texts


@given(schemas())
def test_ddl_and_struct_type_json_read_back_what_they_render(schema: pa.Schema) -> None:
    assert parse_ddl(to_ddl(schema)) == schema
    assert parse_spark_json(to_spark_json(schema)) == schema
    assert parse_schema_text(to_spark_json(schema)) == schema
    namespace: dict[str, Any] = {"pa": pa}
    assert eval(to_arrow_text(schema), namespace) == schema


@given(schemas())
@settings(max_examples=50)
def test_struct_type_json_is_pysparks(schema: pa.Schema) -> None:
    """PySpark reads our StructType JSON (no JVM needed for that) to the same Arrow types."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    spark_type = StructType.fromJson(json.loads(to_spark_json(schema)))
    assert to_arrow_schema(spark_type, timezone="UTC").equals(schema)


def test_ddl_forms() -> None:
    expected = pa.schema(
        [
            ("a", pa.int64()),
            ("b c", pa.struct([("d", pa.decimal128(10, 0)), ("e", pa.string())])),
            ("f", pa.map_(pa.string(), pa.list_(pa.float32()))),
        ]
    )
    text = (
        "a long NOT NULL, `b c` struct<d: DECIMAL, e VARCHAR(3)> COMMENT 'x', "
        "f MAP<string,ARRAY<REAL>>"
    )
    assert parse_ddl(text) == expected
    assert parse_ddl("STRUCT<" + text.replace(" NOT NULL", "") + ">") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "DDL is empty"),
        ("a", "expected a type"),
        ("a INT b INT", "',' or the end"),
        ("a ARRAY<INT", "'>'"),
        ("a DECIMAL(40,2)", "decimal(40,2) is not valid"),
        ("a UUID", "a Spark SQL type"),
        ('{"type": "struct"}', "not a type"),
        ('{"type": "array"}', 'must be an object with "type": "struct"'),
        ('{"type": "struct", "fields": [{"name": 1}]}', "not a field"),
        ('{"type": "struct", "fields": [{"name": "a", "type": "interval"}]}', "unknown type"),
    ],
)
def test_bad_schema_texts(text: str, message: str) -> None:
    with pytest.raises(SchemaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_schema_text(text)


def test_modes_and_checks() -> None:
    assert parse_mode(" dropMalformed ") == "DROPMALFORMED"
    with pytest.raises(SchemaError, match="mode 'x'"):
        parse_mode("x")
    spec = payload_schema(pa.schema([pa.field("a", pa.struct([pa.field("b", pa.int8(), False)]))]))
    assert spec.schema.field("a").type.field("b").nullable  # read as nullable, as Spark does
    for schema, message in [
        (pa.schema([("t", pa.time64("us"))]), "cannot be read from JSON"),
        (pa.schema([("m", pa.map_(pa.int32(), pa.int32()))]), "map keys must be strings"),
        (pa.schema([("_corrupt_record", pa.int64())]), "must be a string field"),
        (pa.schema([("a", pa.int64()), ("a", pa.int8())]), "more than once"),
        (pa.schema([]), "no fields"),
    ]:
        with pytest.raises(SchemaError, match=message):
            payload_schema(schema)
    with pytest.raises(SchemaError, match="clash"):
        payload_schema(pa.schema([("row_no", pa.int64())]), reserved=("row_no",))


# ------------------------------------------------------------------------------ conversions


def one(text: str, dtype: pa.DataType) -> tuple[Any, bool]:
    typed = typed_columns([text], payload_schema(pa.schema([("v", dtype)])))
    array = typed.arrays[0]
    if pa.types.is_timestamp(dtype):  # microseconds since the epoch, UTC
        array = array.cast(pa.int64())
    return array.to_pylist()[0], bool(typed.bad)


@pytest.mark.parametrize(
    ("value", "dtype", "expected", "bad"),
    [
        ("true", pa.bool_(), True, False),
        ("1", pa.bool_(), None, True),
        ("127", pa.int8(), 127, False),
        ("128", pa.int8(), None, True),
        ("1.0", pa.int64(), None, True),
        ('"1"', pa.int64(), None, True),
        ("true", pa.int64(), None, True),
        ("1", pa.float64(), 1.0, False),
        ('"NaN"', pa.float32(), float("nan"), False),
        ('"-Infinity"', pa.float64(), float("-inf"), False),
        ("1", pa.string(), "1", False),
        ('{"a":[1,true]}', pa.string(), '{"a":[1,true]}', False),
        ("1.005", pa.decimal128(5, 2), decimal.Decimal("1.01"), False),
        ('"12.5"', pa.decimal128(3, 1), decimal.Decimal("12.5"), False),
        ("1234", pa.decimal128(5, 2), None, True),
        ('"2026-02-30"', pa.date32(), None, True),
        ('"2026-02-28"', pa.date32(), dt.date(2026, 2, 28), False),
        ('"2026-01-01T01:00:00+01:00"', pa.timestamp("us", tz="UTC"), 1_767_225_600_000_000, False),
        ("86400", pa.timestamp("us", tz="UTC"), 86_400_000_000, False),
        ('"soon"', pa.timestamp("us"), None, True),
        ('"aGk="', pa.binary(), b"hi", False),
        ('"!"', pa.binary(), None, True),
        ('[1,"x"]', pa.list_(pa.int64()), None, True),
        ('{"k":1}', pa.map_(pa.string(), pa.int64()), [("k", 1)], False),
        ('{"b":1,"zz":2}', pa.struct([("b", pa.int64()), ("c", pa.int64())]), {"b": 1, "c": None},
         False),
        ("null", pa.int64(), None, False),
    ],
)  # fmt: skip
def test_conversions(value: str, dtype: pa.DataType, expected: Any, bad: bool) -> None:
    got, was_bad = one('{"v":' + value + "}", dtype)
    if isinstance(expected, float) and expected != expected:
        assert got != got
    else:
        assert got == expected
    assert was_bad is bad


def test_timestamps_are_utc_microseconds() -> None:
    typed = typed_columns(
        ['{"t": "2026-01-01T01:00:00+01:00"}', '{"t": "1970-01-02T00:00:00"}', '{"t": 5}'],
        payload_schema(pa.schema([("t", pa.timestamp("us", tz="UTC"))])),
    )
    assert typed.arrays[0].cast(pa.int64()).to_pylist() == [
        1_767_225_600_000_000, 86_400_000_000, 5_000_000,
    ]  # fmt: skip


def test_modes_and_the_corrupt_column() -> None:
    texts = ['{"a": 1}', '{"a": "x", "b": 2}', "[1]", '{"_corrupt_record": "mine", "a": 3}']
    schema = pa.schema([("a", pa.int64()), ("_corrupt_record", pa.string()), ("b", pa.int64())])
    permissive = typed_columns(texts, payload_schema(schema))
    assert [a.to_pylist() for a in permissive.arrays] == [
        [1, None, None, 3],
        [None, texts[1], texts[2], None],  # the payload's own key is not the column
        [None, 2, None, None],  # partial results: b parsed in row 1
    ]
    assert sorted(permissive.bad) == [1, 2]
    assert "field 'a'" in permissive.bad[1] and "not a JSON object" in permissive.bad[2]
    dropping = typed_columns(texts, payload_schema(schema, "DROPMALFORMED"))
    assert dropping.arrays[1].null_count == 4
    keep = dropping.keep(4)
    assert keep is not None and keep.to_pylist() == [True, False, False, True]
    assert typed_columns(texts[:1], payload_schema(schema)).keep(1) is None
    without = typed_columns(texts, payload_schema(schema.remove(1)))
    assert len(without.arrays) == 2 and sorted(without.bad) == [1, 2]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def _payload_for(dtype: pa.DataType) -> st.SearchStrategy[Any]:
    """Values that mostly fit ``dtype`` (and sometimes do not)."""
    fit: st.SearchStrategy[Any]
    if pa.types.is_struct(dtype):
        fit = st.fixed_dictionaries({}, optional={f.name: _payload_for(f.type) for f in dtype})
    elif pa.types.is_list(dtype):
        fit = st.lists(_payload_for(dtype.value_type), max_size=3)
    elif pa.types.is_boolean(dtype):
        fit = st.booleans()
    elif pa.types.is_integer(dtype):
        bits = dtype.bit_width
        fit = st.integers(-(2 ** (bits - 1)) - 2, 2 ** (bits - 1) + 1)
    elif pa.types.is_floating(dtype):
        fit = st.one_of(
            st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**53), 2**53)
        )
    else:
        fit = st.text(max_size=5)
    return st.one_of(st.none(), fit, fit, fit, json_values)


@st.composite
def pages(draw: st.DrawFn) -> tuple[pa.Schema, list[str]]:
    schema = draw(schemas(FAST_LEAVES, maps=False))
    struct = pa.struct(list(schema))
    rows = draw(st.lists(_payload_for(struct), min_size=1, max_size=8))
    texts = [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in rows]
    return schema, texts


@given(pages())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_pyarrows_json_reader_agrees_with_the_row_path(page: tuple[pa.Schema, list[str]]) -> None:
    schema, texts = page
    spec = payload_schema(schema)
    array = pa.array(texts, pa.string())
    bad: dict[int, str] = {}
    slow = _slow(texts, spec.parsed_schema, bad)
    fast = _fast(array, spec.parsed_schema)
    if fast is not None:  # it refuses a page with a bad row; accepts only what the row path does
        assert not bad
        assert [a.to_pylist() for a in fast] == [a.to_pylist() for a in slow]
    assert [a.to_pylist() for a in typed_columns(array, spec).arrays] == [
        a.to_pylist() for a in slow
    ]


# ------------------------------------------------------------------------------ inference


def test_inference_merges_types() -> None:
    schema, skipped = infer_schema(
        [
            {"a": 1, "b": [1, 2.5], "c": {"x": None}, "e": None},
            {"a": 2.5, "b": [], "c": {"y": "s"}, "d": True, "e": None},
            {"a": 3, "d": "yes", "f": [{"p": 1}, {"q": [1]}]},
            [1],
            "text",
        ]
    )
    assert skipped == 2
    assert schema == pa.schema(
        [
            ("a", pa.float64()),
            ("b", pa.list_(pa.float64())),
            ("c", pa.struct([("x", pa.string()), ("y", pa.string())])),
            ("d", pa.string()),
            ("e", pa.string()),
            ("f", pa.list_(pa.struct([("p", pa.int64()), ("q", pa.list_(pa.int64()))]))),
        ]
    )


objects = st.dictionaries(names, json_values, min_size=1, max_size=4)


@given(st.lists(objects, min_size=1, max_size=6))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_an_inferred_schema_reads_every_sample(samples: list[dict[str, Any]]) -> None:
    """The schema inferred from payloads reads each of them without a bad row, and the DDL
    of it reads back to it."""
    samples = [s for s in samples if all(abs(v) < 1e300 for v in _numbers(s))]
    schema, skipped = infer_schema(samples)
    assert skipped == 0
    if len(schema) == 0:
        return
    typed = typed_columns([json.dumps(s) for s in samples], payload_schema(schema, "FAILFAST"))
    assert typed.bad == {}
    assert parse_ddl(to_ddl(schema)) == schema


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    return []


def test_payload_schema_is_picklable() -> None:
    import pickle

    spec = payload_schema(parse_ddl("a ARRAY<STRUCT<b: DECIMAL(4,1)>>"), "failfast", "bad")
    again = pickle.loads(pickle.dumps(spec))
    assert isinstance(again, PayloadSchema) and again == spec and again.mode == "FAILFAST"
