"""Followers trust only what is possible, and what Redis sends is bounded and visible (issue 29,
items 4 and 6): a shared proof above the stream's max allocated ID is refused in the statement
that reads it; a group commit beyond it moves nothing (`InvalidPosition`), and `streams doctor`
names such a group and a sequence near the bigint limit; lines under an unknown key are not
kept (a flood costs no memory); rejected lines and refused proofs are Prometheus counters.

Each attack is run against real PostgreSQL and Redis, as a role that may write what it attacks
(the test's superuser), while readers run.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import prometheus_client
import psycopg
import pytest
import redis
from helpers import read_through, wait_until
from prometheus_client.parser import text_string_to_metric_families

import streams
from streams import Client
from streams.bench.common import drop_streams
from streams.config import Settings
from streams.core.constants import proof_channel
from streams.core.signing import NONCE_BYTES
from streams.metrics import ClientCollector
from streams.ops.doctor import SEQUENCE_NEAR_LIMIT, diagnose
from streams.reader import Reader
from streams.store.driver import run
from streams.store.identity import read_incarnation
from streams.store.reader_core import ReaderCore
from streams.store.reader_groups import commit_group, group_position, take_generations
from streams.store.reads import READER_SESSION_SETUP, read_after_proof

pytestmark = pytest.mark.timeout(120)

BIGINT_MAX = 2**63 - 1


def allocated(url: str, stream: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT COALESCE(pg_sequence_last_value(sequence_name::regclass), 0) "
            "FROM streams_registry WHERE name = %s",
            (stream,),
        ).fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ proofs beyond the possible


def test_the_follower_statement_refuses_a_proof_beyond_max_allocated(
    client: Client, stream: str, streams_url: str
) -> None:
    with client.writer(stream) as writer:
        ack = writer.append_batch([{"n": n} for n in range(3)])
    info = client.stream(stream)
    with psycopg.connect(streams_url, autocommit=True) as conn:
        token = run(conn, read_incarnation()).token
        conn.execute(
            "INSERT INTO streams_proofs (stream, complete, proven_at, incarnation) "
            "VALUES (%s, %s, now(), %s) "
            "ON CONFLICT (stream) DO UPDATE SET complete = EXCLUDED.complete",
            (info.id, ack.last_id, token),
        )
        (rows,) = run(conn, read_after_proof([info], {stream: 0}, 100, token))
        assert [(r[0], r[2], r[3]) for r in rows] == [(ack.last_id, True, i) for i in ack.ids]
        # Raised one above the sequence: refused in the same statement, no rows behind it.
        conn.execute(
            "UPDATE streams_proofs SET complete = %s WHERE stream = %s",
            (allocated(streams_url, stream) + 1, info.id),
        )
        (rows,) = run(conn, read_after_proof([info], {stream: 0}, 100, token))
        assert len(rows) == 1 and rows[0][2] is False and rows[0][3:] == (None,) * 5


def test_a_follower_refuses_a_raised_proof_and_probes_for_itself(
    client: Client, stream: str, streams_url: str
) -> None:
    """A follower's steps, driven one by one with no prover running: an honest proof
    delivers; the same record raised far beyond max allocated is refused (counted) and the
    follower probes PostgreSQL itself, delivering every fact written next (before, it took
    the raised position and skipped them all)."""
    writer = client.writer(stream)
    first = writer.append_batch([{"n": n} for n in range(3)])
    info = client.stream(stream)
    core = ReaderCore([stream])
    core.following.shared_proofs = True
    with psycopg.connect(streams_url, autocommit=True) as conn:
        for statement in READER_SESSION_SETUP:
            conn.execute(statement)
        run(conn, core.verify_incarnation())  # as a reader's session does on connect
        run(conn, core.open())
        core.set_link_state(True)
        conn.execute(
            "INSERT INTO streams_proofs (stream, complete, proven_at, incarnation) "
            "VALUES (%s, %s, now(), %s) "
            "ON CONFLICT (stream) DO UPDATE SET complete = EXCLUDED.complete, proven_at = now()",
            (info.id, first.last_id, run(conn, read_incarnation()).token),
        )
        epoch = run(conn, core.step())
        assert epoch is not None and [f.stream_id for f in epoch.facts] == list(first.ids)
        assert (core.counters.proof_reads, core.counters.refused_proofs) == (1, 0)
        conn.execute(
            "UPDATE streams_proofs SET complete = %s, proven_at = now() WHERE stream = %s",
            (BIGINT_MAX, info.id),
        )
        assert run(conn, core.step()) is None
        assert core.position(stream) == first.last_id
        more = writer.append_batch([{"n": n} for n in range(3, 7)])
        epoch = run(conn, core.step())
        assert epoch is not None and [f.stream_id for f in epoch.facts] == list(more.ids)
        assert core.counters.refused_proofs == 2 and core.counters.proof_reads == 1
    writer.close()


class Follow(threading.Thread):
    """Polls a reader live (as a service does) until `finish` gives the position to reach."""

    def __init__(self, reader: Reader) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.got: list[int] = []
        self.through: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.through is None:
                epoch = self.reader.poll(timeout=0.1)
                if epoch is not None:
                    self.got += [f.stream_id for f in epoch.facts]
            self.got += read_through(self.reader, self.through)
        except BaseException as exc:  # reported by `finish`
            self.error = exc

    def finish(self, through: int) -> list[int]:
        self.through = through
        self.join(60)
        assert not self.is_alive() and self.error is None, self.error
        return self.got


@pytest.fixture
def proving_clients(streams_url: str, redis_url: str, redis_prefix: str) -> Iterator[list[Client]]:
    """Two reading processes following shared proofs, and a writing one."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                streams.connect(
                    streams_url, redis_url=redis_url, prefix=redis_prefix, shared_proofs=shared
                )
            )
            for shared in (True, True, False)
        ]


