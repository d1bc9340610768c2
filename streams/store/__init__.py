"""PostgreSQL: every SQL statement of streams, as generators, with the two drivers that run them.

Each function here yields operations (`driver.Query`, `driver.Pipeline`, ...) and receives their
results, like psycopg's own generators; `driver.run` executes them on a psycopg connection,
`driver.arun` on an asyncio one, so sync and asyncio share one logic. The rule of the package:
all SQL lives here and nowhere else, and each correctness argument is written beside the
statements it is about.

* `driver`: the operations, the two drivers, and what restores a connection after an
  interruption (cancellation, Ctrl-C).
* `connect`: opening connections; failures that say what, where (redacted) and what next.
* `registry`: streams and the user tables declared to hold their facts.
* `writers`: writer rows, sequences and their repair (the fencing argument).
* `probe`: what is complete: the probe, shared proofs, the prober election (the probe
  argument).
* `rows`: reading facts: pages, starts by time, timestamp floors, batch ranges, and the
  retention check every read makes.
* `groups`: reader groups, and the positions report of ``streams positions``.
* `retention`: pruning facts older than a stream's retention (the retention argument).
* `idempotency`: idempotency keys: a keyed append is written once (the claim argument).
* `writing`: `WriterCore`, one writer instance: registration, appends, heartbeats.
* `reading`: `ReaderCore`, one reader: starts, steps (epochs), group commits.

The data types most callers need are here: `StreamInfo`, `StreamPositions`, `GroupRow`.
"""

from __future__ import annotations

from .reader_groups import GroupRow, StreamPositions, WriterRow
from .registry import FactTable, StreamInfo

__all__ = ["FactTable", "GroupRow", "StreamInfo", "StreamPositions", "WriterRow"]
