"""The `streams` command line (also ``python -m streams``).

Every command takes ``--database-url``, ``--redis-url`` and ``--prefix`` (defaulting to
``STREAMS_DATABASE_URL``, ``STREAMS_REDIS_URL``, ``STREAMS_PREFIX``). Listing commands take
``--json`` and print one JSON document (``read`` prints JSON lines), so scripts can rely on
them. Errors print one line on stderr and exit 1; URLs are always shown redacted.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click
import psycopg

from . import __version__
from .client import Client, connect
from .config import Settings, redact_url
from .epochs import Fact
from .errors import StreamsError
from .reader import Reader, Start
from .timestamps import TimestampMode

F = TypeVar("F", bound=Callable[..., Any])


def _common(func: F) -> F:
    @click.option("--database-url", envvar="STREAMS_DATABASE_URL", help="postgresql:// URL")
    @click.option("--redis-url", envvar="STREAMS_REDIS_URL", help="redis:// or rediss:// URL")
    @click.option("--prefix", envvar="STREAMS_PREFIX", default=None, help="Redis channel prefix")
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except StreamsError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
        except psycopg.Error as exc:
            # Server messages never contain the connection password; name the class only.
            raise click.ClickException(f"StoreError: {type(exc).__name__}") from None

    return wrapper  # type: ignore[return-value]


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


@click.group()
@click.version_option(__version__, prog_name="streams")
def main() -> None:
    """Ordered multi-writer fact streams on PostgreSQL (Redis for the fast path)."""


@main.command()
@_common
def migrate(database_url: str | None, redis_url: str | None, prefix: str | None) -> None:
    """Upgrade the database schema to this version's head (idempotent)."""
    from .migrate import current_revision, upgrade

    settings = _settings(database_url, redis_url, prefix)
    upgrade(settings.database_url)
    click.echo(
        f"{redact_url(settings.database_url)}: schema at {current_revision(settings.database_url)}"
    )


@main.command()
@click.argument("name")
@click.option(
    "--timestamping",
    type=click.Choice([m.value for m in TimestampMode]),
    default=TimestampMode.CLIENT_PREFER.value,
    show_default=True,
)
@click.option("--uncapped", is_flag=True, help="Do not cap client timestamps at arrival time.")
@click.option("--retention", "retention_ms", type=click.IntRange(min=1), help="Retention in ms.")
@click.option(
    "--table",
    "tables",
    multiple=True,
    metavar="TABLE.COLUMN",
    help="A user table holding facts of this stream, and its stream-ID column (repeatable).",
)
@click.option("--json", "as_json", is_flag=True)
@_common
def create(
    name: str,
    timestamping: str,
    uncapped: bool,
    retention_ms: int | None,
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
        )
    _emit(info.as_dict(), as_json, _stream_text)


def _stream_text(d: dict[str, Any]) -> Iterator[str]:
    tables = ", ".join(d["fact_tables"]) or "none"
    retention = "forever" if d["retention_ms"] is None else f"{d['retention_ms']} ms"
    yield (
        f"stream {d['name']}: timestamping {d['timestamping']}"
        f"{' uncapped' if d['uncapped'] else ''}, retention {retention}, "
        f"fact tables besides streams_facts: {tables}"
    )


@main.command()
@click.argument("name")
@click.argument("tables", nargs=-1, metavar="[TABLE.COLUMN]...")
@click.option("--clear", is_flag=True, help="Declare no user tables.")
@click.option("--json", "as_json", is_flag=True)
@_common
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


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True)
@_common
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


@main.command()
@click.argument("stream")
@click.argument("payloads", nargs=-1)
@click.option("--instance", help="Writer instance name (default: <host>-<pid>).")
@click.option("--timestamp", type=int, help="Client timestamp (ms since the Unix epoch).")
@click.option("--json", "as_json", is_flag=True)
@_common
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
    texts = list(payloads) or [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not texts:
        raise click.UsageError("no payloads given (arguments or JSON lines on stdin)")
    try:
        values = [json.loads(t) for t in texts]
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"payload is not JSON: {exc}") from None
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


