"""Benchmarks: each prints its figures beside a raw baseline measured in the same run.

* `common`: what they share (the payload, percentiles, the raw catch-up loop, the printing of
  their lines, and `common.scratch_streams`, which sets up and removes what a benchmark
  creates).
* `write`: appends per second, single facts and batches, Redis on and off, beside raw psycopg.
* `latency`: commit-to-delivery latency beside raw Redis pub/sub; catch-up beside raw paging.
* `fanout`: K reader processes on one stream (`fanout_child` is their program, and the
  writers' and the plain Redis subscribers').
* `probe`: the probe's cost under foreign locks and idle sessions.
* `history`: a long stream: size, appends, starts, catch-up, retention.
* `commands`: the ``streams bench`` group; each benchmark module holds its own command.
* `plots`: ``--plot FILE.png|FILE.svg``, the figures of `write`, `latency`, `fleet` and
  ``history --arrow`` drawn beside their baselines and targets (matplotlib, the ``plot`` extra).

``streams bench spark`` (the Spark source beside Spark's JDBC source) lives with the connector,
`streams_spark.benchmarks`, and joins the group through an entry point (`streams.plugins`): the
library never imports the connector. This package never imports `streams.ops` either: what the
commands share is `streams.cli_params`.

Every benchmark removes what it created (streams, their partitions, sequences, writer rows,
groups and proofs, raw tables, child processes), also when it fails or is interrupted.
Benchmarks are commands (``streams bench ...``), not tests.
"""
