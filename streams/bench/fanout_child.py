"""The child processes of `streams bench fanout`:
``python -m streams.bench.fanout_child <role> <arguments>``.

Each prints ``READY`` once set up, then one JSON line with its figures when it is done:

* ``reader URL REDIS_URL PREFIX STREAM SHARED``: follows ``STREAM`` live (``SHARED`` ``1``: with
  shared proofs) until SIGTERM; ``{"n": facts, "lat": [delay of each fact carrying a send time,
  s], "own": its own probes, "proofs": proofs its client's prober made}``.
* ``writer URL REDIS_URL PREFIX STREAM SECONDS RATE``: after a line on stdin, appends for
  ``SECONDS``: flat out (``RATE`` 0; payload ``{"f": n}``) or ``RATE`` facts/s (payload
  ``{"t": send time}``); ``{"n": facts}``.
* ``subscriber REDIS_URL CHANNEL``: receives plain Redis messages (a send time each) until
  SIGTERM; ``{"n": messages, "lat": [delays, s]}``.

Every role ignores Ctrl-C (its parent ends it, see `common.scratch_streams`) and stops when its
stdin closes: a parent that dies leaves no child behind.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from ..transport.discovery import open_client
from .common import ignore_interrupts

__all__ = ["main"]


def _stopper() -> threading.Event:
    """Set on SIGTERM, or when stdin closes (the parent is gone or done)."""
    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    def watch_stdin() -> None:
        while sys.stdin.readline():
            pass
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=watch_stdin, name="bench-stdin", daemon=True).start()
    return stop


def _done(figures: dict[str, Any]) -> None:
    print(json.dumps(figures), flush=True)


def reader(url: str, redis_url: str, prefix: str, stream: str, shared: str) -> None:
    import streams

    client = streams.connect(url, redis_url=redis_url, prefix=prefix)
    follower = client.reader(stream, start="latest", shared_proofs=shared == "1")
    stop = _stopper()
    lat: list[float] = []
    n = 0
    print("READY", flush=True)
    while not stop.is_set():
        epoch = follower.poll(timeout=0.2)
        if epoch is not None:
            now = time.time()
            for fact in epoch.facts:
                n += 1
                sent = fact.payload.get("t") if isinstance(fact.payload, dict) else None
                if sent:
                    lat.append(now - sent)
    core = follower.core
    proofs = client._proofs.proofs if client._proofs is not None else 0
    _done(
        {
            "n": n,
            "lat": lat,
            "own": core.counters.probes - core.counters.proof_reads,
            "proofs": proofs,
        }
    )


def writer(url: str, redis_url: str, prefix: str, stream: str, seconds: str, rate: str) -> None:
    import streams

    client = streams.connect(url, redis_url=redis_url, prefix=prefix)
    appender = client.writer(stream)
    print("READY", flush=True)
    if not sys.stdin.readline():  # the parent is gone: no go
        appender.close()
        return
    duration, per_s = float(seconds), float(rate)
    end = time.monotonic() + duration
    n = 0
    if per_s <= 0:
        while time.monotonic() < end:
            appender.append({"f": n})
            n += 1
    else:
        due = time.monotonic()
        while due < end:
            appender.append({"t": time.time()})
            n += 1
            due += 1 / per_s
            time.sleep(max(0.0, due - time.monotonic()))
    appender.close()
    _done({"n": n})


def subscriber(redis_url: str, channel: str) -> None:
    r = open_client(redis_url)
    pubsub = r.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
    pubsub.subscribe(channel)
    stop = _stopper()
    lat: list[float] = []
    print("READY", flush=True)
    while not stop.is_set():
        message = pubsub.get_message(timeout=0.2)
        if message is not None:
            lat.append(time.time() - float(message["data"]))
    _done({"n": len(lat), "lat": lat})


ROLES: dict[str, tuple[int, Callable[..., None]]] = {
    "reader": (5, reader),
    "writer": (6, writer),
    "subscriber": (2, subscriber),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the role named by the first argument with the rest; 2 for a bad command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    role = ROLES.get(args[0]) if args else None
    if role is None or len(args) - 1 != role[0]:
        usage = ", ".join(f"{name} ({count} arguments)" for name, (count, _) in ROLES.items())
        print(f"usage: python -m streams.bench.fanout_child ROLE ARGS...; roles: {usage}",
              file=sys.stderr)  # fmt: skip
        return 2
    ignore_interrupts()
    role[1](*args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
