"""PostgreSQL failover: a primary killed, its streaming standby promoted (`tests/pgpair.py`).

Every role gets the libpq multi-host URL (``host1:port1,host2:port2`` with
``target_session_attrs=read-write``) and finds the new primary by itself.

* **Synchronous** standby: nothing acknowledged is lost, no ID is handed out twice, writers,
  plain and group readers, the prover of shared proofs and the CLI resume by themselves, and
  every fact the new primary holds is delivered once to each reader.
* **Asynchronous** standby, cut off from the primary before the last facts: the new primary
  lacks facts that were acknowledged and delivered. The writer's next call and the reader
  stop with `streams.FailoverLoss`, naming the stream and the range; `streams failover check`
  shows the streams and `streams failover repair` moves their sequences past every ID the old
  primary may have handed out.

The figures of one run (time to resume, facts acknowledged, lost, delivered) are printed with
``-s`` and kept in docs/operations.md ("Failover").
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from faultkit import Appender
from helpers import wait_until
from pgpair import PostgresPair, postgres_pair

import streams
from streams.command import main as cli
from streams.migrate import upgrade
from streams.store.failover import FAILOVER_SKIP
from streams.store.identity import TIMELINE_SQL

pytestmark = pytest.mark.timeout(240)


def _stored(url: str, stream: str) -> list[int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT DISTINCT f.stream_id FROM streams_facts f JOIN streams_registry r "
            "ON r.id = f.stream WHERE r.name = %s ORDER BY 1",
            (stream,),
        ).fetchall()
    return [int(r[0]) for r in rows]


class Consumer(threading.Thread):
    """Polls a reader until stopped; keeps every delivered ID and the errors met."""

    def __init__(self, reader: streams.Reader, *, commit: bool = False) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.commit = commit
        self.got: list[int] = []
        self.errors: list[BaseException] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                epoch = self.reader.poll(timeout=0.2)
                if epoch is not None:
                    self.got += [f.stream_id for f in epoch.facts]
                    if self.commit:
                        self.reader.commit()
            except streams.DatabaseChanged as exc:
                self.errors.append(exc)
                return
            except streams.StreamsError as exc:  # the server is down: poll tries again
                self.errors.append(exc)
                time.sleep(0.05)

    def drain(self, stored: list[int], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        want = set(stored)
        while not want <= set(self.got) and self.is_alive():
            assert time.monotonic() < deadline, f"missing {sorted(want - set(self.got))[:10]}"
            time.sleep(0.05)
        self.stopped.set()
        self.join(timeout=30)


@contextlib.contextmanager
def _pair(synchronous: bool) -> Iterator[PostgresPair]:
    with postgres_pair(synchronous=synchronous) as pair:
        upgrade(pair.primary_url)
        yield pair


def _first_append_after(writer: streams.Writer, since: float) -> tuple[int, float]:
    """The ID of ``writer``'s first append that succeeds, and the seconds from ``since``."""
    deadline = time.monotonic() + 60
    while True:
        try:
            ack = writer.append({"probe": True})
            return ack.ids[0], time.monotonic() - since
        except streams.StreamsError:
            assert time.monotonic() < deadline, "no append succeeded after the failover"
            time.sleep(0.01)


def _delivered_after(consumer: Consumer, fact: int, since: float) -> float:
    deadline = time.monotonic() + 60
    while fact not in consumer.got:
        assert time.monotonic() < deadline, f"fact {fact} not delivered after the failover"
        time.sleep(0.005)
    return time.monotonic() - since


