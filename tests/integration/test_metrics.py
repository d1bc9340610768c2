"""Prometheus metrics: the in-process collector of a client and the database collector of
`streams metrics serve`, scraped for real over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import prometheus_client
import psycopg
import yaml
from helpers import REPO_ROOT, default_sigint, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port

import streams
from streams.config import Settings
from streams.metrics import ClientCollector, DatabaseCollector

ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"


Key = tuple[str, tuple[tuple[str, str], ...]]


def samples(registry: prometheus_client.CollectorRegistry) -> dict[Key, float]:
    text = prometheus_client.generate_latest(registry).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_client_collector_reports_writers_readers_and_link(
    streams_url: str, stream: str, redis_url: str, redis_prefix: str
) -> None:
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as client:
        registry = prometheus_client.CollectorRegistry()
        registry.register(ClientCollector(client))
        with client.writer(stream, instance="w") as writer, client.reader(stream, group="g") as r:
            ack = writer.append_batch([{"n": n} for n in range(5)])
            assert len(list(r.facts())) == 5
            got = samples(registry)
            labels = (("instance", "w"), ("stream", stream))
            assert got[("streams_writer_appended_facts_total", labels)] == 5
            assert got[("streams_writer_position", labels)] >= ack.last_id
            group = (("group", "g"), ("stream", stream))
            assert got[("streams_reader_position", group)] == ack.last_id
            assert got[("streams_reader_rows_total", (("group", "g"), ("streams", stream)))] == 5
            assert got[("streams_link_connected", (("prefix", redis_prefix),))] in (0.0, 1.0)


def test_database_collector_shows_a_stalled_stream(streams_url: str, stream: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    registry.register(DatabaseCollector(Settings.resolve(streams_url)))
    # The held fact must outlive the scrape: the suite's usual 2 s lease ends its transaction
    # (idle in transaction) when a scrape of the shared database is slow on a loaded machine.
    with (
        streams.connect(streams_url, lease_seconds=60.0) as client,
        client.writer(stream, instance="w") as writer,
        psycopg.connect(streams_url) as conn,
    ):
        writer.append({"n": 1})
        with client.reader(stream, group="g") as reader:
            list(reader.facts())
            reader.commit()
        with writer.fact(conn) as held:
            held.add({"held": 1})
            later = writer.append({"n": 2}).last_id
            got = samples(registry)
            s = (("stream", stream),)
            assert got[("streams_database_up", ())] == 1
            assert got[("streams_linear_position", s)] == held.stream_id - 1
            assert got[("streams_max_allocated", s)] == later
            assert got[("streams_scratchpad_ids", s)] == 2
            assert got[("streams_oldest_pending_seconds", s)] >= 0
            assert got[("streams_group_lag_ids", (("group", "g"), ("stream", stream)))] == 0


def test_metrics_serve_over_http(streams_url: str, stream: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streams", "metrics", "serve", "--port", str(port),
         "--like", stream, "--database-url", streams_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ},
        preexec_fn=default_sigint,  # noqa: PLW1509 (one signal call: no lock taken)
    )  # fmt: skip
    try:
        body = ""

        def scraped() -> bool:
            nonlocal body
            try:
                # This test is about serving: a loaded machine may be slow to answer.
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
                    body = r.read().decode()
                return True
            except OSError:
                return False

        # Generous: a loaded CI machine takes seconds to start an interpreter and connect.
        wait_until(scraped, timeout=60, what="streams metrics serve to answer")
        # A new stream with no writer nor group has series because --like names it.
        assert f'streams_linear_position{{stream="{stream}"}}' in body
        assert "streams_database_up 1.0" in body
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            raise AssertionError(f"Ctrl-C did not stop metrics serve: {stderr!r}") from None
    assert proc.returncode == 130, stderr  # interrupted (Ctrl-C), quietly
    assert b"Traceback" not in stderr, stderr


def test_alert_rules_parse_and_name_the_stall() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    names = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    stall = names["StreamsLinearPositionStalled"]["expr"]
    assert "streams_linear_position" in stall and "streams_max_allocated" in stall
    # The metric names in the rules exist in the collectors.
    source = Path(streams.metrics.__file__).read_text()
    metric_names = (
        "linear_position",
        "max_allocated",
        "oldest_pending_seconds",
        "group_lag_seconds",
    )
    for name in (*metric_names, "database_up"):
        assert f'"{name}"' in source