_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")
_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: str) -> int:
    """``90s``, ``5m``, ``1h30m``, ``250ms`` -> milliseconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise click.BadParameter(f"invalid duration {text!r} (e.g. 250ms, 90s, 5m, 1h30m)")
    return sum(int(n) * _UNITS[u] for n, u in parts)


@main.command()
@click.argument("stream")
@click.option("--from-id", type=click.IntRange(min=1), help="First stream ID to read.")
@click.option("--from-time", type=click.IntRange(min=0), help="First fact with timestamp >= ms.")
@click.option("--ago", help="Start at a duration ago, e.g. 5m, 1h.")
@click.option("--latest", is_flag=True, help="Start after the facts complete now (with --follow).")
@click.option("--group", help="Reader group: resume after its committed position.")
@click.option("--commit", "commit_group", is_flag=True, help="Commit the group's position.")
@click.option("--follow", "-f", is_flag=True, help="Keep reading new facts (Ctrl-C stops).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Stop after N rows.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines.")
@_common
def read(
    stream: str,
    from_id: int | None,
    from_time: int | None,
    ago: str | None,
    latest: bool,
    group: str | None,
    commit_group: bool,
    follow: bool,
    limit: int | None,
    as_json: bool,
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
    start: Start = "latest" if latest else "earliest"
    if from_id is not None:
        start = from_id
    elif from_time is not None:
        start = dt.datetime.fromtimestamp(from_time / 1000, dt.UTC)
    elif ago is not None:
        start = dt.timedelta(milliseconds=parse_duration_ms(ago))
    if limit is None and not follow:
        limit = 100
    shown = 0
    with (
        _client(database_url, redis_url, prefix) as client,
        client.reader(stream, start=start, group=group) as reader,
    ):
        epochs = iter(reader) if follow else reader.epochs()
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


def _commit_through(reader: Reader, printed: Fact | None, commit_group: bool) -> None:
    if commit_group and printed is not None:
        reader.commit(through=printed)


def _print_row(fact: Fact, row_no: int, payload: Any, as_json: bool) -> None:
    if as_json:
        record = {
            "stream_id": fact.id,
            "row": row_no,
            "instance": fact.instance,
            "timestamp": fact.timestamp,
            "payload": payload,
        }
        click.echo(json.dumps(record, sort_keys=True, separators=(",", ":")))
    else:
        click.echo(f"{fact.id:>10} {fact.timestamp:>14} {fact.instance:<20} {json.dumps(payload)}")


@main.command()
@click.argument("streams", nargs=-1)
@click.option("--json", "as_json", is_flag=True)
@_common
def positions(
    streams: tuple[str, ...],
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Linear position, max allocated, each writer's position and each reader group's lag
    (all streams by default)."""
    with _client(database_url, redis_url, prefix) as client:
        names = list(streams) or [s.name for s in client.streams()]
        data = [client.positions(name).as_dict() for name in names]

    def text(items: list[dict[str, Any]]) -> Iterator[str]:
        for d in items:
            yield (
                f"{d['stream']}: linear {d['linear']}  max allocated {d['max_allocated']}  "
                f"scratchpad {d['max_allocated'] - d['linear']}"
            )
            for name, w in d["writers"].items():
                state = "retired" if w["retired"] else f"lease {w['lease_expires_in_ms']} ms"
                yield f"  writer {name:<28} position {w['position']:>12}  {state}"
            for name, g in d["groups"].items():
                yield f"  group  {name:<28} position {g['position']:>12}  lag {g['lag']}"

    _emit(data, as_json, text)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@_common
