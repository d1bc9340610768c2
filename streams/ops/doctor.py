"""`streams doctor`: checks an operator runs when something looks wrong."""

from __future__ import annotations

import heapq
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from ..config import Settings, redact_url
from ..core.constants import replication_channel
from ..core.staleness import STALE_AFTER_MS
from ..errors import StreamsError
from ..store import sessions
from ..store.driver import run
from ..store.holders import (
    end_exclusive_holders,
    end_long_holders,
    exclusive_streams,
)
from ..store.keys import key_health
from ..store.leases import (
    repair_sequence_now,
    retire_expired_writers,
)
from ..store.overview import StreamHealth, stream_health
from ..store.probe import held_streams
from ..store.registry import check_schema, list_streams
from ..transport.redis_errors import connection_error
from ..types import StreamInfo
from .pg_topology import postgres_topology
from .redis_topology import redis_topology
from .stream_checks import SEQUENCE_NEAR_LIMIT, Check, held_check, quick_checks, stream_checks

#: Streams whose facts `streams doctor` reads by default (the "deep" checks: facts beyond the
#: sequence, IDs in no known table, retention): the ones that need it most (`_deep_first`).
#: The other checks read every stream at once (`streams.store.overview.stream_health`).
DEEP_STREAMS = 100

__all__ = ["SEQUENCE_NEAR_LIMIT", "Check", "diagnose", "repair"]


def repair(settings: Settings, *, deep: int | None = DEEP_STREAMS) -> list[str]:
    """What is always safe, before the checks: retire writers whose lease expired, ending first
    the sessions they still hold open (`streams.store.leases.retire_expired_writers`), end
    every other session that has held a stream's reservation lock past the bound, by its
    transaction's age or, outside a transaction, its idle time (docs/design/liveness.md,
    `streams.store.holders.end_long_holders`, with ``settings.lease_seconds`` as the least
    bound) and every session holding one exclusively (`end_exclusive_holders`), and move
    every sequence past the IDs known to be used
    (`streams.store.leases.repair_sequence`, under the same registration lock a starting writer
    takes). Each on the streams that need it, found for all at once; sequences past the facts
    on the ``deep`` streams of the checks (None: all). Returns what was done."""
    done: list[str] = []
    with sessions.connect(settings.database_url, autocommit=False, purpose="doctor") as conn:
        infos = run(conn, list_streams())
        # One look at pg_locks for every stream, then only the streams that need it.
        for info in run(conn, exclusive_streams(infos)):
            for pid in run(conn, end_exclusive_holders(info)):
                done.append(
                    f"stream {info.name}: ended session pid {pid}, which held its reservation "
                    "lock exclusively (every writer waited for it)"
                )
        health = run(conn, stream_health(infos))
        held = run(conn, held_streams())
        chosen = _deep_first(infos, health, _suspect(_quick(infos, health), held), deep)
        for info in infos:
            h = health.get(info.id)
            if h is not None and h.expired_writers:
                for name in run(conn, retire_expired_writers(info)):
                    done.append(f"stream {info.name}: retired writer {name} (lease expired)")
            if info.id in held:
                for ended in run(conn, end_long_holders(info, settings.lease_seconds)):
                    done.append(
                        f"stream {info.name}: ended session pid {ended.pid} (role {ended.role}, "
                        f"application {ended.application_name!r}, address "
                        f"{ended.client or '(not visible)'}), which held it back for "
                        f"{ended.holding_seconds:.1f} s, past the bound ({ended.bound:.1f} s)"
                    )
            if info.id in chosen:
                target = run(conn, repair_sequence_now(info))
                if target is not None:
                    done.append(f"stream {info.name}: sequence moved to {target}")
    return done


