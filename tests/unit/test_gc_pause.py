"""`streams._gc.collection_paused`: the collector is off inside, back as it was after, whatever
the nesting, the threads or an exception; a program that turned it off keeps it off."""

from __future__ import annotations

import gc
import threading

import pytest

from streams._gc import collection_paused


def test_paused_inside_restored_after_even_on_error() -> None:
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_program_that_turned_it_off_keeps_it_off() -> None:
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_in_threads_end_with_the_last() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collection_paused():
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(5)
    with collection_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause has not ended
    release.set()
    thread.join(5)
    assert gc.isenabled()