def doctor(
    as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """Check connectivity, schema, sequences and writer leases; exit 1 on any problem."""
    from .doctor import diagnose

    settings = _settings(database_url, redis_url, prefix)
    checks = diagnose(settings)
    _emit(
        [c.as_dict() for c in checks],
        as_json,
        lambda items: iter(
            f"[{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in items
        ),
    )
    if not all(c.ok for c in checks):
        sys.exit(1)


@main.group()
def bench() -> None:
    """Benchmarks that print figures beside a raw baseline measured in the same run."""


@bench.command(name="write")
@click.option("--seconds", type=float, default=3.0, show_default=True, help="Per measurement.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--writers", "writer_counts", multiple=True, type=int, default=(1, 4), show_default=True
)
@click.option("--memory-facts", type=int, default=1_000_000, show_default=True)
@_common
def bench_write(
    seconds: float,
    rounds: int,
    writer_counts: tuple[int, ...],
    memory_facts: int,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Appends/s (single and 1000-per-transaction) for 1 and 4 writer processes vs raw."""
    from .bench import run_write_bench, tracker_memory

    settings = _settings(database_url, redis_url, prefix)
    click.echo(f"database {redact_url(settings.database_url)}; medians of {rounds} rounds")
    run_write_bench(
        settings.database_url,
        writer_counts=writer_counts,
        seconds=seconds,
        rounds=rounds,
        report=click.echo,
    )
    if memory_facts:
        tracker_memory(memory_facts, report=click.echo)


@bench.command(name="latency")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="Per writer count.")
@click.option("--rate", type=float, default=200.0, show_default=True, help="Facts/s in total.")
@click.option(
    "--writers", "writer_counts", multiple=True, type=int, default=(1, 4), show_default=True
)
@click.option("--catchup-facts", type=click.IntRange(min=1), default=200_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Also print the results as JSON.")
@_common
def bench_latency(
    seconds: float,
    rate: float,
    writer_counts: tuple[int, ...],
    catchup_facts: int,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Commit-to-delivery p50/p99 vs raw Redis pub/sub; catch-up facts/s vs raw paging."""
    from .bench_latency import run_latency_bench

    settings = Settings.resolve(database_url, redis_url, prefix, require_redis=True)
    assert settings.redis_url is not None
    click.echo(
        f"database {redact_url(settings.database_url)}, Redis {redact_url(settings.redis_url)}"
    )
    result = run_latency_bench(
        settings.database_url,
        settings.redis_url,
        writer_counts=writer_counts,
        rate=rate,
        seconds=seconds,
        catchup_facts=catchup_facts,
        report=click.echo,
    )
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True, separators=(",", ":")))


@main.command()
@click.option("--facts", type=click.IntRange(min=1), default=1000, show_default=True)
@_common
def demo(facts: int, database_url: str | None, redis_url: str | None, prefix: str | None) -> None:
    """Migrate, create a stream, write from two writers (one fact held open) while a reader
    follows, and show positions and epochs."""
    from .migrate import upgrade

    settings = _settings(database_url, redis_url, prefix)
    upgrade(settings.database_url)
    name = f"demo-{int(time.time())}"
    with connect(settings.database_url, settings.redis_url, settings.prefix) as client:
        client.create_stream(name)
        click.echo(f"created stream {name} in {redact_url(settings.database_url)}")
        with (
            client.writer(name, instance="demo-a") as a,
            client.writer(name, instance="demo-b") as b,
            client.reader(name, group="demo") as reader,
            psycopg.connect(settings.database_url) as conn,
        ):
            started = time.perf_counter()
            ack = a.append_batch([{"n": n, "by": "demo-a"} for n in range(facts)])
            click.echo(
                f"demo-a appended {ack.count} facts (ids {ack.first_id}..{ack.last_id})"
                f" in {(time.perf_counter() - started) * 1000:.1f} ms"
            )
            with b.fact(conn) as held:
                held.add({"by": "demo-b", "note": "held open"})
                later = a.append({"n": "after the held one"})
                a.heartbeat()
                b.heartbeat()
                p = client.positions(name)
                click.echo(
                    f"demo-b holds id {held.stream_id} open; demo-a wrote {later.first_id}"
                    f": linear {p.linear} < {held.stream_id} <= max allocated"
                    f" {p.max_allocated}"
                )
                for epoch in reader.epochs():
                    click.echo(f"reader: {epoch!r}")
                click.echo(f"reader stops at {reader.position()}: {held.stream_id} may commit")
            p = client.positions(name)
            click.echo(f"demo-b committed: linear {p.linear}, max allocated {p.max_allocated}")
            for epoch in reader.epochs():
                ids = ", ".join(str(f.id) for f in epoch.facts)
                click.echo(f"reader: {epoch!r}: ids {ids}")
            reader.commit()
            click.echo(f"group 'demo' committed {reader.position()}")
    click.echo(f"now try: streams read {name} --limit 5   or   streams positions {name}")


if __name__ == "__main__":  # pragma: no cover
    main()
