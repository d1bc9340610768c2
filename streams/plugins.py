"""What installed packages add to the `streams` command, found through package entry points.

The library never imports the Spark connector (`streams_spark`: it ships in the same wheel but
needs the ``spark`` extra). What the connector adds to the command is declared in
``pyproject.toml`` as entry points, read from the installed package's metadata and loaded only
when used. The groups:

* ``streams.bench`` (`BENCH`): benchmark commands, each a click command that runs as
  ``streams bench NAME`` (the connector's ``spark``, `streams_spark.benchmarks.spark`);
* ``streams.demo`` (`DEMO`): steps of ``streams demo`` (the connector's ``spark``, the demo's
  Spark query, `streams_spark.demo_query`).

`PluginGroup` is a click group that also holds the commands of an entry-point group, each loaded
when it is named or when the group lists its commands (``streams bench --help``): ``streams
--help`` and every other command load no plugin. A plugin whose module cannot be imported (the
connector without PySpark) is still listed, as a command that says why it cannot run.

Entry points are part of the installed package: a checkout installed with ``pip install -e .``
has them, and needs installing again after they change in ``pyproject.toml``.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import click

from .errors import ConfigurationError

__all__ = ["BENCH", "DEMO", "PluginGroup", "load_plugin"]

#: Benchmark commands: ``streams bench NAME``.
BENCH = "streams.bench"
#: Steps of ``streams demo``.
DEMO = "streams.demo"


def _declared(group: str) -> dict[str, EntryPoint]:
    """The entry points of `group` by name (the first one found where two packages clash)."""
    found: dict[str, EntryPoint] = {}
    for entry in entry_points(group=group):
        found.setdefault(entry.name, entry)
    return found


def load_plugin(group: str, name: str) -> Any:
    """What the entry point `name` of `group` names, its module imported.

    An import error (a missing extra) propagates; no such entry point is a ConfigurationError.
    """
    entry = _declared(group).get(name)
    if entry is None:
        raise ConfigurationError(
            f"no {name!r} among the installed entry points {group!r}: install the package "
            "again (in a checkout: pip install -e .)"
        )
    return entry.load()


class PluginGroup(click.Group):
    """A click group that also holds the commands of the entry-point group `plugins`, each
    loaded when first named or listed; its own commands come first on a clash of names."""

    def __init__(self, *args: Any, plugins: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plugins = plugins
        self._loaded: dict[str, click.Command] = {}

    @functools.cached_property
    def _entry_points(self) -> dict[str, EntryPoint]:
        return _declared(self.plugins)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._entry_points})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in self._entry_points:
            return command
        if cmd_name not in self._loaded:
            self._loaded[cmd_name] = _load_command(self._entry_points[cmd_name])
        return self._loaded[cmd_name]


def _load_command(entry: EntryPoint) -> click.Command:
    try:
        command = entry.load()
    except ImportError as exc:  # the plugin's dependencies are not installed here
        return _unavailable(entry.name, f"{type(exc).__name__}: {exc}")
    if not isinstance(command, click.Command):
        return _unavailable(entry.name, f"{entry.value} is not a click command")
    return command


def _unavailable(name: str, reason: str) -> click.Command:
    """A command that only says why the plugin `name` cannot run here."""

    def fail(args: tuple[str, ...]) -> None:
        path = click.get_current_context().command_path
        raise click.ClickException(f"{path} cannot run here: {reason}")

    return click.Command(
        name,
        callback=fail,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        help=f"Cannot run here: {reason}.",
        context_settings={"ignore_unknown_options": True},
    )
