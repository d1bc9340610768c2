"""A writer killed with SIGKILL mid-transaction, under load, must not hold the stream back.

The child process appends in a loop and, now and then, holds a fact open in its own
transaction. We kill it while it holds one. Meanwhile a writer in this process keeps
appending. We check (1) the linear position moves past the dead writer's reserved ID within
the lease (plus the retirement cadence), and (2) no fact ever appears at or below a linear
position that was already published: every snapshot "facts <= L" taken while running is
exactly what the table holds at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import psycopg

import streams
from streams import Client

CHILD = textwrap.dedent(
    """
    import sys, time, psycopg, streams
    url, stream = sys.argv[1], sys.argv[2]
    client = streams.connect(url, lease_seconds=1.0)
    writer = client.writer(stream, instance="doomed")
    conn = psycopg.connect(url)
    n = 0
    while True:
        writer.append({"child": n})
        n += 1
        if n == 50:
            with writer.fact(conn) as fact:
                fact.add({"child": "held"})
                print("HOLDING", fact.stream_id, flush=True)
                time.sleep(3600)
    """
)


def _facts_at_or_below(
    conn: psycopg.Connection[tuple[Any, ...]], stream_key: int, linear: int
) -> set[int]:
    rows = conn.execute(
        "SELECT DISTINCT stream_id FROM streams_facts WHERE stream = %s AND stream_id <= %s",
        (stream_key, linear),
    ).fetchall()
    return {int(r[0]) for r in rows}


def test_killed_writer_does_not_pin_and_is_fenced(
    client: Client, stream: str, streams_url: str
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, streams_url, stream],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    snapshots: list[tuple[int, set[int]]] = []
    stream_key = client.stream(stream).id
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("HOLDING"), line
        held = int(line.split()[1])
        with (
            streams.connect(streams_url, lease_seconds=1.0) as fast,
            fast.writer(stream, instance="survivor") as survivor,
            psycopg.connect(streams_url, autocommit=True) as conn,
        ):
            survivor.append_batch([{"load": i} for i in range(100)])
            before = fast.positions(stream).linear
            assert before < held, "the held fact must pin the linear position while alive"
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            killed_at = time.monotonic()
            passed_at = None
            while time.monotonic() - killed_at < 15:
                survivor.append({"load": "more"})
                linear = fast.positions(stream).linear
                snapshots.append((linear, _facts_at_or_below(conn, stream_key, linear)))
                if linear > held and passed_at is None:
                    passed_at = time.monotonic() - killed_at
                if passed_at is not None and time.monotonic() - killed_at > passed_at + 1:
                    break
            assert passed_at is not None, "the linear position never passed the dead writer"
            # Lease 1 s, heartbeats every lease/4: well within lease + a second of slack.
            assert passed_at < 1.0 + 2.0, passed_at
            positions = fast.positions(stream)
            assert positions.writers["doomed"].retired
            final = {
                linear: _facts_at_or_below(conn, stream_key, linear) for linear, _ in snapshots
            }
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # The held fact was never committed, and nothing appeared below a published position.
    assert held not in final[max(final)]
    for linear, seen in snapshots:
        assert final[linear] == seen, f"facts appeared at or below published position {linear}"
