"""``streams demo``: the main job end to end (`streams.ops.demo`), with its metrics served on
request.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import click
from click.core import ParameterSource

from ..cli_params import FiniteFloat, ListenAddress, common_options
from ..config import redact_url
from .shared import resolve_settings, stdout_is_terminal

__all__ = ["demo"]


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


def _java_unless_no_spark(ctx: click.Context, param: click.Parameter, no_spark: bool) -> bool:
    """Checked while the options are parsed: before any server starts."""
    if not no_spark and shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise click.ClickException(
            "Spark needs Java 17, and there is no `java` on PATH and no JAVA_HOME: install it "
            "(e.g. apt install openjdk-17-jre-headless), or run `streams demo --no-spark`"
        )
    return no_spark


@click.command()
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
    "--no-spark",
    is_flag=True,
    callback=_java_unless_no_spark,
    help="Only the Python reader (for a machine without Java).",
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
    try:
        _demo(duration, writer_count, rate, no_spark, metrics_at, as_json, database_url,
              redis_url, prefix)  # fmt: skip
    except KeyboardInterrupt:  # before the run (Spark starting) or while checking it
        click.echo("interrupted (Ctrl-C): nothing was checked", err=True)
        sys.exit(130)


def _demo(
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
    from ..migrate import upgrade
    from .demo import print_summary, run_demo

    settings = resolve_settings(database_url, redis_url, prefix)
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
            terminal=stdout_is_terminal() and not as_json,
            out=lambda line: click.echo(line, err=True),
            metrics=registry,
        )
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True, separators=(",", ":")))
    else:
        print_summary(result, lambda line: click.echo(line, err=True), stdout_is_terminal())
        name = result.stream
        ctx = click.get_current_context()
        if ctx.get_parameter_source("database_url") is ParameterSource.DEFAULT:
            from ..devservers.background import find_running

            if find_running() is None:  # the demo's own servers, stopped with it
                click.echo(
                    "the embedded servers stopped with the demo (their data is kept): "
                    "`streams up` starts them again and keeps them running; then"
                )
        click.echo(f"now try: streams positions {name}   or   streams read {name} --limit 5")
    if not result.ok:
        sys.exit(1)
    if result.interrupted:
        sys.exit(130)
