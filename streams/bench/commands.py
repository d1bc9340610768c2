"""``streams bench``: the group of the benchmark commands, one per module of this package, and
those installed packages declare under the entry points ``streams.bench`` (`streams.plugins`:
``streams bench spark`` is the Spark connector's, `streams_spark.benchmarks`).

Cheap to import: the servers are only touched inside the commands, and a plugin is loaded only
when it is named or the group's commands are listed.
"""

from __future__ import annotations

import click

from ..plugins import BENCH, PluginGroup
from .fanout import bench_fanout_command
from .fleet import bench_fleet_command
from .history import bench_history_command
from .latency import bench_latency_command
from .probe_cost import bench_probe_command
from .stream_count import bench_streams_command
from .write import bench_write_command

__all__ = ["bench"]


@click.group(cls=PluginGroup, plugins=BENCH)
def bench() -> None:
    """Benchmarks that print figures beside a raw baseline measured in the same run."""


bench.add_command(bench_probe_command, name="probe")
bench.add_command(bench_fanout_command, name="fanout")
bench.add_command(bench_fleet_command, name="fleet")
bench.add_command(bench_write_command, name="write")
bench.add_command(bench_history_command, name="history")
bench.add_command(bench_latency_command, name="latency")
bench.add_command(bench_streams_command, name="streams")