def test_a_proof_raised_beyond_max_allocated_makes_followers_skip_nothing(
    proving_clients: list[Client], streams_url: str, unique_name: str
) -> None:
    """A role with UPDATE on streams_proofs raises the record far ahead, again and again,
    while facts are written and readers follow: every reader delivers every fact, once, in
    order (before, a follower jumped to the raised position and skipped every fact written
    below it); and the prover replaces the raised record once the attack stops."""
    *reading, writing = proving_clients
    writing.create_stream(unique_name)
    stream_key = writing.stream(unique_name).id
    # Followers of fresh proofs look at the record at least this often (with signed ranges
    # lost, and hints from the prover only for what it could not sign).
    readers = [c.reader(unique_name, poll_interval=0.05) for c in reading]
    for c in reading:
        # Their links lose the prover's signed ranges (as Redis may): every step reads the
        # proof record, raised or not, instead of taking the facts from Redis.
        assert c._link is not None
        c._link.core.discard = lambda raw: raw.startswith(b"RDATA") and b" _proof:" in raw[:200]
    stop = threading.Event()

    def raise_proofs() -> None:
        with psycopg.connect(streams_url, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute(
                    "UPDATE streams_proofs SET complete = %s WHERE stream = %s",
                    (2**62, stream_key),
                )
                stop.wait(0.002)

    attacker = threading.Thread(target=raise_proofs, daemon=True)
    try:
        provers = [c._proofs for c in reading if c._proofs is not None]
        wait_until(
            lambda: any(unique_name in p.proving for p in provers), 15, "a prover to be elected"
        )
        follows = [Follow(r) for r in readers]
        for f in follows:
            f.start()
        attacker.start()
        written: list[int] = []
        with writing.writer(unique_name) as writer:
            for n in range(150):
                written += writer.append_batch([{"n": n, "b": b} for b in range(n % 3 + 1)]).ids
                time.sleep(0.01)
            stop.set()
            attacker.join(10)
            # The next proof replaces the raised record (a prober's `GREATEST` kept it before).
            written += writer.append({"n": "last"}).ids
        for f in follows:
            assert f.finish(written[-1]) == written
        assert sum(r.core.counters.refused_proofs for r in readers) > 0, "no raised proof was read"
        with psycopg.connect(streams_url, autocommit=True) as conn:
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT complete FROM streams_proofs WHERE stream = %s", (stream_key,)
                    ).fetchone()
                    == (written[-1],)
                ),
                10,
                "the prover to replace the raised record",
            )
    finally:
        stop.set()
        for r in readers:
            r.close()
        drop_streams(streams_url, [unique_name])


# ------------------------------------------------------------------ group commits beyond it


