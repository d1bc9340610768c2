"""Reads from a hot standby (`streams.core.standby_fence`): proofs on the primary, rows on the
standby.

A private primary and a streaming standby (`tests/pgpair.py`, asynchronous replication) serve
every test of this module. A reader given the standby as its read URL must deliver nothing that
the standby has not replayed (the fence), deliver every fact once and in order when it has, and
read its rows there (the standby's ``tup_returned`` grows, the primary's does not by as much).
Before read URLs existed, a reader with the standby's replay paused delivered 20 of 20 new facts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import prometheus_client
import psycopg
import pytest
from helpers import rows_returned, wait_until
from pgpair import PostgresPair, postgres_pair
from prometheus_client.parser import text_string_to_metric_families
from proxy import Proxy

import streams
from streams.core.epochs import Fact
from streams.metrics import ClientCollector
from streams.migrate import upgrade


@pytest.fixture(scope="module")
def pair() -> Iterator[PostgresPair]:
    with postgres_pair(synchronous=False) as built:
        upgrade(built.primary_url)
        built.wait_replayed()
        yield built


def _write(url: str, stream: str, count: int, start: int) -> None:
    with streams.connect(url) as client, client.writer(stream) as writer:
        for n in range(start, start + count):
            writer.append({"n": n})


def _drain(reader: streams.Reader, want: int, timeout: float = 30.0) -> list[Fact]:
    got: list[Fact] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        epoch = reader.poll(0.2)
        if epoch is not None:
            got.extend(epoch.facts)
    return got


def _numbers(facts: list[Fact]) -> list[int]:
    return [int(f.payload["n"]) for f in facts]


def test_a_paused_standby_delays_delivery_and_skips_nothing(
    pair: PostgresPair, unique_name: str, redis_url: str, redis_prefix: str
) -> None:
    with streams.connect(pair.primary_url) as admin:
        admin.create_stream(unique_name)
    _write(pair.primary_url, unique_name, 10, 0)
    pair.wait_replayed()
    client = streams.connect(
        pair.primary_url,
        redis_url,
        redis_prefix,
        read_database_url=pair.standby_url,
        standby_max_wait=600.0,  # this test's reader never falls back: it waits
    )
    try:
        reader = client.reader(unique_name)
        assert _numbers(_drain(reader, 10)) == list(range(10))
        pair.pause_replay()
        try:
            _write(pair.primary_url, unique_name, 20, 10)
            before = rows_returned(pair.standby_url)
            # The primary proves 30 complete; the standby has replayed 10: nothing moves.
            late = _drain(reader, 1, timeout=1.5)
            assert late == [], f"delivered {len(late)} facts the standby has not replayed"
            assert reader.position() == 10
            route = reader.core.route
            assert route is not None and route.lag_bytes > 0
            assert route.outcomes["fallback_lag"] == 0
        finally:
            pair.resume_replay()
        rest = _drain(reader, 20)
        assert _numbers(rest) == list(range(10, 30))
        assert reader.poll(0.3) is None  # nothing twice
        assert reader.core.counters.standby_rows >= 30
        wait_until(lambda: rows_returned(pair.standby_url) >= before + 20, 5.0, "stats")
        reader.close()
    finally:
        client.close()


def test_a_lagging_standby_delays_delivery_complete_and_in_order(
    pair: PostgresPair, unique_name: str
) -> None:
    with psycopg.connect(pair.standby_url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET recovery_min_apply_delay = '1s'")
        conn.execute("SELECT pg_reload_conf()")
    try:
        with streams.connect(
            pair.primary_url, read_database_url=pair.standby_url, standby_max_wait=30.0
        ) as client:
            client.create_stream(unique_name)
            reader = client.reader(unique_name)
            started = time.monotonic()
            _write(pair.primary_url, unique_name, 15, 0)
            written = time.monotonic()
            got = _drain(reader, 15)
            done = time.monotonic()
            assert _numbers(got) == list(range(15))
            assert done - written >= 0.9, "delivered before the standby applied the commits"
            route = reader.core.route
            assert route is not None
            assert route.outcomes["standby"] >= 1
            assert route.outcomes["fallback_lag"] == 0
            assert reader.core.counters.standby_rows == 15
            del started
            registry = prometheus_client.CollectorRegistry()
            registry.register(ClientCollector(client))
            text = prometheus_client.generate_latest(registry).decode()
            metrics = {
                (s.name, s.labels.get("outcome")): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.labels.get("streams") == unique_name
            }
            assert metrics[("streams_reader_standby_reads_total", "standby")] >= 1
            assert metrics[("streams_reader_standby_reads_total", "fallback_lag")] == 0
            assert metrics[("streams_reader_standby_rows_total", None)] == 15
            assert ("streams_reader_standby_lag_bytes", None) in metrics
    finally:
        with psycopg.connect(pair.standby_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET recovery_min_apply_delay")
            conn.execute("SELECT pg_reload_conf()")


def test_a_standby_restarted_mid_read_loses_and_repeats_nothing(
    pair: PostgresPair, unique_name: str
) -> None:
    proxy = Proxy.for_url(pair.standby_url)  # the read URL follows the standby's new port
    try:
        with streams.connect(
            pair.primary_url,
            read_database_url=proxy.url(pair.standby_url),
            standby_max_wait=1.0,
        ) as client:
            client.create_stream(unique_name)
            _write(pair.primary_url, unique_name, 40, 0)
            reader = client.reader(unique_name, page_size=10)
            first = _drain(reader, 10)
            assert reader.core.counters.standby_rows > 0
            pair.restart_standby(down_for=1.5)
            proxy.retarget("127.0.0.1", pair.standby.port)
            _write(pair.primary_url, unique_name, 20, 40)
            rest = _drain(reader, 60 - len(first))
            assert _numbers(first + rest) == list(range(60))
            assert reader.poll(0.3) is None
            route = reader.core.route
            assert route is not None
            # Down for longer than the reader waits: it read from the primary meanwhile, and
            # from the standby again once the retry interval passed (or it came back first).
            assert route.outcomes["standby"] >= 2
    finally:
        proxy.close()


def test_a_group_reader_commits_on_the_primary_exactly_once(
    pair: PostgresPair, unique_name: str
) -> None:
    with streams.connect(
        pair.primary_url, read_database_url=pair.standby_url, standby_max_wait=30.0
    ) as client:
        client.create_stream(unique_name)
        _write(pair.primary_url, unique_name, 12, 0)
        group = client.reader(unique_name, group="billing", page_size=5)
        got = []
        for fact in group.facts():
            got.append(fact)
            if len(got) == 7:
                group.commit(fact)
                break
        group.close()
        again = client.reader(unique_name, group="billing")
        rest = _drain(again, 5)
        again.commit()
        assert _numbers(got + rest) == list(range(12))
        assert again.core.counters.standby_rows >= 5
        assert client.groups(unique_name)[0].position == 12


def test_the_history_bench_compares_standby_reads(pair: PostgresPair) -> None:
    from streams.bench.history import run_history_bench

    settings = streams.Settings.resolve(pair.primary_url)
    lines: list[str] = []
    result = run_history_bench(
        settings,
        facts=4000,
        catchup_facts=3000,
        append_seconds=0.2,
        report=lines.append,
        read_url=pair.standby_url,
    )
    found = result.standby
    assert found is not None, lines
    assert found.fallbacks == 0
    # The primary's scans read the facts for a reader without a read URL, and not with one
    # (what is left is the sessions' own catalog reads, and the other tests' late counts).
    saved = found.primary_rows_per_fact_primary_reads - found.primary_rows_per_fact_standby_reads
    assert saved >= 0.9, lines
    assert found.primary_cpu_us_per_fact_standby_reads is not None  # the pair runs here
    assert result.as_dict()["standby"]["throughput_ratio"] > 0
    assert any(line.startswith("catch-up of 3,000 facts") for line in lines)
    with psycopg.connect(pair.primary_url) as conn:
        left = conn.execute(
            "SELECT count(*) FROM streams_registry WHERE name LIKE 'bench-history-%'"
        ).fetchone()
    assert left == (0,)


def test_an_async_reader_reads_on_the_standby_and_waits_for_it(
    pair: PostgresPair, unique_name: str
) -> None:
    async def main() -> list[int]:
        async with await streams.aconnect(
            pair.primary_url, read_database_url=pair.standby_url, standby_max_wait=30.0
        ) as client:
            await client.create_stream(unique_name)
            reader = await client.reader(unique_name)
            pair.pause_replay()
            try:
                _write(pair.primary_url, unique_name, 8, 0)
                assert await reader.poll(0.5) is None  # proven, not replayed: nothing yet
            finally:
                pair.resume_replay()
            # `facts()` (idle timeout 0) waits for what is proven but not yet replayed.
            got = [int(f.payload["n"]) async for f in reader.facts()]
            assert reader.core.counters.standby_rows == 8
            await reader.aclose()
            return got

    assert asyncio.run(main()) == list(range(8))


def test_streams_read_takes_a_read_url(pair: PostgresPair, unique_name: str) -> None:
    from click.testing import CliRunner

    from streams.command import main

    with streams.connect(pair.primary_url) as client:
        client.create_stream(unique_name)
    _write(pair.primary_url, unique_name, 6, 0)
    before = rows_returned(pair.standby_url)
    result = CliRunner().invoke(
        main,
        ["read", unique_name, "--json", "--database-url", pair.primary_url,
         "--read-database-url", pair.standby_url],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [line["stream_id"] for line in lines] == list(range(1, 7))
    wait_until(lambda: rows_returned(pair.standby_url) >= before + 6, 5.0, "stats")
