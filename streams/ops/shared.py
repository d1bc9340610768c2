"""What several command modules of `streams.ops` share: the settings and the client of a
command's ``--database-url``, ``--redis-url`` and ``--prefix``, the output of a listing
(``--json`` or text), whether stdout is a terminal, and ``--stale-after``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from ..cli_params import DURATION
from ..client import Client, connect
from ..config import Settings
from ..core.staleness import STALE_AFTER_MS

__all__ = ["STALE_AFTER", "emit", "open_client", "resolve_settings", "stdout_is_terminal"]


def resolve_settings(
    database_url: str | None, redis_url: str | None, prefix: str | None
) -> Settings:
    return Settings.resolve(database_url, redis_url, prefix)


def open_client(database_url: str | None, redis_url: str | None, prefix: str | None) -> Client:
    return connect(database_url, redis_url, prefix)


def emit(data: Any, as_json: bool, text: Callable[[Any], Iterator[str]]) -> None:
    if as_json:
        click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
    else:
        for line in text(data):
            click.echo(line)


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


#: ``--stale-after``, shared by `streams positions` and `streams doctor` (and `streams groups`).
STALE_AFTER = click.option(
    "--stale-after",
    type=DURATION,
    default=f"{STALE_AFTER_MS // 86_400_000}d",
    show_default=True,
    help="A reader group that has not committed for this long while holding retention back "
    "is stale (e.g. 12h, 7d).",
)
