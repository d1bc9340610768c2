"""`streams schema infer` against real facts: the merged schema in each format, and what it
reads (the inferred DDL types a page of the same facts without a bad row)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from click.testing import CliRunner, Result

from streams import Client
from streams.command import main
from streams.core.typed_payloads import parse_ddl, parse_spark_json


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STREAMS_DATABASE_URL", "STREAMS_REDIS_URL", "STREAMS_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STREAMS_CONNECT_TIMEOUT", "0")


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--database-url", url])


def test_infer_merges_the_latest_facts(client: Client, stream: str, streams_url: str) -> None:
    with client.writer(stream, instance="w") as writer:
        writer.append({"old": "only in the oldest fact"})
        writer.append_batch(
            [
                {"id": 1, "amount": 2, "tags": ["a"], "who": {"name": "x"}, "note": None},
                {"id": 2, "amount": 2.5, "tags": [], "who": {"age": 3}, "flag": True},
                {"id": 3, "amount": 1, "flag": "yes", "note": None},
                [1, 2],
            ]
        )
    result = cli(streams_url, "schema", "infer", stream, "--sample", "4")
    assert result.exit_code == 0, result.output
    ddl = result.stdout.strip()
    assert parse_ddl(ddl) == pa.schema(
        [
            ("amount", pa.float64()),
            ("flag", pa.string()),
            ("id", pa.int64()),
            ("note", pa.string()),
            ("tags", pa.list_(pa.string())),
            ("who", pa.struct([("age", pa.int64()), ("name", pa.string())])),
        ]
    )
    assert "1 of 4 rows are not JSON objects" in result.stderr
    as_json = cli(streams_url, "schema", "infer", stream, "--sample", "4", "--format", "json")
    assert parse_spark_json(as_json.stdout) == parse_ddl(ddl)
    assert json.loads(as_json.stdout)["type"] == "struct"
    arrow = cli(streams_url, "schema", "infer", stream, "--sample", "4", "--format", "arrow")
    assert eval(arrow.stdout, {"pa": pa}) == parse_ddl(ddl)
    # The default sample reaches the oldest fact too; the schema reads the stream's facts.
    everything = cli(streams_url, "schema", "infer", stream)
    assert everything.stdout.startswith("amount DOUBLE, flag STRING, id BIGINT, note STRING, old ")
    table = client.read_arrow(stream, schema=everything.stdout.strip(), mode="DROPMALFORMED")
    assert table.num_rows == 4  # every object parses; the non-object is dropped
    assert table.column("amount").to_pylist() == [None, 2.0, 2.5, 1.0]


def test_infer_errors(client: Client, stream: str, streams_url: str) -> None:
    empty = cli(streams_url, "schema", "infer", stream)
    assert empty.exit_code == 1 and "has no facts to sample" in empty.stderr
    unknown = cli(streams_url, "schema", "infer", "nosuch_stream_zz")
    assert unknown.exit_code == 1 and unknown.stderr.startswith("Error")
    with client.writer(stream, instance="w") as writer:
        writer.append(5)
    scalars = cli(streams_url, "schema", "infer", stream)
    assert scalars.exit_code == 1 and "no field found" in scalars.stderr
