"""Prometheus metrics (optional: ``pip install 'streams[metrics]'``).

Two collectors, both *pull*: nothing is computed until Prometheus scrapes, so the hot paths
(appends, probes) pay nothing for metrics.

* `ClientCollector` reports what one process does: each writer of a `streams.Client`
  (position, pending and in-flight IDs, facts appended), each reader (position per stream,
  probes, pages and rows read) and the Redis link (commands received, malformed, foreign,
  published, dropped, reconnects; its quarantines: convictions by reason, seconds left), and
  what the readers took from Redis and refused: signed ranges verified and applied, lines
  rejected by reason (the reasons `streams.core.signing.verify_range` gives), shared proofs
  refused.
  `enable(client, port=...)` registers it and, with a port, serves ``/metrics``.
* `DatabaseCollector` reports stream-level figures of one database, read at scrape time with
  the same set-based queries as `streams positions` (`streams.store.overview`), per stream
  only for the streams that show something (live writers, groups, held; or a filter), and
  totals (how many streams): linear position, max allocated, scratchpad, the age
  of the oldest pending ID and each session holding the stream back (who holds it), each
  writer's position and pending count, each reader group's (and Spark query's) lag in IDs and
  in time and the retention it holds back, and the database's sessions by role and state.
  ``streams metrics serve`` runs it, so a Prometheus can
  scrape a deployment without touching its services.

What operators of such systems fear most is a silent stall: the linear position not moving
while max allocated moves (a writer holding an ID open). ``deploy/prometheus/alerts.yml`` has a
rule for it, ``StreamsLinearPositionStalled``; ``deploy/grafana/streams.json`` draws these
figures (tests/integration/test_dashboard.py checks that its queries name only what is
exported here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .config import Settings
from .core.stalls import holding_bound
from .errors import ConfigurationError, StreamsError
from .store import sessions
from .store.driver import run
from .store.holders import HoldingState, holding_state
from .store.overview import Overview, overview
from .store.role_checks import connections_by_role
from .types import StreamPositions

if TYPE_CHECKING:
    from .client import Client
    from .transport.link import RedisLink

__all__ = ["ClientCollector", "DatabaseCollector", "enable", "serve", "serve_registry"]

_PREFIX = "streams"


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigurationError(
            "metrics need prometheus-client: pip install 'streams[metrics]'"
        ) from None
    return prometheus_client


def _family(kind: str, name: str, doc: str, labels: list[str]) -> Any:
    core = _prometheus().metrics_core
    cls = core.GaugeMetricFamily if kind == "gauge" else core.CounterMetricFamily
    return cls(f"{_PREFIX}_{name}", doc, labels=labels)


class ClientCollector:
    """The figures of one client's writers, readers and Redis link (see the module doc)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are built at scrape time

    def collect(self) -> Iterator[Any]:
        position = _family(
            "gauge", "writer_position", "Per-writer position.", ["stream", "instance"]
        )
        pending = _family(
            "gauge",
            "writer_pending_ids",
            "IDs reserved and not completed, plus reservations in flight.",
            ["stream", "instance"],
        )
        appended = _family(
            "counter", "writer_appended_facts", "Facts committed.", ["stream", "instance"]
        )
        for writer in list(self._client.writers):
            wcore = writer.core
            if wcore.fenced:
                continue
            tracker = wcore.tracker
            labels = [wcore.stream_name, wcore.instance]
            position.add_metric(labels, tracker.local_position)
            pending.add_metric(labels, tracker.pending_count + tracker.in_flight_count)
            appended.add_metric(labels, wcore.appended)
        yield from (position, pending, appended)

        reader_position = _family(
            "gauge",
            "reader_position",
            "Everything at or below it was delivered.",
            ["stream", "group"],
        )
        probes = _family("counter", "reader_probes", "Probes of PostgreSQL.", ["streams", "group"])
        pages = _family("counter", "reader_pages", "Pages of rows read.", ["streams", "group"])
        rows = _family(
            "counter", "reader_rows", "Rows read (catch-up and live).", ["streams", "group"]
        )
        signed = _family(
            "counter",
            "reader_signed_ranges",
            "Signed ranges from Redis that verified, and that were applied (delivered).",
            ["streams", "group", "outcome"],
        )
        rejected = _family(
            "counter",
            "reader_rejected_lines",
            "Signed-range lines from Redis rejected, by reason (malformed, unknown-key, "
            "bad-mac, inconsistent, ...; no-keys: a failed read of the keys).",
            ["streams", "group", "reason"],
        )
        refused = _family(
            "counter",
            "reader_refused_proofs",
            "Shared proofs refused: above the stream's max allocated ID.",
            ["streams", "group"],
        )
        standby = _family(
            "counter",
            "reader_standby_reads",
            "Reads of a reader with a read URL, by outcome: rows read on the standby; read on "
            "the primary after the standby was behind (fallback_lag) or down "
            "(fallback_unreachable) for the max wait, or on another timeline "
            "(fallback_timeline), or in the retry interval after a fallback (primary).",
            ["streams", "group", "outcome"],
        )
        standby_lag = _family(
            "gauge",
            "reader_standby_lag_bytes",
            "Bytes of WAL the read URL's standby was behind the last proof at the last look.",
            ["streams", "group"],
        )
        standby_rows = _family(
            "counter", "reader_standby_rows", "Rows read on the standby.", ["streams", "group"]
        )
        for reader in list(self._client.readers):
            rcore = reader.core
            group = rcore.group or ""
            for name, value in rcore.positions.items():
                reader_position.add_metric([name, group], value)
            # A pattern reader is labelled by its pattern: its streams come and go.
            sub = rcore.subscription
            label = ",".join(rcore.names) if sub is None else f"~{sub.pattern.pattern}"
            key = [label, group]
            probes.add_metric(key, rcore.counters.probes)
            pages.add_metric(key, rcore.counters.pages)
            rows.add_metric(key, rcore.counters.rows)
            signed.add_metric([*key, "verified"], rcore.counters.verified_ranges)
            signed.add_metric([*key, "applied"], rcore.counters.signed_ranges)
            # A copy: the link's thread adds reasons as lines come (one C call, under the GIL).
            for reason, value in sorted(dict(rcore.counters.rejected_ranges).items()):
                rejected.add_metric([*key, reason], value)
            refused.add_metric(key, rcore.counters.refused_proofs)
            route = rcore.route
            if route is not None:
                for outcome, value in route.outcomes.items():
                    standby.add_metric([*key, outcome], value)
                standby_lag.add_metric(key, route.lag_bytes)
                standby_rows.add_metric(key, rcore.counters.standby_rows)
        yield from (reader_position, probes, pages, rows, signed, rejected, refused)
        yield from (standby, standby_lag, standby_rows)

        link = self._client._link
        if link is not None:
            yield from _link_families(link)


