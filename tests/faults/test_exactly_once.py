"""Exactly once under faults: retry storms with one key, unknown commits retried with their key,
and a consumer killed between its writes and its group commit.

* Four processes (keyed appends, keyed facts, keyed batches) append the same keys, each key
  several times, all at once: each key is one fact, and every process got that fact's ID.
* An append whose ``COMMIT`` answer was lost (it committed) or whose session ended before it
  committed raises `streams.CommitUnknown`; retried with its key it returns the stored fact, or
  writes it: one fact either way.
* A consumer that applies facts to a table and commits its group in the same transaction is
  killed with SIGKILL after its writes and before its commit; the next one applies that fact
  again, for the only time that counts: every effect once, none lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from faultkit import (
    backend_waits_for_a_lock,
    in_thread,
    partition_locked,
    quiet_heartbeat,
    terminate,
)
from helpers import TESTS_DIR, fact_rows, wait_until
from proxy import Proxy

import streams

CHILD = str(TESTS_DIR / "exactly_child.py")


def child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CHILD, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_retry_storm_of_one_key_from_several_processes_writes_it_once(
    client: streams.Client, stream: str, streams_url: str
) -> None:
    keys = [f"request-{n}" for n in range(24)]
    roles = ["append", "append", "fact", "batch"]
    procs = [child(role, streams_url, stream, str(seed), *keys) for seed, role in enumerate(roles)]
    try:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    reported: dict[str, set[int]] = defaultdict(set)
    stamps: dict[str, set[int]] = defaultdict(set)
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        lines = out.splitlines()
        assert lines[-1] == "DONE"
        for line in lines[:-1]:
            found: dict[str, Any] = json.loads(line)
            reported[found["key"]].add(found["id"])
            if found["ts"]:
                stamps[found["key"]].add(found["ts"])
    rows = fact_rows(streams_url, stream)
    stored = {row[4]["key"]: (row[0], row[3]) for row in rows}
    assert len(rows) == len(keys) == len(stored)  # one fact per key
    for key in keys:
        assert reported[key] == {stored[key][0]}, key  # every caller got the same fact
        assert stamps[key] <= {stored[key][1]}, key


def test_commit_unknown_then_a_retry_with_the_key_returns_the_stored_fact(
    streams_url: str, unique_name: str
) -> None:
    """The keyed append commits; its answer is held by the network, then the connection is
    cut: `CommitUnknown`. The retry with the key finds the fact: the same `Ack`, no second
    fact."""
    with Proxy.for_url(streams_url) as proxy:
        url = proxy.url(streams_url)
        with streams.connect(url, lease_seconds=5.0) as client:
            client.create_stream(unique_name)
            with client.writer(unique_name) as writer:
                first = writer.append({"first": True})
                quiet_heartbeat(client, unique_name, writer, first)
                proxy.freeze(replies=True)
                thread, out = in_thread(lambda: writer.append({"ours": True}, key="req-1"))
                wait_until(lambda: len(fact_rows(streams_url, unique_name)) == 2, 10, "commit")
                proxy.cut()
                proxy.thaw()
                thread.join(10)
                (error,) = out
                assert isinstance(error, streams.CommitUnknown), error
                retried = writer.append({"ours": True}, key="req-1")
                assert retried.duplicate
    rows = fact_rows(streams_url, unique_name)
    assert [(r[0], r[3], r[4]) for r in rows][1:] == [
        (retried.first_id, retried.first_timestamp, {"ours": True})
    ]


def test_commit_unknown_then_a_retry_with_the_key_writes_a_fact_that_did_not_commit(
    streams_url: str, unique_name: str
) -> None:
    """The keyed append's session is ended while it waits (after its claim, inside its one
    round trip): `CommitUnknown`, and nothing committed, its claim included. The retry with
    the key writes the fact, once."""
    with streams.connect(streams_url, lease_seconds=5.0) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            pid = writer._conn.info.backend_pid
            with partition_locked(streams_url, client, unique_name):
                thread, out = in_thread(lambda: writer.append({"ours": True}, key="req-2"))
                wait_until(backend_waits_for_a_lock(streams_url, pid), 10, "the insert to wait")
                terminate(streams_url, pid)
                thread.join(10)
            (error,) = out
            assert isinstance(error, streams.CommitUnknown), error
            retried = writer.append({"ours": True}, key="req-2")
            assert not retried.duplicate
            assert writer.append({"ours": True}, key="req-2") == retried
    rows = fact_rows(streams_url, unique_name)
    assert [(r[0], r[4]) for r in rows] == [(retried.first_id, {"ours": True})]


@pytest.fixture
def totals(streams_url: str, unique_name: str) -> Any:
    table = f"totals_{unique_name}"
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (total bigint NOT NULL)")
        admin.execute(f"INSERT INTO {table} VALUES (0)")
        admin.execute(f"CREATE TABLE {table}_applied (stream_id bigint NOT NULL)")
    yield table
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"DROP TABLE {table}, {table}_applied")


def test_a_consumer_killed_between_its_writes_and_its_commit_repeats_and_loses_nothing(
    client: streams.Client, stream: str, streams_url: str, totals: str
) -> None:
    with client.writer(stream) as writer:
        ack = writer.append_batch([{"n": 2**n} for n in range(8)])
    pause_at = ack.ids[3]
    first = child("consume", streams_url, stream, totals, str(pause_at))
    try:
        assert first.stdout is not None
        lines = []
        for line in first.stdout:
            lines.append(line.strip())
            if line.strip() == f"WROTE {pause_at}":
                break
        first.kill()  # SIGKILL: after the fact's writes, before its commit
        first.wait(10)
    finally:
        first.kill()
    assert lines[-2:] == [f"COMMITTED {ack.ids[2]}", f"WROTE {pause_at}"]
    second = child("consume", streams_url, stream, totals, "0")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out.splitlines()[0] == f"WROTE {pause_at}"  # delivered again: it did not count
    with psycopg.connect(streams_url) as conn:
        total = conn.execute(f"SELECT total FROM {totals}").fetchone()
        applied = [r[0] for r in conn.execute(f"SELECT stream_id FROM {totals}_applied ORDER BY 1")]
    assert total == (2**8 - 1,)
    assert applied == list(ack.ids)  # each once
    assert {g.group: g.position for g in client.groups(stream)} == {"consumers": ack.last_id}
