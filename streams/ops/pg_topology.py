"""`streams doctor`'s view of the PostgreSQL deployment: which server is the primary, which are
standbys and how far behind, and what is degraded.

Each host of the database URL is asked on its own (a libpq multi-host URL, ``h1:p1,h2:p2``,
names every server a failover may move the primary to; `streams.store.topology` says what is
asked). Degraded, with the reason:

* no host is a primary, or more than one is (a former primary writable again after a
  failover: split brain; writers may write to either);
* a host does not answer (no failover target there);
* the primary names synchronous standbys (``synchronous_standby_names``) and none is streaming
  as ``sync``/``quorum``: every commit waits until one is;
* a standby (in the URL, streaming from the primary, or the read URL's) is more than
  `LAG_WARNING_SECONDS` behind, or its replay is paused.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..config import redact_url
from ..core.standby_fence import parse_lsn
from ..store.driver import run
from ..store.topology import ServerState, server_state, standbys

__all__ = ["LAG_WARNING_SECONDS", "Finding", "hosts_of", "postgres_topology"]

#: A standby further behind than this (replay) is reported.
LAG_WARNING_SECONDS = 30.0

#: ``(check name, ok, detail)``, as `streams.ops.doctor.Check` takes them.
Finding = tuple[str, bool, str]


def hosts_of(url: str) -> list[tuple[str, str]]:
    """The ``(conninfo, label)`` of each host of a (possibly multi-host) URL, each asked on its
    own (``target_session_attrs=any``: a standby must answer too)."""
    params: dict[str, Any] = conninfo_to_dict(url)
    hosts = str(params.get("host") or params.get("hostaddr") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    found = []
    for host, port in zip(hosts, ports, strict=False):
        one = dict(params, host=host, port=port or None, target_session_attrs="any")
        one.pop("hostaddr", None)
        one["connect_timeout"] = min(int(str(params.get("connect_timeout") or 3)), 3)
        label = f"{host}:{port}" if port else host
        found.append((make_conninfo(**{k: v for k, v in one.items() if v is not None}), label))
    return found


def _state(conninfo: str) -> ServerState:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return run(conn, server_state())


def _describe(state: ServerState) -> str:
    if not state.in_recovery:
        return f"primary, timeline {state.timeline}, WAL at {state.lsn}"
    age = "no transaction replayed yet"
    if state.replay_age is not None:
        age = f"last transaction replayed {state.replay_age:.1f} s ago"
    paused = ", replay PAUSED" if state.replay_paused else ""
    return f"standby, timeline {state.timeline}, replayed to {state.lsn}, {age}{paused}"


def _lsn(text: str | None) -> int | None:
    return parse_lsn(text) if text else None


def postgres_topology(database_url: str, read_database_url: str | None = None) -> list[Finding]:
    """The findings (see the module docstring)."""
    findings: list[Finding] = []
    primaries: list[tuple[str, str, ServerState]] = []
    hosts = hosts_of(database_url)
    for conninfo, label in hosts:
        try:
            state = _state(conninfo)
        except psycopg.Error as exc:
            reason = type(exc).__name__
            findings.append((f"postgres {label}", False, f"does not answer ({reason})"))
            continue
        findings.append((f"postgres {label}", not state.replay_paused, _describe(state)))
        if not state.in_recovery:
            primaries.append((conninfo, label, state))
    if len(hosts) > 1 or len(primaries) != 1:
        if not primaries:
            findings.append(("postgres primary", False, "no host of the URL is a primary"))
        elif len(primaries) > 1:
            labels = ", ".join(f"{label} (timeline {s.timeline})" for _, label, s in primaries)
            findings.append(
                (
                    "postgres primary",
                    False,
                    f"more than one primary: {labels}; split brain: fence the one with the "
                    "lower timeline (a former primary), writers may write to either",
                )
            )
    for conninfo, label, state in primaries:
        name = "postgres replication" + (f" {label}" if len(primaries) > 1 else "")
        findings.append(_replication(conninfo, label, state, name))
    if read_database_url:
        primary_lsn = _lsn(primaries[0][2].lsn) if len(primaries) == 1 else None
        findings.extend(_read_url(read_database_url, primary_lsn))
    return findings


def _replication(conninfo: str, label: str, state: ServerState, name: str) -> Finding:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        peers = run(conn, standbys())
    names = state.synchronous_standby_names.strip()
    lines = []
    lagging = []
    for peer in peers:
        lag = "lag not visible (grant pg_monitor)"
        if peer.replay_lag_bytes is not None:
            seconds = peer.replay_lag_seconds or 0.0
            lag = f"replay lag {peer.replay_lag_bytes} bytes, {seconds:.2f} s"
            if seconds > LAG_WARNING_SECONDS:
                lagging.append(peer.name)
        lines.append(f"{peer.name} ({peer.state}, {peer.sync_state}, {lag})")
    synchronous = [p for p in peers if p.sync_state in ("sync", "quorum")]
    ok = not lagging and (not names or bool(synchronous))
    detail = f"{label}: " + ("; ".join(lines) if lines else "no standby streaming")
    if names and not synchronous:
        detail += (
            f"; synchronous_standby_names = {names!r} but no synchronous standby is streaming: "
            "every commit waits"
        )
    elif not names and peers:
        detail += "; asynchronous: a failover may lose the last acknowledged commits"
    if lagging:
        detail += f"; behind by more than {LAG_WARNING_SECONDS:.0f} s: {', '.join(lagging)}"
    return (name, ok, detail)


def _read_url(url: str, primary_lsn: int | None) -> list[Finding]:
    try:
        state = _state(url)
    except psycopg.Error as exc:
        return [("postgres read URL", False, f"{redact_url(url)}: {type(exc).__name__}")]
    detail = f"{redact_url(url)}: {_describe(state)}"
    replayed = _lsn(state.lsn)
    if primary_lsn is not None and replayed is not None and state.in_recovery:
        detail += f", {max(0, primary_lsn - replayed)} bytes of WAL behind the primary"
    # Readers wait for it to replay past each proof (or fall back to the primary).
    return [("postgres read URL", not state.replay_paused, detail)]
