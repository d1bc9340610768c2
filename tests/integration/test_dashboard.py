"""The Grafana dashboard (deploy/grafana/streams.json) and the alert rules
(deploy/prometheus/alerts.yml) ask only for what the project exports.

A short workload (a writer appending, a reader group consuming, a group left behind on a
stream with retention, a fact held open, a forged line on Redis) runs against real servers;
`/metrics` is scraped over HTTP from both collectors (`streams metrics serve`'s database
collector, as `streams.metrics.serve` runs it, and a client's own, as `streams.metrics.enable`
registers it). Every metric name and label name in every PromQL expression must be in that
scrape. The dashboard must also be a well-formed dashboard of its schema version: the keys
Grafana needs, unique panel ids, panels that do not overlap, targets with a data source.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import prometheus_client
import psycopg
import pytest
import redis
import yaml
from helpers import REPO_ROOT, default_sigint, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port

import streams
from streams.config import Settings
from streams.core.constants import PROOF_INSTANCE_PREFIX, proof_channel
from streams.metrics import ClientCollector, serve

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "streams.json"
ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
HOUR_MS = 3_600_000

# -- a small PromQL tokenizer ---------------------------------------------------------------

#: Words of PromQL that look like metric names: functions, aggregations, operators, modifiers.
PROMQL_WORDS = frozenset(
    """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time days_in_month day_of_month day_of_week
    day_of_year deg delta deriv exp floor histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters
    double_exponential_smoothing hour idelta increase irate label_join label_replace
    last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin
    sinh sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time
    sum_over_time tan tanh time timestamp vector year
    sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk
    limit_ratio
    and or unless by without on ignoring group_left group_right offset bool atan2 inf nan
    """.split()  # noqa: SIM905 (a list literal of 100 words is no easier to read)
)

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# A metric name: an identifier not inside a label matcher, followed by `{`, `[`, `)`, an
# operator, a comma or whitespace (never `(`: that is a function or a grouping).
_METRIC = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?=\s*(?:[{\[),=<>!+\-*/%^]|\s|$))")


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and label names an expression uses."""
    expr = _STRING.sub('""', expr)  # label values, regexes: never names
    expr = _RANGE.sub("", expr)  # [5m], [$__rate_interval]
    labels: set[str] = set()
    for grouping in _GROUPING.findall(expr):
        labels |= set(_IDENT.findall(grouping))
    expr = _GROUPING.sub(" ", expr)
    for matchers in _SELECTOR.findall(expr):
        labels |= {m.group(1) for m in re.finditer(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers)}
    expr = _SELECTOR.sub("{}", expr)
    metrics = {
        name
        for name in _METRIC.findall(expr)
        if name not in PROMQL_WORDS and not re.fullmatch(r"\d.*", name)
    }
    return metrics, labels


def test_the_tokenizer_finds_metrics_and_labels() -> None:
    metrics, labels = promql_names(
        'sum by (stream, kind) (rate(streams_a_total{group=~"$group", x!="y z"}[5m])) '
        "and on (stream) streams_b > 3 or max(streams_c) unless streams_d\n== 1"
    )
    assert metrics == {"streams_a_total", "streams_b", "streams_c", "streams_d"}
    assert labels == {"stream", "kind", "group", "x"}
    assert promql_names("changes(x[5m]) == 0 and changes(y[$__rate_interval]) > 0")[0] == {
        "x",
        "y",
    }


# -- the expressions ---------------------------------------------------------------------------


def dashboard_expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", str(var["query"]))
        if found:  # label_values(selector, label): a selector and a label name
            exprs.append(f"{found.group(1)} + on ({found.group(2)}) vector(0)")
    return exprs


def alert_expressions() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


# -- the structure -------------------------------------------------------------------------------