def _link_families(link: RedisLink) -> Iterator[Any]:
    """The Redis link's counters, whether it is live, and its quarantines."""
    stats, prefix = link.stats, link.core.prefix
    counters = {
        "received": stats.received,
        "malformed": stats.malformed,
        "foreign": stats.foreign,
        "hints": stats.hints,
        "published": stats.published,
        "suppressed": stats.suppressed,
        "dropped": link.dropped,
        "reconnects": stats.reconnects,
        "unheard": stats.unheard,
        "stale_map": stats.stale_map,
    }
    family = _family(
        "counter", "link_commands", "Replication commands by outcome.", ["prefix", "kind"]
    )
    for kind, value in counters.items():
        family.add_metric([prefix, kind], value)
    up = _family("gauge", "link_connected", "1 if the Redis fast path is up.", ["prefix"])
    up.add_metric([prefix], 1 if link.connected else 0)
    convictions = _family(
        "counter",
        "link_foreign_convictions",
        "Quarantines of the Redis fast path: another deployment heard on the channel, by "
        "reason (synapse-commands, unknown-streams).",
        ["prefix", "reason"],
    )
    for reason, value in sorted(stats.convictions.items()):
        convictions.add_metric([prefix, reason], value)
    left = _family(
        "gauge",
        "link_quarantine_seconds",
        "Seconds left in the current quarantine of the Redis fast path (0: none).",
        ["prefix"],
    )
    quarantine = link.quarantine
    left.add_metric([prefix], 0.0 if quarantine is None else quarantine.left(time.monotonic()))
    yield from (family, up, convictions, left)


