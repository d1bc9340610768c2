"""What a failover may have lost of what a role saw, pure (`streams.core.sightings`)."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from streams.core.sightings import RECENT_IDS, Loss, Sighting, assess
from streams.errors import DatabaseChanged, FailoverLoss

ids = st.lists(st.integers(1, 10_000), max_size=60)


@given(ids, ids, st.integers(0, 10_000))
def test_a_loss_is_exactly_the_seen_ids_above_retention_that_are_gone(
    seen: list[int], present: list[int], pruned: int
) -> None:
    loss = assess("s", seen, present, pruned)
    gone = sorted({i for i in seen if i > pruned} - set(present))
    if not gone:
        assert loss is None
        return
    assert loss is not None
    assert (loss.first, loss.last, loss.missing) == (gone[0], gone[-1], len(gone))
    assert loss.at_least == (len(gone) == len({i for i in seen if i > pruned}))


def test_the_error_names_the_stream_the_range_and_what_was_seen() -> None:
    error = Loss("orders", 21, 30, 10, at_least=False).error("writer 'w'", "facts acknowledged")
    assert isinstance(error, FailoverLoss) and isinstance(error, DatabaseChanged)
    assert (error.stream, error.first, error.last, error.missing) == ("orders", 21, 30, 10)
    text = str(error)
    assert text.startswith("writer 'w': ")
    assert "stream 'orders', IDs 21..30" in text and "10 facts acknowledged" in text
    assert "streams failover check" in text
    wider = Loss("orders", 1, 30, 30, at_least=True).error("reader", "facts delivered")
    assert "at least" in str(wider)


def test_a_sighting_keeps_the_most_recent_ids_per_stream() -> None:
    sighting = Sighting()
    sighting.note("a", 7, range(RECENT_IDS + 10))
    sighting.note("b", 8, [5])
    seen = sighting.snapshot()
    assert seen["a"][0] == 7 and seen["a"][1] == list(range(10, RECENT_IDS + 10))
    assert seen["b"] == (8, [5])
    sighting.forget()
    assert sighting.snapshot() == {}


def test_a_sighting_takes_notes_from_many_threads() -> None:
    sighting = Sighting()
    threads = [
        threading.Thread(target=lambda n=n: sighting.note("s", 1, range(n * 100, n * 100 + 100)))
        for n in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(sighting.snapshot()["s"][1]) == list(range(800))


def test_a_writers_loss_is_taken_once_and_a_readers_stays() -> None:
    loss = Loss("s", 1, 2, 2, at_least=False).error("writer", "facts acknowledged")
    writer = Sighting()
    writer.failed = loss
    assert writer.take_loss() is loss
    assert writer.take_loss() is None
    reader = Sighting(sticky=True)
    reader.failed = loss
    assert reader.failed is loss  # a reader raises it from every later call (store.identity)
