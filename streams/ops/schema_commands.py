"""`streams schema infer NAME`: a schema to start from for typed columns.

It samples the payloads of the stream's latest facts (``--sample``, default 1000;
`streams.store.rows.sample_payloads`) and merges their types (`streams.core.typed_payloads.
infer_schema`: integers and floats make doubles, mixed types strings, objects structs, lists
arrays of their merged elements, nulls nullable) into a schema printed as a Spark DDL string
(the Spark source's ``schema`` option), a ``StructType`` JSON, or Python for
``reader.batches(schema=...)`` (``--format arrow``). Payloads that are not JSON objects are
counted on stderr and left out.
"""

from __future__ import annotations

import click

from ..cli_params import STREAM_NAME, common_options
from ..config import Settings
from ..core.payloads import decode_payload
from ..errors import UsageError
from ..store import sessions
from ..store.driver import run
from ..store.registry import check_schema, load_stream
from ..store.rows import sample_payloads

__all__ = ["schema"]


@click.group()
def schema() -> None:
    """Typed columns: `streams schema infer`."""


@schema.command(name="infer")
@click.argument("name", type=STREAM_NAME)
@click.option(
    "--sample", type=click.IntRange(1, 1_000_000), default=1000, show_default=True,
    help="How many of the latest facts to sample.",
)  # fmt: skip
@click.option(
    "--format", "fmt", type=click.Choice(["ddl", "json", "arrow"]), default="ddl",
    show_default=True,
    help="Spark DDL (the Spark source's schema option), StructType JSON, or pyarrow Python.",
)  # fmt: skip
@common_options(redis=False)
def schema_infer(
    name: str,
    sample: int,
    fmt: str,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Print a schema for the payloads of stream NAME, merged over its latest facts."""
    from ..store.arrow_reads import require_arrow

    require_arrow("streams schema infer")
    from ..core.typed_payloads import infer_schema, to_arrow_text, to_ddl, to_spark_json

    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=True, purpose="schema") as conn:
        run(conn, check_schema())
        info = run(conn, load_stream(name))
        texts = run(conn, sample_payloads(info, sample))
    if not texts:
        raise UsageError(f"stream {name!r} has no facts to sample")
    found, skipped = infer_schema(decode_payload(text) for text in texts)
    if skipped:
        click.echo(f"{skipped} of {len(texts)} rows are not JSON objects: left out", err=True)
    if len(found) == 0:
        raise UsageError(f"stream {name!r}: no field found in {len(texts)} sampled rows")
    render = {"ddl": to_ddl, "json": to_spark_json, "arrow": to_arrow_text}[fmt]
    click.echo(render(found))
