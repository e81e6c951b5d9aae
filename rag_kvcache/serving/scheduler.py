"""The server's scheduler: continuous batching of concurrent requests' decoding steps.

- Prefills run one at a time (each prompt's fusion is its own); decoding is shared. Each tick admits at most one
  waiting request's prefill (`FusedGenerator.start`, which gives its first token), then advances every decoding
  request by one token in one batched model step (`decode_together`: each request a slot of the scheduler's
  `DecodePool`, attended in one call a layer over its own positions). At most `max_batch` requests decode
  together; with `max_batch` 1 a request is prefilled only when none is decoding.
- A request leaves the batch when its answer is complete (end of sequence, stop string, `max_tokens`) or its
  client has gone; a new one joins after its prefill, between two steps.
- `order="fcfs"`: the oldest waiting request is prefilled first, one a tick. `order="cache_aware"`: every waiting
  request whose prompt the conversation cache holds all of but a tail of at most `RIDE_TOKENS` (a chat's next
  turn, a question asked again, even while its first asking still decodes: `FusedGenerator.settle` keeps a
  prompt's K/V once its first token is out) joins the batch without a prefill (`FusedGenerator.enter`: its held
  K/V go into its slot, its tail is fed by the next batched step), within `RIDE_TOKENS` tail tokens a step and the
  batch's free places; the oldest request that needs a prefill keeps one of those places, so only requests older
  than it go before it; the others are then prefilled oldest first (time to first token against `fcfs`:
  benchmarks/chat/trace.py).
- `prefetch`: a loader thread reads the chunk caches of the next request to be prefilled into the memory tier
  while the engine computes (`FusedGenerator.load`, one request at a time, each once); a load that fails is
  logged, and the prefill reads or recomputes the caches itself. The server turns it on where the caches wait on
  a network (`ServerConfig.prefetches`).
- All model work runs on the engine's worker thread, between ticks. Work that no request waits for (`later`: a
  chat's shortened history prepared before its next turn, `FusedGenerator.prepare_fit`) runs only when no request
  is waiting or decoding, one task at a time, at most `MAX_IDLE` queued (the oldest dropped first); a request
  that arrives meanwhile waits for the task in flight (a long one is lent time in slices: the chunk caches a
  server makes under a disk budget, `LentThread`). A task's failure is logged: no request depends on it.
- A failure in a prefill fails its request; one in a request's own sampling of a batched step fails that request
  alone (the others decode on as if it had not been there); one in the batched forward fails every request in
  that step, each with the error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import FusionConfig, GenerationConfig
from ..engine.decoding import DecodePool
from ..engine.generation import Step, decode_together
from ..engine.prompt import Segment
from ..query.answers import Answer, Generation
from ..query.generator import FusedGenerator
from .metrics import ServerMetrics

log = logging.getLogger(__name__)

_END = object()  # a job's last item: its stream ends
RIDE_TOKENS = 64  # cache_aware: prompt tokens, all tails together, that held prompts feed with a decoding step
MAX_IDLE = 8  # background tasks queued for an idle moment (`later`); more drop the oldest
Order = Literal["fcfs", "cache_aware"]


@dataclass(eq=False)
class Job:
    """One request in the scheduler: its prompt, what it yields (text, then the `Answer`, then `_END`,
    or an exception), and its generation once prefilled."""

    segments: Sequence[Segment]
    fusion: FusionConfig
    generation: GenerationConfig
    salt: str  # the tenant whose caches of request text it reads (`FusedGenerator.start`)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    live: Generation | None = None
    cancelled: bool = False  # its client has gone: dropped before the next step
    tail: int | None = None  # `cache_aware`: tokens it would compute joining the batch; None: it needs a prefill
    loaded: bool = False  # `prefetch`: its caches were handed to the loader
    submitted: float = field(default_factory=time.perf_counter)

    def deliver(self, released: list[Step], answer: Answer | None) -> None:
        for step in released:
            self.out.put_nowait(step.text)
        if answer is not None:
            self.out.put_nowait(answer)
            self.out.put_nowait(_END)

    def fail(self, error: BaseException) -> None:
        self.out.put_nowait(error)


class Scheduler:
    """Prefills one request at a time and decodes up to `max_batch` together (see the module)."""

    def __init__(
        self,
        generator: FusedGenerator,
        on_engine: Callable[..., Awaitable[Any]],
        max_batch: int,
        metrics: ServerMetrics,
        order: Order,
        prefetch: bool,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        if order not in ("fcfs", "cache_aware"):
            raise ValueError(f"order must be 'fcfs' or 'cache_aware', got {order!r}")
        self.order = order
        self.generator = generator
        self.on_engine = on_engine  # fn(*args) on the engine's worker thread, awaited
        self.max_batch = max_batch
        self.metrics = metrics
        self.pending: deque[Job] = deque()
        self.decoding: list[Job] = []
        self.pool = DecodePool()  # the decoding requests' caches: their rows attend in one call a layer
        self.idle: deque[Callable[[], object]] = deque(maxlen=MAX_IDLE)  # work for when no request waits
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # reads waiting requests' caches into the memory tier while the engine's thread computes
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="rag-kvcache-prefetch") if prefetch else None
        self._loading: Future | None = None

    async def stream(
        self,
        segments: Sequence[Segment],
        fusion: FusionConfig,
        generation: GenerationConfig,
        salt: str = "",
    ) -> AsyncIterator[str | Answer]:
        """The request's text pieces as they are decoded, then its `Answer`. Closing it early (the
        client left) takes the request out before the scheduler's next step."""
        self._run()
        job = Job(segments, fusion, generation, salt)
        self.pending.append(job)
        self._wake.set()
        try:
            while (item := await job.out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.cancelled = True

    def later(self, task: Callable[[], object]) -> None:
        """Run `task` on the engine's thread once no request is waiting or decoding (see the module)."""
        self._run()
        self.idle.append(task)
        self.metrics.background_queue.set(len(self.idle))
        self._wake.set()

    @property
    def running(self) -> bool:
        """Whether the loop has started and not stopped."""
        return self._task is not None and not self._task.done()

    def _run(self) -> None:
        """Start the loop on first use; refuse work once it has stopped."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="rag-kvcache-scheduler")
        if self._task.done():
            raise RuntimeError(f"the scheduler has stopped: {self._task}")

    async def close(self) -> None:
        """Stop the loop (the engine's step in flight completes on its thread, and the loader's load)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.loader is not None:
            await asyncio.to_thread(self.loader.shutdown, wait=True, cancel_futures=True)

    async def _loop(self) -> None:
        try:
            while True:
                if not self.pending and not self.decoding:
                    if self.idle:
                        await self._background(self.idle.popleft())
                        continue
                    self._wake.clear()
                    await self._wake.wait()
                if self.order == "cache_aware" and self.pending and len(self.decoding) < self.max_batch:
                    await self._board()
                if self.pending and len(self.decoding) < self.max_batch:
                    job = self._next()
                    self._load_ahead()
                    await self._prefill(job)
                self._keep(lambda job: not job.cancelled)
                if self.decoding:
                    self._load_ahead()
                    await self._step(self.decoding)
        except BaseException as e:  # stopped (shutdown) or broken: no request is left waiting for it
            error = e if isinstance(e, Exception) else RuntimeError("the server is shutting down")
            for job in [*self.pending, *self.decoding]:
                job.fail(error)
            raise

    async def _background(self, task: Callable[[], object]) -> None:
        self.metrics.background_queue.set(len(self.idle))
        try:
            await self.on_engine(task)
        except Exception:  # no request waits for it: logged, and the server goes on
            log.exception("a background task failed: %s", task)
            self.metrics.background.labels("failed").inc()
        else:
            self.metrics.background.labels("done").inc()

    def _load_ahead(self) -> None:
        """With `prefetch`, once the loader is free: the next waiting request to be prefilled has its caches read
        into the memory tier on the loader's thread while the engine computes (see the module)."""
        if self.loader is None or (self._loading is not None and not self._loading.done()):
            return
        job = next((job for job in self.pending if job.tail is None and not job.loaded and not job.cancelled), None)
        if job is not None:
            job.loaded = True
            self._loading = self.loader.submit(self._load, job)

    def _load(self, job: Job) -> None:
        """On the loader's thread: `job`'s chunk caches into the memory tier."""
        try:
            self.metrics.prefetched.inc(self.generator.load(job.segments, job.fusion, job.salt))
        except Exception:  # no answer depends on it: the prefill reads (or recomputes) the caches itself
            log.warning("reading a waiting request's caches ahead of its prefill failed", exc_info=True)

    async def _prefill(self, job: Job) -> None:
        if job.cancelled:
            return
        self.metrics.queue_wait.observe(time.perf_counter() - job.submitted)
        try:
            job.live, released, answer = await self.on_engine(self._start, job)
        except Exception as e:  # the request's own failure (e.g. a fusion setting refused): it gets the error
            job.fail(e)
            return
        job.deliver(released, answer)
        if answer is None:
            try:  # the prompt's K/V into its pool slot and the conversation cache, once the first token is out
                await self.on_engine(self.generator.settle, job.live)
            except Exception as e:
                job.live.decoder.close()
                job.fail(e)
                return
            self.decoding.append(job)
            self._count()

    async def _board(self) -> None:
        """`cache_aware`: the waiting requests that need no prefill of their own join the batch (see the module)."""
        jobs = [job for job in self.pending if not job.cancelled]
        entered = await self.on_engine(self._enter, jobs, self.max_batch - len(self.decoding))
        for job, live in zip(jobs, entered):
            if live is None:
                continue
            self.pending.remove(job)
            self.metrics.queue_wait.observe(time.perf_counter() - job.submitted)
            if isinstance(live, Exception):  # the request's own failure (e.g. a prompt too long): it gets the error
                job.fail(live)
                continue
            job.live = live
            self.decoding.append(job)
            self.metrics.joined.inc()
        self._count()

    def _enter(self, jobs: list[Job], free: int) -> list[Generation | Exception | None]:
        """On the engine's thread: in order, each of `jobs` started without a prefill where it can join the batch
        (`FusedGenerator.joinable`, a tail within what is left of `RIDE_TOKENS`: `FusedGenerator.enter`) while
        places are `free`, the oldest that needs a prefill (`tail` None) keeping one for it, so that only
        requests older than it go before it; None for the others."""
        room, left, kept, out = free, RIDE_TOKENS, False, []
        for job in jobs:
            tail = self.generator.joinable(job.segments, job.fusion, job.salt)
            job.tail = tail if tail is not None and tail <= RIDE_TOKENS else None
            live: Generation | Exception | None = None
            if job.tail is None:
                room, kept = room - (not kept), True  # the oldest that needs a prefill keeps a place
            elif room > 0 and job.tail <= left:
                try:
                    live = self.generator.enter(job.segments, self.pool, job.fusion, job.generation, job.salt)
                except Exception as e:
                    live = e
                else:
                    room, left = room - 1, left - job.tail
            out.append(live)
        return out

    def _next(self) -> Job:
        """The waiting request to prefill now, taken out of `pending`: the oldest; with `cache_aware`, the oldest
        that cannot join the batch without a prefill when one waits (the others join as places free up)."""
        job = next((job for job in self.pending if job.tail is None), None) if self.order == "cache_aware" else None
        job = job or self.pending[0]
        self.pending.remove(job)
        return job

    def _start(self, job: Job) -> tuple[Generation, list[Step], Answer | None]:
        """On the engine's thread: the prefill and the first token."""
        live = self.generator.start(job.segments, job.fusion, job.generation, job.salt, self.pool)
        try:
            released = live.decoder.take(live.first_token)
            return live, released, self.generator.finish(live) if live.decoder.done else None
        except BaseException:  # the request fails before it joins the batch: its slot is given back
            live.decoder.close()
            raise

    async def _step(self, jobs: list[Job]) -> None:
        self.metrics.decode_batch.observe(len(jobs))
        try:
            results = await self.on_engine(self._advance, list(jobs))
        except Exception as e:
            log.exception("a batched decoding step of %d requests failed", len(jobs))
            for job in jobs:
                job.fail(e)
            self._keep(lambda job: job not in jobs)
            return
        for job, result in zip(jobs, results):
            if isinstance(result, Exception):
                log.warning(
                    "a request's decoding step failed; the %d others in its batch go on: %s", len(jobs) - 1, result
                )
                job.fail(result)
            else:
                job.deliver(*result)
        self._keep(lambda job: not job.live.decoder.done)

    def _keep(self, keep: Callable[[Job], bool]) -> None:
        """Keep the decoding requests for which `keep` holds (the others leave the batch, their slots in
        the pool given back)."""
        kept = []
        for job in self.decoding:
            if keep(job):
                kept.append(job)
            else:
                job.live.decoder.close()
        self.decoding = kept
        self._count()

    def _count(self) -> None:
        self.metrics.decoding.set(len(self.decoding))
        self.metrics.decode_bytes.set(self.pool.nbytes)

    def _advance(self, jobs: list[Job]) -> list[tuple[list[Step], Answer | None] | Exception]:
        """On the engine's thread: one batched decoding step, and the answers of those it completed (a
        request's own failure in place of its result)."""
        joining = [bool(job.live.decoder.tail) for job in jobs]  # joined requests whose tail this step feeds
        released = decode_together([job.live.decoder for job in jobs])
        for job, fed in zip(jobs, joining):
            if fed:
                job.live = self.generator.entered(job.live)
        return [
            r if isinstance(r, Exception) else (r, self.generator.finish(job.live) if job.live.decoder.done else None)
            for job, r in zip(jobs, released)
        ]
