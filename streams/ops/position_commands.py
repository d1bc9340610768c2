"""``streams positions`` (once, ``--watch``ed, or ``--from-redis``) and ``streams writers prune``:
where each stream, writer and reader group is, and the writer rows behind it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from ..cli_params import DURATION, MAX_ID, STREAM_NAME, FiniteFloat, common_options
from ..client import Client
from ..core.staleness import STALE_AFTER_MS
from ..store.overview import Sort
from ..types import StreamPositions
from .render import Table, positions_tables, print_tables, render_plain, rich_renderable
from .shared import STALE_AFTER, emit, open_client, stdout_is_terminal
from .view_options import limited_note, page, truncation_note, view_options

__all__ = ["positions", "writers", "writers_prune"]


#: ``--like``, ``--limit`` and ``--sort`` of a listing.
_View = tuple[str | None, int | None, Sort]


def _read_positions(
    client: Client,
    streams: tuple[str, ...],
    stale_after_ms: int = STALE_AFTER_MS,
    view: _View = (None, None, "name"),
) -> tuple[list[StreamPositions], str | None]:
    """The positions of STREAMS (each asked for), or of every stream --like selects at once
    (`Client.overview`); and the note saying --limit cut the list short, if it did."""
    like, limit, sort = view
    if not streams:
        found = client.overview(like, limit=limit, sort=sort, stale_after_ms=stale_after_ms)
        return [s.positions for s in found.streams], truncation_note(found)
    items = [client.positions(name, stale_after_ms=stale_after_ms) for name in streams]
    if sort == "lag":
        items.sort(key=lambda p: (-max((g.lag for g in p.groups), default=0), p.stream))
    if limit is not None and len(items) > limit:
        return items[:limit], limited_note(limit, len(items))
    return items, None


@click.command()
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
@STALE_AFTER
@view_options
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
    like: str | None,
    limit: int | None,
    sort: Sort,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Linear position, max allocated, scratchpad and its oldest pending ID; each writer's
    position, pending IDs, state and heartbeat; each reader group's (and Spark query's) position,
    lag and time since its last commit, stale when that passes --stale-after while it holds
    retention back (all streams by default, or those --like selects, read at once; retired
    writers folded unless --all)."""
    if streams and like is not None:
        raise click.UsageError("give STREAMS or --like, not both")
    # Streams named on the command line are all shown, whatever their number.
    view: _View = (like, limit if streams else page(limit, as_json), sort)
    if from_redis:
        _positions_from_redis(streams, redis_url, prefix, as_json)
        return
    with open_client(database_url, redis_url, prefix) as client:
        if not watch:
            items, note = _read_positions(client, streams, stale_after, view)
            if as_json:
                data = [p.as_dict(retired=show_all) for p in items]
                click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
            else:
                print_tables(
                    positions_tables(items, show_all), sys.stdout, terminal=stdout_is_terminal()
                )
                if note:
                    click.echo(note)
            return
        _watch_positions(client, streams, show_all, interval, count, as_json, stale_after, view)


def _watch_positions(
    client: Client,
    streams: tuple[str, ...],
    show_all: bool,
    interval: float,
    count: int | None,
    as_json: bool,
    stale_after_ms: int,
    view: _View,
) -> None:
    rates: dict[str, list[float]] = {}
    previous: dict[str, tuple[float, int]] = {}
    live: Any = None
    if stdout_is_terminal() and not as_json:
        from rich.live import Live

        live = Live(auto_refresh=False)
        live.start()
    samples = 0
    try:
        while True:
            now = time.monotonic()
            items, _ = _read_positions(client, streams, stale_after_ms, view)
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
        raise SystemExit(130) from None  # interrupted, as shells expect of Ctrl-C
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
        print_tables([table], sys.stdout, terminal=stdout_is_terminal())
        if report.foreign is not None:
            click.echo(report.foreign.describe(report.prefix), err=True)
    if not rows:
        raise click.ClickException(
            f"no POSITION answered REPLICATE on {report.prefix!r} within "
            f"{report.elapsed_ms} ms ({report.receivers} receiver(s) on the channel)"
        )


@click.group()
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
@common_options(redis=False)
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
    with open_client(database_url, redis_url, prefix) as client:
        pruned = {
            name: client.prune_writers(name, older_than)
            for name in (list(streams) or [s.name for s in client.streams()])
        }
    emit(
        {name: gone for name, gone in pruned.items() if gone},
        as_json,
        lambda d: iter(
            [f"pruned {sum(len(v) for v in d.values())} retired writer(s)"]
            + [f"  {name}: {', '.join(v)}" for name, v in d.items()]
        ),
    )
