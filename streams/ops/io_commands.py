"""``streams append`` and ``streams read``: facts in (JSON documents or lines) and out (rows,
a table or JSON lines; ``--follow`` to tail, ``--group`` and ``--commit`` to resume).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
from collections.abc import Iterator
from typing import Any

import click

from ..cli_params import (
    DURATION,
    GROUP_NAME,
    INSTANCE_NAME,
    MAX_ID,
    MAX_READABLE_MS,
    STREAM_ID,
    STREAM_NAME,
    common_options,
    read_url_option,
)
from ..client import connect
from ..core.epochs import Fact
from ..core.timestamps import MAX_TIMESTAMP
from ..reader import Reader
from ..store.reader_core import Start
from .render import timestamp
from .shared import emit, open_client

__all__ = ["READ_PAGE", "append", "read"]

#: Rows `read` prints without --follow when --limit is not given.
READ_PAGE = 100


@click.command()
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
    # Each text with where it came from, for errors: "argument 2", "stdin line 3".
    if payloads:
        texts = [(f"argument {n}", text) for n, text in enumerate(payloads, start=1)]
    else:
        lines = sys.stdin.read().splitlines()
        texts = [(f"stdin line {n}", t) for n, t in enumerate(lines, start=1) if t.strip()]
    if not texts:
        raise click.UsageError("no payloads given (arguments or JSON lines on stdin)")
    values = []
    for where, text in texts:
        try:
            values.append(json.loads(text))
        except json.JSONDecodeError as exc:
            raise click.UsageError(
                f"{where} is not JSON: {exc.msg} (column {exc.colno}); nothing was appended"
            ) from None
        except RecursionError:
            raise click.UsageError(
                f"{where} is not JSON this library can take: nested too deeply; nothing was "
                "appended"
            ) from None
    with (
        open_client(database_url, redis_url, prefix) as client,
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
    emit(
        data,
        as_json,
        lambda d: iter([f"appended {d['count']} fact(s): ids {d['first_id']}..{d['last_id']}"]),
    )


@click.command()
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
@click.option(
    "--limit",
    type=click.IntRange(0, MAX_ID),
    default=None,
    help=f"Stop after N rows (0: no limit). Without --follow: {READ_PAGE} unless given.",
)
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
    are shown as readers see them: raised to the running maximum in ID order. Without --follow,
    reads until caught up or --limit rows (100 unless given; 0: no limit), and says on stderr
    when it stopped before the end and how to read on. Ctrl-C stops (exit 130).
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
        limit = READ_PAGE
    limit = limit or None  # 0: no limit
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
                for k, fact in enumerate(epoch.facts):
                    if limit is not None and shown + len(fact.payloads) > limit:
                        for row_no, payload in enumerate(fact.payloads[: limit - shown]):
                            _print_row(fact, row_no, payload, as_json)
                        _commit_through(reader, printed, commit_group)
                        _stopped_early(limit, fact.stream_id)  # its other rows are not shown
                        return
                    for row_no, payload in enumerate(fact.payloads):
                        _print_row(fact, row_no, payload, as_json)
                    shown += len(fact.payloads)
                    printed = fact
                    if limit is not None and shown >= limit and k + 1 < len(epoch.facts):
                        _commit_through(reader, printed, commit_group)
                        _stopped_early(limit, fact.stream_id + 1)
                        return
                if commit_group:
                    reader.commit()  # the whole epoch, gaps after its last fact included
                printed = None
                if limit is not None and shown >= limit:
                    if reader.core.behind():
                        _stopped_early(limit, reader.position(stream) + 1)
                    return
        except KeyboardInterrupt:
            _commit_through(reader, printed, commit_group)
            raise SystemExit(130) from None
        finally:
            progress.close()


def _stopped_early(limit: int, next_id: int) -> None:
    """Say (on stderr: the rows on stdout stay data) that rows remain, and how to read them."""
    click.echo(
        f"(stopped after {limit:,} rows, --limit; more follow: --from-id {next_id} reads on, "
        "--limit 0 reads to the end)",
        err=True,
    )


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


def _stdin_terminal() -> bool:
    return sys.stdin.isatty()
