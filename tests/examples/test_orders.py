"""The example service of ``examples/orders``, end to end: two processes of the service, clients
that retry every request several times at once across them (and once after a client-side
timeout), and a consumer killed with SIGKILL at random moments and restarted. At the end the
service's ``customer_totals`` equals what the facts say, every fact applied once, and every
request's answers name one order."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import REPO_ROOT, wait_until
from servers import create_database, database_name, drop_database

from streams.migrate import upgrade

EXAMPLE = REPO_ROOT / "examples" / "orders"
ORDERS = 30
#: SIGKILLs of the consumer, at least (it goes on while the requests are served).
KILLS = 5
CUSTOMERS = ["ada", "grace", "edsger", "barbara"]


@pytest.fixture
def orders_url(postgres_admin_url: str) -> Iterator[str]:
    url = create_database(postgres_admin_url, prefix="streams_orders")
    upgrade(url)
    yield url
    drop_database(postgres_admin_url, database_name(url))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=EXAMPLE,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def post(port: int, key: str, order: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/orders",
        data=json.dumps(order).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/docs", timeout=1):
            return True
    except (OSError, urllib.error.URLError):
        return False


class Consumers:
    """The consumer process, killed with SIGKILL at random moments and started again."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.kills, self.stop = env, 0, threading.Event()
        self.proc = self._start()
        self.thread = threading.Thread(target=self._kill_loop, daemon=True)
        self.thread.start()

    def _start(self) -> subprocess.Popen[bytes]:
        return start(self.env, "consumer.py", "--slow", "0.03")

    def _kill_loop(self) -> None:
        rng = random.Random(21)
        while not self.stop.wait(rng.uniform(0.4, 1.0)) or self.kills < KILLS:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.kills += 1
            self.proc = self._start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def test_retried_requests_and_a_killed_consumer_count_each_order_once(orders_url: str) -> None:
    env = {**os.environ, "STREAMS_DATABASE_URL": orders_url, "PYTHONPATH": str(EXAMPLE)}
    env.pop("STREAMS_REDIS_URL", None)
    subprocess.run([sys.executable, "consumer.py", "--setup"], cwd=EXAMPLE, env=env, check=True)
    ports = [free_port(), free_port()]
    services = [
        start(env, "-m", "uvicorn", "app:app", "--port", str(port), "--log-level", "warning")
        for port in ports
    ]
    consumers = None
    try:
        for port in ports:
            wait_until(functools.partial(answers, port), 30, f"the service on {port}")
        consumers = Consumers(env)
        rng = random.Random(7)
        orders: dict[str, dict[str, Any]] = {
            f"request-{n}": {"customer": rng.choice(CUSTOMERS), "amount": rng.randint(1, 500)}
            for n in range(ORDERS)
        }
        got: dict[str, list[int]] = defaultdict(list)

        def attempt(key: str, port: int, timeout: float) -> None:
            try:
                answer = post(port, key, orders[key], timeout)
            except (OSError, urllib.error.URLError):
                return  # the client gave up (a timeout): it retries below
            assert (answer["customer"], answer["amount"]) == tuple(orders[key].values())
            got[key].append(answer["order"])

        with ThreadPoolExecutor(max_workers=8) as pool:
            # Each request three times at once across both processes, one of them with a
            # client timeout too short for an answer; then once more, after all that.
            waves = [
                (key, ports[n % 2], 0.005 if n == 2 else 30.0) for key in orders for n in range(3)
            ]
            rng.shuffle(waves)
            list(pool.map(lambda a: attempt(*a), waves))
            list(pool.map(lambda key: attempt(key, rng.choice(ports), 30.0), orders))
        consumers.finish()
        kills = consumers.kills
        final = subprocess.run(
            [sys.executable, "consumer.py", "--idle", "2"], cwd=EXAMPLE, env=env, timeout=60,
            capture_output=True, check=False,
        )  # fmt: skip
        assert final.returncode == 0, final.stderr.decode()
    finally:
        if consumers is not None:
            consumers.finish()
        for service in services:
            service.send_signal(signal.SIGTERM)
        for service in services:
            service.wait(15)

    assert kills >= KILLS
    for key in orders:
        assert len(set(got[key])) == 1 and len(got[key]) >= 3, (key, got[key])
    with psycopg.connect(orders_url) as conn:
        facts = conn.execute(
            "SELECT f.stream_id, f.payload FROM streams_facts f "
            "JOIN streams_registry r ON r.id = f.stream WHERE r.name = 'orders' ORDER BY 1"
        ).fetchall()
        stored = conn.execute(
            "SELECT stream_id, customer, amount FROM orders ORDER BY 1"
        ).fetchall()
        totals = conn.execute("SELECT customer, orders, amount FROM customer_totals").fetchall()
        applied = Counter(row[0] for row in conn.execute("SELECT stream_id FROM applied_facts"))
    assert sorted(got[key][0] for key in orders) == [f[0] for f in facts]  # one fact per request
    assert [(f[0], f[1]["customer"], f[1]["amount"]) for f in facts] == stored
    assert all(f[1]["order"] == f[0] for f in facts)
    expected: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for order in orders.values():
        expected[order["customer"]][0] += 1
        expected[order["customer"]][1] += order["amount"]
    assert {c: [n, a] for c, n, a in totals} == expected
    assert applied == Counter({f[0]: 1 for f in facts})  # each fact applied once


def test_the_example_is_not_shipped() -> None:
    assert not (Path(REPO_ROOT) / "streams" / "examples").exists()
