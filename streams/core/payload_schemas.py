"""Payload schemas as text, and inferred from payloads. Pure; no I/O.

A *payload schema* (`streams.core.typed_payloads`) is Arrow fields. People write them as Spark
DDL strings (``"order_id BIGINT, tags ARRAY<STRING>"``) or Spark ``StructType`` JSON; this
module reads both without Spark (the Spark source's planner has no JVM: `parse_ddl`,
`parse_spark_json`, `parse_schema_text`) into the Arrow types PySpark maps Spark's to, writes
them back (`to_ddl`, `to_spark_json`, and Python for pyarrow: `to_arrow_text`), and infers one
from sample payloads (`infer_schema`: Spark's JSON inference rules).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

__all__ = [
    "SchemaError",
    "infer_schema",
    "parse_ddl",
    "parse_schema_text",
    "parse_spark_json",
    "to_arrow_text",
    "to_ddl",
    "to_spark_json",
]

_TS_TYPE = pa.timestamp("us", tz="UTC")


class SchemaError(ValueError):
    """A schema text, mode or corrupt-record column that cannot be used (the message says
    why and where)."""


# ------------------------------------------------------------------------------ DDL and JSON

_SIMPLE = {
    "boolean": pa.bool_(),
    "tinyint": pa.int8(),
    "byte": pa.int8(),
    "smallint": pa.int16(),
    "short": pa.int16(),
    "int": pa.int32(),
    "integer": pa.int32(),
    "bigint": pa.int64(),
    "long": pa.int64(),
    "float": pa.float32(),
    "real": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": _TS_TYPE,
    "timestamp_ltz": _TS_TYPE,
    "timestamp_ntz": pa.timestamp("us"),
}
_TOKEN = re.compile(
    r"\s*(?:(`(?:[^`]|``)*`)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)|('(?:[^'\\]|\\.)*')|(.))"
)


class _Tokens:
    """The tokens of a DDL string: (kind, text, offset); kinds name, quoted, number, string,
    punct."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.items: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                break
            pos = match.end()
            kinds = ("quoted", "name", "number", "string", "punct")
            for kind, value in zip(kinds, match.groups(), strict=True):
                if value is not None:
                    self.items.append((kind, value, match.start(match.lastindex or 0)))
        self.i = 0

    def peek(self) -> tuple[str, str, int]:
        return self.items[self.i] if self.i < len(self.items) else ("end", "", len(self.text))

    def take(self) -> tuple[str, str, int]:
        item = self.peek()
        self.i += 1
        return item

    def error(self, what: str) -> SchemaError:
        kind, value, at = self.peek()
        found = "the end" if kind == "end" else repr(value)
        return SchemaError(f"DDL {self.text!r}: expected {what} at offset {at}, found {found}")

    def expect(self, punct: str) -> None:
        if self.peek()[:2] != ("punct", punct):
            raise self.error(repr(punct))
        self.take()

    def keyword(self, word: str) -> bool:
        kind, value, _ = self.peek()
        if kind == "name" and value.lower() == word:
            self.take()
            return True
        return False


def _ddl_name(tokens: _Tokens) -> str:
    kind, value, _ = tokens.peek()
    if kind == "name":
        tokens.take()
        return value
    if kind == "quoted":
        tokens.take()
        return value[1:-1].replace("``", "`")
    raise tokens.error("a field name")


def _ddl_number(tokens: _Tokens) -> int:
    if tokens.peek()[0] != "number":
        raise tokens.error("a number")
    return int(tokens.take()[1])


def _ddl_type(tokens: _Tokens) -> pa.DataType:
    kind, value, _ = tokens.peek()
    if kind != "name":
        raise tokens.error("a type")
    tokens.take()
    word = value.lower()
    if word in ("array", "map", "struct"):
        tokens.expect("<")
        if word == "array":
            out: pa.DataType = pa.list_(_ddl_type(tokens))
        elif word == "map":
            key = _ddl_type(tokens)
            tokens.expect(",")
            out = pa.map_(key, _ddl_type(tokens))
        else:
            fields: list[pa.Field] = []
            while tokens.peek()[:2] != ("punct", ">"):
                if fields:
                    tokens.expect(",")
                fields.append(_ddl_field(tokens, colon=True))
            out = pa.struct(fields)
        tokens.expect(">")
        return out
    if word in ("decimal", "dec", "numeric"):
        precision, scale = 10, 0
        if tokens.peek()[:2] == ("punct", "("):
            tokens.take()
            precision = _ddl_number(tokens)
            if tokens.peek()[:2] == ("punct", ","):
                tokens.take()
                scale = _ddl_number(tokens)
            tokens.expect(")")
        if not 1 <= precision <= 38 or not 0 <= scale <= precision:
            raise SchemaError(f"DDL {tokens.text!r}: decimal({precision},{scale}) is not valid")
        return pa.decimal128(precision, scale)
    if word in ("varchar", "char"):
        tokens.expect("(")
        _ddl_number(tokens)
        tokens.expect(")")
        return pa.string()
    if word not in _SIMPLE:
        tokens.i -= 1
        raise tokens.error("a Spark SQL type (e.g. BIGINT, DOUBLE, STRING, ARRAY<...>)")
    return _SIMPLE[word]