def test_group_commits_refuse_a_position_beyond_max_allocated(
    client: Client, stream: str, streams_url: str
) -> None:
    writer = client.writer(stream)
    ack = writer.append_batch([{"n": n} for n in range(3)])
    info = client.stream(stream)
    # The store function (what `commit`, `commit(conn=...)` and the Spark source share).
    with psycopg.connect(streams_url, autocommit=False) as conn:
        held = run(conn, take_generations("forged", [info], "test"))
        with pytest.raises(streams.InvalidPosition) as caught:
            run(conn, commit_group("forged", [(info, BIGINT_MAX, 0)], held))
        conn.rollback()
        assert (caught.value.stream, caught.value.position) == (stream, BIGINT_MAX)
        assert caught.value.max_allocated == allocated(streams_url, stream)
        assert run(conn, group_position(info, "forged")) is None
        # At max allocated exactly: committed (nothing above it is possible, all of it is).
        top = allocated(streams_url, stream)
        assert run(conn, commit_group("forged", [(info, top, 0)], held)) == {stream: top}
    # A reader whose position was forced there (as a forged signed range did).
    with client.reader(stream, group="g") as reader:
        assert read_through(reader, ack.last_id) == list(ack.ids)
        assert reader.commit() == {stream: ack.last_id}
        reader.core.positions[stream] = BIGINT_MAX
        with pytest.raises(streams.InvalidPosition, match="beyond the stream's max allocated"):
            reader.commit()
        with psycopg.connect(streams_url, autocommit=False) as conn:
            with pytest.raises(streams.InvalidPosition):
                reader.commit(conn=conn)
            conn.rollback()
    assert [(g.group, g.position) for g in client.groups(stream)] == [
        ("forged", top),
        ("g", ack.last_id),
    ]
    # Nothing was bricked: the stream takes appends and the group resumes where it was.
    more = writer.append({"n": "more"})
    with client.reader(stream, group="g") as reader:
        assert read_through(reader, more.last_id) == list(more.ids)
    writer.close()


# ------------------------------------------------------------------ doctor


def test_doctor_reports_a_group_beyond_max_allocated_and_a_sequence_near_the_limit(
    own_database: str, unique_name: str
) -> None:
    with streams.connect(own_database) as client:
        client.create_stream(unique_name)
        with client.writer(unique_name) as writer:
            ack = writer.append_batch([{"n": n} for n in range(3)])
        with client.reader(unique_name, group="g") as reader:
            read_through(reader, ack.last_id)
            reader.commit()
        info = client.stream(unique_name)

    def checks() -> dict[str, Any]:
        return {c.name: c for c in diagnose(Settings(database_url=own_database))}

    found = checks()
    assert found[f"stream {unique_name}: reader groups"].ok
    assert found[f"stream {unique_name}: sequence"].ok
    with psycopg.connect(own_database, autocommit=True) as conn:
        conn.execute(
            "UPDATE streams_reader_groups SET position = %s WHERE stream = %s",
            (BIGINT_MAX, info.id),
        )
    groups = checks()[f"stream {unique_name}: reader groups"]
    assert not groups.ok
    assert f"g (at {BIGINT_MAX}) beyond max allocated {ack.last_id}" in groups.detail
    # What a repair after such a row did: the sequence near the limit, its appends failing.
    with psycopg.connect(own_database, autocommit=True) as conn:
        conn.execute("SELECT setval(%s::regclass, %s)", (info.sequence_name, SEQUENCE_NEAR_LIMIT))
    sequence = checks()[f"stream {unique_name}: sequence"]
    assert not sequence.ok and "NEAR THE BIGINT LIMIT" in sequence.detail


# ------------------------------------------------------------------ bounded and visible


