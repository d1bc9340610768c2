"""`streams groups list|delete`: reader groups (Python readers' and Spark queries'), stale ones
first among them.

A group is *stale* when it has not committed for the stale-after time (``--stale-after``,
default one day) while holding a stream's retention back (`streams.core.staleness`): typically a
Spark query started without ``group`` (it commits to ``spark-<digest>``) whose checkpoint was
abandoned. Nothing deletes a group by itself; ``streams groups delete GROUP`` does, once its
reader is known to be gone. A reader or query still running is fenced by it (its next commit
raises `GroupFenced`: deleting the group deletes its generations, `streams.store.reader_groups`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..cli_params import DURATION, GROUP_NAME, MAX_ID, STREAM_NAME, common_options
from ..client import connect
from ..core.staleness import STALE_AFTER_MS
from .render import Table, age, print_tables
from .view_options import LIKE_PATTERN, TABLE_PAGE, limited_note, page

__all__ = ["groups"]

_STALE_AFTER_HELP = (
    "A group that has not committed for this long while holding retention back is stale "
    "(e.g. 12h, 7d)."
)


def _stdin_terminal() -> bool:
    return sys.stdin.isatty()


@click.group()
def groups() -> None:
    """Reader groups and Spark queries: `streams groups list`, `streams groups delete`."""


@groups.command(name="list")
@click.argument("streams", nargs=-1, type=STREAM_NAME)
@click.option(
    "--stale-after", type=DURATION, default=f"{STALE_AFTER_MS // 86_400_000}d",
    show_default=True, help=_STALE_AFTER_HELP,
)  # fmt: skip
@click.option("--stale", "only_stale", is_flag=True, help="Only the stale groups.")
@click.option(
    "--like",
    type=LIKE_PATTERN,
    metavar="PATTERN",
    help="Only streams whose name matches this SQL LIKE pattern ('%' any text).",
)
@click.option(
    "--limit",
    type=click.IntRange(0, MAX_ID),
    help=f"Show the first N groups only (0: all). A table shows the first {TABLE_PAGE} unless "
    "given; --json lists all unless given.",
)
@click.option(
    "--sort",
    type=click.Choice(["name", "lag"]),
    default="name",
    show_default=True,
    help="By stream and group name, or by lag (the largest first).",
)
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
def groups_list(
    streams: tuple[str, ...],
    stale_after: int,
    only_stale: bool,
    like: str | None,
    limit: int | None,
    sort: str,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Every reader group of the STREAMS (default: all) with its position, lag, time since its
    last commit, and whether it holds retention back or is stale; its consumer's generation,
    how long ago that consumer took the group, and who it is (every stream's at once)."""
    if streams and like is not None:
        raise click.UsageError("give STREAMS or --like, not both")
    with connect(database_url, redis_url, prefix) as client:
        if streams:
            found = [g for name in streams for g in client.groups(name, stale_after_ms=stale_after)]
        else:
            view = client.overview(like, stale_after_ms=stale_after, grouped=True)
            found = [g for s in view.streams for g in s.positions.groups]
    rows = [{"stream": g.stream, **g.as_dict()} for g in found if g.stale or not only_stale]
    if sort == "lag":
        rows.sort(key=lambda r: (-r["lag"], r["stream"], r["group"]))
    matched = len(rows)
    rows = rows[: page(limit, as_json)]
    if as_json:
        click.echo(json.dumps(rows, sort_keys=True, separators=(",", ":")))
        return
    table = Table(
        "reader groups and Spark queries",
        ["STREAM", "GROUP", "POSITION", "LAG", "IDLE_MS", "GENERATION", "TAKEN_AGE_MS", "OWNER",
         "STATE"],
        numeric=frozenset({"POSITION", "LAG", "IDLE_MS", "GENERATION", "TAKEN_AGE_MS"}),
    )  # fmt: skip
    for row in rows:
        state = "stale" if row["stale"] else "holds retention" if row["holds_retention"] else ""
        held = row["generation"] is not None
        table.rows.append(
            [row["stream"], row["group"], str(row["position"]), str(row["lag"]),
             age(row["idle_ms"]), str(row["generation"]) if held else "-",
             age(row["taken_age_ms"]) if held else "-", row["owner"] or "-", state]
        )  # fmt: skip
    print_tables([table], sys.stdout, terminal=sys.stdout.isatty())
    if len(rows) < matched:
        click.echo(limited_note(len(rows), matched, "groups"))


@groups.command(name="delete")
@click.argument("group", type=GROUP_NAME)
@click.option(
    "--stream", "streams", multiple=True, type=STREAM_NAME,
    help="Only on this stream (repeatable; default: every stream the group committed on).",
)  # fmt: skip
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (for scripts).")
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
def groups_delete(
    group: str,
    streams: tuple[str, ...],
    yes: bool,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Delete reader group GROUP: its committed positions no longer hold retention back.

    A reader that uses the group again starts from its own start position (a Spark query
    from its checkpoint, if it has one). Asks first on a terminal; scripts pass --yes.
    """
    with connect(database_url, redis_url, prefix) as client:
        for name in streams:
            client.stream(name)  # an unknown stream is an error of its own (UnknownStream)
        holding = client.group_streams(group)
        if not holding:
            raise click.ClickException(f"no reader group {group!r} on any stream")
        missing = [name for name in streams if name not in holding]
        if missing:
            raise click.ClickException(
                f"reader group {group!r} has no position on {', '.join(missing)} "
                f"(it has on: {', '.join(holding)})"
            )
        targets = list(dict.fromkeys(streams)) or holding
        if not yes:
            if not _stdin_terminal():
                raise click.UsageError(
                    f"deleting reader group {group!r} on {', '.join(targets)} needs confirming: "
                    "pass --yes (no terminal to ask on)"
                )
            click.confirm(
                f"Delete reader group {group!r} on {', '.join(targets)}?", abort=True, err=True
            )
        deleted = [name for name in targets if client.delete_group(name, group)]
    result: dict[str, Any] = {"group": group, "deleted": deleted}
    if as_json:
        click.echo(json.dumps(result, sort_keys=True, separators=(",", ":")))
    else:
        click.echo(f"deleted reader group {group!r} on {', '.join(deleted) or 'no stream'}")
