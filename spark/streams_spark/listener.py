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
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_query: dict[str, dict[str, int]] = {}
        self.latest: dict[str, int] = {}

    def lag(self, query_id: Any) -> dict[str, int]:
        with self._lock:
            return dict(self._by_query.get(str(query_id), {}))

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
        pass