def _live_key(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT max(id) FROM streams_keys WHERE retired_at IS NULL").fetchone()
    assert row is not None and row[0] is not None
    return int(row[0])


#: A key id no database has.
UNKNOWN_KEY = 2**31 - 1


def signed_line(stream: str, token: int, key: int, rows: str = "[]") -> bytes:
    """A prober's line in the signed-range format (`streams.core.signing`) whose signature is
    not one: ``rows`` (the JSON text of its rows) stands where the sealed rows go."""
    head = f"RDATA {stream} _proof:evil {token} ".encode()
    proof = b'{"sig":"%s","proof":{"key":%d,"after":0,"nonce":"%s","sealed":"%s"}}' % (
        base64.b64encode(b"\xab" * 64),
        key,
        base64.b64encode(b"\x00" * NONCE_BYTES),
        base64.b64encode(rows.encode()),
    )
    return head + proof


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_flood_of_lines_under_an_unknown_key_costs_no_memory(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """Lines of nearly 1 MiB under a key nobody has: a reader kept up to 256 of them until its
    next read of the keys (with the rows in clear, 1 MiB of ``[],`` each, parsed 20 times their
    size, 40 took it 0.9 GB up); now it keeps none, and still delivers. (Sealed rows are one
    string: what a kept line would cost is smaller now, and no line is kept anyway.)"""
    raw = redis.Redis.from_url(redis_url)
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as client:
        client.create_stream(unique_name)
        reader = client.reader(unique_name, poll_interval=30.0)
        try:
            with client.writer(unique_name) as writer:
                first = writer.append({"n": 0})
                assert read_through(reader, first.last_id) == list(first.ids)
                wait_until(lambda: reader.core.live, 10, "the reader to be live")
                count = 40
                # The protocol's most bytes per line, less the rest, as base64 (4 for 3 bytes).
                room = (1024 * 1024 - 400) * 3 // 4
                rows = "[" + ",".join(["[]"] * (room // 3)) + "]"
                line = signed_line(unique_name, 10**12, UNKNOWN_KEY, rows)
                assert len(line) < 1024 * 1024
                gc.collect()
                before = rss_bytes()
                channel = proof_channel(redis_prefix, unique_name)
                core: Any = reader.core

                def heard() -> int:  # dropped now; kept, before (until the keys were read)
                    return int(core.counters.rejected_ranges.get("unknown-key", 0)) + len(
                        getattr(core, "_offered", ())
                    )

                for n in range(count):
                    # One at a time (Redis cuts a subscriber more than 32 MB behind), again if
                    # not heard (the link may still be subscribing to the proof channel).
                    deadline = time.monotonic() + 20
                    while heard() <= n:
                        assert time.monotonic() < deadline, f"line {n} was not heard"
                        raw.publish(channel, line)
                        wait = time.monotonic() + 1
                        while heard() <= n and time.monotonic() < wait:
                            time.sleep(0.01)
                gc.collect()
                grown = rss_bytes() - before
                assert grown < 200 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB"
                more = writer.append_batch([{"n": n} for n in range(1, 6)])
                assert read_through(reader, more.last_id) == list(more.ids)
        finally:
            reader.close()
            raw.close()
            drop_streams(streams_url, [unique_name])


def scrape(client: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = prometheus_client.CollectorRegistry()
    registry.register(ClientCollector(client))
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_rejected_lines_refused_proofs_and_signed_ranges_are_counted(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    raw = redis.Redis.from_url(redis_url)
    with streams.connect(
        streams_url, redis_url=redis_url, prefix=redis_prefix, shared_proofs=True
    ) as client:
        client.create_stream(unique_name)
        stream_key = client.stream(unique_name).id
        reader = client.reader(unique_name, poll_interval=30.0)
        try:
            with client.writer(unique_name) as writer:
                ack = writer.append_batch([{"n": n} for n in range(3)])
                read_through(reader, ack.last_id)
                wait_until(lambda: reader.core.live, 10, "the reader to be live")
                channel = proof_channel(redis_prefix, unique_name)
                forged = {
                    "malformed": f"RDATA {unique_name} _proof:evil {10**9} ".encode()
                    + orjson.dumps({"nothing": "signed"}),
                    "unknown-key": signed_line(unique_name, 10**9, UNKNOWN_KEY),
                    "bad-signature": signed_line(unique_name, 10**9, _live_key(streams_url)),
                }
                deadline = time.monotonic() + 10
                # Again until heard: the link may still be subscribing to the proof channel.
                while not all(reader.core.counters.rejected_ranges.get(why) for why in forged):
                    assert time.monotonic() < deadline, reader.core.counters.rejected_ranges
                    for line in forged.values():
                        raw.publish(channel, line)
                    time.sleep(0.1)
                # A proof raised beyond max allocated, read by this (following) reader.
                with psycopg.connect(streams_url, autocommit=True) as conn:
                    conn.execute(
                        "UPDATE streams_proofs SET complete = %s WHERE stream = %s",
                        (2**62, stream_key),
                    )
                reader.poll(timeout=0.5)
            got = scrape(client)
            key = (("group", ""), ("streams", unique_name))
            for why in forged:
                labels = tuple(sorted((*key, ("reason", why))))
                assert got[("streams_reader_rejected_lines_total", labels)] >= 1, why
            for outcome in ("verified", "applied"):
                labels = tuple(sorted((*key, ("outcome", outcome))))
                assert ("streams_reader_signed_ranges_total", labels) in got
            assert got[("streams_reader_refused_proofs_total", key)] == float(
                reader.core.counters.refused_proofs
            )
        finally:
            reader.close()
            raw.close()
            drop_streams(streams_url, [unique_name])


def test_doctor_checks_a_live_key_of_this_history(own_database: str) -> None:
    """No live key of the database's incarnation (all retired, or all made before a restore
    or a failover): the doctor says so, and that signed ranges are not taken meanwhile."""

    def keys() -> Any:
        return {c.name: c for c in diagnose(Settings(database_url=own_database))}["keys"]

    assert keys().ok
    with psycopg.connect(own_database, autocommit=True) as conn:
        conn.execute("UPDATE streams_keys SET incarnation = 'elsewhere'")
        found = keys()
        assert not found.ok and "of another history" in found.detail, found.detail
        conn.execute("UPDATE streams_keys SET retired_at = now()")
        found = keys()
        assert not found.ok and "streams keys rotate" in found.detail, found.detail
    with streams.connect(own_database) as client:
        client.rotate_replication_keys()
    assert keys().ok


# ------------------------------------------------------------------ a history that went back


def test_a_reader_stops_when_its_stream_goes_back_under_it(client: Client, stream: str) -> None:
    """A physical restore in place (or a failover to a standby that lagged) keeps the
    database's incarnation but sets the stream back below what the reader saw: the IDs above
    are handed out again, and the reader, past them, would skip the facts written under them
    as delivered. It stops with `DatabaseChanged` naming the stream and the range instead, and
    delivers nothing of the new history."""
    info = client.stream(stream)
    with client.writer(stream) as writer:
        first = writer.append_batch([{"n": n} for n in range(5)])
    with client.reader(stream, poll_interval=0.05) as reader:
        assert read_through(reader, first.last_id) == list(first.ids)
        with psycopg.connect(client.settings.database_url, autocommit=True) as conn:
            # What the restored copy looks like: facts above 2 gone, the sequence at 2, and
            # the writer rows of that time.
            conn.execute(
                "DELETE FROM streams_facts WHERE stream = %s AND stream_id > 2", (info.id,)
            )
            conn.execute("DELETE FROM streams_writers WHERE stream = %s", (info.id,))
            conn.execute("SELECT setval(%s::regclass, 2)", (info.sequence_name,))
        with client.writer(stream) as writer:
            again = writer.append({"n": "new history"})
        assert again.last_id <= first.last_id  # an ID handed out again
        with pytest.raises(streams.DatabaseChanged) as failed:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                epoch = reader.poll(timeout=0.2)
                assert epoch is None or not epoch.facts, epoch
        assert f"stream {stream!r}" in str(failed.value)
        assert f"went back from {first.last_id} to {again.last_id}" in str(failed.value)
        assert f"IDs up to {first.last_id} may differ" in str(failed.value)


def test_a_group_beyond_its_stream_stops_when_opened(client: Client, stream: str) -> None:
    """A group row beyond the stream's max allocated ID (the stream went back under it, or
    the row was written by hand): opening the group fails loudly, naming stream and range,
    rather than skipping the facts written next under those IDs."""
    info = client.stream(stream)
    with client.writer(stream) as writer:
        ack = writer.append_batch([{"n": n} for n in range(3)])
    with client.reader(stream, group="g") as reader:
        assert read_through(reader, ack.last_id) == list(ack.ids)
        reader.commit()
    with psycopg.connect(client.settings.database_url, autocommit=True) as conn:
        conn.execute("UPDATE streams_reader_groups SET position = 10 WHERE stream = %s", (info.id,))
    with pytest.raises(streams.DatabaseChanged) as failed:
        client.reader(stream, group="g").close()
    assert f"stream {stream!r}: the group committed 10" in str(failed.value)
    assert f"max allocated ID {ack.last_id}" in str(failed.value)
