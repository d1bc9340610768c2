"""``streams bench``: the group of the benchmark commands, one per module of this package.

Cheap to import: pyspark and the servers are only touched inside the commands.
"""

from __future__ import annotations

import click

from .fanout import bench_fanout_command
from .fleet import bench_fleet_command
from .history import bench_history_command
from .latency import bench_latency_command
from .probe_cost import bench_probe_command
from .spark import bench_spark_command
from .write import bench_write_command

__all__ = ["bench"]


@click.group()
def bench() -> None:
    """Benchmarks that print figures beside a raw baseline measured in the same run."""


bench.add_command(bench_spark_command, name="spark")
bench.add_command(bench_probe_command, name="probe")
bench.add_command(bench_fanout_command, name="fanout")
bench.add_command(bench_fleet_command, name="fleet")
bench.add_command(bench_write_command, name="write")
bench.add_command(bench_history_command, name="history")
bench.add_command(bench_latency_command, name="latency")
