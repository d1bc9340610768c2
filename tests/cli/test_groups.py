"""Stale reader groups (issue 20, item 7): a group that stopped committing while it holds
retention back shows as stale in `streams positions` (text and JSON), `streams groups list` and
`streams doctor`; `streams groups delete` drops it (CliRunner, real PostgreSQL).

An abandoned group is made by moving its last commit (``updated_at``) two days back, as if its
reader (a Spark query without ``group``, whose checkpoint was thrown away) had stopped then.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

import streams.ops.group_commands
from streams import Client
from streams.command import main

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def cli(url: str, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, [*args, "--database-url", url], input=input)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def commit_group(client: Client, stream: str, group: str, position: int) -> None:
    """Commit ``group`` at ``position`` through a reader, as an application does."""
    with client.reader(stream, start=position + 1, group=group) as reader:
        reader.commit()
    with client.reader(stream, group=group) as reader:
        assert reader.position() == position


def abandon(url: str, client: Client, stream: str, group: str, days: float = 2.0) -> None:
    """Pretend ``group`` last committed ``days`` ago."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE streams_reader_groups SET updated_at = now() - make_interval(secs => %s) "
            "WHERE stream = %s AND group_name = %s",
            (days * 86_400, client.stream(stream).id, group),
        )


def fill(client: Client, stream: str, old: int, new: int) -> tuple[list[int], list[int]]:
    """``old`` facts two hours old, then ``new`` facts of now; their IDs."""
    base = int((time.time() - 7200) * 1000)
    with client.writer(stream, instance="w") as writer:
        olds = [writer.append({"n": k}, timestamp=base + k).first_id for k in range(old)]
        news = [writer.append({"n": k}).first_id for k in range(new)]
    return olds, news


@pytest.fixture
def groups_on_retention(client: Client, stream: str, streams_url: str) -> dict[str, int]:
    """A stream keeping an hour, six facts older than that, and three groups (named
    ``<role>-<stream>``: the session's database is shared): ``abandoned-`` (holds retention
    back, no commit for two days), ``live-`` (holds it too, committed just now) and
    ``caught-up-`` (at the end, no commit for two days: holds nothing back)."""
    olds, news = fill(client, stream, 6, 2)
    client.set_retention(stream, HOUR_MS)
    positions = {"abandoned": olds[1], "live": olds[3], "caught-up": news[-1]}
    for role, position in positions.items():
        commit_group(client, stream, f"{role}-{stream}", position)
    abandon(streams_url, client, stream, f"abandoned-{stream}")
    abandon(streams_url, client, stream, f"caught-up-{stream}")
    return positions


def test_positions_marks_a_group_idle_while_holding_retention_as_stale(
    streams_url: str, stream: str, groups_on_retention: dict[str, int]
) -> None:
    (entry,) = json.loads(ok(cli(streams_url, "positions", stream, "--json")))
    got = {name.removesuffix(f"-{stream}"): g for name, g in entry["groups"].items()}
    assert set(got) == set(groups_on_retention)
    assert {name: g["position"] for name, g in got.items()} == groups_on_retention
    assert got["abandoned"]["stale"] is True and got["abandoned"]["holds_retention"] is True
    assert 2 * DAY_MS <= got["abandoned"]["idle_ms"] < 2 * DAY_MS + 60_000
    assert got["live"]["stale"] is False and got["live"]["holds_retention"] is True
    assert 0 <= got["live"]["idle_ms"] < 60_000
    assert got["caught-up"]["stale"] is False and got["caught-up"]["holds_retention"] is False
    # The fields that were there stay (a contract surface: fields are added, never removed).
    assert {"group", "position", "lag", "lag_ms", "updated_at"} <= set(got["live"])
    # The threshold is the operator's: idle two days is not stale after three.
    (relaxed,) = json.loads(
        ok(cli(streams_url, "positions", stream, "--json", "--stale-after", "3d"))
    )
    assert relaxed["groups"][f"abandoned-{stream}"]["stale"] is False
    # Text: a STATE column says it.
    lines = ok(cli(streams_url, "positions", stream)).splitlines()
    header = next(line for line in lines if line.startswith("STREAM") and "GROUP" in line)
    assert "IDLE_MS" in header and "STATE" in header
    by_group = {
        line.split()[1].removesuffix(f"-{stream}"): line.rstrip()
        for line in lines
        if line.startswith(stream) and len(line.split()) > 5
    }
    assert by_group["abandoned"].endswith("stale") and "2d00h" in by_group["abandoned"]
    assert by_group["live"].endswith("holds retention")
    assert not by_group["caught-up"].endswith(("stale", "retention"))
    # `streams groups list --stale` lists only the stale one.
    stale = json.loads(ok(cli(streams_url, "groups", "list", stream, "--stale", "--json")))
    assert [(g["stream"], g["group"]) for g in stale] == [(stream, f"abandoned-{stream}")]
    text = ok(cli(streams_url, "groups", "list", stream))
    assert f"caught-up-{stream}" in text and f"abandoned-{stream}" in text and "stale" in text