def diagnose(
    settings: Settings, *, stale_after_ms: int = STALE_AFTER_MS, deep: int | None = DEEP_STREAMS
) -> list[Check]:
    """Every check, in order; a reader group idle ``stale_after_ms`` or longer while holding a
    stream's retention back fails its stream's retention check. The checks that read a
    stream's facts run on ``deep`` streams at most (None: all; `DEEP_STREAMS`)."""
    checks: list[Check] = []
    where = redact_url(settings.database_url)
    try:
        # A health check waits for a starting server 5 s at most (less, if configured so).
        conn = sessions.connect(
            settings.database_url,
            autocommit=True,
            connect_timeout=min(5.0, settings.connect_timeout),
            purpose="doctor",
        )
    except StreamsError as exc:  # StoreError (unreachable) or ConfigurationError (bad URL)
        found = [Check("database", False, str(exc))]
        if "," in settings.database_url:  # which hosts of a multi-host URL answer, as what
            found += [Check(*f) for f in postgres_topology(settings.database_url)]
        return found
    with conn:
        version = conn.execute("SHOW server_version").fetchone()
        checks.append(
            Check("database", True, f"{where} (PostgreSQL {version[0] if version else '?'})")
        )
        read_url = getattr(settings, "read_database_url", None)
        checks += [Check(*f) for f in postgres_topology(settings.database_url, read_url)]
        try:
            run(conn, check_schema())
            checks.append(Check("schema", True, "at head"))
        except StreamsError as exc:
            checks.append(Check("schema", False, str(exc)))
            return checks
        checks.append(_roles_check(conn))
        checks.append(_keys_check(conn))
        infos = run(conn, list_streams())
        # The channel is observed until it has been quiet for a while (a fixed wait, 0.25 s at
        # least): meanwhile, this session checks every stream.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="doctor-channel") as pool:
            channel = (
                pool.submit(_channel_check, settings, [i.name for i in infos])
                if settings.redis_url
                else None
            )
            checks.extend(
                _streams_checks(conn, infos, stale_after_ms, settings.lease_seconds, deep)
            )
            observed = None if channel is None else channel.result()
    if settings.redis_url:
        checks.append(_redis_check(settings.redis_url, settings.prefix))
    if observed is not None:
        checks.append(observed)
    if settings.redis_url:
        checks.append(Check("redis topology", *redis_topology(settings.redis_url)))
    return checks


def _redis_check(redis_url: str, prefix: str) -> Check:
    """Redis answers, and how many processes listen on the replication channel."""
    import redis

    from ..transport.discovery import open_client

    # A connection failure says why (`streams.transport.redis_errors`, password scrubbed);
    # anything else, even redis-py's URL parser raising ValueError, shows only the class name:
    # such messages may quote part of the URL, and so of its password.
    failure: str | None = None
    try:
        client = open_client(redis_url, socket_timeout=3, socket_connect_timeout=3)
        try:
            client.ping()
            channel = replication_channel(prefix)
            listeners = dict(client.pubsub_numsub(channel)).get(channel.encode(), 0)
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        failure = str(connection_error(redis_url, exc, purpose="doctor"))
    except Exception as exc:
        failure = f"cannot reach {redact_url(redis_url)}: {type(exc).__name__}"
    if failure is not None:
        return Check("redis", False, failure)
    return Check(
        "redis", True, f"{redact_url(redis_url)}: {listeners} process(es) listening on {channel!r}"
    )


def _streams_checks(
    conn: psycopg.Connection[Any],
    infos: list[StreamInfo],
    stale_after_ms: int,
    lease_seconds: float,
    deep: int | None,
) -> list[Check]:
    """The checks of every stream: set-based for all (sequence against the positions used,
    groups beyond max allocated, expired leases, who holds a stream back), and the deep ones
    on ``deep`` streams; a quiet stream that passes shows in one summary line."""
    health = run(conn, stream_health(infos))
    held = run(conn, held_streams())
    quick = _quick(infos, health)
    chosen = _deep_first(infos, health, _suspect(quick, held), deep)
    checks: list[Check] = []
    quiet = 0
    for info in infos:
        h = health.get(info.id)
        if h is None:  # dropped since it was listed
            continue
        if info.id in chosen:
            checks.extend(stream_checks(conn, info, h, info.id in held, stale_after_ms,
                                         lease_seconds))  # fmt: skip
            continue
        failing = [c for c in quick[info.id] if not c.ok]
        if info.id in held:
            failing.append(held_check(conn, info, lease_seconds))
        checks.extend(failing)
        quiet += not failing
    skipped = len(health) - len(chosen)
    detail = f"{len(health)} stream(s): {quiet} passed every set-based check"
    if skipped:
        detail += (
            f"; the checks that read facts (facts beyond the sequence, IDs in no known table, "
            f"retention) ran on {len(chosen)} of them (failing, held back, with writers, groups, "
            f"retention or declared tables, then the newest), not on {skipped}: "
            "`streams doctor --all-streams` runs them on every stream"
        )
    checks.append(Check("streams", True, detail))
    return checks


