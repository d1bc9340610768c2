"""Child programs of the chaos test (``tests/faults/test_chaos.py``), one role per process:

* ``writer URL REDIS PREFIX STREAM NAME SEED LEASE``: appends at random (single appends,
  batches, keyed appends, multi-row ``fact()`` facts in its own transaction, and ``fact()``
  reservations it rolls back on purpose: gaps). Every row's payload is ``{"w": NAME, "n":
  <attempt>, "j": <index in a batch>, "r": <row>, "k": <rows of the fact>}``. It prints
  ``ACK n k id...`` (the IDs of attempt ``n``, ``k`` rows each), ``UNK n k count``
  (`streams.CommitUnknown`), ``RB n id`` (a reservation rolled back: that ID is a gap),
  ``LOSS n stream first last missing message`` (`streams.FailoverLoss`: a failover lost facts
  acknowledged to it, IDs ``first..last``; it goes on), ``ERR n Type message`` (another error of
  the library's tree), ``BAD Type message`` (an error outside it). Another
  `streams.DatabaseChanged` (a history it may not write in): ``CHANGED n message``, exit 6.
  SIGUSR1 pauses it between appends (it prints ``PAUSED``), SIGUSR2 resumes it, SIGTERM makes
  it finish the current append, print ``DONE`` and exit.
* ``reader URL REDIS PREFIX STREAMS MODE NAME SEED [GROUP]``: follows the comma-separated
  ``STREAMS`` with shared proofs; ``MODE`` is ``plain`` (no group), ``auto`` (group ``GROUP``,
  `Reader.commit` after each epoch) or ``tx`` (group ``GROUP``, records each fact in table
  ``chaos_effects`` and commits the group in that same transaction, ``commit(conn=...)``). It
  prints ``START {positions}``, then per epoch ``E stream id:w:n:j:rows ...``, ``P stream
  position`` when a position moves, ``C {positions}`` after a group commit succeeded. SIGUSR1
  arms a suicide: at its next epoch it prints ``DYING`` and SIGKILLs itself between the epoch
  and its commit. `streams.GroupFenced` and `streams.GroupMoved` mean "not the owner any
  more": it prints ``FENCED Type`` and exits 0. Any other failure of a group consumer's
  transaction exits 3 (the test starts a new consumer, as a supervisor would). A
  `streams.FailoverLoss` (it delivered facts a failover lost) stops it for good: it prints
  ``LOSS 0 stream first last missing message`` and exits 5; another `streams.DatabaseChanged`:
  ``CHANGED 0 message``, exit 6. SIGTERM: print ``DONE``, exit.

Every child that cannot open its client, writer or reader (any error: the library waits up to
its ``connect_timeout``, 30 s, for a server that is restarting or failing over, longer than any
fault lasts) prints ``OPEN Type message`` and exits 7.

Every child dies with its parent (``PR_SET_PDEATHSIG``, set by the test before ``exec``) and
flushes every line, so a line cut short by SIGKILL is the only one lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import psycopg

import streams


class _Rollback(Exception):
    """Raised inside ``fact()`` to roll its transaction back on purpose."""


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def loss(exc: streams.FailoverLoss) -> str:
    return f"{exc.stream} {exc.first} {exc.last} {exc.missing} {_short(exc)}"


@contextlib.contextmanager
def opening() -> Iterator[None]:
    """Opening a client, writer or reader: any error is reported (``OPEN``) and ends the
    process (the test judges it; a supervisor would start a new one)."""
    try:
        yield
    except Exception as exc:
        out(f"OPEN {type(exc).__name__} {_short(exc)}")
        traceback.print_exc()  # where it came from, in the child's .err
        sys.stderr.flush()
        os._exit(7)


class Flags:
    def __init__(self) -> None:
        self.paused = False
        self.stop = False
        self.die = False
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, *_: object) -> None:
        self.stop = True


def write(url: str, redis_url: str, prefix: str, stream: str, name: str, seed: int,
          lease: float) -> None:  # fmt: skip
    rng = random.Random(seed)
    flags = Flags()
    signal.signal(signal.SIGUSR1, lambda *_: setattr(flags, "paused", True))
    signal.signal(signal.SIGUSR2, lambda *_: setattr(flags, "paused", False))
    generation = 0
    with opening():
        client = streams.connect(url, redis_url=redis_url, prefix=prefix, lease_seconds=lease)
        writer = client.writer(stream, instance=f"{name}g{generation}")
    conn: psycopg.Connection[Any] | None = None
    out("READY")
    n = 0
    while not flags.stop:
        if flags.paused:
            out("PAUSED")
            while flags.paused and not flags.stop:
                time.sleep(0.01)
            continue
        n += 1
        kind = rng.choices(["one", "batch", "key", "fact", "rollback"], [4, 2, 2, 2, 2])[0]
        rows = rng.randint(2, 4) if kind in ("fact", "rollback") else 1
        count = rng.randint(2, 6) if kind == "batch" else 1

        def row(j: int, r: int, k: int, n: int = n) -> dict[str, Any]:
            return {"w": name, "n": n, "j": j, "r": r, "k": k, "pad": "x" * 20}

        try:
            if kind in ("fact", "rollback"):
                if conn is None or conn.closed or conn.broken:
                    conn = None
                    conn = psycopg.connect(url, connect_timeout=3)
                reserved: int | None = None
                try:
                    with writer.fact(conn) as fact:
                        reserved = fact.stream_id
                        fact.add(*(row(0, r, rows) for r in range(rows)))
                        if kind == "rollback":
                            raise _Rollback
                except _Rollback:
                    out(f"RB {n} {reserved}")
                    continue
                out(f"ACK {n} {rows} {fact.stream_id}")
            elif kind == "batch":
                ack = writer.append_batch([row(j, 0, 1) for j in range(count)])
                out(f"ACK {n} 1 {' '.join(map(str, ack.ids))}")
            elif kind == "key":
                key = f"{name}-{n}"
                try:
                    ack = writer.append(row(0, 0, 1), key=key)
                except streams.CommitUnknown:
                    ack = writer.append(row(0, 0, 1), key=key)  # once at most, by its key
                out(f"ACK {n} 1 {' '.join(map(str, ack.ids))}")
            else:
                ack = writer.append(row(0, 0, 1))
                out(f"ACK {n} 1 {' '.join(map(str, ack.ids))}")
        except streams.CommitUnknown as exc:
            out(f"UNK {n} {rows} {count} {_short(exc)}")
        except streams.WriterFenced as exc:
            out(f"ERR {n} WriterFenced {_short(exc)}")
            with_retry = writer
            generation += 1
            with opening():
                writer = client.writer(stream, instance=f"{name}g{generation}")
            with_retry.close()
        except streams.FailoverLoss as exc:
            out(f"LOSS {n} {loss(exc)}")
        except streams.DatabaseChanged as exc:
            out(f"CHANGED {n} {_short(exc)}")
            os._exit(6)
        except streams.StreamsError as exc:
            out(f"ERR {n} {type(exc).__name__} {_short(exc)}")
            time.sleep(0.05)
        except psycopg.OperationalError as exc:  # our own connection of fact(): reconnect
            out(f"OWN {n} {type(exc).__name__} {_short(exc)}")
            conn = None
            time.sleep(0.05)
        except Exception as exc:
            out(f"BAD {type(exc).__name__} {_short(exc)}")
            time.sleep(0.05)
        time.sleep(rng.uniform(0.005, 0.04))
    out("DONE")
    os._exit(0)  # the test checks what was printed; no teardown may block an exit


def _describe(fact: streams.Fact) -> str:
    first: dict[str, Any] = fact.payloads[0]
    return f"{fact.stream_id}:{first['w']}:{first['n']}:{first['j']}:{len(fact.payloads)}"


def read(url: str, redis_url: str, prefix: str, names: list[str], mode: str, name: str,
         seed: int, group: str | None) -> None:  # fmt: skip
    flags = Flags()
    signal.signal(signal.SIGUSR1, lambda *_: setattr(flags, "die", True))
    with opening():
        client = streams.connect(url, redis_url=redis_url, prefix=prefix, shared_proofs=True)
        reader = client.reader(names, group=group, poll_interval=0.2)
    conn: psycopg.Connection[Any] | None = None
    positions = {s: reader.position(s) for s in names}
    out(f"START {json.dumps(positions)}")
    while not flags.stop:
        try:
            epoch = reader.poll(timeout=0.5)
        except streams.ConnectionLost as exc:
            out(f"ERR 0 {type(exc).__name__} {_short(exc)}")
            continue
        except streams.FailoverLoss as exc:
            out(f"LOSS 0 {loss(exc)}")
            os._exit(5)
        except streams.DatabaseChanged as exc:
            out(f"CHANGED 0 {_short(exc)}")
            os._exit(6)
        except streams.StreamsError as exc:
            out(f"ERR 0 {type(exc).__name__} {_short(exc)}")
            if mode != "plain":
                os._exit(3)
            continue
        except Exception as exc:
            out(f"BAD {type(exc).__name__} {_short(exc)}")
            os._exit(4)
        if epoch is not None and epoch.facts:
            for stream in names:
                facts = [_describe(f) for f in epoch.facts if f.stream == stream]
                if facts:
                    out(f"E {stream} {' '.join(facts)}")
        for stream in names:
            now = reader.position(stream)
            if now != positions[stream]:
                positions[stream] = now
                out(f"P {stream} {now}")
        if mode == "plain" or epoch is None:
            continue  # an epoch of gaps only is committed too: the group's position moves
        if flags.die:
            out("DYING")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if mode == "auto":
                committed = reader.commit()
            else:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(url, connect_timeout=3)
                with conn.cursor() as cur:
                    if epoch.facts:
                        cur.executemany(
                            "INSERT INTO chaos_effects (grp, stream, stream_id, consumer) "
                            "VALUES (%s, %s, %s, %s)",
                            [(group, f.stream, f.stream_id, name) for f in epoch.facts],
                        )
                committed = reader.commit(conn=conn)
                conn.commit()
        except (streams.GroupFenced, streams.GroupMoved) as exc:
            out(f"FENCED {type(exc).__name__} {_short(exc)}")
            os._exit(0)
        except streams.FailoverLoss as exc:
            out(f"LOSS 0 {loss(exc)}")
            os._exit(5)
        except streams.DatabaseChanged as exc:
            out(f"CHANGED 0 {_short(exc)}")
            os._exit(6)
        except (streams.StreamsError, psycopg.Error) as exc:
            # The epoch's effects and position did not commit (or nobody knows): this consumer
            # cannot go on from its in-memory position. A supervisor starts a new one.
            tag = "ERR 0" if isinstance(exc, streams.StreamsError) else "OWN 0"
            out(f"{tag} {type(exc).__name__} {_short(exc)}")
            os._exit(3)
        except Exception as exc:
            out(f"BAD {type(exc).__name__} {_short(exc)}")
            os._exit(4)
        out(f"C {json.dumps(committed)}")
    out("DONE")
    os._exit(0)


def main(argv: list[str]) -> None:
    role = argv[0]
    if role == "writer":
        url, redis_url, prefix, stream, name, seed, lease = argv[1:8]
        write(url, redis_url, prefix, stream, name, int(seed), float(lease))
    else:
        url, redis_url, prefix, names, mode, name, seed = argv[1:8]
        group = argv[8] if len(argv) > 8 else None
        read(url, redis_url, prefix, names.split(","), mode, name, int(seed), group)


if __name__ == "__main__":
    main(sys.argv[1:])
