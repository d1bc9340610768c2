"""A waiting reader reads the link's subscription itself ("Lending the subscription" in
`streams.transport.link.RedisLink`): one thread wake-up per hint, not two, with nothing lost.

What must hold whoever reads: every fact delivered once, in order; the listener thread still
sends its keep-alive PINGs and reconnects; a reader closed from another thread stops waiting at
once; a listener that may not be kept waiting (a prover) is served by the listener thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import wait_until

import streams
from streams import Client
from streams.reader import Reader
from streams.transport import link as link_module
from streams.transport.link import RedisLink


def _switches(thread: threading.Thread) -> int:
    """Context switches of one thread so far (Linux: /proc/self/task/<tid>/status)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


@pytest.fixture
def reading_client(streams_url: str, redis_url: str, redis_prefix: str) -> Iterator[Client]:
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as c:
        assert c.link is not None
        wait_until(lambda: c.link is not None and c.link.connected, 15, "the link")
        yield c


@pytest.fixture
def writing_client(streams_url: str, redis_url: str, redis_prefix: str) -> Iterator[Client]:
    with streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as c:
        yield c


class _Follower:
    """A reader followed on a thread of its own, as a service would: every fact's ID, in
    the order delivered."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.ids: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                epoch = self.reader.poll(timeout=0.5)
                if epoch is not None:
                    self.ids.extend(fact.stream_id for fact in epoch.facts)
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


def _append_slowly(client: Client, stream: str, count: int, gap: float) -> list[int]:
    with client.writer(stream, instance="w") as writer:
        ids = []
        for n in range(count):
            ids.append(writer.append({"n": n}).first_id)
            time.sleep(gap)
        return ids


def test_a_waiting_reader_reads_the_subscription_itself(
    reading_client: Client, writing_client: Client, stream: str
) -> None:
    link = reading_client.link
    assert isinstance(link, RedisLink)
    follower = _Follower(reading_client.reader(stream, start="latest"))
    try:
        wait_until(lambda: link.core.stats.lent > 0 or follower.reader.live, 10, "live")
        time.sleep(0.3)
        lent, received = link.core.stats.lent, link.core.stats.received
        listener_before = _switches(link._listen_thread)
        ids = _append_slowly(writing_client, stream, 200, 0.005)
        wait_until(lambda: follower.ids[-1:] == ids[-1:], 15, "every fact")
        assert follower.ids == ids  # each once, in order
        heard = link.core.stats.received - received
        assert heard >= 200
        # The reader's own thread read most of them, and the listener thread stayed asleep
        # (it looks every LEND_PARK; before lending it woke for every message).
        assert link.core.stats.lent - lent >= heard * 0.7
        assert _switches(link._listen_thread) - listener_before < heard * 0.5
    finally:
        follower.close()


def test_keepalive_goes_on_while_a_reader_holds_the_subscription(
    reading_client: Client, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listener thread still sends its PINGs (and sees the PONGs the reader read): a quiet
    stream and a lending reader do not make the link look dead."""
    monkeypatch.setattr(link_module, "KEEPALIVE", 0.3)
    link = reading_client.link
    assert isinstance(link, RedisLink)
    with reading_client.reader(stream, start="latest") as reader:
        reader.poll(timeout=0.5)
        reconnects, pong = link.core.stats.reconnects, link._last_pong
        assert reader.poll(timeout=3.0) is None  # nothing to read: it waits (and lends)
        assert link.core.stats.lent > 0  # the PONGs were read on the reader's thread
        assert link._last_pong > pong
        assert link.core.stats.reconnects == reconnects
        assert link.connected


def test_a_reader_closed_from_another_thread_stops_waiting_at_once(
    reading_client: Client, stream: str
) -> None:
    reader = reading_client.reader(stream, start="latest")
    returned = threading.Event()

    def wait() -> None:
        try:
            while True:
                reader.poll(timeout=30)
        except streams.UsageError:  # closed
            returned.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(1.0)  # it waits, holding the subscription
    started = time.monotonic()
    reader.close()
    assert returned.wait(5)
    assert time.monotonic() - started < 1.0


