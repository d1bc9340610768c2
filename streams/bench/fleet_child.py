"""The child processes of `streams bench fleet`: ``python -m streams.bench.fleet_child <role>
<arguments>``.

Each prints ``READY`` once set up, then answers each command line on stdin with one JSON line,
and exits when stdin closes (a parent that dies leaves no child behind; Ctrl-C is the parent's).

* ``writer URL REDIS_URL PREFIX STREAM`` (``REDIS_URL`` ``-``: Redis off) and ``raw_writer URL
  REDIS_URL CHANNEL TABLE``: ``run SECONDS RATE`` appends for ``SECONDS``, flat out (``RATE`` 0)
  or at ``RATE`` facts/s (each payload carries its wall-clock send time), and answers ``{"n",
  "cpu", "stmts", "recv"}`` for that run. The raw writer does what the issue's baseline says:
  one ``INSERT`` (autocommit) and one ``PUBLISH`` of the payload per fact.
* ``reader URL REDIS_URL PREFIX STREAM`` (a live reader, shared proofs on) and ``raw_reader
  REDIS_URL CHANNEL`` (a plain subscriber) follow all along; ``mark`` restarts their counters,
  ``report`` answers ``{"n", "lat", "cpu", "stmts", "recv"}`` since the mark (``lat``: delivery
  delays in seconds, at most `MAX_SAMPLES`).

``cpu``: the process's user + system seconds (every thread); ``stmts``: SQL statements it sent
(counted in psycopg's cursor, so everything the library sends: appends, heartbeats, probes,
proofs, elections); ``recv``: Redis messages its link (or subscription) received.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from ..transport.discovery import open_client
from .common import ignore_interrupts

__all__ = ["main"]

#: Most latency samples a reader reports (evenly thinned beyond that).
MAX_SAMPLES = 20_000

_statements = 0


def _count_statements() -> None:
    """Count every statement psycopg sends from this process (the benchmark's instrument)."""
    cursor: Any = psycopg.Cursor

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            global _statements
            _statements += 1
            return method(*args, **kwargs)

        return wrapper

    cursor.execute = counted(cursor.execute)
    cursor.executemany = counted(cursor.executemany)
    cursor.copy = counted(cursor.copy)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reply(figures: dict[str, Any]) -> None:
    print(json.dumps(figures), flush=True)


def _commands() -> Any:
    for line in sys.stdin:
        words = line.split()
        if words:
            yield words


def _pace(seconds: float, rate: float, one: Callable[[int], None]) -> int:
    """Call ``one(n)`` flat out or ``rate`` times a second for ``seconds``; how many calls."""
    end = time.monotonic() + seconds
    n = 0
    if rate <= 0:
        while time.monotonic() < end:
            one(n)
            n += 1
        return n
    due = time.monotonic()
    while due < end:
        one(n)
        n += 1
        due += 1 / rate
        time.sleep(max(0.0, due - time.monotonic()))
    return n


def _writer_loop(append: Callable[[int, bool], None], received: Callable[[], int]) -> None:
    print("READY", flush=True)
    for words in _commands():
        if words[0] != "run":
            continue
        seconds, rate = float(words[1]), float(words[2])
        cpu, stmts, recv = _cpu(), _statements, received()
        timed = rate > 0
        n = _pace(seconds, rate, lambda i, timed=timed: append(i, timed))  # type: ignore[misc]
        _reply({"n": n, "cpu": _cpu() - cpu, "stmts": _statements - stmts,
                "recv": received() - recv})  # fmt: skip


def writer(url: str, redis_url: str, prefix: str, stream: str) -> None:
    import streams

    client = streams.connect(url, redis_url=None if redis_url == "-" else redis_url, prefix=prefix)
    appender = client.writer(stream)

    def append(n: int, timed: bool) -> None:
        appender.append({"t": time.time()} if timed else {"f": n})

    def received() -> int:
        link = client.link
        return link.core.stats.received if link is not None else 0

    try:
        _writer_loop(append, received)
    finally:
        appender.close()
        client.close()


def raw_writer(url: str, redis_url: str, channel: str, table: str) -> None:
    conn = psycopg.connect(url, autocommit=True)
    r = open_client(redis_url)
    statement = f"INSERT INTO {table} (payload) VALUES (%s)".encode()  # the parent's name

    def append(n: int, timed: bool) -> None:
        payload = json.dumps({"t": time.time()} if timed else {"f": n})
        conn.execute(statement, (payload,))
        r.publish(channel, payload)

    try:
        _writer_loop(append, lambda: 0)
    finally:
        conn.close()
        r.close()


class _Tally:
    """What a reader received since the last mark (the following thread adds, the command
    loop reads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0
        self.lat: list[float] = []
        self.cpu = _cpu()
        self.stmts = 0
        self.recv = 0

    def add(self, sent: float | None, now: float) -> None:
        with self.lock:
            self.n += 1
            if sent is not None:
                self.lat.append(now - sent)

    def mark(self, recv: int) -> None:
        with self.lock:
            self.n, self.lat = 0, []
            self.cpu, self.stmts, self.recv = _cpu(), _statements, recv

    def report(self, recv: int) -> dict[str, Any]:
        with self.lock:
            lat = self.lat
            if len(lat) > MAX_SAMPLES:
                step = len(lat) / MAX_SAMPLES
                lat = [lat[int(i * step)] for i in range(MAX_SAMPLES)]
            return {"n": self.n, "lat": lat, "cpu": _cpu() - self.cpu,
                    "stmts": _statements - self.stmts, "recv": recv - self.recv}  # fmt: skip


def _reader_loop(tally: _Tally, received: Callable[[], int]) -> None:
    print("READY", flush=True)
    for words in _commands():
        if words[0] == "mark":
            tally.mark(received())
            _reply({})
        elif words[0] == "report":
            _reply(tally.report(received()))


def _sent(payload: Any) -> float | None:
    sent = payload.get("t") if isinstance(payload, dict) else None
    return float(sent) if isinstance(sent, int | float) else None


def reader(url: str, redis_url: str, prefix: str, stream: str) -> None:
    import streams

    client = streams.connect(url, redis_url=redis_url, prefix=prefix)
    follower = client.reader(stream, start="latest", shared_proofs=True)
    tally = _Tally()
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            epoch = follower.poll(timeout=0.2)
            if epoch is not None:
                now = time.time()
                for fact in epoch.facts:
                    tally.add(_sent(fact.payload), now)

    def received() -> int:
        link = client.link
        return link.core.stats.received if link is not None else 0

    thread = threading.Thread(target=follow, name="bench-follow", daemon=True)
    thread.start()
    try:
        _reader_loop(tally, received)
    finally:
        stop.set()
        thread.join(5)
        follower.close()
        client.close()


def raw_reader(redis_url: str, channel: str) -> None:
    r = open_client(redis_url)
    pubsub: Any = r.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
    pubsub.subscribe(channel)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # confirmed: nothing published later is missed
        message = pubsub.get_message(timeout=0.5)
        if message is not None and message["type"] == "subscribe":
            break
    tally = _Tally()
    count = [0]
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            message = pubsub.get_message(timeout=0.2)
            if message is not None and message["type"] == "message":
                count[0] += 1
                tally.add(_sent(json.loads(message["data"])), time.time())

    thread = threading.Thread(target=follow, name="bench-follow", daemon=True)
    thread.start()
    try:
        _reader_loop(tally, lambda: count[0])
    finally:
        stop.set()
        thread.join(5)
        pubsub.close()
        r.close()


ROLES: dict[str, Callable[..., None]] = {
    "writer": writer,
    "raw_writer": raw_writer,
    "reader": reader,
    "raw_reader": raw_reader,
}


def main(argv: list[str]) -> None:
    ignore_interrupts()
    _count_statements()
    ROLES[argv[0]](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
