"""`LagListener`: how far each streams query is behind the linear position, after each batch."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pyspark.sql.streaming.listener import (
    QueryIdleEvent,
    QueryProgressEvent,
    QueryStartedEvent,
    QueryTerminatedEvent,
    StreamingQueryListener,
)

__all__ = ["LagListener", "lag_from_progress"]

log = logging.getLogger("streams.spark")


def lag_from_progress(progress: Any) -> dict[str, int]:
    """Per stream, the IDs between the batch's end offset and the linear position the source
    last proved (its ``latestOffset`` report): the same figure `streams.Client.groups` shows as
    a reader group's lag. Sources other than ``streams`` are ignored."""
    lags: dict[str, int] = {}
    for source in progress.sources:
        end, latest = _frontier(source.endOffset), _frontier(source.latestOffset)
        if end is None:
            continue
        for name, position in end.items():
            linear = latest.get(name, position) if latest is not None else position
            lags[name] = max(0, int(linear) - int(position))
    return lags


def _frontier(text: Any) -> dict[str, int] | None:
    if not text:
        return None
    try:
        data = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return None
    if (
        not isinstance(data, dict)
        or data.get("v") != 1
        or not isinstance(data.get("streams"), dict)
    ):
        return None
    return {str(k): int(v) for k, v in data["streams"].items()}


class LagListener(StreamingQueryListener):
    """Logs (``streams.spark``, INFO) and keeps each query's lag per stream after every batch.

    ``spark.streams.addListener(LagListener())``; then ``listener.lag(query.id)`` (or
    ``listener.latest`` for the last batch of any query) is ``{stream: IDs behind}``.

    Spark delivers listener events on its own thread, after the fact: a query may have
    finished (``awaitTermination`` returned) before its last batch's event arrived. So for a
    query that is no longer active, `lag` first waits (``timeout`` seconds at most) for the
    event that says it terminated, which Spark sends after every event of its batches.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_query: dict[str, dict[str, int]] = {}
        self._terminated: dict[str, threading.Event] = {}
        self.latest: dict[str, int] = {}

    def lag(self, query_id: Any, timeout: float = 10.0) -> dict[str, int]:
        """The lag after the query's last batch reported so far (``{}``: none yet)."""
        if not _active(query_id):
            self._terminated_event(str(query_id)).wait(timeout)
        with self._lock:
            return dict(self._by_query.get(str(query_id), {}))

    def _terminated_event(self, query_id: str) -> threading.Event:
        with self._lock:
            return self._terminated.setdefault(query_id, threading.Event())

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        pass

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        progress = event.progress
        lags = lag_from_progress(progress)
        if not lags:
            return
        with self._lock:
            self._by_query[str(progress.id)] = lags
            self.latest = lags
        log.info(
            "query %s batch %s: lag %s",
            progress.name or progress.id, progress.batchId, lags,
        )  # fmt: skip

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        pass

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        self._terminated_event(str(event.id)).set()


def _active(query_id: Any) -> bool:
    """Whether a query of this id runs in the active Spark session (True when that cannot be
    told: then `LagListener.lag` answers at once, as before)."""
    try:
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession()
        if session is None:
            return True
        return any(str(q.id) == str(query_id) for q in session.streams.active)
    except Exception:
        return True
