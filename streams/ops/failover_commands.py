"""`streams failover check|repair`: the way on after a PostgreSQL failover that lost facts.

A failover to a *synchronous* standby loses nothing acknowledged: every role resumes by itself
on the new primary (`streams.core.sightings`). A failover to an *asynchronous* one may lose the
old primary's last commits: a writer whose acknowledged facts are gone raises
`streams.FailoverLoss` once, a reader that delivered facts that are gone stops with it, naming
the stream and the IDs. What the operator does then:

1. `streams failover check`: this database's timeline, and per stream the sequence's last
   value, the highest fact and any reader group committed beyond the sequence (a group row
   the new primary holds was committed before the switch point, so it is consistent with the
   facts here; one beyond the sequence was written by hand or restored from elsewhere).
2. `streams failover repair --skip N`: moves each stream's sequence ``N`` IDs past the highest
   of its last value, its highest fact and its groups. The old primary may have handed out
   IDs beyond what the new one's sequence logged (a reader that passed them, as delivered or
   as gaps, would skip the new facts written under them): choose ``N`` above the number of IDs
   the old primary could hand out in the replication lag (appends/s x lag seconds), or a round
   number such as 1,000,000 (IDs are 64-bit). Readers stopped by `streams.FailoverLoss` are then
   restarted: a group resumes from its committed row (re-delivering what it consumed after it);
   a plain reader from the position its application chooses.
3. The facts named by the errors are gone from this history: re-append them from their source
   if the application can (an idempotent append with the same keys writes each once).
"""

from __future__ import annotations

import json

import click

from ..cli_params import STREAM_NAME, common_options
from ..config import Settings, redact_url
from ..store import sessions
from ..store.driver import run
from ..store.failover import FAILOVER_SKIP, failover_report, repair_sequences
from ..store.identity import read_incarnation
from ..store.registry import check_schema

__all__ = ["failover"]

#: The most `streams failover repair --skip` takes: a sequence moved further could reach the
#: bigint limit (2**63 - 1) after which appends fail.
MAX_SKIP = 2**60


@click.group()
def failover() -> None:
    """After a PostgreSQL failover: what the new primary holds, and moving sequences past IDs
    the old primary may have handed out (see docs/operations.md, "Failover")."""


@failover.command(name="check")
@click.option("--json", "as_json", is_flag=True)
@common_options
def check(
    as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """The timeline, and per stream the sequence, the highest fact and groups beyond it."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=True, purpose="failover") as conn:
        run(conn, check_schema())
        current = run(conn, read_incarnation())
        report = run(conn, failover_report())
    if as_json:
        data = {
            "incarnation": current.as_dict(),
            "streams": [
                {
                    "stream": s.name,
                    "sequence": s.sequence,
                    "max_fact": s.max_fact,
                    "groups_beyond": [{"group": g, "position": p} for g, p in s.groups_beyond],
                }
                for s in report
            ],
        }
        click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
        return
    click.echo(f"{redact_url(settings.database_url)}: timeline {current.timeline}")
    for s in report:
        highest = "none (no facts)" if s.max_fact is None else s.max_fact
        line = f"  {s.name}: sequence {s.sequence}, highest fact {highest}"
        if s.groups_beyond:
            line += ", groups beyond the sequence: " + ", ".join(
                f"{g} at {p}" for g, p in s.groups_beyond
            )
        click.echo(line)
    click.echo(
        "after a failover to an asynchronous standby: `streams failover repair --skip N` moves "
        "every sequence past IDs the old primary may have handed out"
    )


@failover.command(name="repair")
@click.option(
    "--skip",
    type=click.IntRange(min=0, max=MAX_SKIP),
    default=FAILOVER_SKIP,
    show_default=True,
    help="IDs to leave unused past the highest known one (more than the old primary could "
    "hand out in the replication lag).",
)
@click.option(
    "--stream", "streams", multiple=True, type=STREAM_NAME,
    help="Only this stream (repeatable; default: every stream).",
)  # fmt: skip
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (for scripts).")
@click.option("--json", "as_json", is_flag=True)
@common_options
def repair(
    skip: int,
    streams: tuple[str, ...],
    yes: bool,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Move stream sequences SKIP IDs past the highest known ID, so that IDs the old primary
    handed out are never handed out again. Asks first on a terminal; scripts pass --yes."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=True, purpose="failover") as conn:
        run(conn, check_schema())
        known = {s.name for s in run(conn, failover_report())}
        unknown = [name for name in streams if name not in known]
        if unknown:
            raise click.ClickException(f"no stream {', '.join(map(repr, unknown))}")
        if not yes:
            click.confirm(
                f"move the sequences of {', '.join(streams) or 'every stream'} {skip} IDs past "
                "the highest known ID?",
                abort=True,
            )
        moved = run(conn, repair_sequences(skip, list(streams) or None))
    if as_json:
        data = [{"stream": n, "old": o, "new": new} for n, o, new in moved]
        click.echo(json.dumps({"moved": data}, sort_keys=True, separators=(",", ":")))
        return
    for name, old, new in moved:
        click.echo(f"  {name}: sequence {old} -> {new}")
    if not moved:
        click.echo("every sequence is past that already")
