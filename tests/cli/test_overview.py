"""Every stream at once (issue 40): `Client.overview` agrees with the per-stream
`Client.positions`; ``streams list``, ``positions`` and ``groups list`` take --like, --limit and
--sort; the database collector's series; ``streams create --from-file`` and ``streams drop``
(CliRunner, real PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import prometheus_client
import psycopg
import pytest
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from streams import Client
from streams.command import main
from streams.config import Settings
from streams.metrics import DatabaseCollector
from streams.ops.view_options import TABLE_PAGE

# Figures that move between two reads (clocks, ages): left out of the comparison.
_MOVING = {
    "idle_ms",
    "taken_age_ms",
    "heartbeat_age_ms",
    "lease_expires_in_ms",
    "lag_ms",
    "oldest_pending_ms",
}


def cli(url: str, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, [*args, "--database-url", url], input=input)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def still(value: Any) -> Any:
    """``value`` without the `_MOVING` figures."""
    if isinstance(value, dict):
        return {k: still(v) for k, v in value.items() if k not in _MOVING}
    return value


@pytest.fixture
def family(client: Client, unique_name: str) -> Iterator[list[str]]:
    """Four new streams ``<unique>_a`` .. ``_d`` (dropped afterwards)."""
    names = [f"{unique_name}_{x}" for x in "abcd"]
    made = client.create_streams(names)
    assert [c.new for c in made] == [True] * 4
    yield names
    client.drop_streams(names)


def test_overview_agrees_with_positions(
    client: Client, family: list[str], unique_name: str, streams_url: str
) -> None:
    a, b, c, _ = family
    with client.writer(a, instance="wa") as wa, psycopg.connect(streams_url) as conn:
        acks = [wa.append({"n": n}) for n in range(4)]
        with client.reader(a, start=acks[1].first_id + 1, group="g") as reader:
            reader.commit()  # the group at the second fact: lag 2
        with client.reader(b, group="h") as reader:
            reader.commit()
        with client.writer(b, instance="wb") as wb:
            wb.append({"b": 1})
        with wa.fact(conn) as held:  # a pending ID: linear stays below max allocated
            held.add({"held": 1})
            wa.append({"after": 1})
            found = client.overview(f"{unique_name}%")
            assert [s.info.name for s in found.streams] == family
            assert found.matched == 4 and not found.truncated
            for s in found.streams:
                single = client.positions(s.info.name)
                assert still(s.positions.as_dict()) == still(single.as_dict()), s.info.name
                assert (s.positions.oldest_pending_ms is None) == (single.oldest_pending_ms is None)
            first = found.streams[0]
            assert first.positions.scratchpad == 2
            assert first.lag == first.positions.linear - acks[1].first_id
            (group,) = first.positions.groups
            assert group.lag_ms is not None
            assert first.live_writers == 1
    assert client.overview(f"{unique_name}_c").streams[0].info.name == c


def test_list_positions_and_groups_take_like_limit_and_sort(
    client: Client, family: list[str], unique_name: str, streams_url: str
) -> None:
    a, b, c, d = family
    for name, facts, at in ((b, 5, 1), (c, 3, 1)):
        with client.writer(name, instance="w") as writer:
            ids = [writer.append({"n": n}).first_id for n in range(facts)]
        with client.reader(name, start=ids[at] + 1, group="g") as reader:
            reader.commit()  # b lags 3, c lags 1
    like = f"{unique_name}%"
    listed = json.loads(ok(cli(streams_url, "list", "--json", "--like", like, "--sort", "lag")))
    assert [r["name"] for r in listed] == [b, c, a, d]
    assert [r["lag"] for r in listed] == [3, 1, 0, 0]
    assert {"linear", "max_allocated", "timestamping", "writers", "groups"} <= set(listed[0])
    text = ok(cli(streams_url, "list", "--like", like, "--limit", "2"))
    assert a in text and b in text and c not in text
    assert "(first 2 of 4 streams shown: --limit N or --limit 0 for more" in text
    shown = json.loads(
        ok(cli(streams_url, "positions", "--json", "--like", like, "--sort", "lag", "--limit", "1"))
    )
    assert [p["stream"] for p in shown] == [b]
    assert shown[0]["groups"]["g"]["lag"] == 3
    text = ok(cli(streams_url, "positions", "--like", like, "--limit", "3"))
    assert "(first 3 of 4 streams shown: --limit N or --limit 0 for more" in text
    assert cli(streams_url, "positions", a, "--like", like).exit_code == 2
    groups = json.loads(ok(cli(streams_url, "groups", "list", "--json", "--like", like)))
    assert [(g["stream"], g["lag"]) for g in groups] == [(b, 3), (c, 1)]
    groups = json.loads(
        ok(cli(streams_url, "groups", "list", "--json", "--like", like, "--sort", "lag",
               "--limit", "1"))
    )  # fmt: skip
    assert [g["stream"] for g in groups] == [b]
    text = ok(cli(streams_url, "groups", "list", "--like", like, "--limit", "1"))
    assert "(first 1 of 2 groups shown: --limit N or --limit 0 for more" in text


def test_an_empty_like_pattern_is_refused(streams_url: str) -> None:
    for argv in (["list"], ["positions"], ["groups", "list"], ["metrics", "serve"]):
        result = cli(streams_url, *argv, "--like", "")
        assert result.exit_code == 2, result.output
        assert "an empty pattern matches no stream" in result.output


def test_a_table_shows_a_page_unless_told_and_json_shows_all(
    client: Client, streams_url: str, unique_name: str
) -> None:
    names = [f"{unique_name}_{n:03d}" for n in range(TABLE_PAGE + 2)]
    client.create_streams(names)
    try:
        like = f"{unique_name}%"
        text = ok(cli(streams_url, "list", "--like", like))
        assert names[TABLE_PAGE - 1] in text and names[TABLE_PAGE] not in text
        assert (
            f"(first {TABLE_PAGE} of {TABLE_PAGE + 2} streams shown: --limit N or --limit 0" in text
        )
        every = ok(cli(streams_url, "list", "--like", like, "--limit", "0"))
        assert names[-1] in every and "shown" not in every
        listed = json.loads(ok(cli(streams_url, "list", "--json", "--like", like)))
        assert [r["name"] for r in listed] == names
        text = ok(cli(streams_url, "positions", "--like", like))
        assert names[TABLE_PAGE] not in text and f"of {TABLE_PAGE + 2} streams shown" in text
        shown = json.loads(ok(cli(streams_url, "positions", "--json", "--like", like)))
        assert len(shown) == TABLE_PAGE + 2
        assert names[-1] in ok(cli(streams_url, "positions", *names))  # named: all shown
    finally:
        client.drop_streams(names)


def _series(collector: DatabaseCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_metrics_show_series_of_active_or_matching_streams_only(
    client: Client, family: list[str], unique_name: str, streams_url: str
) -> None:
    a, b, quiet, _ = family
    with client.writer(a, instance="w") as writer:
        writer.append({"n": 1})
        with client.reader(b, group="g") as reader:
            reader.commit()
        got = _series(DatabaseCollector(Settings.resolve(streams_url)))
        assert got[("streams_database_up", ())] == 1
        assert got[("streams_streams", ())] >= 4
        assert got[("streams_streams_with_series", ())] >= 2
        assert ("streams_linear_position", (("stream", a),)) in got  # a live writer
        assert any(
            name == "streams_writer_persisted_position" and ("stream", a) in labels
            for name, labels in got
        )
        assert got[("streams_group_lag_ids", (("group", "g"), ("stream", b)))] == 0
        assert ("streams_linear_position", (("stream", quiet),)) not in got
        got = _series(DatabaseCollector(Settings.resolve(streams_url), like=quiet))
        assert got[("streams_linear_position", (("stream", quiet),))] == 0


def test_create_from_file_and_drop(client: Client, unique_name: str, streams_url: str) -> None:
    names = [f"{unique_name}_{n}" for n in range(5)]
    lines = f"# streams\n{names[0]}\n\n{names[1]}\n" + json.dumps(
        {"name": names[2], "retention_ms": 60_000}
    )
    made = json.loads(ok(cli(streams_url, "create", "--from-file", "-", "--json", input=lines)))
    assert made == {"created": names[:3], "existed": []}
    # The same settings: it exists already (other settings would be StreamExists).
    array = json.dumps([{"name": names[2], "retention_ms": 60_000}, {"name": names[3]}, names[4]])
    text = ok(cli(streams_url, "create", "--from-file", "-", input=array))
    assert text.strip() == "created 2 stream(s); 1 existed already"
    assert client.stream(names[2]).retention_ms == 60_000
    assert "exists already" in ok(cli(streams_url, "create", names[0]))
    assert "exists already" not in ok(cli(streams_url, "create", f"{unique_name}_new"))
    made = json.loads(ok(cli(streams_url, "create", names[1], "--json")))
    assert made["created"] is False and made["name"] == names[1]
    bad = cli(streams_url, "create", "--from-file", "-", input='{"nom": "x"}\n')
    assert bad.exit_code == 2 and "'name'" in bad.output
    assert cli(streams_url, "create").exit_code == 2
    # Without --yes and no terminal: refused, nothing dropped.
    assert cli(streams_url, "drop", names[0]).exit_code == 2
    gone = json.loads(ok(cli(streams_url, "drop", names[0], "--yes", "--json")))
    assert gone == {"dropped": [names[0]], "missing": []}
    text = ok(cli(streams_url, "drop", "--like", f"{unique_name}%", "--yes"))
    assert text.strip() == "dropped 5 stream(s)"
    assert not client.overview(f"{unique_name}%").streams


def test_doctor_sums_up_the_streams_it_checked_at_once(
    client: Client, family: list[str], streams_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import streams.ops.doctor

    monkeypatch.setattr(streams.ops.doctor, "DEEP_STREAMS", 1)
    with client.writer(family[0], instance="w") as writer:
        writer.append({"n": 1})
    result = cli(streams_url, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    summary = checks["streams"]
    assert summary["ok"] is True
    # The deep checks ran on one stream: the newest written one (or a failing one).
    assert "ran on 1 of them" in summary["detail"], summary
    assert "--all-streams" in summary["detail"]
    assert f"stream {family[1]}: fact tables" not in checks
    every = {
        c["name"] for c in json.loads(cli(streams_url, "doctor", "--json", "--all-streams").stdout)
    }
    assert f"stream {family[1]}: fact tables" in every


def test_drop_like_matches_as_sql_like_does(streams_url: str) -> None:
    """`streams drop --like` matches names in Python as ``LIKE`` does in PostgreSQL (`list`)."""
    from streams.ops.stream_commands import like_matcher

    names = ["orders-1", "orders_1", "orders", "x%y", "x_y", "xy", "ORDERS-1", "a\\b"]
    patterns = ["orders%", "orders_1", "orders\\_1", "x\\%y", "x_y", "%", "", "_%", "a\\\\b"]
    with psycopg.connect(streams_url) as conn:
        for pattern in patterns:
            rows = conn.execute(
                "SELECT n FROM unnest(%s::text[]) AS n WHERE n LIKE %s", (names, pattern)
            ).fetchall()
            expected = {n for (n,) in rows}
            assert {n for n in names if like_matcher(pattern)(n)} == expected, pattern
