"""Sink commits: how a Spark write appends each row exactly once (revision ``0008_sink_commits``).

A task's attempt writes in one transaction that starts with `claim_task`; `commit_batch`
records a batch Spark committed and drops its task commits. Why no row is written twice or
lost, for retries, speculative and zombie attempts and replays: docs/design/sink.md.
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