def test_a_stream_without_retention_has_no_stale_group(
    client: Client, stream: str, streams_url: str
) -> None:
    _, news = fill(client, stream, 0, 3)
    commit_group(client, stream, "old", news[0])
    abandon(streams_url, client, stream, "old", days=30)
    (group,) = client.groups(stream)
    assert group.idle_ms >= 30 * DAY_MS
    assert (group.holds_retention, group.stale) == (False, False)


def test_doctor_fails_on_a_stale_group_and_says_how_to_drop_it(
    streams_url: str, stream: str, groups_on_retention: dict[str, int]
) -> None:
    def retention_check(*extra: str) -> tuple[int, dict[str, Any]]:
        result = cli(streams_url, "doctor", "--json", *extra)
        checks = {c["name"]: c for c in json.loads(result.stdout)}
        return result.exit_code, checks[f"stream {stream}: retention"]

    code, check = retention_check()
    assert code == 1 and check["ok"] is False
    position = groups_on_retention["abandoned"]
    assert f"abandoned-{stream} (at {position}, last commit 2d00h ago)" in check["detail"]
    assert f"streams groups delete GROUP --stream {stream}" in check["detail"]
    assert f"live-{stream}" not in check["detail"]
    _, relaxed = retention_check("--stale-after", "3d")
    assert relaxed["ok"] is True and "stale" not in relaxed["detail"]


def test_groups_delete_drops_a_group_and_frees_retention(
    client: Client,
    stream: str,
    streams_url: str,
    groups_on_retention: dict[str, int],
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    abandoned, live = f"abandoned-{stream}", f"live-{stream}"
    other = f"{unique_name}_b"
    client.create_stream(other)
    (other_id,) = fill(client, other, 0, 1)[1]
    commit_group(client, other, abandoned, other_id)

    # Errors name what is wrong and delete nothing.
    unknown = cli(streams_url, "groups", "delete", "nosuch", "--yes")
    assert unknown.exit_code == 1
    assert "Error: no reader group 'nosuch' on any stream" in unknown.output
    bad_stream = cli(streams_url, "groups", "delete", abandoned, "--stream", "nosuch_zz", "--yes")
    assert bad_stream.exit_code == 1 and "UnknownStream" in bad_stream.output
    elsewhere = cli(streams_url, "groups", "delete", live, "--stream", other, "--yes")
    assert elsewhere.exit_code == 1
    assert f"reader group '{live}' has no position on {other} (it has on: {stream})" in (
        elsewhere.output
    )
    # A script must say --yes: without a terminal nothing is asked, nothing deleted.
    unconfirmed = cli(streams_url, "groups", "delete", abandoned)
    assert unconfirmed.exit_code == 2 and "pass --yes" in unconfirmed.output
    # On a terminal it asks; "n" keeps the group.
    monkeypatch.setattr(streams.ops.group_commands, "_stdin_terminal", lambda: True)
    declined = cli(streams_url, "groups", "delete", abandoned, "--stream", stream, input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert len(client.groups(stream)) == 3
    assert [g.group for g in client.groups(other)] == [abandoned]

    # Before: retention is held by the abandoned group.
    assert client.prune(stream).limited_by == f"group {abandoned}"
    # "y" on the terminal deletes it on the stream given, not on the other one.
    confirmed = cli(streams_url, "groups", "delete", abandoned, "--stream", stream, input="y\n")
    assert ok(confirmed).strip().endswith(f"deleted reader group '{abandoned}' on {stream}")
    assert {g.group for g in client.groups(stream)} == {live, f"caught-up-{stream}"}
    assert [g.group for g in client.groups(other)] == [abandoned]
    # Retention goes on to the next group (the live one, which is not stale).
    result = client.prune(stream)
    assert (result.after, result.limited_by) == (groups_on_retention["live"], f"group {live}")

    # --yes and no --stream: every stream the group is on, JSON for scripts.
    commit_group(client, stream, abandoned, groups_on_retention["live"])
    monkeypatch.setattr(streams.ops.group_commands, "_stdin_terminal", lambda: False)
    out = ok(cli(streams_url, "groups", "delete", abandoned, "--yes", "--json"))
    assert json.loads(out) == {"group": abandoned, "deleted": sorted([stream, other])}
    assert client.group_streams(abandoned) == []
