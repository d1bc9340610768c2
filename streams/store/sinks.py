"""Sink commits: how a Spark write appends each row exactly once (revision ``0008_sink_commits``).

Terms
-----
* A **sink query** is one Spark write into one stream, named by a **query id**: a streaming
  query's id (Spark keeps it in the checkpoint, so a restarted query has the same one) or a
  random id for one batch write job. Its row in ``streams_sink_queries`` holds
  ``committed_batch``: the last micro-batch whose write Spark committed on the driver (-1 before
  the first; a batch job is micro-batch 0).
* A **task** is one Spark task writing one partition of one micro-batch; its **key** is
  (stream, query id, batch id, partition id). Spark may run a task more than once: a retry after
  a failure, a speculative copy, a zombie attempt still running after its stage ended, and, after
  a driver restart, the whole last micro-batch again from the checkpoint (a *replay*: the same
  offsets, hence the same rows in the same partitions, for a deterministic query).
* A **task commit** is the row ``streams_sink_commits`` holds for a task key.

The exactly-once argument
-------------------------
Each attempt of a task writes in **one transaction** that begins with `claim_task` and then
reserves IDs and copies the facts (`streams.store.writer_core.WriterCore.append_facts`), and commits
them together. `claim_task` is one statement that locks the query's row ``FOR SHARE``, then
inserts the task commit unless the batch is at or below ``committed_batch``, ``ON CONFLICT DO
NOTHING``. So an attempt writes facts only if it inserted the task commit, and:

1. *Two attempts of one task never both write.* The task commit's primary key admits one row per
   key. An attempt whose insert meets a row of a transaction still open waits for it (the unique
   index's rule); if that transaction commits, the insert does nothing and the attempt writes
   nothing; if it rolls back (its facts with it: their IDs are gaps), the insert goes ahead. A
   committed task commit is never deleted while an attempt of its batch could still insert one
   again (3).
2. *A replayed batch writes nothing twice.* A replay of batch B after some of its tasks committed
   meets their task commits (1) and writes only the partitions that had not committed. If Spark
   had committed B on the driver (`commit_batch`) before the restart, every task of B had
   committed, ``committed_batch >= B``, and no attempt of B writes at all.
3. *Deleting task commits is safe.* `commit_batch` raises ``committed_batch`` to B and deletes the
   query's task commits of batches ``<= B`` in one transaction, whose ``UPDATE`` of the query row
   waits for every attempt holding it ``FOR SHARE`` (an attempt of any batch, open since before).
   An attempt that locks the row later sees ``committed_batch >= B`` and writes nothing for a
   batch ``<= B``; one that locked it earlier has ended, with (1) deciding it, before the task
   commits are gone. Spark commits B only once every task of B succeeded, so nothing of B is
   still to write, and batch ids of a query only grow.
4. *An attempt that fails writes nothing.* Its transaction rolls back: no facts, no task commit,
   and its reserved IDs complete as gaps (`streams.store.writer_state`); a process killed mid-write
   loses its connection, and the server rolls back the same way.

What it rests on: Spark replays a batch with the same rows in the same partitions (true for a
query whose source replays its offsets, as ``streams`` and Kafka do, with Spark's fixed number
of shuffle partitions in the checkpoint); rows of a task that differ between attempts would be
written as the first committed attempt had them. A batch job's tasks are one micro-batch (0)
whose query id is new for every job, so a task retried within a job writes once, and the same
DataFrame written twice is written twice.

Retention of task commits: `commit_batch` deletes a query's task commits as soon as Spark
committed their batch (3), so the table holds at most the batches in flight. Query rows stay
while their query may still restart: `commit_batch` also deletes (with their task commits) the
rows of queries that committed nothing for ``retention_seconds`` (default 7 days). A checkpoint
restarted after that is exact, except in one case: its driver died after Spark committed the
last batch to the sink and before Spark wrote that to the checkpoint; that batch is then
written again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import StoreError
from ..types import StreamInfo
from .driver import Autocommit, Commit, Gen, Query

__all__ = [
    "DEFAULT_RETENTION_SECONDS",
    "BatchCommit",
    "TaskKey",
    "claim_task",
    "commit_batch",
    "sink_state",
]

#: Seconds a sink query's row outlives its last committed batch (7 days).
DEFAULT_RETENTION_SECONDS = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class TaskKey:
    """Which Spark task is writing: the key of its task commit."""

    query_id: str
    batch_id: int
    partition_id: int


@dataclass(frozen=True, slots=True)
class BatchCommit:
    """What `commit_batch` did: the query's ``committed_batch`` now, task commits it deleted,
    and rows of stale queries retention removed."""

    committed_batch: int
    task_commits_deleted: int
    stale_queries_deleted: int


def claim_task(info: StreamInfo, key: TaskKey) -> Gen[bool]:
    """Begin a task's transaction: True if this attempt is to write its facts (it inserted the
    task commit), False if an attempt of this task, or Spark's commit of its batch, did.

    The query's row is created first, in a transaction of its own (so that tasks of one batch
    never wait for each other's first insert of it). The second statement opens the caller's
    transaction: the caller writes its facts in it and commits, or rolls it back.
    """
    yield Autocommit(
        "INSERT INTO streams_sink_queries (stream, query_id) VALUES (%s, %s) "
        "ON CONFLICT DO NOTHING",
        (info.id, key.query_id),
    )
    rows = yield Query(
        """
        WITH q AS (
            SELECT committed_batch FROM streams_sink_queries
            WHERE stream = %(stream)s AND query_id = %(query)s
            FOR SHARE
        ), claimed AS (
            INSERT INTO streams_sink_commits (stream, query_id, batch_id, partition_id)
            SELECT %(stream)s, %(query)s, %(batch)s, %(partition)s
            FROM q WHERE q.committed_batch < %(batch)s
            ON CONFLICT DO NOTHING
            RETURNING 1
        )
        SELECT (SELECT committed_batch FROM q), (SELECT count(*) FROM claimed)
        """,
        {
            "stream": info.id,
            "query": key.query_id,
            "batch": key.batch_id,
            "partition": key.partition_id,
        },
    )
    committed, claimed = rows[0]
    if committed is None:
        # Retention removed the row between the two statements (a query idle for days, whose
        # task started just then): fail this attempt; Spark's retry creates the row again.
        raise StoreError(
            f"sink query {key.query_id!r} on stream {info.name!r} vanished while a task "
            "began (retention); the task is retried"
        )
    return bool(claimed)


def commit_batch(
    info: StreamInfo,
    query_id: str,
    batch_id: int,
    retention_seconds: float = DEFAULT_RETENTION_SECONDS,
) -> Gen[BatchCommit]:
    """Spark committed ``batch_id`` on the driver: raise ``committed_batch`` (forward only),
    delete the query's task commits up to it, and the rows of queries idle past retention."""
    rows = yield Query(
        """
        INSERT INTO streams_sink_queries AS q (stream, query_id, committed_batch)
        VALUES (%(stream)s, %(query)s, %(batch)s)
        ON CONFLICT (stream, query_id) DO UPDATE
        SET committed_batch = GREATEST(q.committed_batch, EXCLUDED.committed_batch),
            committed_at = now()
        RETURNING committed_batch
        """,
        {"stream": info.id, "query": query_id, "batch": batch_id},
    )
    committed = int(rows[0][0])
    deleted = yield Query(
        "WITH d AS (DELETE FROM streams_sink_commits "
        "WHERE stream = %s AND query_id = %s AND batch_id <= %s RETURNING 1) "
        "SELECT count(*) FROM d",
        (info.id, query_id, committed),
    )
    # Stale queries of every stream, their task commits with them (ON DELETE CASCADE). A row
    # that anyone holds (a task's FOR SHARE, another driver's commit) is skipped, not waited
    # for: two drivers deleting each other's rows cannot deadlock, and a row a task holds is
    # not stale (the next commit looks again).
    stale = yield Query(
        """
        WITH d AS (
            DELETE FROM streams_sink_queries
            WHERE (stream, query_id) IN (
                SELECT stream, query_id FROM streams_sink_queries
                WHERE committed_at < now() - make_interval(secs => %s)
                FOR UPDATE SKIP LOCKED
            )
            RETURNING 1
        )
        SELECT count(*) FROM d
        """,
        (retention_seconds,),
    )
    yield Commit()
    return BatchCommit(committed, int(deleted[0][0]), int(stale[0][0]))


def sink_state(info: StreamInfo, query_id: str) -> Gen[tuple[int | None, list[tuple[int, int]]]]:
    """A query's ``committed_batch`` (None: no row) and its task commits as (batch, partition)."""
    rows = yield Query(
        "SELECT committed_batch FROM streams_sink_queries WHERE stream = %s AND query_id = %s",
        (info.id, query_id),
    )
    tasks = yield Query(
        "SELECT batch_id, partition_id FROM streams_sink_commits "
        "WHERE stream = %s AND query_id = %s ORDER BY 1, 2",
        (info.id, query_id),
    )
    yield Commit()
    return (int(rows[0][0]) if rows else None), [(int(b), int(p)) for b, p in tasks]
