"""The operator's commands of the `streams` command line (`ops`): `streams.command` composes
them with the benchmarks (``streams bench``) into the ``streams`` command.

Every command takes ``--database-url``, ``--redis-url`` and ``--prefix`` (defaulting to
``STREAMS_DATABASE_URL``, ``STREAMS_REDIS_URL``, ``STREAMS_PREFIX``). Listing commands take
``--json`` and print one JSON document (``read`` prints JSON lines), so scripts can rely on
them. Errors print one line on stderr and exit 1; URLs are always shown redacted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
from click.core import ParameterSource

from ..cli_params import (
    DURATION,
    GROUP_NAME,
    INSTANCE_NAME,
    MAX_DURATION_MS,
    MAX_ID,
    MAX_READABLE_MS,
    RETENTION,
    STREAM_ID,
    STREAM_NAME,
    Duration,
    FiniteFloat,
    ListenAddress,
    common_options,
    read_url_option,
)
from ..client import Client, connect
from ..config import Settings, redact_url
from ..core.epochs import Fact
from ..core.staleness import STALE_AFTER_MS
from ..core.timestamps import MAX_TIMESTAMP, TimestampMode
from ..reader import Reader
from ..store import sessions
from ..store.driver import run
from ..store.reader_core import Start
from ..store.registry import check_schema
from ..store.retention import PRUNE_BATCH
from ..types import StreamPositions
from .failover_commands import failover
from .group_commands import groups
from .incarnation_commands import incarnation
from .render import (
    Table,
    format_duration_ms,
    positions_tables,
    print_tables,
    render_plain,
    rich_renderable,
    timestamp,
)
from .role_commands import roles
from .schema_commands import schema


def _settings(database_url: str | None, redis_url: str | None, prefix: str | None) -> Settings:
    return Settings.resolve(database_url, redis_url, prefix)


def _client(database_url: str | None, redis_url: str | None, prefix: str | None) -> Client:
    return connect(database_url, redis_url, prefix)


def _emit(data: Any, as_json: bool, text: Callable[[Any], Iterator[str]]) -> None:
    if as_json:
        click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
    else:
        for line in text(data):
            click.echo(line)


#: Every command of ``streams`` but ``bench``, gathered for `streams.command`.
ops = click.Group("ops")


@ops.command()
@common_options
def migrate(database_url: str | None, redis_url: str | None, prefix: str | None) -> None:
    """Upgrade the database schema to this version's head (idempotent)."""
    from ..migrate import current_revision, upgrade

    settings = _settings(database_url, redis_url, prefix)
    upgrade(settings.database_url)
    click.echo(
        f"{redact_url(settings.database_url)}: schema at {current_revision(settings.database_url)}"
    )


@ops.command()
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
    with _client(database_url, redis_url, prefix) as client:
        info = client.create_stream(
            name,
            timestamping=timestamping,
            uncapped=uncapped,
            retention_ms=retention_ms,
            fact_tables=list(tables) if tables else None,
            key_window_ms=key_window_ms,
        )
    _emit(info.as_dict(), as_json, _stream_text)


def _stream_text(d: dict[str, Any]) -> Iterator[str]:
    tables = ", ".join(d["fact_tables"]) or "none"
    retention = "forever" if d["retention_ms"] is None else f"{d['retention_ms']} ms"
    yield (
        f"stream {d['name']}: timestamping {d['timestamping']}"
        f"{' uncapped' if d['uncapped'] else ''}, retention {retention}, "
        f"key window {format_duration_ms(d['key_window_ms'])}, "
        f"fact tables besides streams_facts: {tables}"
    )


@ops.command(name="key-window")
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
    with _client(database_url, redis_url, prefix) as client:
        info = client.stream(name) if window is None else client.set_key_window(name, window)
    _emit(info.as_dict(), as_json, _stream_text)


@ops.command()
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
    with _client(database_url, redis_url, prefix) as client:
        if tables or clear:
            info = client.set_fact_tables(name, list(tables))
        else:
            info = client.stream(name)
    _emit(info.as_dict(), as_json, _stream_text)


