"""Child programs of the fault tests: a writer in a process of its own, stopped or cut off by the
test (run as ``python tests/fault_child.py ROLE URL STREAM LEASE ROWS``).

Roles:

* ``batch``: `append_batch` of ROWS facts, again and again;
* ``fact``: ``writer.fact(conn)`` with ``fact.add`` of ROWS rows (a ``COPY`` inside the
  caller's transaction), again and again.

It prints one line per event, flushed: ``READY <backend pid of the connection that will COPY>``,
then ``ACK <first id> <last id>`` after each append, ``ERROR <class>`` after a failed one (and
goes on, so that a test sees what a woken writer does next). It rests `PAUSE` seconds between
appends, so that a reader on a loaded machine keeps up with it, and stops writing after
`MAX_APPENDS` (then only waits to be killed): a test that fails or hangs before it freezes the
child must not fill the database's disk.
"""

from __future__ import annotations

import sys
import time

import psycopg

import streams

PAYLOAD = {"order": 17, "lines": ["a" * 40, "b" * 40], "total": 42.5}
PAUSE = 0.2
MAX_APPENDS = 50


def main(argv: list[str]) -> None:
    role, url, stream, lease, rows = argv[0], argv[1], argv[2], float(argv[3]), int(argv[4])
    with streams.connect(url, lease_seconds=lease) as client:
        writer = client.writer(stream, instance=f"frozen-{role}")
        if role == "batch":
            pid = writer._conn.info.backend_pid
            conn = None
        else:
            conn = psycopg.connect(url)
            pid = conn.info.backend_pid
        print(f"READY {pid}", flush=True)
        for _ in range(MAX_APPENDS):
            try:
                if conn is None:
                    ack = writer.append_batch([PAYLOAD] * rows)
                    print(f"ACK {ack.first_id} {ack.last_id}", flush=True)
                else:
                    with writer.fact(conn) as fact:
                        fact.add(*([PAYLOAD] * rows))
                    print(f"ACK {fact.stream_id} {fact.stream_id}", flush=True)
            except Exception as exc:  # the test reads what a woken writer meets
                print(f"ERROR {type(exc).__name__}", flush=True)
                if conn is not None and conn.closed:
                    conn = psycopg.connect(url)
            time.sleep(PAUSE)
        print("DONE", flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1:])