def test_a_killed_subscription_while_a_reader_holds_it(
    reading_client: Client, writing_client: Client, stream: str, redis_url: str
) -> None:
    """The reader hands the error to the listener, which reconnects; no fact is lost."""
    link = reading_client.link
    assert isinstance(link, RedisLink)
    follower = _Follower(reading_client.reader(stream, start="latest"))
    admin = redis.Redis.from_url(redis_url)
    try:
        first = _append_slowly(writing_client, stream, 20, 0.01)
        wait_until(lambda: follower.ids[-1:] == first[-1:], 15, "the first facts")
        wait_until(lambda: link._lender is not None, 10, "the reader to hold the subscription")
        reconnects = link.core.stats.reconnects
        (sub,) = [c for c in admin.client_list() if c["name"] == link.client_name("sub")]
        assert admin.client_kill_filter(_id=sub["id"]) == 1
        wait_until(lambda: link.core.stats.reconnects > reconnects, 15, "a reconnect")
        wait_until(lambda: link.connected, 15, "the link to subscribe again")
        second = _append_slowly(writing_client, stream, 20, 0.01)
        wait_until(lambda: follower.ids[-1:] == second[-1:], 15, "the facts after")
        assert follower.ids == first + second
    finally:
        admin.close()
        follower.close()


class _Impatient:
    """A listener that may not be kept waiting (as a prover is): no lending while it is here."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def on_hint(self, hint: Any) -> None:
        self.tokens.append(hint.token)

    def on_link_state(self, connected: bool) -> None:
        pass


def test_an_impatient_listener_keeps_the_listener_thread_reading(
    reading_client: Client, writing_client: Client, stream: str
) -> None:
    link = reading_client.link
    assert isinstance(link, RedisLink)
    impatient = _Impatient()
    link.add_listener(impatient, [stream])
    follower = _Follower(reading_client.reader(stream, start="latest"))
    try:
        time.sleep(0.3)
        lent = link.core.stats.lent
        ids = _append_slowly(writing_client, stream, 50, 0.005)
        wait_until(lambda: follower.ids[-1:] == ids[-1:], 15, "every fact")
        wait_until(lambda: ids[-1] in impatient.tokens, 5, "the impatient listener's hints")
        assert follower.ids == ids
        assert link.core.stats.lent == lent  # nobody parked the listener
    finally:
        follower.close()
        link.remove_listener(impatient, [stream])


def test_shared_proof_followers_lend_and_deliver_everything(
    streams_url: str, redis_url: str, redis_prefix: str, writing_client: Client, stream: str
) -> None:
    """A follower of shared proofs (another client proves) lends; its prover does not."""
    with (
        streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as proving,
        streams.connect(streams_url, redis_url=redis_url, prefix=redis_prefix) as following,
    ):
        prover = _Follower(proving.reader(stream, start="latest", shared_proofs=True))
        wait_until(lambda: proving._proofs is not None and bool(proving._proofs.proving), 15)
        follower = _Follower(following.reader(stream, start="latest", shared_proofs=True))
        try:
            time.sleep(1.0)
            assert proving.link is not None
            proving_lent = proving.link.core.stats.lent  # (it lent before it was elected)
            ids = _append_slowly(writing_client, stream, 100, 0.005)
            wait_until(lambda: follower.ids[-1:] == ids[-1:], 15, "the follower")
            wait_until(lambda: prover.ids[-1:] == ids[-1:], 15, "the prover")
            assert follower.ids == ids
            assert prover.ids == ids
            assert following.link is not None
            assert following.link.core.stats.lent > 0
            assert proving.link.core.stats.lent == proving_lent
        finally:
            follower.close()
            prover.close()
