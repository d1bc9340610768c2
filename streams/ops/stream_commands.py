"""``streams create``, ``key-window``, ``tables``, ``retention``, ``prune`` and ``list``: streams
and their settings, and applying their retention.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import click

from ..cli_params import MAX_DURATION_MS, RETENTION, STREAM_NAME, Duration, common_options
from ..config import validate_stream_name
from ..core.timestamps import TimestampMode
from ..store.overview import Sort
from ..store.retention import PRUNE_BATCH
from ..types import StreamSpec
from .render import format_duration_ms
from .shared import emit, open_client
from .view_options import LIKE_PATTERN, page, truncation_note, view_options

__all__ = ["create", "drop", "key_window", "list_", "prune_", "retention", "tables"]


@click.command()
@click.argument("name", type=STREAM_NAME, required=False)
@click.option(
    "--from-file",
    "from_file",
    type=click.File("r"),
    help="Create every stream of FILE ('-': stdin): one name per line, or JSON lines or a JSON "
    "array of objects with 'name' and any of timestamping, uncapped, retention_ms, "
    "fact_tables, key_window_ms.",
)
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
@common_options(redis=False)
def create(
    name: str | None,
    from_file: IO[str] | None,
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
    """Create stream NAME (idempotent when the settings match), or every stream of
    --from-file at once."""
    if (name is None) == (from_file is None):
        raise click.UsageError("give a stream NAME or --from-file FILE (one of them)")
    if from_file is not None:
        specs = read_specs(from_file)
        with open_client(database_url, redis_url, prefix) as client:
            made = client.create_streams(specs)
        result = {
            "created": [c.info.name for c in made if c.new],
            "existed": [c.info.name for c in made if not c.new],
        }
        emit(
            result,
            as_json,
            lambda d: iter(
                [f"created {len(d['created'])} stream(s); {len(d['existed'])} existed already"]
            ),
        )
        return
    assert name is not None
    spec = StreamSpec(
        name,
        timestamping=timestamping,
        uncapped=uncapped,
        retention_ms=retention_ms,
        fact_tables=list(tables) if tables else None,
        key_window_ms=key_window_ms,
    )
    with open_client(database_url, redis_url, prefix) as client:
        (one,) = client.create_streams([spec])
    emit({**one.info.as_dict(), "created": one.new}, as_json, _stream_text)


def read_specs(source: IO[str]) -> list[StreamSpec]:
    """The streams of a `streams create --from-file` FILE: a JSON array, or lines each a name
    or a JSON object (blank lines and ``#`` comments skipped)."""
    text = source.read()
    try:
        if text.lstrip().startswith("["):
            items: list[object] = json.loads(text)
            if not isinstance(items, list):
                raise ValueError("not a JSON array")
        else:
            items = [
                json.loads(line) if line.startswith("{") else line
                for line in (raw.strip() for raw in text.splitlines())
                if line and not line.startswith("#")
            ]
        specs = [StreamSpec.parse(item) for item in items]
    except ValueError as exc:  # json.JSONDecodeError is one
        raise click.BadParameter(str(exc), param_hint="--from-file") from None
    for spec in specs:
        validate_stream_name(spec.name)
    return specs


@click.command()
@click.argument("names", nargs=-1, type=STREAM_NAME)
@click.option(
    "--like",
    type=LIKE_PATTERN,
    metavar="PATTERN",
    help="Also every stream whose name matches this SQL LIKE pattern.",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (for scripts).")
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
def drop(
    names: tuple[str, ...],
    like: str | None,
    yes: bool,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Drop streams NAMES (and those --like matches): their facts, writers, reader groups and
    idempotency keys, for good. Asks first on a terminal; scripts pass --yes."""
    if not names and like is None:
        raise click.UsageError("give stream NAMES or --like PATTERN")
    with open_client(database_url, redis_url, prefix) as client:
        known = [s.name for s in client.streams()]  # one statement, whatever their number
        targets = list(dict.fromkeys(names))
        if like is not None:
            matches = like_matcher(like)
            targets = list(dict.fromkeys([*targets, *(n for n in known if matches(n))]))
        if not yes and set(targets) & set(known):
            if not sys.stdin.isatty():
                raise click.UsageError(
                    f"dropping {len(targets)} stream(s) needs confirming: pass --yes "
                    "(no terminal to ask on)"
                )
            shown = ", ".join(targets[:10]) + (" ..." if len(targets) > 10 else "")
            click.confirm(f"Drop {len(targets)} stream(s): {shown}?", abort=True, err=True)
        dropped = client.drop_streams(targets)
    missing = [n for n in targets if n not in set(dropped)]
    emit(
        {"dropped": dropped, "missing": missing},
        as_json,
        lambda d: iter(
            [f"dropped {len(d['dropped'])} stream(s)"]
            + ([f"no such stream: {', '.join(d['missing'])}"] if d["missing"] else [])
        ),
    )


def like_matcher(pattern: str) -> Callable[[str], bool]:
    """SQL ``LIKE`` of ``pattern`` (``%``, ``_``, ``\\`` escaping either) on a name."""
    parts = []
    chars = iter(pattern)
    for c in chars:
        if c == "\\":
            parts.append(re.escape(next(chars, "\\")))
        elif c == "%":
            parts.append(".*")
        elif c == "_":
            parts.append(".")
        else:
            parts.append(re.escape(c))
    regex = re.compile("".join(parts), re.DOTALL)
    return lambda name: regex.fullmatch(name) is not None


def _stream_text(d: dict[str, Any]) -> Iterator[str]:
    tables = ", ".join(d["fact_tables"]) or "none"
    retention = "forever" if d["retention_ms"] is None else f"{d['retention_ms']} ms"
    yield (
        f"stream {d['name']}: timestamping {d['timestamping']}"
        f"{' uncapped' if d['uncapped'] else ''}, retention {retention}, "
        f"key window {format_duration_ms(d['key_window_ms'])}, "
        f"fact tables besides streams_facts: {tables}"
        + ("" if d.get("created", True) else " (exists already)")
    )


@click.command(name="key-window")
@click.argument("name", type=STREAM_NAME)
@click.argument("window", required=False, metavar="[DURATION]", type=Duration(min_ms=1))
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
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
@common_options(redis=False)
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
@common_options(redis=False)
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
@common_options(redis=False)
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
                raise SystemExit(130) from None  # interrupted, as shells expect of Ctrl-C


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
@view_options
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
def list_(
    like: str | None,
    limit: int | None,
    sort: Sort,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """List streams with their linear position, max allocated ID, live writers, reader groups
    and their largest lag (all streams at once, whatever their number)."""
    with open_client(database_url, redis_url, prefix) as client:
        found = client.overview(like, limit=page(limit, as_json), sort=sort)
    data = [
        {
            **s.info.as_dict(),
            "linear": s.positions.linear,
            "max_allocated": s.positions.max_allocated,
            "writers": s.live_writers,
            "groups": len(s.positions.groups),
            "lag": s.lag,
        }
        for s in found.streams
    ]

    def text(rows: list[dict[str, Any]]) -> Iterator[str]:
        yield (
            f"{'STREAM':<24} {'LINEAR':>12} {'MAX ALLOC':>12} {'WRITERS':>7} {'GROUPS':>6} "
            f"{'LAG':>10}  TIMESTAMPING"
        )
        for r in rows:
            yield (
                f"{r['name']:<24} {r['linear']:>12} {r['max_allocated']:>12} {r['writers']:>7} "
                f"{r['groups']:>6} {r['lag']:>10}  "
                f"{r['timestamping']}{' uncapped' if r['uncapped'] else ''}"
            )
        note = truncation_note(found)
        if note:
            yield note

    emit(data, as_json, text)
