"""The Spark query of the long chaos run (``tests/faults/test_chaos.py``, 300 s or more): the
project's source (`streams_spark`, local mode, the tests' shared SparkSession) reads both
streams of the run under every fault of the run, and is itself stopped and started again from
its checkpoint at random (``spark-restart``), as a driver restarted by its supervisor.

Its sink keeps each micro-batch's rows by batch ID; a batch Spark runs again after a restart
(the same ID) replaces the first run's rows, as an idempotent sink's would. At the end
(`SparkRun.check`): read in batch order, each stream's rows are in stream-ID order, none twice,
every stored fact is there whole and as stored (the same rows, payloads and row count), and
nothing else is.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

__all__ = ["SparkRun"]


class SparkRun:
    """A streaming query over ``names`` that collects every micro-batch (see the module
    docstring); `restart` stops it and starts it again on the same checkpoint."""

    def __init__(self, spark: Any, url: str, names: list[str], checkpoint: Path) -> None:
        self.spark = spark
        self.url = url
        self.names = names
        self.checkpoint = checkpoint
        #: batch ID -> rows ``(stream, stream_id, row_no, payload)`` of its last run.
        self.batches: dict[int, list[tuple[str, int, int, dict[str, Any]]]] = {}
        #: Batches Spark ran again (after a restart), and queries started.
        self.replayed = 0
        self.starts = 0
        #: Why each query before the current one ended other than by `restart` (none expected).
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.query: Any = None
        self.start()

    def _sink(self, df: Any, batch_id: int) -> None:
        rows = [
            (r.stream, int(r.stream_id), int(r.row_no), json.loads(r.payload))
            for r in df.select("stream", "stream_id", "row_no", "payload").collect()
        ]
        with self._lock:
            if batch_id in self.batches:
                self.replayed += 1
            self.batches[batch_id] = rows

    def start(self) -> None:
        self.starts += 1
        self.query = (
            self.spark.readStream.format("streams")
            .option("streams", ",".join(self.names))
            .option("databaseUrl", self.url)
            .option("maxFactsPerTrigger", "500")
            .option("partitions", "2")
            .option("pollInterval", "200ms")
            .load()
            .writeStream.foreachBatch(self._sink)
            .option("checkpointLocation", str(self.checkpoint))
            .trigger(processingTime="500 milliseconds")
            .start()
        )

    def restart(self) -> None:
        """Stop the query (between or in a micro-batch) and start it on its checkpoint."""
        self.note_failure()
        self.query.stop()
        self.start()

    def note_failure(self) -> None:
        """If the query died by itself, record why and start it again (a supervisor would);
        the check fails on any."""
        if self.query.isActive:
            return
        self.failures.append(str(self.query.exception()))
        self.start()

    def pid(self) -> int | None:
        """The JVM's process (driver and executors: local mode), if it can be told."""
        gateway = getattr(self.spark.sparkContext, "_gateway", None)
        proc = getattr(gateway, "proc", None)
        return None if proc is None else int(proc.pid)

    def rows(self) -> list[tuple[str, int, int, dict[str, Any]]]:
        with self._lock:
            return [row for _, rows in sorted(self.batches.items()) for row in rows]

    def reached(self, targets: dict[str, int]) -> bool:
        """Whether the output holds every stream up to its target position (the last stored
        fact at most that far)."""
        last: dict[str, int] = {}
        for stream, stream_id, _, _ in self.rows():
            last[stream] = max(last.get(stream, 0), stream_id)
        return all(last.get(name, 0) >= target for name, target in targets.items())

    def finish(self, targets: dict[str, int], stored: dict[str, set[int]], timeout: float) -> None:
        """Wait until the output reaches ``targets`` (each stream's highest stored fact at most
        that far, ``stored``: its IDs), then stop the query."""
        deadline = time.monotonic() + timeout
        want = {n: max((i for i in ids if i <= targets[n]), default=0) for n, ids in stored.items()}
        while not self.reached(want):
            self.note_failure()
            if time.monotonic() > deadline:
                break  # `check` says what is missing
            time.sleep(0.2)
        self.note_failure()
        self.query.stop()

    def check(
        self, stored: dict[str, dict[int, list[dict[str, Any]]]], through: dict[str, int]
    ) -> list[str]:
        """The output against the stored facts up to ``through`` (see the module docstring)."""
        problems = [
            f"spark: the query failed: {_gist(why)}" for why in self.failures if not _starved(why)
        ]
        by_stream: dict[str, list[tuple[int, int, dict[str, Any]]]] = defaultdict(list)
        for stream, stream_id, row_no, payload in self.rows():
            by_stream[stream].append((stream_id, row_no, payload))
        for name in self.names:
            rows = by_stream.get(name, [])
            keys = [(i, r) for i, r, _ in rows]
            if keys != sorted(set(keys)):
                twice = sorted(k for k, count in Counter(keys).items() if count > 1)
                problems.append(
                    f"spark: {name} rows out of order or twice across micro-batches: "
                    f"{twice[:10]} ({len(keys) - len(set(keys))} extra)"
                )
            got: dict[int, list[dict[str, Any]]] = defaultdict(list)
            for stream_id, _, payload in sorted(rows, key=lambda r: (r[0], r[1])):
                got[stream_id].append(payload)
            kept = {i: p for i, p in stored[name].items() if i <= through[name]}
            missing = sorted(set(kept) - set(got))
            extra = sorted(set(got) - set(kept))
            if missing or extra:
                problems.append(
                    f"spark: {name} facts missing {missing[:10]} ({len(missing)}), not stored "
                    f"{extra[:10]} ({len(extra)})"
                )
            for stream_id in sorted(set(kept) & set(got)):
                if sorted(map(_canonical, got[stream_id])) != sorted(
                    map(_canonical, kept[stream_id])
                ):
                    problems.append(f"spark: {name} fact {stream_id} is not as stored (torn)")
        return problems

    def summary(self) -> dict[str, int]:
        with self._lock:
            batches = len(self.batches)
        return {
            "batches": batches,
            "replayed": self.replayed,
            "queries": self.starts,
            "rows": len(self.rows()),
            "worker timeouts": sum(1 for why in self.failures if _starved(why)),
        }

    def close(self) -> None:
        if self.query is not None and self.query.isActive:
            self.query.stop()


def _canonical(payload: dict[str, Any]) -> str:
    return json.dumps(payload, sort_keys=True)


#: What PySpark says when its Python worker did not connect back to the JVM in time (its
#: socket timeout, 15 s): the machine starved of CPU (the chaos run's servers and children on
#: two cores), not the source. The query is started again on its checkpoint, which the check
#: then covers like any restart.
_WORKER_TIMEOUTS = ("Python worker failed to connect back", "CANNOT_OPEN_SOCKET")


def _starved(why: str) -> bool:
    return any(marker in why for marker in _WORKER_TIMEOUTS) and "streams.errors" not in why


def _gist(why: str) -> str:
    """The last line naming an error of a query's exception (its Python traceback inside)."""
    lines = [line.strip() for line in why.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else why)[:400]