@ops.command()
@click.argument("action", type=click.Choice(["list", "rotate"]), default="list")
@click.option("--json", "as_json", is_flag=True)
@common_options
def keys(
    action: str, as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """List the replication keys (never their secrets), or rotate them: add a key and retire
    the others.

    The elected prober signs the facts it publishes on Redis with the newest key's private
    seed (schema streams_prover, readable by the prover role only) and seals their payloads
    with its cipher key; readers deliver them without PostgreSQL only if the signature checks
    under a live key of their database incarnation. Rotate after a seed may have leaked (the
    server makes the new secrets; rotating needs the right to write the key tables). With
    Redis, a KEYS line makes readers and provers read the keys again at once; others follow
    within 30 s. After a restore or a failover the prover makes a new key by itself.
    """
    with _client(database_url, redis_url, prefix) as client:
        if action == "rotate":
            new = client.rotate_replication_keys()
            _emit({"rotated": True, "key": new}, as_json, lambda d: iter([f"new key {d['key']}; "
                  "every other key is retired"]))  # fmt: skip
            return
        listed = [
            {**k, "created_at": _iso(k["created_at"]), "retired_at": _iso(k["retired_at"])}
            for k in client.replication_keys()
        ]
    _emit(listed, as_json, _keys_text)


def _iso(value: object) -> str | None:
    return None if value is None else value.isoformat()  # type: ignore[attr-defined]


def _keys_text(keys: list[dict[str, Any]]) -> Iterator[str]:
    for k in keys:
        state = "live" if k["live"] else f"retired {k['retired_at']}"
        yield f"key {k['id']}: created {k['created_at']}, {state}, incarnation {k['incarnation']}"


@ops.command()
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
    with _client(database_url, redis_url, prefix) as client:
        if keep is None:
            info = client.stream(name)
        else:
            info = client.set_retention(name, None if keep == "forever" else int(keep))
    _emit(info.as_dict(), as_json, _stream_text)


@ops.command(name="prune")
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
    with _client(database_url, redis_url, prefix) as client:
        while True:
            # Every stream by default: each may have idempotency keys past its key window.
            names = list(streams) or [s.name for s in client.streams()]
            for name in names:
                _emit(client.prune(name, batch=batch).as_dict(), as_json, _prune_text)
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


@ops.command(name="list")
@click.option("--json", "as_json", is_flag=True)
@common_options
def list_(
    as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """List streams with their linear position and max allocated ID."""
    with _client(database_url, redis_url, prefix) as client:
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

    _emit(data, as_json, text)


@ops.command()
@click.argument("stream", type=STREAM_NAME)
@click.argument("payloads", nargs=-1)
@click.option(
    "--instance", type=INSTANCE_NAME, help="Writer instance name (default: <host>-<pid>)."
)
@click.option(
    "--timestamp",
    type=click.IntRange(0, MAX_TIMESTAMP),
    help="Client timestamp (ms since the Unix epoch).",
)
@click.option("--json", "as_json", is_flag=True)
@common_options
def append(
    stream: str,
    payloads: tuple[str, ...],
    instance: str | None,
    timestamp: int | None,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Append facts: each PAYLOAD is a JSON document (or read JSON lines from stdin)."""
    if not payloads and _stdin_terminal():
        raise click.UsageError(
            "no payloads: give JSON documents as arguments, or pipe JSON lines into stdin "
            "(e.g. `echo '{\"n\": 1}' | streams append NAME`)"
        )
    texts = list(payloads) or [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not texts:
        raise click.UsageError("no payloads given (arguments or JSON lines on stdin)")
    try:
        values = [json.loads(t) for t in texts]
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"payload is not JSON: {exc}") from None
    except RecursionError:
        raise click.UsageError(
            "payload is not JSON this library can take: nested too deeply"
        ) from None
    with (
        _client(database_url, redis_url, prefix) as client,
        client.writer(stream, instance=instance) as writer,
    ):
        stamps = [timestamp] * len(values)
        ack = writer.append_batch(values, timestamps=stamps)
    data = {
        "first_id": ack.first_id,
        "last_id": ack.last_id,
        "count": ack.count,
        "first_timestamp": ack.first_timestamp,
        "last_timestamp": ack.last_timestamp,
    }
    _emit(
        data,
        as_json,
        lambda d: iter([f"appended {d['count']} fact(s): ids {d['first_id']}..{d['last_id']}"]),
    )


@ops.command()
@click.argument("stream", type=STREAM_NAME)
@click.option("--from-id", type=STREAM_ID, help="First stream ID to read.")
@click.option(
    "--from-time",
    type=click.IntRange(0, MAX_READABLE_MS),
    help="First fact with timestamp >= ms.",
)
@click.option("--ago", type=DURATION, help="Start at a duration ago, e.g. 5m, 1h.")
@click.option("--latest", is_flag=True, help="Start after the facts complete now (with --follow).")
@click.option("--group", type=GROUP_NAME, help="Reader group: resume after its committed position.")
@click.option("--commit", "commit_group", is_flag=True, help="Commit the group's position.")
@click.option("--follow", "-f", is_flag=True, help="Keep reading new facts (Ctrl-C stops).")
@click.option("--limit", type=click.IntRange(1, MAX_ID), default=None, help="Stop after N rows.")
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "json"]),
    default=None,
    help="table (human timestamps; the default) or json (JSON lines).",
)
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@read_url_option
@common_options
def read(
    stream: str,
    from_id: int | None,
    from_time: int | None,
    ago: int | None,
    latest: bool,
    group: str | None,
    commit_group: bool,
    follow: bool,
    limit: int | None,
    output_format: str | None,
    as_json: bool,
    read_database_url: str | None,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Read completed facts in stream-ID order, one line per row (``--follow`` to tail).

    Only facts PostgreSQL proves complete are shown: nothing at or above a pending ID. Timestamps
    are shown as readers see them: raised to the running maximum in ID order. Without --follow
    and --limit, reads until caught up; --limit defaults to 100 rows without --follow.
    """
    if sum(x is not None for x in (from_id, from_time, ago)) + latest > 1:
        raise click.UsageError("give at most one of --from-id, --from-time, --ago, --latest")
    if commit_group and group is None:
        raise click.UsageError("--commit needs --group")
    if as_json and output_format == "table":
        raise click.UsageError("--json and --format table contradict each other")
    as_json = as_json or output_format == "json"
    start: Start = "latest" if latest else "earliest"
    if from_id is not None:
        start = from_id
    elif from_time is not None:
        start = dt.datetime.fromtimestamp(from_time / 1000, dt.UTC)
    elif ago is not None:
        start = dt.timedelta(milliseconds=ago)
    if limit is None and not follow:
        limit = 100
    shown = 0
    with (
        connect(database_url, redis_url, prefix, read_database_url=read_database_url) as client,
        client.reader(stream, start=start, group=group) as reader,
    ):
        epochs = iter(reader) if follow else reader.epochs()
        progress = contextlib.ExitStack()
        if not follow and sys.stderr.isatty() and not sys.stdout.isatty():
            epochs = _with_progress(progress, reader, stream, epochs)
        # The last fact printed whole, when a limit or Ctrl-C stops inside an epoch: --commit
        # commits exactly what was printed, never more (the rest comes again next time).
        printed: Fact | None = None
        try:
            for epoch in epochs:
                for fact in epoch.facts:
                    if limit is not None and shown + len(fact.payloads) > limit:
                        for row_no, payload in enumerate(fact.payloads[: limit - shown]):
                            _print_row(fact, row_no, payload, as_json)
                        _commit_through(reader, printed, commit_group)
                        return
                    for row_no, payload in enumerate(fact.payloads):
                        _print_row(fact, row_no, payload, as_json)
                    shown += len(fact.payloads)
                    printed = fact
                if commit_group:
                    reader.commit()  # the whole epoch, gaps after its last fact included
                printed = None
                if limit is not None and shown >= limit:
                    return
        except KeyboardInterrupt:
            _commit_through(reader, printed, commit_group)
            return
        finally:
            progress.close()


def _with_progress(
    stack: contextlib.ExitStack, reader: Reader, stream: str, epochs: Iterator[Any]
) -> Iterator[Any]:
    """A progress bar on stderr (a terminal) while the rows go to a pipe or a file: position
    against the complete position the reader aims at."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    bar = stack.enter_context(
        Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
    )
    start = reader.position(stream)
    task = bar.add_task(f"reading {stream}", total=max(1, reader.core.target(stream) - start))
    for epoch in epochs:
        total = max(1, reader.core.target(stream) - start)
        bar.update(task, completed=reader.position(stream) - start, total=total)
        yield epoch


def _commit_through(reader: Reader, printed: Fact | None, commit_group: bool) -> None:
    if commit_group and printed is not None:
        reader.commit(through=printed)


def _print_row(fact: Fact, row_no: int, payload: Any, as_json: bool) -> None:
    if as_json:
        record = {
            "stream_id": fact.stream_id,
            "row": row_no,
            "instance": fact.instance,
            "timestamp": fact.timestamp,
            "payload": payload,
        }
        click.echo(json.dumps(record, sort_keys=True, separators=(",", ":")))
    else:
        click.echo(
            f"{fact.stream_id:>10}  {timestamp(fact.timestamp)}  {fact.instance:<20} "
            f"{json.dumps(payload, ensure_ascii=False)}"
        )


def _terminal() -> bool:
    return sys.stdout.isatty()


def _stdin_terminal() -> bool:
    return sys.stdin.isatty()


def _read_positions(
    client: Client, streams: tuple[str, ...], stale_after_ms: int = STALE_AFTER_MS
) -> list[StreamPositions]:
    names = list(streams) or [s.name for s in client.streams()]
    return [client.positions(name, stale_after_ms=stale_after_ms) for name in names]


#: ``--stale-after``, shared by `streams positions` and `streams doctor` (and `streams groups`).
_STALE_AFTER = click.option(
    "--stale-after",
    type=DURATION,
    default=f"{STALE_AFTER_MS // 86_400_000}d",
    show_default=True,
    help="A reader group that has not committed for this long while holding retention back "
    "is stale (e.g. 12h, 7d).",
)


@ops.command()
@click.argument("streams", nargs=-1, type=STREAM_NAME)
@click.option("--watch", "-w", is_flag=True, help="Redraw every --interval until Ctrl-C.")
@click.option("--interval", type=FiniteFloat(0.05, 86_400), default=1.0, show_default=True)
@click.option("--count", type=click.IntRange(1, MAX_ID), help="With --watch: stop after N samples.")
@click.option("--all", "show_all", is_flag=True, help="Also list retired writers.")
@click.option(
    "--from-redis",
    is_flag=True,
    help="No database: ask every deployment on the channel (REPLICATE) for its positions.",
)
@_STALE_AFTER
@click.option("--json", "as_json", is_flag=True)
@common_options
def positions(
    streams: tuple[str, ...],
    watch: bool,
    interval: float,
    count: int | None,
    show_all: bool,
    from_redis: bool,
    stale_after: int,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Linear position, max allocated, scratchpad and its oldest pending ID; each writer's
    position, pending IDs, state and heartbeat; each reader group's (and Spark query's) position,
    lag and time since its last commit, stale when that passes --stale-after while it holds
    retention back (all streams by default; retired writers folded unless --all)."""
    if from_redis:
        _positions_from_redis(streams, redis_url, prefix, as_json)
        return
    with _client(database_url, redis_url, prefix) as client:
        if not watch:
            items = _read_positions(client, streams, stale_after)
            if as_json:
                data = [p.as_dict(retired=show_all) for p in items]
                click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
            else:
                print_tables(positions_tables(items, show_all), sys.stdout, terminal=_terminal())
            return
        _watch_positions(client, streams, show_all, interval, count, as_json, stale_after)


def _watch_positions(
    client: Client,
    streams: tuple[str, ...],
    show_all: bool,
    interval: float,
    count: int | None,
    as_json: bool,
    stale_after_ms: int,
) -> None:
    rates: dict[str, list[float]] = {}
    previous: dict[str, tuple[float, int]] = {}
    live: Any = None
    if _terminal() and not as_json:
        from rich.live import Live

        live = Live(auto_refresh=False)
        live.start()
    samples = 0
    try:
        while True:
            now = time.monotonic()
            items = _read_positions(client, streams, stale_after_ms)
            for p in items:
                if p.stream in previous:
                    then, linear = previous[p.stream]
                    rate = (p.linear - linear) / max(now - then, 1e-6)
                    rates.setdefault(p.stream, []).append(max(0.0, rate))
                previous[p.stream] = (now, p.linear)
            if as_json:
                data = [
                    {**p.as_dict(retired=show_all), "rate": _last(rates.get(p.stream))}
                    for p in items
                ]
                click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
            elif live is not None:
                live.update(rich_renderable(positions_tables(items, show_all, rates)), refresh=True)
            else:
                click.echo(render_plain(positions_tables(items, show_all, rates)) + "\n")
            samples += 1
            if count is not None and samples >= count:
                return
            time.sleep(max(0.0, interval - (time.monotonic() - now)))
    except KeyboardInterrupt:
        return
    finally:
        if live is not None:
            live.stop()


def _last(values: list[float] | None) -> float | None:
    return values[-1] if values else None


def _positions_from_redis(
    streams: tuple[str, ...], redis_url: str | None, prefix: str | None, as_json: bool
) -> None:
    from ..config import DEFAULT_PREFIX, validate_redis_url
    from .channel import observe_channel

    if not redis_url:
        raise click.UsageError("--from-redis needs --redis-url (or STREAMS_REDIS_URL)")
    validate_redis_url(redis_url)
    report = observe_channel(redis_url, prefix or DEFAULT_PREFIX)
    rows = [p for p in report.positions if not streams or p.stream in streams]
    if as_json:
        click.echo(json.dumps(report.as_dict(), sort_keys=True, separators=(",", ":")))
    else:
        table = Table(
            f"positions heard on {report.prefix!r}",
            ["STREAM", "INSTANCE", "POSITION", "ANSWER_MS"],
            numeric=frozenset({"POSITION", "ANSWER_MS"}),
        )
        table.rows = [[p.stream, p.instance, str(p.new_token), str(p.ms)] for p in rows]
        print_tables([table], sys.stdout, terminal=_terminal())
        if report.foreign is not None:
            click.echo(report.foreign.describe(report.prefix), err=True)
    if not rows:
        raise click.ClickException(
            f"no POSITION answered REPLICATE on {report.prefix!r} within "
            f"{report.elapsed_ms} ms ({report.receivers} receiver(s) on the channel)"
        )


@ops.group()
def writers() -> None:
    """Writer rows: `streams writers prune`."""


@writers.command(name="prune")
@click.argument("streams", nargs=-1, type=STREAM_NAME)
@click.option(
    "--older-than",
    type=DURATION,
    default="1d",
    show_default=True,
    help="Remove retired writers whose last heartbeat is older than this (e.g. 1h, 7d).",
)
@click.option("--json", "as_json", is_flag=True)
@common_options
def writers_prune(
    streams: tuple[str, ...],
    older_than: int,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Remove retired writers' rows (every `streams append` registers one). Safe: a retired
    writer stays fenced without its row."""
    with _client(database_url, redis_url, prefix) as client:
        pruned = {
            name: client.prune_writers(name, older_than)
            for name in (list(streams) or [s.name for s in client.streams()])
        }
    _emit(
        {name: gone for name, gone in pruned.items() if gone},
        as_json,
        lambda d: iter(
            [f"pruned {sum(len(v) for v in d.values())} retired writer(s)"]
            + [f"  {name}: {', '.join(v)}" for name, v in d.items()]
        ),
    )


@ops.command()
@click.option(
    "--repair",
    is_flag=True,
    help="Do what is safe first: retire expired writers, end sessions holding a stream back "
    "past the lease, repair sequences behind used IDs.",
)
@_STALE_AFTER
@click.option(
    "--lease",
    type=Duration(min_ms=500, max_ms=3_600_000),
    default="10s",
    show_default=True,
    help="The lease your services use: no session may hold a stream back longer than the "
    "longest of it and the stream's writers' leases (--repair ends those that have).",
)
@click.option("--json", "as_json", is_flag=True)
@common_options
def doctor(
    repair: bool,
    stale_after: int,
    lease: int,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Check connectivity, schema, sequences, declared tables, sessions holding a stream back
    (writers or not: role, application, address), writer leases, retention (reader groups
    that lost facts, or are stale: no commit for --stale-after while holding retention back)
    and the replication channel; exit 1 on any problem."""
    from .doctor import diagnose
    from .doctor import repair as do_repair

    settings = Settings.resolve(database_url, redis_url, prefix, lease_seconds=lease / 1000)
    actions = do_repair(settings) if repair else []
    checks = diagnose(settings, stale_after_ms=stale_after)
    if as_json:
        data: Any = [c.as_dict() for c in checks]
        if repair:
            data = {"repaired": actions, "checks": data}
        click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
    else:
        for action in actions:
            click.echo(f"[repaired] {action}")
        for c in checks:
            click.echo(f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    if not all(c.ok for c in checks):
        sys.exit(1)


@ops.group()
def metrics() -> None:
    """Prometheus metrics (needs `pip install 'streams[metrics]'`)."""


@metrics.command(name="serve")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=9464, show_default=True)
@click.option("--addr", default="127.0.0.1", show_default=True, help="Address to listen on.")
@common_options
def metrics_serve(
    port: int, addr: str, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """Serve stream-level figures of one database on http://ADDR:PORT/metrics (linear
    position, max allocated, scratchpad, oldest pending ID and who holds it, writers, group
    lag and the retention groups hold back, connections per role), read at each scrape; runs
    until Ctrl-C. The database is read once at start (exit 1 if it cannot be: a wrong URL
    must not look like an outage); later, a scrape that cannot read it reports
    streams_database_up 0."""
    from ..metrics import serve

    settings = _settings(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=True, purpose="metrics") as conn:
        run(conn, check_schema())
    try:
        server = serve(settings, port, addr)
    except OSError as exc:  # a bad address, a port in use or not ours to take
        reason = exc.strerror or type(exc).__name__
        raise click.ClickException(f"cannot listen on {addr!r} port {port}: {reason}") from None
    host, bound = server.server_address[:2]
    click.echo(
        f"serving metrics of {redact_url(settings.database_url)} on http://{host}:{bound}/metrics"
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()


ops.add_command(groups)
ops.add_command(incarnation)
ops.add_command(failover)
ops.add_command(roles)
ops.add_command(schema)


@contextlib.contextmanager
def _demo_metrics(addr: str, port: int) -> Iterator[Any]:
    """A Prometheus registry served on ``addr:port`` while the demo runs (bound before it
    starts: a bad address fails the command at once)."""
    from ..metrics import serve_registry

    try:
        registry, server = serve_registry(port, addr)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise click.ClickException(f"cannot listen on {addr!r} port {port}: {reason}") from None
    host, bound = server.server_address[:2]
    click.echo(f"serving the demo's metrics on http://{host}:{bound}/metrics", err=True)
    try:
        yield registry
    finally:
        server.shutdown()
        server.server_close()


@ops.command()
@click.option(
    "--duration", type=FiniteFloat(0.5, 86_400), default=30.0, show_default=True,
    help="Seconds to run (Ctrl-C stops earlier).",
)  # fmt: skip
@click.option("--writers", "writer_count", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option(
    "--rate", type=FiniteFloat(1, 10_000), default=50.0, show_default=True,
    help="Facts/s per writer process.",
)  # fmt: skip
@click.option(
    "--no-spark", is_flag=True, help="Only the Python reader (for a machine without Java)."
)
@click.option(
    "--metrics", "metrics_at", type=ListenAddress(), default=None,
    help="Serve the Python reader's Prometheus metrics (its Redis link, what it read and "
    "rejected) on http://ADDR:PORT/metrics (needs streams[metrics]).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@common_options
def demo(
    duration: float,
    writer_count: int,
    rate: float,
    no_spark: bool,
    metrics_at: tuple[str, int] | None,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """The main job, end to end: writer processes append (single facts, batches, multi-row facts
    in a user table) while a Python reader group and a Spark query consume epochs; a live view;
    then a summary that checks every fact was delivered exactly once, whole, in order, to both
    (exit 1 if not). With no database URL configured, runs on embedded servers (./.streams/)."""
    from ..migrate import upgrade
    from .demo import print_summary, run_demo

    settings = _settings(database_url, redis_url, prefix)
    with contextlib.ExitStack() as stack:
        registry = None if metrics_at is None else stack.enter_context(_demo_metrics(*metrics_at))
        upgrade(settings.database_url)
        click.echo(f"database {redact_url(settings.database_url)}", err=True)
        result = run_demo(
            settings,
            duration=duration,
            writers=writer_count,
            rate=rate,
            spark=not no_spark,
            terminal=_terminal() and not as_json,
            out=lambda line: click.echo(line, err=True),
            metrics=registry,
        )
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True, separators=(",", ":")))
    else:
        print_summary(result, lambda line: click.echo(line, err=True), _terminal())
        name = result.stream
        ctx = click.get_current_context()
        # The servers stopped with the demo: later commands must ask for them again.
        again = (
            " --embedded"
            if ctx.get_parameter_source("database_url") is ParameterSource.DEFAULT
            else ""
        )
        click.echo(
            f"now try: streams positions {name}{again}   or   streams read {name} --limit 5{again}"
        )
    if not result.ok:
        sys.exit(1)
