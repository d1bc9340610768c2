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


@click.group(commands={**ops.commands, "bench": bench})
@click.version_option(__version__, prog_name="streams")
def main() -> None:
    """Ordered multi-writer fact streams on PostgreSQL (Redis for the fast path)."""