class DatabaseCollector:
    """Stream-level figures of one database, read at scrape time (see the module doc).

    Per-stream series only for the streams that show something (`streams.store.overview`,
    ``active``): a writer not retired, a reader group, a session holding it back; and for those
    whose name matches ``like`` (an SQL ``LIKE`` pattern). Totals over every stream always
    (``streams_streams``...), so a scrape stays small at ten thousand streams."""

    def __init__(self, settings: Settings, *, like: str | None = None) -> None:
        self._settings = settings
        self._like = like
        self._lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        up = _family("gauge", "database_up", "1 if the last scrape could read the database.", [])
        try:
            with (
                self._lock,
                sessions.connect(
                    self._settings.database_url, autocommit=False, purpose="metrics"
                ) as conn,
            ):
                found = run(conn, overview(retire=False, active=True))
                shown = {s.info.name: s for s in found.streams}
                if self._like is not None:
                    for s in run(conn, overview(self._like, retire=False)).streams:
                        shown.setdefault(s.info.name, s)
                # Who holds a stream back: only for the streams some session holds.
                items = [
                    (s.positions, run(conn, holding_state(s.info)) if s.info.id in found.held
                     else _NOT_HELD)
                    for _, s in sorted(shown.items())
                ]  # fmt: skip
                connections = run(conn, connections_by_role())
        except StreamsError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _total_families(found, len(items))
        yield from _stream_families(items)
        yield from _stall_families(items, self._settings.lease_seconds)
        yield from _writer_families(items)
        yield from _group_families(items)
        yield _connection_family(connections)


_Item = tuple[StreamPositions, HoldingState]

#: What `holding_state` finds of a stream no session holds (no need to ask).
_NOT_HELD = HoldingState(None, 0, [])


def _total_families(found: Overview, shown: int) -> Iterator[Any]:
    streams = _family("gauge", "streams", "Streams in the database.", [])
    streams.add_metric([], found.total)
    series = _family(
        "gauge",
        "streams_with_series",
        "Streams with per-stream series in this scrape: with a writer not retired, a reader "
        "group or a session holding them back, or matching the collector's filter.",
        [],
    )
    series.add_metric([], shown)
    held = _family(
        "gauge", "streams_held", "Streams some session holds back (a reservation lock).", []
    )
    held.add_metric([], len(found.held))
    yield from (streams, series, held)


def _stream_families(items: list[_Item]) -> Iterator[Any]:
    linear = _family("gauge", "linear_position", "Every ID at or below it completed.", ["stream"])
    allocated = _family("gauge", "max_allocated", "The sequence's last value.", ["stream"])
    scratchpad = _family("gauge", "scratchpad_ids", "IDs in (linear, max allocated].", ["stream"])
    oldest = _family(
        "gauge", "oldest_pending_seconds", "Age of the oldest open writing transaction.", ["stream"]
    )
    for p, _ in items:
        linear.add_metric([p.stream], p.linear)
        allocated.add_metric([p.stream], p.max_allocated)
        scratchpad.add_metric([p.stream], p.scratchpad)
        oldest.add_metric([p.stream], (p.oldest_pending_ms or 0) / 1000)
    yield from (linear, allocated, scratchpad, oldest)


def _stall_families(items: list[_Item], lease_seconds: float) -> Iterator[Any]:
    past_lease = _family(
        "gauge",
        "held_past_lease_seconds",
        "Longest time a session has held the stream back past the lease: an open writing "
        "transaction past its writer's lease, or any session past the bound (the longest "
        "lease of the stream's writers, at least the collector's), by its transaction's age "
        "or idle time (0: none; such a session is ended by the next reader or prover that "
        "looks, if its role may).",
        ["stream"],
    )
    holder = _family(
        "gauge",
        "stall_holder_seconds",
        "How long each session holding the stream's linear position back has held it (its "
        "transaction's age; outside a transaction, as a session-level lock, its idle time), by "
        "who holds it: writer instance ('' if it is no known writer's), login role, "
        "application_name and session state (the longest of a stream is its current stall; "
        "`streams doctor` names the session).",
        ["stream", "instance", "role", "application", "state"],
    )
    for p, state in items:
        holders = state.holders
        bound = holding_bound(lease_seconds, state.writers_lease)
        past = max(
            (
                max(h.lease_expired_seconds or 0.0, (h.holding_seconds or 0.0) - bound)
                for h in holders
            ),
            default=0.0,
        )
        past_lease.add_metric([p.stream], max(0.0, past))
        # Two sessions with the same labels (one writer's, say) are one series: the oldest.
        # No pid or address label: the series stay as few as the roles and applications.
        longest: dict[tuple[str, str, str, str], float] = {}
        for h in holders:
            key = (h.instance or "", h.role, h.application_name, h.state)
            held = h.transaction_seconds if h.holding_seconds is None else h.holding_seconds
            longest[key] = max(longest.get(key, 0.0), held)
        for key, seconds in sorted(longest.items()):
            holder.add_metric([p.stream, *key], seconds)
    yield from (past_lease, holder)


