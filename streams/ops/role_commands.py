"""`streams roles create|show|check|grant|revoke`: the least-privilege role model
(`streams.store.privileges`, granted by `streams.store.roles`, checked by
`streams.store.role_checks`).

``create`` makes the six NOLOGIN group roles (``streams_admin``, ``streams_operator``,
``streams_prover``, ``streams_writer``, ``streams_reader``, ``streams_group_reader``) and gives
each exactly what its statements need on this database's schema (idempotent: run it again after
every ``streams migrate``); people and services then log in as users granted those roles
(``GRANT streams_reader TO billing``). ``grant ROLE --stream S`` / ``--group G`` lets a role
write some streams (use some groups) only; ``revoke`` takes them back. ``show`` prints what
each role holds. ``check`` reports what an attacker with a login would use (grants beyond the
model, functions that run with another role's rights without the defences) and what the model
grants but a role lacks here; it exits 1 on either. `streams doctor` runs the same check.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import click
import psycopg

from ..cli_params import common_options
from ..config import Settings, redact_url
from ..store import sessions
from ..store.driver import run
from ..store.registry import check_schema
from ..store.role_checks import (
    Finding,
    RoleGrants,
    missing_grants,
    overbroad_grants,
    role_grants,
)
from ..store.roles import create_roles, grant_scoped, revoke_scoped
from ..store.stream_objects import stream_objects

__all__ = ["RoleReport", "check_roles", "roles"]


@dataclass(frozen=True, slots=True)
class RoleReport:
    """What `check_roles` found: grants beyond the model (`overbroad`) and grants of the model
    missing here (`missing`)."""

    overbroad: list[Finding]
    missing: list[str]

    @property
    def ok(self) -> bool:
        return not self.overbroad and not self.missing

    def lines(self) -> list[str]:
        found = [f"over-broad: {f.describe()}" for f in self.overbroad]
        if self.missing:
            found.append(
                f"incomplete ({len(self.missing)} grant(s) of the model missing, e.g. "
                f"{self.missing[0]}): run `streams roles create` (again after every "
                "`streams migrate`)"
            )
        return found

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "overbroad": [f.as_dict() for f in self.overbroad],
            "missing": self.missing,
        }


def check_roles(conn: psycopg.Connection[Any]) -> RoleReport:
    """The check of `streams roles check` and `streams doctor`, on an open connection."""
    return RoleReport(run(conn, overbroad_grants()), run(conn, missing_grants()))


@click.group()
def roles() -> None:
    """The role model: `streams roles create`, `streams roles show`, `streams roles check`."""


@roles.command(name="create")
@click.option(
    "--restrict-public",
    is_flag=True,
    help="Also revoke TEMPORARY on the database and CREATE on schema public from PUBLIC "
    "(every role of the database loses them: only if nothing else here needs them).",
)
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
def roles_create(
    restrict_public: bool,
    as_json: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Create the group roles (NOLOGIN) if missing and grant each exactly what it needs on this
    database: streams_admin owns the library's objects, streams_definer its functions that run
    with their owner's rights; streams_operator, streams_prover, streams_writer, streams_reader
    and streams_group_reader get the model's privileges and lose any others they held on them,
    as does PUBLIC. Idempotent; run it as a superuser or the owner of the schema (with
    CREATEROLE), and again after every `streams migrate`."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=False, purpose="roles") as conn:
        run(conn, check_schema())
        done = run(conn, create_roles(restrict_public=restrict_public))
    if as_json:
        click.echo(json.dumps({"done": done}, sort_keys=True, separators=(",", ":")))
        return
    click.echo(f"{redact_url(settings.database_url)}:")
    for line in done:
        click.echo(f"  {line}")


@roles.command(name="show")
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
def roles_show(
    as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """Each role of the model: whether it exists, its members, the roles it belongs to, and
    its privileges on the library's tables, stream sequences and the prover's schema."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=False, purpose="roles") as conn:
        run(conn, check_schema())
        found = run(conn, role_grants())
    if as_json:
        data = {"roles": [g.as_dict() for g in found]}
        click.echo(json.dumps(data, sort_keys=True, separators=(",", ":")))
        return
    for grants in found:
        for line in _show_lines(grants):
            click.echo(line)


