"""The ``streams`` command (also ``python -m streams``): the operator's commands
(`streams.ops.cli`) and the benchmarks (``streams bench``, `streams.bench.commands`), composed
here so that neither package imports the other. What they share (parameter types, the error
discipline, ``--embedded``) is `streams.cli_params`; what installed packages add (the Spark
connector's benchmark and demo step) comes through entry points, `streams.plugins`.
"""

from __future__ import annotations

import click

from . import __version__
from .bench.commands import bench
from .ops.cli import ops

__all__ = ["main"]


class _Streams(click.Group):
    """Ctrl-C ends any command with 130, as shells expect of an interrupted command, and no
    traceback (click's own answer is "Aborted!" and 1). Commands that stop cleanly on Ctrl-C
    (``read --follow``, ``demo``, ``metrics serve``) say more themselves."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None


@click.group(cls=_Streams, commands={**ops.commands, "bench": bench})
@click.version_option(__version__, prog_name="streams")
def main() -> None:
    """Ordered multi-writer fact streams on PostgreSQL (Redis for the fast path)."""
