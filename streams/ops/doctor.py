"""`streams doctor`: checks an operator runs when something looks wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ..config import Settings, redact_url
from ..core.constants import replication_channel
from ..core.staleness import STALE_AFTER_MS
from ..core.stalls import holding_bound
from ..errors import StreamsError
from ..store import sessions
from ..store.driver import run
from ..store.holders import (
    LockHolder,
    end_exclusive_holders,
    end_long_holders,
    exclusive_streams,
    holding_state,
)
from ..store.keys import key_health
from ..store.leases import (
    repair_sequence_now,
    retire_expired_writers,
    sequence_state,
    unseen_ids,
)
from ..store.overview import StreamHealth, stream_health
from ..store.probe import held_streams, probe
from ..store.reader_groups import list_groups
from ..store.registry import check_schema, list_streams
from ..store.retention import prune_target
from ..transport.redis_errors import connection_error
from ..types import StreamInfo
from .pg_topology import postgres_topology
from .redis_topology import redis_topology
from .render import age

#: A reservation held open longer than this is reported: it holds every reader back.
HELD_WARNING_SECONDS = 5.0
#: A sequence at or above this is reported: near the bigint limit (``2**63 - 1``), where the
#: next appends fail. No stream gets there by appending (4.6e18 IDs); a sequence moved there
#: by repair after a forged position does, which bricks the stream.
SEQUENCE_NEAR_LIMIT = 2**62
#: Streams whose facts `streams doctor` reads by default (the "deep" checks: facts beyond the
#: sequence, IDs in no known table, retention): the ones that need it most (`_deep_first`).
#: The other checks read every stream at once (`streams.store.overview.stream_health`).
DEEP_STREAMS = 100

__all__ = ["Check", "diagnose", "repair"]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


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
        chosen = _deep_first(infos, health, held, deep)
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
        checks.extend(_streams_checks(conn, infos, stale_after_ms, settings.lease_seconds, deep))
    if settings.redis_url:
        import redis

        from ..transport.discovery import open_client

        # A connection failure says why (`streams.transport.redis_errors`, password scrubbed);
        # anything else, even redis-py's URL parser raising ValueError, shows only the class name:
        # such messages may quote part of the URL, and so of its password.
        failure: str | None = None
        try:
            client = open_client(settings.redis_url, socket_timeout=3, socket_connect_timeout=3)
            try:
                client.ping()
                channel = replication_channel(settings.prefix)
                listeners = dict(client.pubsub_numsub(channel)).get(channel.encode(), 0)
            finally:
                client.close()
        except (redis.RedisError, OSError) as exc:
            failure = str(connection_error(settings.redis_url, exc, purpose="doctor"))
        except Exception as exc:
            failure = f"cannot reach {redact_url(settings.redis_url)}: {type(exc).__name__}"
        if failure is None:
            checks.append(
                Check(
                    "redis",
                    True,
                    f"{redact_url(settings.redis_url)}: {listeners} process(es) listening on "
                    f"{channel!r}",
                )
            )
        else:
            checks.append(Check("redis", False, failure))
    if settings.redis_url:
        checks.append(_channel_check(settings, [i.name for i in infos]))
        checks.append(Check("redis topology", *redis_topology(settings.redis_url)))
    return checks


#: How many of the most recent IDs `streams doctor` looks up in every table it knows.
UNSEEN_WINDOW = 10_000


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
    chosen = _deep_first(infos, health, held, deep)
    checks: list[Check] = []
    quiet = 0
    for info in infos:
        h = health.get(info.id)
        if h is None:  # dropped since it was listed
            continue
        if info.id in chosen:
            checks.extend(_stream_checks(conn, info, h, info.id in held, stale_after_ms,
                                         lease_seconds))  # fmt: skip
            continue
        failing = [c for c in _quick_checks(info, h) if not c.ok]
        if info.id in held:
            failing.append(_held_check(conn, info, lease_seconds))
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


def _deep_first(
    infos: list[StreamInfo],
    health: dict[int, StreamHealth],
    held: dict[int, int],
    deep: int | None,
) -> set[int]:
    """The ids of the streams the deep checks run on: every stream with ``deep`` None, else
    the ones that need them most, at most ``deep``: failing a set-based check, held back,
    with writers, groups, retention or declared tables, written to; newest first."""

    def rank(info: StreamInfo) -> tuple[int, int]:
        h = health[info.id]
        if not all(c.ok for c in _quick_checks(info, h)) or info.id in held:
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
    ranked = sorted((rank(info), info.id) for info in known)
    return {i for (level, _), i in ranked[:deep] if level < 3}


def _quick_checks(info: StreamInfo, h: StreamHealth) -> list[Check]:
    """The set-based checks of one stream (`streams.store.overview.stream_health`)."""
    checks = []
    behind = h.max_position is not None and h.max_position > h.allocated
    if behind or h.allocated >= SEQUENCE_NEAR_LIMIT:
        checks.append(
            _sequence_check(info, h.allocated, h.max_position, "not read", h.max_position, behind)
        )
    checks.append(_groups_check(info, h))
    checks.append(_writers_check(info, h.expired_writers))
    return checks


def _sequence_check(
    info: StreamInfo,
    allocated: int,
    max_used: int | None,
    stored: int | str | None,
    max_position: int | None,
    behind: bool,
) -> Check:
    near_limit = allocated >= SEQUENCE_NEAR_LIMIT
    return Check(
        f"stream {info.name}: sequence",
        not behind and not near_limit,
        f"sequence at {allocated}, highest ID used {max_used} (facts "
        f"{stored}, writer and group positions {max_position})"
        + (
            "; BEHIND: the next writer to start repairs it (or `streams doctor --repair`)"
            if behind
            else ""
        )
        + (
            f"; NEAR THE BIGINT LIMIT ({2**63 - 1}): appends will fail; no stream gets "
            "there by appending: a repair moved it to a forged or restored position "
            "(see the reader groups check)"
            if near_limit
            else ""
        ),
    )


def _writers_check(info: StreamInfo, expired: int) -> Check:
    return Check(
        f"stream {info.name}: writers",
        expired == 0,
        "no expired lease"
        if expired == 0
        else f"{expired} writer(s) with an expired lease not yet retired "
        "(retired by the next positions call or writer heartbeat; if it stays, a "
        "transaction of theirs is still open)",
    )


def _stream_checks(
    conn: psycopg.Connection[Any],
    info: StreamInfo,
    health: StreamHealth,
    held: bool,
    stale_after_ms: int,
    lease_seconds: float,
) -> list[Check]:
    state = run(conn, sequence_state(info))
    allocated = state.last_value or 0
    checks = [
        _sequence_check(
            info,
            allocated,
            state.max_used,
            state.max_stored,
            state.max_position,
            state.repair_target is not None,
        ),
        _groups_check(info, health),
    ]
    declared = ", ".join(str(t) for t in info.fact_tables) or "none"
    if state.missing_tables:
        missing = ", ".join(str(t) for t in state.missing_tables)
        checks.append(
            Check(
                f"stream {info.name}: declared tables",
                False,
                f"declared tables do not exist: {missing}; their IDs cannot be seen by repair "
                f"(`streams tables {info.name} ...` to fix the declaration)",
            )
        )
    unseen = run(conn, unseen_ids(info, UNSEEN_WINDOW))
    detail = f"besides streams_facts: {declared}"
    if unseen.unseen:
        detail += (
            f"; {unseen.unseen} of the last {unseen.ids} IDs have no row in any of them: "
            "rolled back, or facts in a table this stream does not declare (or in rows a "
            "declaration's WHERE leaves out), which sequence repair cannot see (`streams "
            f"tables {info.name} \"TABLE.COLUMN [WHERE KEY = 'VALUE']\"`; index TABLE on "
            "(COLUMN), or on (KEY, COLUMN) when a WHERE says which rows are this stream's)"
        )
    checks.append(Check(f"stream {info.name}: fact tables", True, detail))
    if held:
        checks.append(_held_check(conn, info, lease_seconds))
    else:  # no session holds it: complete is max allocated, no need to probe
        checks.append(
            Check(
                f"stream {info.name}: linear position",
                True,
                f"{health.allocated} (max allocated {health.allocated})",
            )
        )
    retention = _retention_check(conn, info, stale_after_ms)
    if retention is not None:
        checks.append(retention)
    checks.append(_writers_check(info, health.expired_writers))
    return checks


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


def _groups_check(info: StreamInfo, health: StreamHealth) -> Check:
    """Reader groups committed beyond the stream's max allocated ID: no reader reaches such a
    position by itself (commits refuse it: `streams.errors.InvalidPosition`), so the row was
    written by hand or by a role that may write ``streams_reader_groups``, or a restore set
    the sequence back. The group skips every fact up to it, and sequence repair would move the
    sequence there."""
    allocated = health.allocated
    beyond = [(group, position) for group, position in health.groups if position > allocated]
    name = f"stream {info.name}: reader groups"
    if not beyond:
        return Check(name, True, f"none beyond max allocated ({allocated})")
    shown = ", ".join(f"{group} (at {position})" for group, position in beyond)
    return Check(
        name,
        False,
        f"group(s) {shown} beyond max allocated {allocated}: no fact above it was ever "
        "written, so the position is forged (a role that may write streams_reader_groups) or "
        "from before a restore; the group would skip every fact up to it, and sequence repair "
        "(a writer's start, `streams doctor --repair`) would move the sequence there. Delete "
        f"the group (`streams groups delete GROUP --stream {info.name}`) first",
    )


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


def _retention_check(
    conn: psycopg.Connection[Any], info: StreamInfo, stale_after_ms: int
) -> Check | None:
    """Retention at a glance: how far it pruned, what waits for `streams prune` and what holds
    it back; failing when a reader group lost facts (its position is below what was pruned) or
    is stale (no commit for ``stale_after_ms`` while holding retention back: an abandoned
    reader or Spark checkpoint, `streams.core.staleness`)."""
    goal = run(conn, prune_target(info))
    if info.retention_ms is None and goal.pruned_through == 0:
        return None
    keeps = "forever" if info.retention_ms is None else f"{info.retention_ms} ms"
    groups = run(conn, list_groups(info, stale_after_ms=stale_after_ms))
    lost = [g for g in groups if g.position < goal.pruned_through]
    stale = [g for g in groups if g.stale]
    detail = f"keeps {keeps}, pruned through {goal.pruned_through}"
    if goal.target > goal.pruned_through:
        detail += f"; IDs up to {goal.target} may go now (`streams prune {info.name}`)"
    elif info.retention_ms is not None:
        detail += f"; held by: {goal.limited_by}"
    if lost:
        names = ", ".join(f"{g.group} (at {g.position})" for g in lost)
        detail += (
            f"; reader group(s) {names} are below what was pruned and lost facts: their "
            "readers fail with FactsPruned (delete the group, or start it again)"
        )
    if stale:
        names = ", ".join(
            f"{g.group} (at {g.position}, last commit {age(g.idle_ms)} ago)" for g in stale
        )
        detail += (
            f"; stale reader group(s) {names} hold retention back: no commit for "
            f"{age(stale_after_ms)} or more; if its reader or Spark checkpoint is gone, "
            f"`streams groups delete GROUP --stream {info.name}`"
        )
    return Check(f"stream {info.name}: retention", not lost and not stale, detail)


def _held_check(conn: psycopg.Connection[Any], info: Any, lease_seconds: float) -> Check:
    """Which sessions hold the stream's linear position back, who they are (role, application,
    address), for how long, and when the bound of docs/design/liveness.md
    (`streams.store.holders`: the longest lease of the stream's writers, at least
    ``lease_seconds``) passes for them."""
    found = run(conn, probe([info]))[info.name]
    state = run(conn, holding_state(info))
    holders = state.holders
    name = f"stream {info.name}: linear position"
    if not holders:
        return Check(name, True, f"{found.complete} (max allocated {found.max_allocated})")
    bound = holding_bound(lease_seconds, state.writers_lease)
    oldest = holders[0]
    # Named first: a session whose writer's lease expired (it should have been ended: this
    # role may not end it, or nobody has looked since), then sessions that are no writer's
    # (anyone may take a reservation lock), else the oldest.
    expired = [h for h in holders if (h.lease_expired_seconds or 0) > 0]
    strangers = [h for h in holders if h.instance is None]
    past = [h for h in holders if _past_bound(h, bound)]
    exclusive = [h for h in holders if h.exclusive]
    shown = (exclusive or expired or past or strangers or [oldest])[0]
    label = "expired: " if expired else "past the bound: " if past else "oldest: "
    if not expired and not past and strangers:
        label = "no writer's: "
    if exclusive:
        label = "blocking every writer: "
    detail = (
        f"{found.complete} (max allocated {found.max_allocated}); {len(holders)} session(s) "
        f"holding its reservation locks; {label}{shown.describe()}; " + _bound_detail(shown, bound)
    )
    others = [h for h in strangers if h is not shown][:4]
    if others:
        detail += "; also no writer's: " + "; ".join(h.who() for h in others)
    if expired:
        detail += (
            "; it holds the stream past its writer's lease: `streams doctor --repair` (or any "
            "reader) ends it if this role may signal that session"
        )
    longest = max(
        h.transaction_seconds if h.holding_seconds is None else h.holding_seconds for h in holders
    )
    healthy = not expired and not past and not exclusive and longest < HELD_WARNING_SECONDS
    return Check(name, healthy, detail)


def _past_bound(holder: LockHolder, bound: float) -> bool:
    return holder.holding_seconds is not None and holder.holding_seconds > bound


def _bound_detail(holder: LockHolder, bound: float) -> str:
    """When the bound passes for ``holder``, and what then ends it."""
    ends = (
        "the next reader or prover to look ends it (if its role may signal that session), "
        "and so does `streams doctor --repair`"
        if holder.may_end
        else "this role may not end that session (a superuser's, or another role's without "
        "pg_signal_backend); readers and provers of a role that may will"
    )
    if holder.holding_seconds is None:
        return (
            f"bound {bound:.1f} s (the longest lease); how long it has held the stream is not "
            "visible to this role (pg_read_all_stats, or a superuser, sees it); readers and "
            "the prover end it one bound after the sequence passed its key"
        )
    left = bound - holder.holding_seconds
    if left > 0:
        return (
            f"the bound ({bound:.1f} s, the longest lease) passes in {left:.1f} s at the "
            f"latest; then {ends}"
        )
    return f"past the bound ({bound:.1f} s, the longest lease) by {-left:.1f} s: {ends}"
