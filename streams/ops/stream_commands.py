"""``streams create``, ``key-window``, ``tables``, ``retention``, ``prune`` and ``list``: streams
and their settings, and applying their retention.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import click

from ..cli_params import MAX_DURATION_MS, RETENTION, STREAM_NAME, Duration, common_options
from ..core.timestamps import TimestampMode
from ..store.retention import PRUNE_BATCH
from .render import format_duration_ms
from .shared import emit, open_client

__all__ = ["create", "key_window", "list_", "prune_", "retention", "tables"]


@click.command()
@click.argument("name", type=STREAM_NAME)
@click.option(
    "--timestamping",
    type=click.Choice([m.value for m in TimestampMode]),
    default=TimestampMode.CLIENT_PREFER.value,
    show_default=True,
)
@click.option("--uncapped", is_flag=True, help="Do not cap client timestamps at arrival time.")
@click.option(
    "--retention",
    "retention_ms",
    type=click.IntRange(1, MAX_DURATION_MS),
    help="Retention in ms.",
)
@click.option(
    "--key-window",
    "key_window_ms",
    type=Duration(min_ms=1),
    help="How long an append's idempotency key names it (e.g. 24h, the default; 30m).",
)
@click.option(
    "--table",
    "tables",
    multiple=True,
    metavar="TABLE.COLUMN",
    help=(
        "A user table holding facts of this stream, and its stream-ID column (repeatable); "
        "\"TABLE.COLUMN WHERE KEY = 'VALUE'\" for a table several streams share."
    ),
)
@click.option("--json", "as_json", is_flag=True)
@common_options
def create(
    name: str,
    timestamping: str,
    uncapped: bool,
    retention_ms: int | None,
    key_window_ms: int | None,
    tables: tuple[str, ...],
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Create a stream (idempotent when the settings match)."""
    with open_client(database_url, redis_url, prefix) as client:
        info = client.create_stream(
            name,
            timestamping=timestamping,
            uncapped=uncapped,
            retention_ms=retention_ms,
            fact_tables=list(tables) if tables else None,
            key_window_ms=key_window_ms,
        )
    emit(info.as_dict(), as_json, _stream_text)


def _stream_text(d: dict[str, Any]) -> Iterator[str]:
    tables = ", ".join(d["fact_tables"]) or "none"
    retention = "forever" if d["retention_ms"] is None else f"{d['retention_ms']} ms"
    yield (
        f"stream {d['name']}: timestamping {d['timestamping']}"
        f"{' uncapped' if d['uncapped'] else ''}, retention {retention}, "
        f"key window {format_duration_ms(d['key_window_ms'])}, "
        f"fact tables besides streams_facts: {tables}"
    )


@click.command(name="key-window")
@click.argument("name", type=STREAM_NAME)
@click.argument("window", required=False, metavar="[DURATION]", type=Duration(min_ms=1))
@click.option("--json", "as_json", is_flag=True)
@common_options
def key_window(
    name: str,
    window: int | None,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Show or set how long an append's idempotency key names it on stream NAME (24h, 30m).

    A keyed append whose key was written within the window returns the original acknowledgement
    and writes nothing; `streams prune` removes older keys.
    """
    with open_client(database_url, redis_url, prefix) as client:
        info = client.stream(name) if window is None else client.set_key_window(name, window)
    emit(info.as_dict(), as_json, _stream_text)


@click.command()
@click.argument("name", type=STREAM_NAME)
@click.argument("tables", nargs=-1, metavar="[\"TABLE.COLUMN [WHERE KEY = 'VALUE']\"]...")
@click.option("--clear", is_flag=True, help="Declare no user tables.")
@click.option("--json", "as_json", is_flag=True)
@common_options
def tables(
    name: str,
    tables: tuple[str, ...],
    clear: bool,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Show or declare the user tables that hold facts of stream NAME (besides streams_facts).

    Sequence repair (a writer starting, `streams doctor --repair`) moves the sequence past the
    largest ID in each of them; IDs in an undeclared table cannot be seen.
    """
    if clear and tables:
        raise click.UsageError("give tables or --clear, not both")
    with open_client(database_url, redis_url, prefix) as client:
        if tables or clear:
            info = client.set_fact_tables(name, list(tables))
        else:
            info = client.stream(name)
    emit(info.as_dict(), as_json, _stream_text)


@click.command()
@click.argument("name", type=STREAM_NAME)
@click.argument("keep", required=False, metavar="[DURATION|forever]", type=RETENTION)
@click.option("--json", "as_json", is_flag=True)
@common_options
def retention(
    name: str,
    keep: str | int | None,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Show or set how long stream NAME keeps its facts: a duration (7d, 12h, 30m) or forever.

    `streams prune` applies it; it never removes facts a reader group has not committed.
    """
    with open_client(database_url, redis_url, prefix) as client:
        if keep is None:
            info = client.stream(name)
        else:
            info = client.set_retention(name, None if keep == "forever" else int(keep))
    emit(info.as_dict(), as_json, _stream_text)


@click.command(name="prune")
@click.argument("streams", nargs=-1, type=STREAM_NAME)
@click.option(
    "--batch",
    type=click.IntRange(1, 10_000_000),
    default=PRUNE_BATCH,
    show_default=True,
    help="Rows removed per transaction.",
)
@click.option(
    "--every",
    type=Duration(min_ms=100),
    help="Keep pruning at this interval (e.g. 1m) until interrupted.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON lines, one per stream and round.")
@common_options
def prune_(
    streams: tuple[str, ...],
    batch: int,
    every: int | None,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Apply retention: remove facts older than each stream's retention (default: every
    stream), in short transactions, never past a reader group's position; and idempotency
    keys older than each stream's key window."""
    interval = None if every is None else every / 1000
    with open_client(database_url, redis_url, prefix) as client:
        while True:
            # Every stream by default: each may have idempotency keys past its key window.
            names = list(streams) or [s.name for s in client.streams()]
            for name in names:
                emit(client.prune(name, batch=batch).as_dict(), as_json, _prune_text)
            if interval is None:
                return
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return


def _prune_text(d: dict[str, Any]) -> Iterator[str]:
    moved = d["pruned_through"] - d["pruned_through_before"]
    done = (
        f"removed {d['rows_deleted']:,} row(s) in {d['transactions']} transaction(s)"
        if moved
        else "nothing to remove"
    )
    yield (
        f"{d['stream']}: pruned through {d['pruned_through']} ({done}); "
        f"retention allows {d['target']}, held by: {d['limited_by']}"
    )


@click.command(name="list")
@click.option("--json", "as_json", is_flag=True)
@common_options
def list_(
    as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """List streams with their linear position and max allocated ID."""
    with open_client(database_url, redis_url, prefix) as client:
        data = []
        for info in client.streams():
            positions = client.positions(info.name)
            data.append(
                {
                    **info.as_dict(),
                    "linear": positions.linear,
                    "max_allocated": positions.max_allocated,
                }
            )

    def text(rows: list[dict[str, Any]]) -> Iterator[str]:
        yield f"{'STREAM':<24} {'LINEAR':>12} {'MAX ALLOC':>12}  TIMESTAMPING"
        for r in rows:
            yield (
                f"{r['name']:<24} {r['linear']:>12} {r['max_allocated']:>12}  "
                f"{r['timestamping']}{' uncapped' if r['uncapped'] else ''}"
            )

    emit(data, as_json, text)
