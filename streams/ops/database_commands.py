"""``streams migrate``, ``streams doctor`` and ``streams metrics serve``: a database as a whole,
its schema, its health (`streams.ops.doctor`) and its figures (`streams.metrics`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from ..cli_params import Duration, common_options
from ..config import Settings, redact_url
from ..store import sessions
from ..store.driver import run
from ..store.registry import check_schema
from .shared import STALE_AFTER, resolve_settings
from .view_options import LIKE_PATTERN

__all__ = ["doctor", "metrics", "migrate"]


@click.command()
@common_options(redis=False)
def migrate(database_url: str | None, redis_url: str | None, prefix: str | None) -> None:
    """Upgrade the database schema to this version's head (idempotent)."""
    from ..migrate import current_revision, upgrade

    settings = resolve_settings(database_url, redis_url, prefix)
    upgrade(settings.database_url)
    click.echo(
        f"{redact_url(settings.database_url)}: schema at {current_revision(settings.database_url)}"
    )


@click.command()
@click.option(
    "--repair",
    is_flag=True,
    help="Do what is safe first: retire expired writers, end sessions holding a stream back "
    "past the lease, repair sequences behind used IDs.",
)
@STALE_AFTER
@click.option(
    "--lease",
    type=Duration(min_ms=500, max_ms=3_600_000),
    default="10s",
    show_default=True,
    help="The lease your services use: no session may hold a stream back longer than the "
    "longest of it and the stream's writers' leases (--repair ends those that have).",
)
@click.option(
    "--all-streams",
    is_flag=True,
    help="Run the checks that read a stream's facts on every stream (by default on the 100 "
    "that need them most; the others are checked at once).",
)
@click.option("--json", "as_json", is_flag=True)
@common_options
def doctor(
    repair: bool,
    stale_after: int,
    lease: int,
    all_streams: bool,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Check connectivity, schema, sequences, declared tables, sessions holding a stream back
    (writers or not: role, application, address), writer leases, retention (reader groups
    that lost facts, or are stale: no commit for --stale-after while holding retention back)
    and the replication channel; exit 1 on any problem. Every stream is checked at once; the
    checks that read facts run on the 100 streams that need them most (--all-streams: all),
    and streams that pass show in one summary line."""
    from .doctor import DEEP_STREAMS, diagnose
    from .doctor import repair as do_repair

    settings = Settings.resolve(database_url, redis_url, prefix, lease_seconds=lease / 1000)
    deep = None if all_streams else DEEP_STREAMS
    actions = do_repair(settings, deep=deep) if repair else []
    checks = diagnose(settings, stale_after_ms=stale_after, deep=deep)
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


@click.group()
def metrics() -> None:
    """Prometheus metrics (needs `pip install 'streams[metrics]'`)."""


@metrics.command(name="serve")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=9464, show_default=True)
@click.option("--addr", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--like",
    type=LIKE_PATTERN,
    metavar="PATTERN",
    help="Series for the streams whose name matches this SQL LIKE pattern too (by default only "
    "streams with live writers, reader groups or a session holding them back have series).",
)
@common_options
def metrics_serve(
    port: int,
    addr: str,
    like: str | None,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Serve stream-level figures of one database on http://ADDR:PORT/metrics (linear
    position, max allocated, scratchpad, oldest pending ID and who holds it, writers, group
    lag and the retention groups hold back, connections per role), read at each scrape; runs
    until Ctrl-C. Per-stream series only for streams with live writers, reader groups or a
    session holding them back, and those --like matches; totals for all. The database is
    read once at start (exit 1 if it cannot be: a wrong URL must not look like an outage);
    later, a scrape that cannot read it reports streams_database_up 0."""
    from ..metrics import serve

    settings = resolve_settings(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=True, purpose="metrics") as conn:
        run(conn, check_schema())
    try:
        server = serve(settings, port, addr, like=like)
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
        raise SystemExit(130) from None  # interrupted, as shells expect of Ctrl-C