def _ddl_field(tokens: _Tokens, *, colon: bool) -> pa.Field:
    name = _ddl_name(tokens)
    if colon and tokens.peek()[:2] == ("punct", ":"):
        tokens.take()
    dtype = _ddl_type(tokens)
    if tokens.keyword("not") and not tokens.keyword("null"):
        raise tokens.error("NULL after NOT")
    if tokens.keyword("comment"):
        if tokens.peek()[0] != "string":
            raise tokens.error("a quoted comment")
        tokens.take()
    return pa.field(name, dtype)


def parse_ddl(text: str) -> pa.Schema:
    """A Spark DDL string (``"a BIGINT, b STRUCT<c: STRING>"``, or ``"STRUCT<...>"``) -> an
    Arrow schema, without Spark (`_SIMPLE` lists the type names)."""
    tokens = _Tokens(text)
    if tokens.peek()[0] == "end":
        raise SchemaError("DDL is empty")
    kind, value, _ = tokens.peek()
    if (
        kind == "name"
        and value.lower() == "struct"
        and len(tokens.items) > 1
        and tokens.items[1][:2] == ("punct", "<")
    ):
        whole = _ddl_type(tokens)
        if tokens.peek()[0] != "end":
            raise tokens.error("the end")
        return pa.schema(list(whole))
    fields = [_ddl_field(tokens, colon=False)]
    while tokens.peek()[:2] == ("punct", ","):
        tokens.take()
        fields.append(_ddl_field(tokens, colon=False))
    if tokens.peek()[0] != "end":
        raise tokens.error("',' or the end")
    return pa.schema(fields)


_JSON_SIMPLE = {
    "boolean": pa.bool_(),
    "byte": pa.int8(),
    "short": pa.int16(),
    "integer": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": _TS_TYPE,
    "timestamp_ntz": pa.timestamp("us"),
}
_JSON_DECIMAL = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def _json_type(data: Any) -> pa.DataType:
    if isinstance(data, str):
        if data in _JSON_SIMPLE:
            return _JSON_SIMPLE[data]
        if data == "decimal":
            return pa.decimal128(10, 0)
        match = _JSON_DECIMAL.fullmatch(data)
        if match:
            precision, scale = int(match.group(1)), int(match.group(2))
            if 1 <= precision <= 38 and 0 <= scale <= precision:
                return pa.decimal128(precision, scale)
        raise SchemaError(f"StructType JSON: unknown type {data!r}")
    if isinstance(data, dict):
        kind = data.get("type")
        if kind == "array" and "elementType" in data:
            return pa.list_(_json_type(data["elementType"]))
        if kind == "map" and "keyType" in data and "valueType" in data:
            return pa.map_(_json_type(data["keyType"]), _json_type(data["valueType"]))
        if kind == "struct" and isinstance(data.get("fields"), list):
            return pa.struct([_json_field(f) for f in data["fields"]])
    raise SchemaError(f"StructType JSON: not a type: {json.dumps(data)[:80]}")


def _json_field(data: Any) -> pa.Field:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or "type" not in data:
        raise SchemaError(f"StructType JSON: not a field: {json.dumps(data)[:80]}")
    return pa.field(data["name"], _json_type(data["type"]))


