"""`streams doctor`: checks an operator runs when something looks wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ._ops import run
from .config import Settings, redact_url
from .constants import replication_channel
from .errors import StreamsError
from .store import (
    check_schema,
    list_streams,
    max_allocated_sql,
    probe,
    reservation_lock_holders,
)

#: A reservation held open longer than this is reported: it holds every reader back.
HELD_WARNING_SECONDS = 5.0

__all__ = ["Check", "diagnose"]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def diagnose(settings: Settings) -> list[Check]:
    checks: list[Check] = []
    where = redact_url(settings.database_url)
    try:
        conn = psycopg.connect(settings.database_url, autocommit=True, connect_timeout=5)
    except psycopg.Error as exc:
        return [Check("database", False, f"cannot connect to {where}: {type(exc).__name__}")]
    with conn:
        version = conn.execute("SHOW server_version").fetchone()
        checks.append(
            Check("database", True, f"{where} (PostgreSQL {version[0] if version else '?'})")
        )
        try:
            run(conn, check_schema())
            checks.append(Check("schema", True, "at head"))
        except StreamsError as exc:
            checks.append(Check("schema", False, str(exc)))
            return checks
        for info in run(conn, list_streams()):
            row = conn.execute(
                f"SELECT {max_allocated_sql(info).as_string(conn)}, "
                "(SELECT max(stream_id) FROM streams_facts WHERE stream = %s), "
                "(SELECT count(*) FROM streams_writers WHERE stream = %s AND NOT retired "
                " AND lease_expires_at < clock_timestamp())",
                (info.id, info.id),
            ).fetchone()
            assert row is not None
            allocated, stored, expired = int(row[0]), row[1], int(row[2])
            behind = stored is not None and stored > allocated
            checks.append(
                Check(
                    f"stream {info.name}: sequence",
                    not behind,
                    f"sequence at {allocated}, highest stored ID {stored}"
                    + ("; BEHIND the data: the next writer to start repairs it" if behind else ""),
                )
            )
            checks.append(_held_check(conn, info))
            checks.append(
                Check(
                    f"stream {info.name}: writers",
                    expired == 0,
                    "no expired lease"
                    if expired == 0
                    else f"{expired} writer(s) with an expired lease not yet retired "
                    "(retired by the next positions call or writer heartbeat; if it stays, a "
                    "transaction of theirs is still open)",
                )
            )
    if settings.redis_url:
        import redis

        try:
            client = redis.Redis.from_url(settings.redis_url, socket_timeout=3)
            client.ping()
            channel = replication_channel(settings.prefix)
            listeners = dict(client.pubsub_numsub(channel)).get(channel.encode(), 0)
            client.close()
            checks.append(
                Check(
                    "redis",
                    True,
                    f"{redact_url(settings.redis_url)}: {listeners} process(es) listening on "
                    f"{channel!r}",
                )
            )
        except redis.RedisError as exc:
            checks.append(
                Check(
                    "redis",
                    False,
                    f"cannot reach {redact_url(settings.redis_url)}: {type(exc).__name__}",
                )
            )
    return checks


def _held_check(conn: psycopg.Connection[Any], info: Any) -> Check:
    """Which transactions hold the stream's linear position back, and for how long."""
    found = run(conn, probe([info]))[info.name]
    holders = run(conn, reservation_lock_holders(info))
    name = f"stream {info.name}: linear position"
    if not holders:
        return Check(name, True, f"{found.complete} (max allocated {found.max_allocated})")
    oldest = holders[0]
    detail = (
        f"{found.complete} (max allocated {found.max_allocated}); {len(holders)} writing "
        f"transaction(s) open, oldest pid {oldest.pid} {oldest.application_name!r} "
        f"{oldest.state} for {oldest.transaction_seconds:.1f} s"
    )
    return Check(name, oldest.transaction_seconds < HELD_WARNING_SECONDS, detail)
