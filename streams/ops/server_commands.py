"""``streams up``, ``streams down``, ``streams status``: the project's embedded PostgreSQL and
Redis kept running in the background for development (`streams.devservers.background`), the
way ``docker compose up -d`` feels. While they run, ``streams.connect()``, ``aconnect()``,
every command and the Spark source started in this directory (or below it) use them when no
URL is configured.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from ..cli_params import EMBEDDED_DIR, failure_line

__all__ = ["down", "status", "up"]


def _directory(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    if not value.strip() or "\x00" in value:
        raise click.BadParameter("name a directory (default .streams)")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise click.BadParameter(f"{value!r} is not a directory")
    return path


_DIR = click.option(
    "--dir",
    "base_dir",
    callback=_directory,
    default=str(EMBEDDED_DIR),
    show_default=True,
    help="Where the servers keep their data (programs find it from this directory's parent "
    "and below).",
)


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(failure_line(exc, None, None))


@click.command()
@_DIR
def up(base_dir: Path) -> None:
    """Start (or reuse) private PostgreSQL and Redis servers under ./.streams/, migrate the
    database, and keep them running after this command ends. Prints the ``export`` lines for
    other programs on stdout (``eval "$(streams up)"``); what it did on stderr."""
    from ..devservers.background import bring_up

    try:
        servers = bring_up(base_dir, announce=lambda line: click.echo(line, err=True))
    except Exception as exc:
        raise _fail(exc) from None
    click.echo(f"  database  {servers.database_url}", err=True)
    click.echo(f"  redis     {servers.redis_url}", err=True)
    click.echo(
        "streams commands, streams.connect() and the Spark source started here use them when "
        "no URL is set; `streams down` stops them. For other programs:",
        err=True,
    )
    click.echo(f"export STREAMS_DATABASE_URL={shlex.quote(servers.database_url)}")
    click.echo(f"export STREAMS_REDIS_URL={shlex.quote(servers.redis_url)}")


@click.command()
@_DIR
def down(base_dir: Path) -> None:
    """Stop the servers `streams up` started under ./.streams/ (data is kept). A server that a
    running program still uses (the demo, a command with --embedded) stops when it ends."""
    from ..devservers.background import bring_down

    if not base_dir.is_dir():
        click.echo(f"no embedded servers in {base_dir.absolute()}")
        return
    try:
        lines = bring_down(base_dir)
    except Exception as exc:
        raise _fail(exc) from None
    for line in lines or [f"no embedded servers in {base_dir.absolute()}"]:
        click.echo(line)


@click.command()
@_DIR
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def status(base_dir: Path, as_json: bool) -> None:
    """Whether the embedded servers under ./.streams/ run, with their URLs. Exit 0 when both
    run, 3 when they do not (as service managers' status commands do)."""
    from ..devservers.background import describe, find_running, server_status

    try:
        servers = server_status(base_dir) if base_dir.is_dir() else []
        found = find_running(base_dir.absolute().parent)
    except Exception as exc:
        raise _fail(exc) from None
    running = len(servers) == 2 and all(s.running for s in servers)
    if as_json:
        document = {"running": running, "base_dir": str(base_dir.absolute())} | describe(servers)
        if found is not None and running:
            document |= {"database_url": found.database_url, "redis_url": found.redis_url}
        click.echo(json.dumps(document, sort_keys=True))
    else:
        state = "running" if running else "not running (`streams up` starts them)"
        click.echo(f"embedded servers in {base_dir.absolute()}: {state}")
        for server in servers:
            what = f"pid {server.pid}, port {server.port}, {server.version}"
            kept = (
                "kept by `streams up`" if server.pinned
                else "in use by a running program" if server.users
                else "stops when its program ends"
            )  # fmt: skip
            click.echo(f"  {server.kind:<9} {what if server.running else 'stopped'}"
                       + (f" ({kept})" if server.running else ""))  # fmt: skip
        if found is not None and running:
            click.echo(f"  database  {found.database_url}")
            click.echo(f"  redis     {found.redis_url}")
    if not running:
        raise SystemExit(3)