def test_the_dashboard_is_a_dashboard_of_its_schema_version() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for key in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert key in dashboard, key
    # Grafana 11 writes 39 to 41 (11.5, the compose file's, 40); since 36 every panel and
    # target names its data source, as here.
    assert 39 <= dashboard["schemaVersion"] <= 41
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dashboard["uid"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for var in variables.values():
        assert var["type"] in ("datasource", "query", "custom", "constant", "interval"), var
        assert var["query"], var["name"]
    assert variables["datasource"] == {**variables["datasource"], "type": "datasource",
                                       "query": "prometheus"}  # fmt: skip
    assert {"stream", "group"} <= set(variables)
    source = {"type": "prometheus", "uid": "${datasource}"}
    ids: set[int] = set()
    cells: dict[tuple[int, int], int] = {}
    for panel in dashboard["panels"]:
        assert isinstance(panel["id"], int) and panel["id"] not in ids, panel["id"]
        ids.add(panel["id"])
        assert panel["type"] and panel["title"]
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, (panel["id"], "overlaps", cells[(x, y)])
                cells[(x, y)] = panel["id"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and target["expr"].strip(), panel["title"]
    # Every variable is used, and every variable used is defined.
    text = json.dumps(dashboard["panels"])
    for name in ("stream", "group", "datasource"):
        assert f"${name}" in text or f"${{{name}}}" in text, name
    used = set(re.findall(r"\$\{?(\w+)", text)) - {"__rate_interval", "__interval"}
    assert used <= set(variables), used - set(variables)


# -- the live scrape ------------------------------------------------------------------------------


Sample = tuple[str, tuple[tuple[str, str], ...]]


class Scrape:
    """What `/metrics` served: metric name (as exposed: counters end in ``_total``) -> the
    label names of its samples, and every sample's value."""

    def __init__(self) -> None:
        self.labels: dict[str, set[str]] = {}
        self.values: dict[Sample, float] = {}

    def add(self, port: int) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                self.values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def exported(self, name: str) -> bool:
        return any(name + end in self.labels for end in ("", "_total", "_sum", "_count", "_bucket"))


@contextmanager
def client_metrics(client: streams.Client) -> Iterator[int]:
    """A client's collector served over HTTP (as `streams.metrics.enable` does, in a registry
    of its own so the server can be stopped)."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(ClientCollector(client))
    port = free_port()
    server, _ = prometheus_client.start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def live_scrape(
    streams_url: str, redis_url: str, redis_prefix: str, stream: str
) -> Iterator[tuple[Scrape, dict[str, int]]]:
    """The workload, what both collectors serve during it, and the IDs it wrote."""
    base = int((time.time() - 7200) * 1000)
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as client:
        client.set_retention(stream, HOUR_MS)
        with (
            client.writer(stream, instance="w") as writer,
            client.reader(stream, group="g", poll_interval=0.2) as reader,
            psycopg.connect(streams_url) as conn,
            redis.Redis.from_url(redis_url) as raw,
            client_metrics(client) as client_port,
        ):
            old = [writer.append({"n": k}, timestamp=base + k).first_id for k in range(4)]
            new = [writer.append({"n": k}).first_id for k in range(4)]
            # A group left behind, at the second old fact: retention would prune two more.
            with client.reader(stream, start=old[1] + 1, group="behind") as behind:
                behind.commit()
            got = []
            for fact in reader.facts():
                got.append(fact.stream_id)
                if fact.stream_id == new[-1]:
                    break
            reader.commit()
            assert got == old + new
            # A forged prover's line: rejected by the reader (counted by reason).
            line = f'RDATA {stream} {PROOF_INSTANCE_PREFIX}forged {new[-1] + 1} {{"x": 1}}'

            def rejected() -> bool:
                raw.publish(proof_channel(redis_prefix, stream), line)
                return sum(reader.core.counters.rejected_ranges.values()) > 0

            wait_until(rejected, timeout=20, what="the reader to reject a forged line")
            with writer.fact(conn) as held:  # a stall, and who holds it
                held.add({"held": 1})
                found = Scrape()
                db_server = serve(Settings.resolve(streams_url), free_port())
                try:
                    found.add(db_server.server_address[1])
                    found.add(client_port)
                finally:
                    db_server.shutdown()
                    db_server.server_close()
                yield found, {"behind": old[1], "first_young": new[0], "held": held.stream_id}


def test_every_name_the_dashboard_and_the_alerts_use_is_exported(
    live_scrape: tuple[Scrape, dict[str, int]], stream: str
) -> None:
    found, ids = live_scrape
    # The workload gave the families the new panels draw samples that say what happened.
    value = found.values
    s = (("stream", stream),)
    (held_by,) = [
        dict(labels)
        for name, labels in value
        if name == "streams_stall_holder_seconds" and dict(labels)["stream"] == stream
    ]
    assert held_by["instance"] == "w", held_by  # the writer holding the fact open
    assert set(held_by) == {"stream", "instance", "role", "application", "state"}
    assert value[("streams_linear_position", s)] == ids["held"] - 1
    behind = (("group", "behind"), ("stream", stream))
    assert value[("streams_group_holds_retention", behind)] == 1
    # Retention alone would prune every fact before the first young one.
    assert (
        value[("streams_group_retention_held_ids", behind)]
        == ids["first_young"] - 1 - ids["behind"]
    )
    caught_up = (("group", "g"), ("stream", stream))
    assert value[("streams_group_retention_held_ids", caught_up)] == 0
    roles = {dict(k[1])["role"] for k in value if k[0] == "streams_database_connections"}
    assert "postgres" in roles
    assert any(k[0] == "streams_reader_rejected_lines_total" for k in value)

    labels_exported = set().union(*found.labels.values())
    exprs = dashboard_expressions(json.loads(DASHBOARD.read_text())) + alert_expressions()
    seen: set[str] = set()
    for expr in exprs:
        metrics, labels = promql_names(expr)
        assert metrics, f"no metric found in {expr!r}"
        seen |= metrics
        for name in metrics:
            assert found.exported(name), f"{name} (in {expr!r}) is not exported"
        for label in labels:
            assert label in labels_exported, f"label {label} (in {expr!r}) is not exported"
            on_one = any(
                label in found.labels.get(n, set()) | found.labels.get(n + "_total", set())
                for n in metrics
            )
            assert on_one, f"label {label} is on none of {sorted(metrics)} (in {expr!r})"
    # The panels the issue asks for are there (the checks above would pass on an empty board).
    for name in (
        "streams_linear_position",
        "streams_max_allocated",
        "streams_stall_holder_seconds",
        "streams_writer_persisted_position",
        "streams_group_lag_ids",
        "streams_group_lag_seconds",
        "streams_group_retention_held_ids",
        "streams_link_connected",
        "streams_link_commands_total",
        "streams_reader_rejected_lines_total",
        "streams_database_connections",
    ):
        assert name in seen, name
    # And the check catches a misspelt name or label.
    metrics, labels = promql_names('rate(streams_linear_positon{strem="a"}[5m])')
    assert metrics == {"streams_linear_positon"} and labels == {"strem"}
    assert not found.exported("streams_linear_positon") and "strem" not in labels_exported


def test_the_demo_serves_what_the_redis_panels_draw(own_database: str, redis_url: str) -> None:
    """`streams demo --metrics`, as the compose file runs it for the dashboard's Redis panels:
    its reader's client is scraped while it runs."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streams", "demo", "--no-spark", "--duration", "30",
         "--writers", "1", "--rate", "20", "--json", "--metrics", f"127.0.0.1:{port}",
         "--database-url", own_database, "--redis-url", redis_url,
         "--prefix", f"dash{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint,  # noqa: PLW1509 (one signal call: no lock taken)
    )  # fmt: skip
    found = Scrape()
    try:

        def served() -> bool:
            try:
                found.add(port)
            except OSError:
                return False
            return any(
                name == "streams_reader_rows_total" and value > 0
                for (name, _), value in found.values.items()
            )

        wait_until(served, timeout=60, what="the demo to serve its reader's metrics")
    finally:
        proc.send_signal(signal.SIGINT)  # the demo stops early and checks what it did
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]  # interrupted, as shells expect of Ctrl-C
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["interrupted"] is True, summary
    assert "streams_link_connected" in found.labels
    assert found.labels["streams_link_commands_total"] == {"prefix", "kind"}
    assert {"streams", "group"} <= found.labels["streams_reader_rows_total"]
