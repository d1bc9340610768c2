"""The connector's benchmarks: ``streams bench spark``, the Spark source beside Spark's own
sources and the Spark sink beside plain Python writers.

* `spark`: the command, and the throughput, latency and probe-rate parts;
* `spark_overhead`: the cost of a micro-batch beside Spark's built-in source and an empty one;
* `spark_sink`: the sink beside ``append_batch`` from plain Python processes;
* `bench_empty`: the empty Python data source, the floor any Python source pays.

They live with the connector, so that the library never imports it: the ``streams`` command
finds ``streams bench spark`` through the entry point ``spark`` of the group ``streams.bench``
(``pyproject.toml``, `streams.plugins`). They use the library's benchmark toolkit
(`streams.bench.common`) and the parameters every command shares (`streams.cli_params`).
"""
