"""Admission control: a bounded queue in front of the engine, a cap per API key, 429 with `Retry-After`
when either is full."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .errors import APIError
from .metrics import ServerMetrics


class Admission:
    """At most `max_batch + max_queue` requests admitted at once (a burst of requests all waiting at once
    fills both): generations go to the scheduler, which decodes at most `max_batch` together and chooses
    which waiting one to prefill next; other engine work (documents) takes one of `max_batch` places in
    arrival order. At most `max_per_key` admitted requests are one tenant's (an API key's; 0: no limit;
    requests without a key are not counted)."""

    def __init__(self, max_queue: int, max_batch: int, metrics: ServerMetrics, max_per_key: int = 0) -> None:
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_per_key = max_per_key
        self.metrics = metrics
        self.waiting = 0
        self.active = 0
        self.in_flight: dict[str, int] = {}  # per tenant: its requests waiting or served
        self._slot = asyncio.Semaphore(max_batch)
        self._service_s = 1.0  # moving average of a request's service time, for Retry-After

    def admit(self, tenant: str = "") -> Ticket:
        """A place in the queue, or a 429 when the queue is full or `tenant` has its most requests in flight."""
        retry = max(1, math.ceil(self._service_s * (self.waiting + self.active) / self.max_batch))
        if self.waiting >= self.max_queue + self.max_batch - self.active:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"the server is busy ({self.waiting} requests waiting); retry in {retry} s",
                type="rate_limit_error",
                code="server_busy",
                headers={"Retry-After": str(retry)},
            )
        if tenant and self.max_per_key and self.in_flight.get(tenant, 0) >= self.max_per_key:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"this API key has {self.max_per_key} requests in flight, the most this server allows "
                f"one key (max_per_key); retry in {retry} s",
                type="rate_limit_error",
                code="key_busy",
                headers={"Retry-After": str(retry)},
            )
        self._set_waiting(+1)
        if tenant:
            self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        return Ticket(self, tenant)

    def _left(self, tenant: str) -> None:
        if tenant:
            self.in_flight[tenant] -= 1
            if not self.in_flight[tenant]:
                del self.in_flight[tenant]

    def _set_waiting(self, delta: int) -> None:
        self.waiting += delta
        self.metrics.queue_depth.set(self.waiting)

    def _set_active(self, delta: int) -> None:
        self.active += delta
        self.metrics.active.set(self.active)

    def served(self, seconds: float) -> None:
        self._service_s = 0.8 * self._service_s + 0.2 * seconds


class Ticket:
    """An admitted request: waits for the engine in `serve()`; `close()` gives its place back."""

    def __init__(self, admission: Admission, tenant: str = "") -> None:
        self._admission = admission
        self._tenant = tenant
        self._queued = True
        self._open = True
        self.admitted_at = time.perf_counter()

    @property
    def tenant(self) -> str:
        """The tenant the request was admitted for ("" without keys)."""
        return self._tenant

    @asynccontextmanager
    async def serve(self, slot: bool = True) -> AsyncIterator[None]:
        """In service until the block ends: after one of the `max_batch` places is free (`slot`), or at once
        for a generation, which the scheduler queues itself (it prefills the waiting request it chooses,
        `Scheduler.order`, and decodes at most `max_batch`) and whose queueing time it records."""
        adm = self._admission
        if slot:
            await adm._slot.acquire()
        self._queued = False
        adm._set_waiting(-1)
        adm._set_active(+1)
        started = time.perf_counter()
        if slot:
            adm.metrics.queue_wait.observe(started - self.admitted_at)
        try:
            yield
        finally:
            adm._set_active(-1)
            if slot:
                adm._slot.release()
            adm.served(time.perf_counter() - started)

    def close(self) -> None:
        """Give the place back (served or not); once."""
        if self._queued:
            self._queued = False
            self._admission._set_waiting(-1)
        if self._open:
            self._open = False
            self._admission._left(self._tenant)