def _writer_families(items: list[_Item]) -> Iterator[Any]:
    position = _family(
        "gauge",
        "writer_persisted_position",
        "Per-writer position as persisted.",
        ["stream", "instance", "state"],
    )
    pending = _family(
        "gauge",
        "writer_persisted_pending",
        "Pending IDs at the writer's last heartbeat.",
        ["stream", "instance", "state"],
    )
    for p, _ in items:
        for name, w in p.writers.items():
            if w.retired:
                continue
            position.add_metric([p.stream, name, w.state], w.position)
            pending.add_metric([p.stream, name, w.state], w.pending)
    yield from (position, pending)


def _group_families(items: list[_Item]) -> Iterator[Any]:
    labels = ["stream", "group"]
    lag = _family("gauge", "group_lag_ids", "Linear position minus the group's.", labels)
    lag_seconds = _family(
        "gauge", "group_lag_seconds", "Age of the oldest fact the group has not consumed.", labels
    )
    holds = _family(
        "gauge",
        "group_holds_retention",
        "1 if the group stops retention's prune short of the stream's retention period.",
        labels,
    )
    held = _family(
        "gauge",
        "group_retention_held_ids",
        "IDs retention would prune but for the group (0 unless it holds retention back).",
        labels,
    )
    for p, _ in items:
        for g in p.groups:
            key = [p.stream, g.group]
            lag.add_metric(key, g.lag)
            lag_seconds.add_metric(key, (g.lag_ms or 0) / 1000)
            holds.add_metric(key, 1 if g.holds_retention else 0)
            held.add_metric(key, g.retention_held_ids)
    yield from (lag, lag_seconds, holds, held)


def _connection_family(connections: list[tuple[str, str, int]]) -> Any:
    family = _family(
        "gauge",
        "database_connections",
        "Sessions connected to the database, by login role and state ('unknown': another "
        "role's session, unless this one may read all statistics).",
        ["role", "state"],
    )
    for role, state, count in connections:
        family.add_metric([role, state], count)
    return family


def enable(client: Client, *, port: int | None = None, addr: str = "127.0.0.1") -> Any:
    """Register a `ClientCollector` for ``client`` (in prometheus-client's default registry)
    and, with ``port``, serve ``/metrics`` there. Returns the collector (unregister it with
    ``prometheus_client.REGISTRY.unregister``)."""
    prometheus = _prometheus()
    collector = ClientCollector(client)
    prometheus.REGISTRY.register(collector)
    if port is not None:
        prometheus.start_http_server(port, addr=addr)
    return collector


def serve(
    settings: Settings, port: int, addr: str = "127.0.0.1", *, like: str | None = None
) -> Any:
    """Serve `DatabaseCollector` figures on ``http://addr:port/metrics`` (a daemon thread;
    ``like``: streams that always have series); returns the server (``.shutdown()`` stops it)."""
    registry, server = serve_registry(port, addr)
    registry.register(DatabaseCollector(settings, like=like))
    return server


def serve_registry(port: int, addr: str = "127.0.0.1") -> tuple[Any, Any]:
    """A registry of its own served on ``http://addr:port/metrics`` (a daemon thread), empty
    until collectors are registered (``registry.register(ClientCollector(client))``); returns
    it and the server (``.shutdown()`` stops it). Raises `OSError` if it cannot listen there."""
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry()
    server, _thread = prometheus.start_http_server(port, addr=addr, registry=registry)
    return registry, server