def test_synchronous_failover_loses_nothing_and_every_role_resumes(
    redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    with _pair(synchronous=True) as pair:
        url = pair.multi_host_url
        client = streams.connect(url, redis_url, redis_prefix, connect_timeout=20)
        client.create_stream(unique_name)
        appenders = [Appender(client.writer(unique_name), pace=0.002) for _ in range(2)]
        plain = Consumer(client.reader(unique_name, start="earliest"))
        group = Consumer(client.reader(unique_name, group="billing"), commit=True)
        proved = Consumer(client.reader(unique_name, start="earliest", shared_proofs=True))
        consumers = [plain, group, proved]
        for thread in [*appenders, *consumers]:
            thread.start()
        time.sleep(1.5)

        acked_before = sum(len(a.acked) for a in appenders)
        pair.kill_primary()
        killed = time.monotonic()
        promote_s = pair.promote()
        probe_writer = client.writer(unique_name, instance="after-failover")
        first, resume_s = _first_append_after(probe_writer, killed)
        delivered_s = [_delivered_after(c, first, killed) for c in consumers]
        time.sleep(1.5)
        for appender in appenders:
            appender.stop()
        probe_writer.close()

        stored = _stored(pair.standby_url, unique_name)
        acked = [i for a in appenders for i in a.acked]
        assert len(acked) == len(set(acked)), "an ID was acknowledged twice"
        lost = sorted(set(acked) - set(stored))
        assert lost == [], f"acknowledged facts lost: {lost}"
        for consumer in consumers:
            consumer.drain(stored)
            fatal = [e for e in consumer.errors if isinstance(e, streams.DatabaseChanged)]
            assert fatal == [], fatal
            assert sorted(consumer.got) == sorted(set(consumer.got)), "delivered twice"
            assert set(consumer.got) == set(stored), "delivered a fact the new primary lacks"
        # The CLI on the same URL sees the new primary.
        result = CliRunner().invoke(cli, ["positions", "--json", "--database-url", url])
        assert result.exit_code == 0, result.output
        positions = json.loads(result.output)
        assert unique_name in json.dumps(positions)
        client.close()
        print(
            f"\nsynchronous failover: promote {promote_s:.2f} s, first append {resume_s:.2f} s "
            f"after the kill, delivered {max(delivered_s):.2f} s after it; acked {len(acked)} "
            f"({acked_before} before the kill), lost 0, "
            f"stored {len(stored)}, delivered {len(plain.got)}/{len(group.got)}/"
            f"{len(proved.got)} (plain/group/shared proofs), each once"
        )


def test_asynchronous_failover_is_detected_and_named(
    redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    with _pair(synchronous=False) as pair:
        url = pair.multi_host_url
        client = streams.connect(url, redis_url, redis_prefix, connect_timeout=20)
        client.create_stream(unique_name)
        writer = client.writer(unique_name)
        reader = client.reader(unique_name, start="earliest")
        group = client.reader(unique_name, group="billing")
        kept = [writer.append({"n": n}).ids[0] for n in range(20)]
        pair.wait_replayed()
        pair.cut_off()
        # More than a sequence logs ahead (32): the standby's sequence is behind these IDs.
        lost = [writer.append({"n": n}).ids[0] for n in range(20, 120)]
        delivered: list[int] = []
        while len(delivered) < 120:
            epoch = reader.poll(timeout=2.0)
            assert epoch is not None
            delivered += [f.stream_id for f in epoch.facts]
        grouped: list[Any] = []
        while len(grouped) < 120:
            epoch = group.poll(timeout=2.0)
            assert epoch is not None
            grouped += epoch.facts
        group.commit()

        pair.kill_primary()
        pair.promote()
        assert _stored(pair.standby_url, unique_name) == kept
        with psycopg.connect(pair.standby_url) as conn:
            row = conn.execute(
                "SELECT pg_sequence_last_value(sequence_name::regclass), fenced_timeline, "
                f"({TIMELINE_SQL}) FROM streams_registry"
            ).fetchone()
        assert row is not None
        last_value, fenced, timeline = row
        # The standby's sequence is behind the lost IDs, unless a session of the writer (its
        # heartbeat reconnects on its own) already fenced the new timeline: then it is past
        # them by the fence's skip.
        if fenced is not None and fenced >= timeline:
            assert last_value > FAILOVER_SKIP > lost[-1], row
        else:
            assert last_value < lost[-1], "the standby's sequence is not behind"

        # A writer that never saw the old timeline gets no ID the old primary handed out: its
        # session moved its stream's sequence past them first (`streams_fence_stream`).
        with streams.connect(url, redis_url, redis_prefix) as other:
            fresh_id = other.writer(unique_name, instance="fresh").append({"n": "fresh"}).ids[0]
        assert fresh_id > lost[-1], "an ID of the old timeline handed out again"

        # The writer: its next call names the acknowledged facts that are gone, once.
        with pytest.raises(streams.FailoverLoss) as caught:
            writer.append({"n": 30})
        assert caught.value.stream == unique_name
        assert (caught.value.first, caught.value.last, caught.value.missing) == (
            lost[0],
            lost[-1],
            len(lost),
        )
        assert "facts acknowledged" in str(caught.value)
        after = writer.append({"n": 31})  # reported: the writer goes on
        assert after.ids[0] > lost[-1], "an ID was handed out twice"

        # The reader: stops, naming what it delivered that is gone; and stays stopped.
        for _ in range(2):
            with pytest.raises(streams.FailoverLoss) as caught:
                reader.poll(timeout=2.0)
            assert (caught.value.first, caught.value.last) == (lost[0], lost[-1])
            assert "facts delivered" in str(caught.value)
        with pytest.raises(streams.FailoverLoss):
            group.poll(timeout=2.0)

        # The operator's view, and the repair: sequences move past every ID handed out.
        runner = CliRunner()
        result = runner.invoke(cli, ["failover", "check", "--json", "--database-url", url])
        assert result.exit_code == 0, result.output
        report = {s["stream"]: s for s in json.loads(result.output)["streams"]}
        assert report[unique_name]["max_fact"] == after.ids[0]
        result = runner.invoke(
            cli, ["failover", "repair", "--skip", "1000", "--yes", "--database-url", url]
        )
        assert result.exit_code == 0, result.output
        assert writer.append({"n": 32}).ids[0] > after.ids[0] + 999

        # A new reader starts on the new history and delivers what is there, once.
        with streams.connect(url, redis_url, redis_prefix) as fresh:
            again = fresh.reader(unique_name, start="earliest")
            got: list[int] = []
            deadline = time.monotonic() + 30
            while len(got) < len(kept) + 2:
                assert time.monotonic() < deadline, f"delivered only {got}"
                epoch = again.poll(timeout=2.0)
                got += [f.stream_id for f in epoch.facts] if epoch is not None else []
            assert got[: len(kept)] == kept
            again.close()
        for closable in (reader, group, writer, client):
            with contextlib.suppress(streams.StreamsError):
                closable.close()
        print(
            f"\nasynchronous failover: acked {len(kept) + len(lost)}, lost {len(lost)} "
            f"(IDs {lost[0]}..{lost[-1]}), detected by the writer and both readers; the next "
            f"ID handed out {fresh_id}"
        )


def _doctor(url: str) -> dict[str, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["doctor", "--json", "--database-url", url])
    checks = json.loads(result.output)
    return {c["name"]: c for c in checks}


def test_doctor_shows_the_topology_and_what_is_degraded() -> None:
    with _pair(synchronous=True) as pair:
        primary = f"postgres 127.0.0.1:{pair.primary.port}"
        standby = f"postgres 127.0.0.1:{pair.standby.port}"
        checks = _doctor(pair.multi_host_url)
        assert checks[primary]["ok"] and "primary, timeline 1" in checks[primary]["detail"]
        assert checks[standby]["ok"] and "standby, timeline 1" in checks[standby]["detail"]
        replication = checks["postgres replication"]
        assert replication["ok"] and "standby1 (streaming, sync" in replication["detail"]

        pair.pause_replay()
        checks = _doctor(pair.multi_host_url)
        assert not checks[standby]["ok"] and "replay PAUSED" in checks[standby]["detail"]
        pair.resume_replay()

        pair.promote()  # the primary still runs: two primaries
        checks = _doctor(pair.multi_host_url)
        assert not checks["postgres primary"]["ok"]
        assert "split brain" in checks["postgres primary"]["detail"]
        assert "timeline 2" in checks["postgres primary"]["detail"]
        # With no standby left, the old primary's commits would wait for one.
        old = checks[f"postgres replication 127.0.0.1:{pair.primary.port}"]
        assert not old["ok"] and "every commit waits" in old["detail"]


def test_asyncio_roles_ride_out_a_synchronous_failover_and_see_an_asynchronous_loss(
    redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """The same checks run for `AsyncWriter` and `AsyncReader` (one logic with the sync
    classes: `streams.store.identity.verify` with their sightings)."""
    import asyncio

    async def scenario(pair: PostgresPair, synchronous: bool) -> None:
        url = pair.multi_host_url
        client = await streams.aconnect(url, redis_url, redis_prefix, connect_timeout=20)
        await client.create_stream(unique_name)
        writer = await client.writer(unique_name)
        reader = await client.reader(unique_name, start="earliest")
        kept = [(await writer.append({"n": n})).ids[0] for n in range(10)]
        pair.wait_replayed()
        if not synchronous:
            pair.cut_off()
        more = [(await writer.append({"n": n})).ids[0] for n in range(10, 15)]
        got: list[int] = []
        while len(got) < 15:
            epoch = await reader.poll(timeout=2.0)
            assert epoch is not None
            got += [f.stream_id for f in epoch.facts]
        pair.kill_primary()
        pair.promote()
        if synchronous:
            after = (await writer.append({"n": 15})).ids[0]
            while after not in got:
                epoch = await reader.poll(timeout=2.0)
                got += [f.stream_id for f in epoch.facts] if epoch else []
            assert got == [*kept, *more, after]
        else:
            with pytest.raises(streams.FailoverLoss) as by_writer:
                await writer.append({"n": 15})
            with pytest.raises(streams.FailoverLoss) as by_reader:
                await reader.poll(timeout=2.0)
            for caught in (by_writer, by_reader):
                assert (caught.value.first, caught.value.last) == (more[0], more[-1])
        for closable in (reader, writer, client):
            with contextlib.suppress(streams.StreamsError):
                await closable.aclose()

    for synchronous in (True, False):
        with _pair(synchronous=synchronous) as pair:
            asyncio.run(scenario(pair, synchronous))


def test_facts_without_rows_are_no_loss_and_a_callers_session_fences_a_new_timeline(
    unique_name: str,
) -> None:
    """Issue 38. Through a synchronous failover:

    * a committed ``fact()`` with no row in the facts table (rows are optional; the caller's
      own table holds its effect), and one whose rows are in a declared table, are never
      named by `FailoverLoss` (the writer's check looks for rows: it remembered neither the
      first, and finds the second in the declared table);
    * a ``fact(conn=...)`` on a caller's session that reaches the new primary before any
      session of the writer's own gets an ID past the fence (the old timeline's IDs may have
      been handed out there).
    """
    declared = f"{unique_name}_d"
    with _pair(synchronous=True) as pair:
        url = pair.multi_host_url
        with psycopg.connect(pair.primary_url, autocommit=True) as admin:
            admin.execute(f"CREATE TABLE {unique_name}_app (id bigint PRIMARY KEY)")
            admin.execute(f"CREATE TABLE {declared}_rows (stream_id bigint PRIMARY KEY)")
        # A long lease: the writers' heartbeats (lease / 4) stay off their sessions, so the
        # caller's session is the first on the new timeline.
        client = streams.connect(url, connect_timeout=20, lease_seconds=120)
        client.create_stream(unique_name)
        client.create_stream(declared, fact_tables=[f"public.{declared}_rows.stream_id"])
        plain, with_table = client.writer(unique_name), client.writer(declared)
        before = plain.append({"n": 0}).ids[0]
        with psycopg.connect(url) as app:
            with plain.fact(app) as fact:  # no rows: the caller's table holds its effect
                app.execute(f"INSERT INTO {unique_name}_app VALUES (%s)", (fact.stream_id,))
            rowless = fact.stream_id
            with with_table.fact(app) as fact:
                app.execute(f"INSERT INTO {declared}_rows VALUES (%s)", (fact.stream_id,))
            in_table = fact.stream_id
        pair.kill_primary()
        pair.promote()
        with psycopg.connect(url) as app:  # the caller reconnects first
            with plain.fact(app) as fact:
                fact.add({"after": "failover"})
            first_after = fact.stream_id
        assert first_after > before + FAILOVER_SKIP, (before, first_after)
        # The writers' own sessions reconnect now: what they remember is all there.
        ack = plain.append({"n": 1})
        assert ack.ids[0] > first_after
        with_table.append({"n": 2})
        with psycopg.connect(pair.standby_url) as conn:
            assert conn.execute(f"SELECT id FROM {unique_name}_app").fetchall() == [(rowless,)]
            held = conn.execute(f"SELECT stream_id FROM {declared}_rows").fetchall()
            assert held == [(in_table,)]
        plain.close()
        with_table.close()
        client.close()


def test_a_writer_fenced_on_the_new_timeline_still_names_its_lost_facts(
    redis_url: str, redis_prefix: str, unique_name: str
) -> None:
    """Issue 38 (found by the asynchronous chaos variant). After an asynchronous failover the
    writer is fenced on the new primary before its next call: there its lease may have run
    out (the renewals after the cut are lost) and been retired, or, as here, its name taken
    over. Its next call still names the acknowledged facts the failover lost before it says
    the writer is retired: `FailoverLoss` first, then `WriterFenced`."""
    with _pair(synchronous=False) as pair:
        url = pair.multi_host_url
        client = streams.connect(
            url, redis_url, redis_prefix, connect_timeout=20, lease_seconds=2.0
        )
        client.create_stream(unique_name)
        writer = client.writer(unique_name)
        kept = [writer.append({"n": n}).ids[0] for n in range(5)]
        pair.wait_replayed()
        pair.cut_off()
        lost = [writer.append({"n": n}).ids[0] for n in range(5, 45)]
        pair.kill_primary()
        pair.promote()
        # Another process takes the name over on the new primary (as a reader retiring the
        # expired lease would, it bumps the generation).
        with streams.connect(url, redis_url, redis_prefix, connect_timeout=20) as other:
            other.writer(unique_name, instance=writer.instance).close()
        # The writer's heartbeat (every lease / 4) reaches the new primary first: it finds the
        # loss, then its writer fenced.
        deadline = time.monotonic() + 30
        while not writer._core.fenced:
            assert time.monotonic() < deadline, "the heartbeat never found the writer fenced"
            time.sleep(0.05)
        with pytest.raises(streams.FailoverLoss) as caught:
            _first_call_past_connecting(writer)
        assert (caught.value.first, caught.value.last) == (lost[0], lost[-1])
        assert caught.value.stream == unique_name
        with pytest.raises(streams.WriterFenced):
            writer.append({"n": "after"})
        assert _stored(pair.standby_url, unique_name) == kept
        with contextlib.suppress(streams.StreamsError):
            writer.close()
        client.close()


def _first_call_past_connecting(writer: streams.Writer) -> None:
    """Append until a call gets past reaching the new primary (which may take a few tries)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            writer.append({"n": "probe"})
            return
        except (streams.FailoverLoss, streams.WriterFenced):
            raise
        except streams.StreamsError:
            assert time.monotonic() < deadline, "no call reached the new primary"
            time.sleep(0.05)


def test_signed_ranges_of_the_old_timeline_are_not_delivered_after_the_check(
    redis_url: str, redis_prefix: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38 (found by the asynchronous chaos variant: a group consumer frozen through a
    failover). A follower verifies the prover's signed ranges as Redis brings them, on its
    link's thread, before it polls. Ranges of facts the promoted standby lacks, verified
    before the failover, must not be delivered after the reader has checked what it delivered
    against the new primary: it would go on past facts that are gone without a
    `FailoverLoss`. Either it never delivers them, or it stops with `FailoverLoss`."""
    # Every step reads the keys first: the reader's session reaches the new primary (and
    # checks what it delivered) before it looks at the signed ranges it holds.
    monkeypatch.setattr("streams.core.reader_state.KEY_REFRESH", 0.0)
    with _pair(synchronous=False) as pair:
        url = pair.multi_host_url
        options: dict[str, Any] = {"connect_timeout": 20, "shared_proofs": True}
        with contextlib.ExitStack() as stack:
            prover, follower, writing = (
                stack.enter_context(streams.connect(url, redis_url, redis_prefix, **options))
                for _ in range(3)
            )
            writing.create_stream(unique_name)
            stack.enter_context(prover.reader(unique_name)).poll()
            proofs = prover._proofs
            assert proofs is not None
            wait_until(lambda: unique_name in proofs.proving, 15, "a prover of the stream")
            reader = stack.enter_context(follower.reader(unique_name, poll_interval=30.0))
            writer = writing.writer(unique_name)
            kept = [writer.append({"n": n}).ids[0] for n in range(5)]
            delivered: list[int] = []
            deadline = time.monotonic() + 30
            while not delivered or delivered[-1] < kept[-1]:
                assert time.monotonic() < deadline, delivered
                epoch = reader.poll(timeout=1.0)
                delivered += [f.stream_id for f in epoch.facts] if epoch is not None else []
            assert reader.core.counters.signed_ranges > 0 or reader.core.counters.proof_reads > 0
            pair.wait_replayed()
            pair.cut_off()
            before = reader.core.counters.verified_ranges
            lost = [writer.append({"n": n}).ids[0] for n in range(5, 25)]
            # The follower verifies the prover's ranges of the lost facts without polling.
            wait_until(
                lambda: (
                    reader.core.counters.verified_ranges > before
                    and any(r.through >= lost[-1] for r in reader.core.inbox.verified)
                ),
                30,
                "the follower to hold a verified range of the lost facts",
            )
            pair.kill_primary()
            pair.promote()
            with streams.connect(url, redis_url, redis_prefix, connect_timeout=20) as fresh:
                after = fresh.writer(unique_name, instance="after").append({"n": "after"})
            got: list[int] = []
            stopped = False
            deadline = time.monotonic() + 60
            while after.ids[0] not in got:
                assert time.monotonic() < deadline, got
                try:
                    epoch = reader.poll(timeout=1.0)
                except streams.FailoverLoss:
                    stopped = True
                    break
                except streams.StreamsError:
                    time.sleep(0.05)
                    continue
                got += [f.stream_id for f in epoch.facts] if epoch is not None else []
            gone = sorted(set(got) & set(lost))
            assert stopped or not gone, f"delivered {gone} (lost) and went on to {got[-1]}"
            assert _stored(pair.standby_url, unique_name) == [*kept, after.ids[0]]
            writer.close()
