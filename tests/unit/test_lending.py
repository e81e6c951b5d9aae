"""`LentThread`: background work that runs only within its owner's `lend`, stopped at its next `pause` once the
lent time is up and resumed there at the next `lend`."""

from __future__ import annotations

import threading
import time

import pytest

from rag_kvcache.serving.lending import LentThread


class Pieces:
    """Work of `pieces` pieces of `layers` pauses each, that records where it is and fails if it ever runs while
    its owner is not in `lend`."""

    def __init__(self, pieces: int, layers: int) -> None:
        self.left, self.layers = pieces, layers
        self.layers_done = 0
        self.finished = 0
        self.lending = threading.Event()  # set by the test around each `lend`

    def step(self, pause) -> bool:
        if self.left == 0:
            return False
        for _ in range(self.layers):
            pause()
            assert self.lending.is_set(), "the work ran while its owner was not lending it time"
            self.layers_done += 1
        self.finished += 1
        self.left -= 1
        return self.left > 0

    def lend(self, thread: LentThread, seconds: float) -> bool:
        self.lending.set()
        try:
            return thread.lend(seconds)
        finally:
            self.lending.clear()


def test_no_time_lent_runs_one_layer_a_lend_and_nothing_between_lends():
    work = Pieces(pieces=2, layers=3)
    thread = LentThread(work.step, "test-lent")
    try:
        seen = []
        while work.lend(thread, 0.0):
            seen.append(work.layers_done)
            time.sleep(0.01)  # the owner runs: the work must not
            assert work.layers_done == seen[-1]
        # a lend of no time runs the work to its next pause or the end of a piece: a layer at most
        assert seen == [0, 1, 2, 3, 3, 4, 5] and work.layers_done == 6 and work.finished == 2
    finally:
        thread.close()


def test_time_lent_runs_the_work_to_its_end_and_a_later_lend_finds_new_work():
    work = Pieces(pieces=3, layers=4)
    thread = LentThread(work.step, "test-lent")
    try:
        assert work.lend(thread, 60.0) is False  # nothing more to do: handed back at once, not after 60 s
        assert work.finished == 3 and work.layers_done == 12
        work.left = 1  # new work (a prompt wanted another cache)
        assert work.lend(thread, 60.0) is False and work.finished == 4
    finally:
        thread.close()


def test_a_failed_piece_is_raised_from_lend_and_the_thread_goes_on():
    calls = []

    def step(pause) -> bool:
        calls.append(len(calls))
        pause()
        if len(calls) == 1:
            raise OSError("disk full")
        return len(calls) < 3

    thread = LentThread(step, "test-lent")
    try:
        with pytest.raises(OSError, match="disk full"):
            thread.lend(60.0)
        assert thread.lend(60.0) is False and calls == [0, 1, 2]
    finally:
        thread.close()


def test_closing_drops_the_piece_stopped_midway_and_refuses_more_time():
    work = Pieces(pieces=1, layers=5)
    thread = LentThread(work.step, "test-lent")
    assert work.lend(thread, 0.0) is True  # stopped before its first layer
    thread.close()
    assert not thread._thread.is_alive()
    assert work.finished == 0 and work.layers_done == 0  # the piece never went on past its pause
    thread.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        thread.lend(1.0)


def test_a_negative_time_is_refused():
    thread = LentThread(lambda pause: False, "test-lent")
    try:
        with pytest.raises(ValueError, match="-1"):
            thread.lend(-1)
    finally:
        thread.close()