def parse_spark_json(text: str) -> pa.Schema:
    """A Spark ``StructType`` JSON (``StructType.json()``) -> an Arrow schema, without Spark."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SchemaError(f"StructType JSON is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("type") != "struct":
        raise SchemaError('StructType JSON must be an object with "type": "struct"')
    return pa.schema(list(_json_type(data)))


def parse_schema_text(text: str) -> pa.Schema:
    """A Spark DDL string, or a ``StructType`` JSON (text starting with ``{``)."""
    if not isinstance(text, str):
        raise SchemaError("schema must be a DDL string or a StructType JSON")
    if text.lstrip().startswith("{"):
        return parse_spark_json(text)
    return parse_ddl(text)


def _ddl_quote(name: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return name
    return "`" + name.replace("`", "``") + "`"


def _ddl_of(dtype: pa.DataType) -> str:
    if pa.types.is_struct(dtype):
        return (
            "STRUCT<" + ", ".join(f"{_ddl_quote(f.name)}: {_ddl_of(f.type)}" for f in dtype) + ">"
        )
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return f"ARRAY<{_ddl_of(dtype.value_type)}>"
    if pa.types.is_map(dtype):
        return f"MAP<{_ddl_of(dtype.key_type)}, {_ddl_of(dtype.item_type)}>"
    if pa.types.is_decimal(dtype):
        return f"DECIMAL({dtype.precision},{dtype.scale})"
    if pa.types.is_timestamp(dtype):
        return "TIMESTAMP" if dtype.tz else "TIMESTAMP_NTZ"
    for name, simple in _SIMPLE.items():
        if simple == dtype and name in _DDL_NAMES:
            return name.upper()
    raise SchemaError(f"type {dtype} has no Spark equivalent")


_DDL_NAMES = frozenset(
    ("boolean", "tinyint", "smallint", "int", "bigint", "float", "double", "string", "binary",
     "date")
)  # fmt: skip


def to_ddl(schema: pa.Schema) -> str:
    """The schema as a Spark DDL string (`parse_ddl` reads it back)."""
    return ", ".join(f"{_ddl_quote(f.name)} {_ddl_of(f.type)}" for f in schema)


def _json_of(dtype: pa.DataType) -> Any:
    if pa.types.is_struct(dtype):
        return {
            "type": "struct",
            "fields": [
                {"name": f.name, "type": _json_of(f.type), "nullable": True, "metadata": {}}
                for f in dtype
            ],
        }
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return {"type": "array", "elementType": _json_of(dtype.value_type), "containsNull": True}
    if pa.types.is_map(dtype):
        return {
            "type": "map",
            "keyType": _json_of(dtype.key_type),
            "valueType": _json_of(dtype.item_type),
            "valueContainsNull": True,
        }
    if pa.types.is_decimal(dtype):
        return f"decimal({dtype.precision},{dtype.scale})"
    for name, simple in _JSON_SIMPLE.items():
        if simple == dtype:
            return name
    raise SchemaError(f"type {dtype} has no Spark equivalent")


def to_spark_json(schema: pa.Schema) -> str:
    """The schema as a Spark ``StructType`` JSON (`parse_spark_json` reads it back)."""
    return json.dumps(_json_of(pa.struct(list(schema))))


def _arrow_of(dtype: pa.DataType) -> str:
    if pa.types.is_struct(dtype):
        inner = ", ".join(f"pa.field({f.name!r}, {_arrow_of(f.type)})" for f in dtype)
        return f"pa.struct([{inner}])"
    if pa.types.is_list(dtype):
        return f"pa.list_({_arrow_of(dtype.value_type)})"
    if pa.types.is_map(dtype):
        return f"pa.map_({_arrow_of(dtype.key_type)}, {_arrow_of(dtype.item_type)})"
    if pa.types.is_decimal(dtype):
        return f"pa.decimal128({dtype.precision}, {dtype.scale})"
    if pa.types.is_timestamp(dtype):
        return 'pa.timestamp("us", tz="UTC")' if dtype.tz else 'pa.timestamp("us")'
    names = {
        pa.bool_(): "bool_",
        pa.float32(): "float32",
        pa.float64(): "float64",
        pa.date32(): "date32",
    }
    return f"pa.{names.get(dtype, str(dtype))}()"


def to_arrow_text(schema: pa.Schema) -> str:
    """The schema as Python (``pa.schema([...])``) to paste into ``reader.batches(schema=)``."""
    inner = ",\n".join(f"    pa.field({f.name!r}, {_arrow_of(f.type)})" for f in schema)
    return f"pa.schema([\n{inner},\n])"


# ------------------------------------------------------------------------------ inference


def _infer(value: Any) -> pa.DataType:
    if value is None:
        return pa.null()
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64() if -(1 << 63) <= value < (1 << 63) else pa.float64()
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, str):
        return pa.string()
    if isinstance(value, list):
        element: pa.DataType = pa.null()
        for item in value:
            element = _merge(element, _infer(item))
        return pa.list_(element)
    if isinstance(value, dict):
        return pa.struct([pa.field(str(k), _infer(v)) for k, v in value.items()])
    return pa.string()


def _merge(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """The type both values fit (Spark's inference: int+float -> double, nulls -> the other,
    structs field by field, arrays by element, anything else -> string)."""
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b) or a == b:
        return a
    numbers = (pa.int64(), pa.float64())
    if a in numbers and b in numbers:
        return pa.float64()
    if pa.types.is_list(a) and pa.types.is_list(b):
        return pa.list_(_merge(a.value_type, b.value_type))
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        fields = {f.name: f.type for f in a}
        for f in b:
            fields[f.name] = _merge(fields[f.name], f.type) if f.name in fields else f.type
        return pa.struct([pa.field(name, dtype) for name, dtype in fields.items()])
    return pa.string()


def _settle(dtype: pa.DataType) -> pa.DataType:
    """Types only nulls were seen for become strings, and fields are sorted by name (Spark's
    choices: PostgreSQL's ``jsonb`` does not keep the payload's key order anyway)."""
    if pa.types.is_null(dtype):
        return pa.string()
    if pa.types.is_list(dtype):
        return pa.list_(_settle(dtype.value_type))
    if pa.types.is_struct(dtype):
        fields = sorted(dtype, key=lambda f: f.name)
        return pa.struct([pa.field(f.name, _settle(f.type)) for f in fields])
    return dtype


def infer_schema(payloads: Iterable[Any]) -> tuple[pa.Schema, int]:
    """The schema of decoded payloads, merged across them (fields sorted by name), and how
    many were not JSON objects (left out: a payload schema describes objects)."""
    merged: pa.DataType = pa.struct([])
    skipped = 0
    for payload in payloads:
        if isinstance(payload, dict):
            merged = _merge(merged, _infer(payload))
        else:
            skipped += 1
    return pa.schema(list(_settle(merged))), skipped
