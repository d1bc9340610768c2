"""PostgreSQL: every SQL statement of streams, as generators, with the two drivers that run them.

Each function here yields operations (`driver.Query`, `driver.Pipeline`, ...) and receives their
results, like psycopg's own generators; `driver.run` executes them on a psycopg connection,
`driver.arun` on an asyncio one, so sync and asyncio share one logic. The rules of the package:
all SQL lives here and nowhere else; each correctness argument is a page of docs/design/,
linked from the module it is about; and the face `reads` is how readers outside the store
read (the read sequence: incarnation, probe, rows, retention, and why that order is the
proof): they run its plans on their driver, never an order of their own. The library's shells
and the prober take it from here (`reader_core` runs it for `streams.reader`); connectors (the
Spark source's driver and executors, any other engine's) through `streams.connector`, as every
other internal they need.

* `driver`: the operations, the two drivers, and what restores a connection after an
  interruption (cancellation, Ctrl-C).
* `sessions`: opening connections; failures that say what, where (redacted) and what next.
* `registry`: streams and the user tables declared to hold their facts.
* `leases`: writer rows, sequences and their repair (docs/design/fencing.md, liveness.md).
* `probe`: what is complete: the probe, shared proofs, the prober election (docs/design/probe.md,
  durability.md).
* `identity`: the database's incarnation, read on every new session.
* `reads`: the read sequence every reader runs, written once (its plans: a caught-up
  reader's, the prober's, a follower's, a range planned earlier for any driver).
* `rows`: the statements that read facts and check retention; starts by time, timestamp
  floors, batch ranges.
* `reader_groups`: reader groups, and the positions report of ``streams positions``.
* `keys`: the replication keys that sign ranges.
* `roles`: the role model: which roles may run which statements, its grants and their check.
* `retention`: pruning facts older than a stream's retention (the retention argument).
* `sinks`: the Spark sink's task commits (the exactly-once argument).
* `idempotency`: idempotency keys: a keyed append is written once (docs/design/claim.md).
* `writer_core`: `WriterCore`, one writer instance: registration, appends; the face of
  `writer_state` (its state, the steps every reservation shares), `writer_sql` (its
  statements), `keyed_appends`, `joined_facts` (facts in a caller's transaction) and
  `writer_beats` (heartbeats, retiring).
* `reader_core`: `ReaderCore`, one reader: starts, steps (epochs), group commits.

The data types callers see (`StreamInfo`, `StreamPositions`, `GroupRow`, `Ack`, ...) are
`streams.types`, which the store imports and never the other way round.
"""