def _quick(infos: list[StreamInfo], health: dict[int, StreamHealth]) -> dict[int, list[Check]]:
    """Each stream's set-based checks, by id (a stream dropped since it was listed: none)."""
    return {info.id: quick_checks(info, health[info.id]) for info in infos if info.id in health}


def _suspect(quick: dict[int, list[Check]], held: dict[int, int]) -> set[int]:
    """The streams that fail a set-based check or that some session holds back."""
    return {i for i, found in quick.items() if not all(c.ok for c in found)} | set(held)


def _deep_first(
    infos: list[StreamInfo],
    health: dict[int, StreamHealth],
    suspect: set[int],
    deep: int | None,
) -> set[int]:
    """The ids of the streams the deep checks run on: every stream with ``deep`` None, else
    the ones that need them most, at most ``deep``: ``suspect`` (failing a set-based check,
    held back), with writers, groups, retention or declared tables, written to; newest
    first."""

    def rank(info: StreamInfo) -> tuple[int, int]:
        h = health[info.id]
        if info.id in suspect:
            level = 0
        elif h.live_writers or h.groups or info.retention_ms is not None or info.fact_tables:
            level = 1
        elif h.allocated or h.max_position:
            level = 2
        else:
            level = 3
        return level, -info.id

    known = [info for info in infos if info.id in health]
    if deep is None:
        return {info.id for info in known}
    ranked = heapq.nsmallest(deep, ((rank(info), info.id) for info in known))
    return {i for (level, _), i in ranked if level < 3}


def _keys_check(conn: psycopg.Connection[Any]) -> Check:
    """A live key made in this database's incarnation: without one no signed range verifies
    (readers read PostgreSQL for everything, correct but slower) until the prover renews the
    keys or someone runs ``streams keys rotate``; who may read the private keys is the
    ``roles`` check's."""
    health = run(conn, key_health())
    if health.live_here:
        return Check("keys", True, f"{health.live_here} live key(s) of this database's history")
    other = f" ({health.live} of another history)" if health.live else ""
    return Check(
        "keys",
        False,
        f"no live key of this database's history{other}: signed ranges are not taken from "
        "Redis until the prover makes one (it does, if its role may write the keys) or you run "
        "`streams keys rotate`",
    )


def _roles_check(conn: psycopg.Connection[Any]) -> Check:
    """`streams roles check`: grants beyond the role model (who else may sign, write proofs or
    keys, or read the readers' keys), and grants of the model missing where it is in use."""
    from .role_commands import check_roles

    report = check_roles(conn)
    if report.ok:
        return Check("roles", True, "no grant beyond the role model on the key tables")
    return Check("roles", False, "; ".join(report.lines()) + " (`streams roles check`)")


def _channel_check(settings: Settings, known: list[str]) -> Check:
    """Is another deployment (a Synapse homeserver, another `streams` database) on our
    replication channel? Publishes only REPLICATE, which is safe on any such channel."""
    from .channel import observe_channel

    assert settings.redis_url is not None
    name = f"redis channel {settings.prefix!r}"
    try:
        report = observe_channel(settings.redis_url, settings.prefix, known_streams=set(known))
    except StreamsError as exc:  # says what failed, the password scrubbed
        return Check(name, False, f"cannot observe: {exc}")
    except Exception as exc:  # redis-py's messages may quote the URL: class name only
        return Check(name, False, f"cannot observe: {type(exc).__name__}")
    if report.foreign is not None:
        return Check(name, False, report.foreign.describe(settings.prefix))
    answered = sorted({p.instance for p in report.positions})
    return Check(
        name,
        True,
        f"{len(answered)} writer instance(s) answered REPLICATE, no other deployment heard",
    )
