"""The operator's surface: the ``streams`` commands and what only they use.

* `cli`: the commands (click), all but ``streams bench``, gathered from their modules:
  `stream_commands`, `key_commands`, `io_commands`, `position_commands`, `database_commands`,
  `group_commands`, `incarnation_commands`, `failover_commands`, `role_commands`,
  `schema_commands` and `demo_commands`; what several of them share is `shared`.
* `doctor`: health checks and the safe repairs; `render`: tables for terminals and pipes.
* `channel`: a read-only look at a replication channel (who answers ``REPLICATE``).
* `demo`: the main job end to end, checking itself (its Spark query is the connector's, found
  through an entry point: `streams.plugins`).

Their parameter types, error discipline and ``--embedded`` are `streams.cli_params` and
`streams.devservers`, shared with the benchmarks; `streams.command` composes the ``streams``
command. The library never imports this package; it may import anything below it, never
`streams.bench` nor the Spark connector.
"""
