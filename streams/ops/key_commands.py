"""``streams keys [list|rotate]``: the replication keys that sign what the prober publishes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click

from ..cli_params import common_options
from .shared import emit, open_client

__all__ = ["keys"]


@click.command()
@click.argument("action", type=click.Choice(["list", "rotate"]), default="list")
@click.option("--json", "as_json", is_flag=True)
@common_options
def keys(
    action: str, as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """List the replication keys (never their secrets), or rotate them: add a key and retire
    the others.

    The elected prober signs the facts it publishes on Redis with the newest key's private
    seed (schema streams_prover, readable by the prover role only) and seals their payloads
    with its cipher key; readers deliver them without PostgreSQL only if the signature checks
    under a live key of their database incarnation. Rotate after a seed may have leaked (the
    server makes the new secrets; rotating needs the right to write the key tables). With
    Redis, a KEYS line makes readers and provers read the keys again at once; others follow
    within 30 s. After a restore or a failover the prover makes a new key by itself.
    """
    with open_client(database_url, redis_url, prefix) as client:
        if action == "rotate":
            new = client.rotate_replication_keys()
            emit({"rotated": True, "key": new}, as_json, lambda d: iter([f"new key {d['key']}; "
                  "every other key is retired"]))  # fmt: skip
            return
        listed = [
            {**k, "created_at": _iso(k["created_at"]), "retired_at": _iso(k["retired_at"])}
            for k in client.replication_keys()
        ]
    emit(listed, as_json, _keys_text)


def _iso(value: object) -> str | None:
    return None if value is None else value.isoformat()  # type: ignore[attr-defined]


def _keys_text(keys: list[dict[str, Any]]) -> Iterator[str]:
    for k in keys:
        state = "live" if k["live"] else f"retired {k['retired_at']}"
        made = k["incarnation"] or "not recorded (a key from before revision 0012)"
        yield f"key {k['id']}: created {k['created_at']}, {state}, incarnation {made}"
