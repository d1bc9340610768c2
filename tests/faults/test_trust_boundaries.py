"""The attacks of issue 29 on signed ranges, against real PostgreSQL and Redis.

Each one made a live reader deliver facts PostgreSQL did not have before prover keys
(`streams.store.keys`, `streams.core.signing`):

(a) a role granted ``SELECT`` on every table of ``public`` read the HMAC key and signed ghost
    facts and the range ``(2, 2**63-1]``; now it reads public keys and cipher keys only, and
    nothing it signs verifies;
(b) lines signed after a ``pg_dump`` and replayed after a ``pg_restore`` delivered the facts
    the restore lost; now the restore is another incarnation, and the lines verify nowhere;
(c) the same after a failover-like change of the incarnation;
(d) a rotation took 30 s to reach running readers; now ``KEYS`` retires the old key at once;
and a capture of everything the proof and data channels carry during a workload finds no
payload in clear text. The secret of a rotation is never a statement's parameter.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from helpers import wait_until
from servers import database_name, libpq_url

import streams
from streams import Client
from streams.bench.common import drop_streams
from streams.core.constants import data_channel, proof_channel, replication_channel
from streams.core.epochs import Fact
from streams.core.protocol import RdataCommand, serialize
from streams.core.signing import SigningKey, sign_range
from streams.reader import Reader
from streams.store.driver import Commit, Gen, Query, run
from streams.store.keys import may_sign, rotate_keys, signing_key
from streams.store.reads import read_after_proof
from streams.store.registry import load_stream

pytestmark = pytest.mark.timeout(180)

GHOST = '{"order": 914, "refund": 1000000}'


def _connect(url: str, redis_url: str, prefix: str) -> Client:
    return streams.connect(url, redis_url=redis_url, prefix=prefix, shared_proofs=True)


def _drain(reader: Reader, through: int, timeout: float = 30.0, commit: bool = False) -> list[Fact]:
    """Poll ``reader`` until its position reaches ``through``; the facts delivered."""
    got: list[Fact] = []
    deadline = time.monotonic() + timeout
    while reader.position() < through:
        assert time.monotonic() < deadline, (reader.position(), through)
        epoch = reader.poll(timeout=0.3)
        if epoch is not None:
            got += epoch.facts
            if commit:
                reader.commit()
    return got


def _quiet(reader: Reader, seconds: float) -> list[Fact]:
    """What ``reader`` delivers within ``seconds`` (polling)."""
    got: list[Fact] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        epoch = reader.poll(timeout=0.2)
        if epoch is not None:
            got += epoch.facts
    return got


class Capture(threading.Thread):
    """Every message on some Redis channels (redis-py's subscriber), kept in order."""

    def __init__(self, redis_url: str, channels: list[str]) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(redis_url)
        self.pubsub = self.client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
        self.pubsub.subscribe(*channels)
        self.messages: list[tuple[str, bytes]] = []
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.is_set():
            message = self.pubsub.get_message(timeout=0.1)
            if message is not None and message["type"] == "message":
                self.messages.append((message["channel"].decode(), bytes(message["data"])))

    def signed(self) -> list[bytes]:
        return [data for _, data in self.messages if data.startswith(b"RDATA ")
                and b" _proof:" in data[:300]]  # fmt: skip

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        self.pubsub.close()
        self.client.close()


def _max_allocated(url: str, name: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT COALESCE(pg_sequence_last_value(sequence_name::regclass), 0) "
            "FROM streams_registry WHERE name = %s",
            (name,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _as_user(url: str, role: str) -> str:
    """``url`` (a PostgreSQL URL) for another user (trust authentication)."""
    parts = urlsplit(libpq_url(url))
    netloc = f"{role}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@contextlib.contextmanager
def _reader_role(url: str, unique_name: str) -> Iterator[str]:
    """A login role granted SELECT on every table and sequence of ``public``, as a BI role
    is: its URL. Dropped afterwards."""
    role = f"bi_{unique_name}"[:60]
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
        admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"')
        admin.execute(f'GRANT SELECT ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
    try:
        yield _as_user(url, role)
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE "{role}"')


def _forger(bi_url: str) -> SigningKey:
    """The best key a reader role can make with everything it may read: a seed of its own
    under the live key's number, with the real cipher key and incarnation."""
    with psycopg.connect(bi_url, autocommit=True) as bi:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            bi.execute("SELECT seed FROM streams_prover.signing_keys")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            bi.execute("INSERT INTO streams_keys (incarnation) VALUES ('mine')")
        assert run(bi, may_sign()) is False
        assert run(bi, signing_key()) is None
        key_id, cipher, incarnation = bi.execute(
            "SELECT id, cipher_key, incarnation FROM streams_keys "
            "WHERE retired_at IS NULL ORDER BY id DESC LIMIT 1"
        ).fetchone()  # type: ignore[misc]
    return SigningKey(int(key_id), os.urandom(32), bytes(cipher), incarnation)


def _forged_lines(mine: SigningKey, name: str, prefix: str, after: int) -> list[tuple[str, bytes]]:
    """Ghost facts after ``after`` and the empty range (2, 2**63-1], signed with ``mine``."""
    instance = "_proof:forger"
    ghosts = [(after + n, 0, "w", int(time.time() * 1000), GHOST) for n in (1, 2, 3)]
    lines = [
        RdataCommand(name, instance, after + 3, sign_range(name, instance, after, after + 3,
                                                           ghosts, mine)),
        RdataCommand(name, instance, 2**63 - 1, sign_range(name, instance, 2, 2**63 - 1, [],
                                                           mine)),
    ]  # fmt: skip
    channel = proof_channel(prefix, name)
    return [(channel, serialize(line)) for line in lines]


def test_a_role_that_reads_every_public_table_cannot_make_a_reader_deliver_a_ghost(
    own_database: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    url, name = own_database, unique_name
    with _reader_role(url, unique_name) as bi_url, contextlib.ExitStack() as stack:
        proving = stack.enter_context(_connect(url, redis_url, redis_prefix))
        following = stack.enter_context(_connect(url, redis_url, redis_prefix))
        proving.create_stream(name)
        first = proving.reader(name, poll_interval=0.2)
        stack.callback(first.close)
        assert proving._proofs is not None
        wait_until(lambda: name in proving._proofs.proving, 15, "a prover")  # type: ignore[union-attr]
        follower = following.reader(name, group="g", poll_interval=0.2)
        stack.callback(follower.close)
        raw = redis.Redis.from_url(redis_url)
        stack.callback(raw.close)
        got: list[Fact] = []
        with proving.writer(name, instance="w") as writer:
            ids = [writer.append({"n": n}).last_id for n in range(5)]
            got += _drain(follower, ids[-1], commit=True)
            mine = _forger(bi_url)
            for n in range(5, 25):
                lines = _forged_lines(mine, name, redis_prefix, follower.position())
                for channel, line in lines:
                    raw.publish(channel, line)
                time.sleep(0.05)
                got += _quiet(follower, 0.1)
                if n % 4 == 0:
                    ids.append(writer.append({"n": n}).last_id)
        got += _drain(follower, ids[-1], commit=True)
        got += _quiet(follower, 1.0)
        assert [f.stream_id for f in got] == ids
        assert all("refund" not in str(f.payload) for f in got)
        allocated = _max_allocated(url, name)
        assert follower.position() <= allocated
        (group,) = following.groups(name)
        assert group.position <= allocated
        rejected = follower.core.counters.rejected_ranges
        assert rejected.get("bad-signature", 0) > 0, rejected
        # And the stream still takes appends (the 2**63-1 range bricked it before).
        with proving.writer(name, instance="w") as writer:
            writer.append({"after": True})


def test_a_process_that_cannot_read_the_seeds_never_proves(
    own_database: str,
    redis_url: str,
    redis_prefix: str,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, name = own_database, unique_name
    with streams.connect(url) as owner:
        owner.create_stream(name)
        with owner.writer(name, instance="w") as writer:
            ids = [writer.append({"n": n}).last_id for n in range(3)]
    with _reader_role(url, unique_name) as bi_url:
        caplog.set_level(logging.INFO, logger="streams.proofs")
        client = _connect(bi_url, redis_url, redis_prefix)
        with client, client.reader(name, poll_interval=0.2) as reader:
            assert [f.stream_id for f in _drain(reader, ids[-1])] == ids
            time.sleep(2.0)  # several elections
            assert client._proofs is not None
            assert not client._proofs.proving
        assert "does not stand for election" in caplog.text


def _capture_ghosts(
    url: str, redis_url: str, prefix: str, name: str, between: Any
) -> tuple[list[int], list[bytes]]:
    """Five facts read by a live reader; ``between(url)`` (a backup); five "lost" facts signed
    and published; returns the first five IDs and every signed line captured."""
    capture = Capture(redis_url, [proof_channel(prefix, name)])
    try:
        with _connect(url, redis_url, prefix) as client:
            client.create_stream(name)
            with client.reader(name, poll_interval=0.2) as reader:
                assert client._proofs is not None
                wait_until(lambda: name in client._proofs.proving, 15, "a prover")  # type: ignore[union-attr]
                with client.writer(name, instance="w") as writer:
                    first = [writer.append({"era": "kept", "n": n}).last_id for n in range(5)]
                _drain(reader, first[-1])
                between(url)
                with client.writer(name, instance="w") as writer:
                    lost = [writer.append({"era": "lost", "n": n}).last_id for n in range(5)]
                _drain(reader, lost[-1])
                wait_until(
                    lambda: any(
                        f" {lost[-1]} ".encode() in line[:200] for line in capture.signed()
                    ),
                    10,
                    "the lost facts signed",
                )
        return first, capture.signed()
    finally:
        capture.close()


def _replay_then_write(
    url: str, redis_url: str, prefix: str, name: str, first: list[int], lines: list[bytes]
) -> None:
    """A fresh reader of the database as it is now, while every captured line is replayed:
    it must deliver none of the lost facts, and the facts written now."""
    raw = redis.Redis.from_url(redis_url)
    channel = proof_channel(prefix, name)
    client = _connect(url, redis_url, prefix)
    with raw, client, client.reader(name, poll_interval=0.2) as reader:
        got = _drain(reader, first[-1])
        assert [f.payload["era"] for f in got] == ["kept"] * 5
        for _ in range(3):
            for line in lines:
                raw.publish(channel, line)
            got += _quiet(reader, 0.3)
        got += _quiet(reader, 1.0)
        assert [f.stream_id for f in got] == first, "a lost fact came back"
        with client.writer(name, instance="w2") as writer:
            now = [writer.append({"era": "now", "n": n}).last_id for n in range(5)]
        for line in lines:
            raw.publish(channel, line)
        later = _drain(reader, now[-1])
        assert [f.payload["era"] for f in later] == ["now"] * 5
        assert [f.stream_id for f in later] == now
        # Heard and rejected: under a key of the other history, or one this reader no longer
        # knows, or (arriving right after the prover's KEYS line) while its keys were stale.
        rejected = reader.core.counters.rejected_ranges
        reasons = ("other-history", "unknown-key", "keys-changed")
        assert sum(rejected.get(reason, 0) for reason in reasons) > 0, rejected
        keys = client.replication_keys()
        assert keys[0]["live"] and all(not k["live"] for k in keys[1:])
        assert keys[0]["incarnation"] == reader.core.incarnation, "the prover renewed the key"


def test_lines_signed_before_a_restore_deliver_nothing_after_it(
    own_database: str,
    postgres_admin_url: str,
    redis_url: str,
    redis_prefix: str,
    unique_name: str,
    tmp_path: Any,
) -> None:
    """pg_dump, five more facts signed and published, the database restored from the dump
    (into a new database of the same name: ``pg_restore --clean`` into the old one trips over
    the partitions' inherited keys), the captured lines replayed while a fresh reader runs."""
    dump = tmp_path / "backup.dump"

    def backup(url: str) -> None:
        subprocess.run(["pg_dump", "-Fc", "-f", str(dump), "-d", libpq_url(url)], check=True)

    first, lines = _capture_ghosts(own_database, redis_url, redis_prefix, unique_name, backup)
    assert lines
    name = database_name(own_database)
    with psycopg.connect(libpq_url(postgres_admin_url), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    done = subprocess.run(
        ["pg_restore", "--exit-on-error", "-d", libpq_url(own_database), str(dump)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    _replay_then_write(own_database, redis_url, redis_prefix, unique_name, first, lines)


def test_lines_signed_before_a_failover_deliver_nothing_after_it(
    own_database: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """A failover to an asynchronous standby, as the new primary sees it: the last facts the
    old primary acknowledged are missing, and the database history is another one."""
    first, lines = _capture_ghosts(
        own_database, redis_url, redis_prefix, unique_name, lambda url: None
    )
    with psycopg.connect(own_database, autocommit=True) as conn:
        info = run(conn, load_stream(unique_name))
        old = conn.execute("SELECT id::text FROM streams_incarnation").fetchone()
        # What the standby never received: the last facts, the writer's position, the sequence.
        conn.execute("DELETE FROM streams_facts WHERE stream = %s AND stream_id > %s",
                     (info.id, first[-1]))  # fmt: skip
        conn.execute("UPDATE streams_writers SET position = LEAST(position, %s) WHERE stream = %s",
                     (first[-1], info.id))  # fmt: skip
        conn.execute("SELECT setval(%s::regclass, %s)", (info.sequence_name, first[-1]))
        conn.execute("UPDATE streams_incarnation SET id = gen_random_uuid()")
        # The old primary's proof record, as a standby would have it: not to be followed.
        (old_token,) = conn.execute(
            "SELECT incarnation FROM streams_proofs WHERE stream = %s", (info.id,)
        ).fetchone()  # type: ignore[misc]
        assert old is not None and old_token.startswith(old[0])
        results = run(conn, read_after_proof([info], {unique_name: 0}, 10, old_token))
        assert results[0], "the old history's record, read with the old token"
        results = run(conn, read_after_proof([info], {unique_name: 0}, 10, "another/1/2/3/4"))
        assert not results[0], "a record of another history reads as none"
    _replay_then_write(own_database, redis_url, redis_prefix, unique_name, first, lines)


def test_a_rotation_retires_the_old_key_at_once_for_running_readers(
    own_database: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """A seed leaked: the operator rotates while readers run, and the leaked key stops
    verifying at once (before: for up to 30 s, `KEY_REFRESH`)."""
    url, name = own_database, unique_name
    raw = redis.Redis.from_url(redis_url)
    with contextlib.ExitStack() as stack:
        stack.callback(raw.close)
        client = stack.enter_context(_connect(url, redis_url, redis_prefix))
        operator = stack.enter_context(_connect(url, redis_url, redis_prefix))
        client.create_stream(name)
        reader = client.reader(name, poll_interval=0.2)
        stack.callback(reader.close)
        assert client._proofs is not None
        wait_until(lambda: name in client._proofs.proving, 15, "a prover")  # type: ignore[union-attr]
        with client.writer(name, instance="w") as writer:
            ids = [writer.append({"n": n}).last_id for n in range(3)]
        got = _drain(reader, ids[-1])
        with psycopg.connect(url) as conn:
            leaked = run(conn, signing_key())
        assert leaked is not None
        operator.rotate_replication_keys()
        time.sleep(0.3)  # the KEYS line, not a 30 s refresh
        instance = "_proof:leaked"
        at = reader.position()
        ghosts = [(at + 1, 0, "w", 1, GHOST)]
        line = RdataCommand(name, instance, at + 1, sign_range(name, instance, at, at + 1,
                                                               ghosts, leaked))  # fmt: skip
        for _ in range(5):
            raw.publish(proof_channel(redis_prefix, name), serialize(line))
            got += _quiet(reader, 0.3)
        got += _quiet(reader, 1.5)
        assert [f.stream_id for f in got] == ids, "a ghost signed with the retired key"
        rejected = reader.core.counters.rejected_ranges
        assert rejected.get("unknown-key", 0) + rejected.get("retired-key", 0) > 0, rejected
        with client.writer(name, instance="w") as writer:
            more = writer.append({"n": 3}).last_id
        assert [f.payload for f in _drain(reader, more)] == [{"n": 3}]


def test_redis_sees_no_payload_in_clear_text(
    streams_url: str, redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """Every message on the replication, data and proof channels during a workload with
    shared proofs: IDs, counts, sizes, never a payload."""
    name = unique_name
    marker = "s3cr3t-payload-"
    capture = Capture(
        redis_url,
        [replication_channel(redis_prefix), data_channel(redis_prefix, name),
         proof_channel(redis_prefix, name)],
    )  # fmt: skip
    try:
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(_connect(streams_url, redis_url, redis_prefix))
                       for _ in range(2)]  # fmt: skip
            clients[0].create_stream(name)
            readers = [c.reader(name, poll_interval=0.2) for c in clients]
            for r in readers:
                stack.callback(r.close)
            wait_until(
                lambda: any(name in (c._proofs.proving if c._proofs else ()) for c in clients),
                15,
                "a prover",
            )
            for r in readers:
                r.poll(timeout=0)  # open: positions known, signed lines taken from here on
            done = threading.Event()

            def follow(reader: Reader) -> None:  # live, as a service polls
                while not done.is_set():
                    reader.poll(timeout=0.1)

            followers = [threading.Thread(target=follow, args=(r,), daemon=True) for r in readers]
            for f in followers:
                f.start()
            with clients[0].writer(name, instance="w") as writer:
                last = 0
                for n in range(40):
                    if n % 5 == 0:
                        last = writer.append_batch(
                            [{"text": f"{marker}{n}-{b}", "amount": 7346237} for b in range(3)]
                        ).last_id
                    else:
                        last = writer.append({"text": f"{marker}{n}", "amount": 7346237}).last_id
                    time.sleep(0.01)
            time.sleep(0.5)
            done.set()
            for f in followers:
                f.join(10)
            for r in readers:
                _drain(r, last)
            assert sum(r.core.counters.signed_ranges for r in readers) > 0
            time.sleep(0.3)
    finally:
        capture.close()
        drop_streams(streams_url, [name])
    assert capture.signed(), "signed ranges went over Redis"
    for channel, data in capture.messages:
        for needle in (marker.encode(), b"7346237", base64.b64encode(marker.encode())[:12]):
            assert needle not in data, (channel, data[:200])


def _record(conn: psycopg.Connection[Any], gen: Gen[Any]) -> tuple[Any, list[Query]]:
    """Run a store plan, keeping every statement it sends."""
    sent: list[Query] = []
    reply: list[Any] = []
    try:
        op = next(gen)
        while True:
            if isinstance(op, Query):
                sent.append(op)
                cur = conn.execute(op.statement, op.params)
                reply = cur.fetchall() if cur.description else []
            else:
                assert isinstance(op, Commit)
                conn.commit()
                reply = []
            op = gen.send(reply)
    except StopIteration as stop:
        return stop.value, sent


def test_a_rotation_sends_no_secret_to_the_server(streams_url: str) -> None:
    """The seed and the cipher key are made by the server: no statement or parameter of a
    rotation carries them (so no ``log_statement`` setting could log them)."""
    with psycopg.connect(streams_url) as conn:
        conn.execute("SET log_statement = 'all'")
        new, sent = _record(conn, rotate_keys())
        seed, cipher, public = conn.execute(
            "SELECT s.seed, k.cipher_key, k.public_key FROM streams_keys k "
            "JOIN streams_prover.signing_keys s ON s.key_id = k.id WHERE k.id = %s",
            (new,),
        ).fetchone()  # type: ignore[misc]
    assert len(bytes(seed)) == 32 and len(bytes(cipher)) == 32 and len(bytes(public)) == 32
    for query in sent:
        params = query.params
        values = list(params.values()) if isinstance(params, dict) else list(params or ())
        assert not any(isinstance(v, bytes | bytearray | memoryview) for v in values), query
        text = str(query.statement) + repr(values)
        for secret in (bytes(seed), bytes(cipher)):
            for form in (secret.hex(), base64.b64encode(secret).decode(), repr(secret)):
                assert form not in text