def _show_lines(grants: RoleGrants) -> list[str]:
    if not grants.exists:
        return [f"{grants.role}: does not exist (`streams roles create`)"]
    members = ", ".join(grants.members) or "none"
    lines = [f"{grants.role} (members: {members})"]
    if grants.member_of:
        lines.append(f"  member of: {', '.join(grants.member_of)}")
    if grants.owns:
        lines.append(f"  owns (every privilege): {', '.join(grants.owns)}")
    by_privilege: dict[str, list[str]] = {}
    for relation, privileges in grants.privileges.items():
        for privilege in privileges:
            by_privilege.setdefault(privilege, []).append(relation)
    for privilege, relations in sorted(by_privilege.items()):
        lines.append(f"  {privilege}: {', '.join(relations)}")
    if grants.sequences:
        held = ", ".join(f"{p} on {n}" for p, n in sorted(grants.stream_sequences.items()))
        lines.append(f"  stream sequences ({grants.sequences}): {held or 'nothing'}")
        held = ", ".join(f"{p} on {n}" for p, n in sorted(grants.stream_partitions.items()))
        lines.append(f"  stream partitions ({grants.sequences}): {held or 'nothing'}")
    if grants.functions:
        lines.append(f"  functions: {', '.join(f.split('(')[0] for f in grants.functions)}")
    if grants.streams:
        lines.append(f"  streams: {', '.join(grants.streams)}")
    if grants.groups:
        lines.append(f"  groups: {', '.join(grants.groups)}")
    if len(lines) == 1:
        lines.append("  nothing")
    return lines


@roles.command(name="check")
@click.option("--json", "as_json", is_flag=True)
@common_options(redis=False)
def roles_check(
    as_json: bool, database_url: str | None, redis_url: str | None, prefix: str | None
) -> None:
    """Report what an attacker with a login would use: grants beyond the model (PUBLIC; a role
    that may read the private keys or write streams_proofs or streams_keys without being the
    prover or the admin; one outside the model that may read the readers' keys; UPDATE on a
    stream's sequence; writes of group rows or of the facts' parent table), functions that run
    with another role's rights without a pinned search_path, executable by PUBLIC or owned by a
    superuser; and grants of the model missing here. Exit 1 on any."""
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=False, purpose="roles") as conn:
        run(conn, check_schema())
        report = check_roles(conn)
    if as_json:
        click.echo(json.dumps(report.as_dict(), sort_keys=True, separators=(",", ":")))
    elif report.ok:
        click.echo("no grant beyond the role model on the library's objects")
    else:
        for line in report.lines():
            click.echo(f"[FAIL] {line}")
    if not report.ok:
        sys.exit(1)


def _scoped(
    role: str,
    stream_names: tuple[str, ...],
    groups: tuple[str, ...],
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
    revoke: bool = False,
    everything: bool = False,
) -> None:
    if not (stream_names or groups or everything):
        raise click.UsageError("name at least one --stream or --group")
    settings = Settings.resolve(database_url, redis_url, prefix)
    with sessions.connect(settings.database_url, autocommit=False, purpose="roles") as conn:
        run(conn, check_schema())
        objects = run(conn, stream_objects(list(stream_names))) if stream_names else []
        unknown = sorted(set(stream_names) - {o.name for o in objects})
        if unknown:
            raise click.UsageError(f"no stream {', '.join(unknown)}")
        if revoke:
            done = run(conn, revoke_scoped(role, objects, groups, everything=everything))
        else:
            done = run(conn, grant_scoped(role, objects, groups))
    for line in done or ["nothing to do"]:
        click.echo(line)


def _role_name(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """A role name as PostgreSQL takes one: 1 to 63 bytes, no NUL, not a predefined role."""
    if not value or len(value.encode()) > 63 or "\x00" in value:
        raise click.BadParameter("a role name has 1 to 63 bytes and no NUL character")
    if value.startswith("pg_"):
        raise click.BadParameter("pg_* roles are PostgreSQL's own")
    return value


@roles.command(name="grant")
@click.argument("role", callback=_role_name)
@click.option("--stream", "stream", multiple=True, help="A stream ROLE may write.")
@click.option("--group", "group", multiple=True, help="A reader group ROLE may open and commit.")
@common_options(redis=False)
def roles_grant(
    role: str,
    stream: tuple[str, ...],
    group: tuple[str, ...],
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Let ROLE (a user, or a group role of yours) write these streams only, or open and commit
    these reader groups only: what a writer (group reader) holds in common, and these streams'
    partitions and sequences (these groups). ROLE must not be a member of streams_writer
    (streams_group_reader), which holds every stream (group). As an admin."""
    _scoped(role, stream, group, database_url, redis_url, prefix)


@roles.command(name="revoke")
@click.argument("role", callback=_role_name)
@click.option("--stream", "stream", multiple=True, help="A stream ROLE may no longer write.")
@click.option("--group", "group", multiple=True, help="A group ROLE may no longer use.")
@click.option("--all", "everything", is_flag=True, help="Every stream and group, and the rest.")
@common_options(redis=False)
def roles_revoke(
    role: str,
    stream: tuple[str, ...],
    group: tuple[str, ...],
    everything: bool,
    database_url: str | None,
    redis_url: str | None,
    prefix: str | None,
) -> None:
    """Take back streams or groups `streams roles grant` gave ROLE (--all: every one, and what
    it held in common on the library's objects). As an admin."""
    _scoped(role, stream, group, database_url, redis_url, prefix, True, everything)
