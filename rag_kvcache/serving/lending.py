"""`LentThread`: background work on a thread of its own that runs only in the time its owner lends it.

A server makes the chunk caches prompts wanted in the background (`CacheOpener.backfill`). One cache can take
several forwards (a chunk's cache behind its neighbours, and their caches behind the prefix where the budget keeps
none), and a request that arrives while the engine's thread makes one would wait for all of it. Here the work runs
on a thread of its own, and only while the engine's thread waits in `lend(seconds)`; once the time is up the work
stops at its next `pause` (the model calls it before each layer) and goes on from there at the next `lend`. So a
request waits for background work at most about `seconds` and one layer, and the work still moves forward in every
gap between requests.

The two threads never run at once (the owner waits while the work runs, and the work waits while the owner runs),
so the work sees the index, the model and the stores as the engine's thread left them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..engine.spec import Pause
from ..errors import RagKVCacheError


class _Closed(RagKVCacheError):
    """Raised inside the work at its next `pause` once the thread is closed: the piece in hand is dropped."""


class LentThread:
    """Runs `step(pause)` over and over on a thread named `name`, but only within `lend`. `step` does one piece of
    the work, calls `pause` where it may be stopped, and returns whether there is more to do."""

    def __init__(self, step: Callable[[Pause], bool], name: str) -> None:
        self._step = step
        self._go = threading.Event()  # set: the work may run
        self._back = threading.Event()  # set: the work has stopped (time up, nothing to do, failed or closed)
        self._until = 0.0  # when the lent time is up (time.monotonic)
        self._more = True
        self._error: Exception | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def lend(self, seconds: float) -> bool:
        """Let the work run for `seconds` (to its next `pause` after them), waiting for it; returns whether it has
        more to do. A failure of `step` is raised here (the thread goes on with the next piece at the next `lend`)."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        if self._closed:
            raise RuntimeError(f"{self._thread.name} is closed: no time can be lent to it")
        self._until = time.monotonic() + seconds
        self._back.clear()
        self._go.set()
        self._back.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._more

    def close(self) -> None:
        """End the thread (idempotent). Work stopped midway is dropped: what a piece has not finished is not kept."""
        self._closed = True
        self._go.set()
        self._thread.join()

    def _pause(self) -> None:
        if time.monotonic() >= self._until:
            self._hand_back()
        if self._closed:
            raise _Closed

    def _hand_back(self) -> None:
        """Stop: the owner's `lend` returns, and this thread waits for the next."""
        self._go.clear()
        self._back.set()
        self._go.wait()

    def _run(self) -> None:
        self._go.wait()
        try:
            while not self._closed:
                try:
                    self._more = self._step(self._pause)
                except _Closed:
                    raise
                except Exception as error:  # the owner's to report, from `lend`
                    self._error, self._more = error, True
                if self._error is not None or not self._more or time.monotonic() >= self._until:
                    self._hand_back()
        except _Closed:
            pass
        finally:
            self._back.set()
