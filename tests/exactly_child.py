"""Child programs of the exactly-once fault tests (``python tests/exactly_child.py ROLE ...``).

Writers (``ROLE URL STREAM SEED KEY...``): ``append`` (one keyed append per key), ``fact``
(``writer.fact(conn, key=...)``, its own transaction) or ``batch`` (keyed batches of three). Each
waits for a line on stdin (so that every process starts at once), appends every key in an order
of its own (``SEED``), each key several times over (a retry storm), and prints one JSON line per
key: ``{"key", "id", "ts", "duplicate"}``, then ``DONE``.

Consumer (``consume URL STREAM TABLE PAUSE_AT``): follows group ``consumers`` fact by fact; for
each fact it adds the fact's ``n`` to ``TABLE``'s total and records the fact in ``TABLE_applied``,
then commits the group through that fact in the same transaction. It prints ``WROTE <id>``
after the writes (before the commit) and ``COMMITTED <id>`` after; at the fact ``PAUSE_AT`` it
sleeps after its writes, before its commit (a test kills it there). It stops when caught up.
"""

from __future__ import annotations

import json
import random
import sys
import time

import psycopg

import streams

#: Appends of each key by each process.
REPEATS = 3


def write(role: str, url: str, stream: str, seed: int, keys: list[str]) -> None:
    order = [key for key in keys for _ in range(REPEATS)]
    random.Random(seed).shuffle(order)
    with streams.connect(url, lease_seconds=5.0) as client:
        writer = client.writer(stream, instance=f"{role}-{seed}")
        conn = psycopg.connect(url)
        sys.stdin.readline()  # the start line: every process starts at once
        seen: dict[str, streams.Ack] = {}
        # The keys of one batch are distinct.
        batches = [list(dict.fromkeys(order[i : i + 3])) for i in range(0, len(order), 3)]
        for chunk in batches if role == "batch" else [[key] for key in order]:
            payloads = [{"key": key} for key in chunk]
            if role == "append":
                acks = [writer.append(payloads[0], key=chunk[0])]
            elif role == "fact":
                with writer.fact(conn, key=chunk[0]) as fact:
                    if not fact.duplicate:
                        fact.add(payloads[0])
                acks = [fact.ack]
            else:
                ack = writer.append_batch(payloads, keys=chunk)
                acks = [_single(ack, n) for n in range(len(chunk))]
            for key, single in zip(chunk, acks, strict=True):
                if key in seen and seen[key].first_id != single.first_id:
                    raise AssertionError(f"{key}: {single} after {seen[key]}")
                seen[key] = single
                print(
                    json.dumps({"key": key, "id": single.first_id, "ts": single.first_timestamp}),
                    flush=True,
                )
        writer.close()
        conn.close()
    print("DONE", flush=True)


def _single(ack: streams.Ack, n: int) -> streams.Ack:
    """The `Ack` of the ``n``-th payload of a batch, as its own append would have it: its ID,
    and its timestamp (known for the first and last IDs; the tests compare IDs otherwise)."""
    stream_id = ack.ids[n]
    stamp = ack.first_timestamp if stream_id == ack.first_id else ack.last_timestamp
    if stream_id not in (ack.first_id, ack.last_id):
        stamp = 0
    return streams.Ack.of([stream_id], [stamp])


def consume(url: str, stream: str, table: str, pause_at: int) -> None:
    with (
        streams.connect(url) as client,
        client.reader(stream, group="consumers") as reader,
        psycopg.connect(url) as conn,
    ):
        for fact in reader.facts():
            conn.execute(f"UPDATE {table} SET total = total + %s", (fact.payload["n"],))
            conn.execute(f"INSERT INTO {table}_applied VALUES (%s)", (fact.stream_id,))
            print(f"WROTE {fact.stream_id}", flush=True)
            if fact.stream_id == pause_at:
                time.sleep(120)  # killed here, between the writes and the commit
            reader.commit(fact, conn=conn)
            conn.commit()
            print(f"COMMITTED {fact.stream_id}", flush=True)
    print("DONE", flush=True)


def main(argv: list[str]) -> None:
    role = argv[0]
    if role == "consume":
        consume(argv[1], argv[2], argv[3], int(argv[4]))
    else:
        write(role, argv[1], argv[2], int(argv[3]), argv[4:])


if __name__ == "__main__":
    main(sys.argv[1:])
