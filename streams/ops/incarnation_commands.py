"""`streams incarnation [accept]`: which database history this is, and the way on after a
restore, a recreated database or a failover.

A process (a reader, a group reader, a writer, the prover, a Spark query) that finds its
database's incarnation changed stops with `streams.DatabaseChanged` (`streams.core.incarnation`).
Restarting it is the way on for everything that keeps no position of its own: it starts in the
new history. What does keep positions:

* a group's rows record the incarnation they were committed in; a group reader opening a row of
  another one stops too, because its position may name facts this history lacks, or pass facts
  written here since under the same IDs. `streams incarnation` lists them; once the operator
  decided that their positions hold here (a restore of a dump with the group rows in it keeps
  facts and positions together), `streams incarnation accept GROUP...` (or ``--all``) binds
  them to this incarnation. Otherwise ``streams groups delete GROUP`` and start the group anew;
* a Spark query's checkpoint: start it with a new checkpoint (and ``startingPosition``), or
  once with ``failOnDataLoss=false`` to go on from the checkpoint's positions.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ..cli_params import GROUP_NAME, common_options
from ..config import Settings, redact_url
from ..core.incarnation import written_elsewhere
from ..store import sessions
from ..store.driver import run
from ..store.identity import accept_groups, bound_groups, read_incarnation
from ..store.registry import check_schema

__all__ = ["incarnation"]


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True)
@common_options
@click.pass_context
def incarnation(
    ctx: click.Context,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """This database's incarnation (the history positions belong to) and the reader groups
    committed in another one; `streams incarnation accept` binds those to this one."""
    if ctx.invoked_subcommand is not None:
        return
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=True, purpose="incarnation") as conn:
        run(conn, check_schema())
        current = run(conn, read_incarnation())
        rows = run(conn, bound_groups())
    others: list[dict[str, Any]] = []
    for row in rows:
        changed = written_elsewhere(row.incarnation, current)
        if changed is not None:
            others.append(
                {
                    "stream": row.stream,
                    "group": row.group,
                    "position": row.position,
                    "incarnation": row.incarnation,
                    "changed": changed,
                }
            )
    if as_json:
        data = {"incarnation": current.as_dict(), "other_groups": others}
        click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
        return
    click.echo(
        f"{redact_url(settings.database_url)}: incarnation {current.id}, system identifier "
        f"{current.system_identifier}, database OID {current.database_oid}, table OID "
        f"{current.table_oid}, timeline {current.timeline}"
    )
    if not others:
        click.echo("every reader group was committed in this incarnation (or before 0011)")
        return
    click.echo("reader groups committed in another incarnation (their readers stop):")
    for other in others:
        click.echo(
            f"  {other['group']} on {other['stream']} at {other['position']}: {other['changed']}"
        )
    click.echo(
        "check their positions against this database, then `streams incarnation accept "
        "GROUP...` (or --all), or `streams groups delete GROUP` to start a group anew"
    )


@incarnation.command(name="accept")
@click.argument("group", nargs=-1, type=GROUP_NAME, metavar="[GROUP]...")
@click.option("--all", "every", is_flag=True, help="Every group committed in another one.")
@click.option("--json", "as_json", is_flag=True)
@common_options
def accept(
    group: tuple[str, ...],
    every: bool,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Bind the rows of the GROUPs (or --all) committed in another incarnation to this one: their
    readers then resume from their positions. Only after checking that those positions hold in
    this database's history."""
    groups = list(group)
    if bool(groups) == every:
        raise click.UsageError("name the groups, or give --all (not both)")
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=True, purpose="incarnation") as conn:
        run(conn, check_schema())
        current = run(conn, read_incarnation())
        bound = run(conn, accept_groups(current.token, None if every else groups))
    if as_json:
        rows = [{"stream": s, "group": g} for s, g in bound]
        click.echo(json.dumps({"incarnation": current.token, "accepted": rows}, sort_keys=True))
        return
    for stream, name in bound:
        click.echo(f"group {name} on {stream}: bound to incarnation {current.id}")
    if not bound:
        click.echo("no group row was committed in another incarnation")
