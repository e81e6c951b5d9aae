"""Computing chunk caches at indexing time: forward passes over packs of chunks, each cache handed to
a writer thread so the next pack's compute does not wait for the disk.

A pack is several chunks end to end in one forward (`ModelAdapter.prefill_packed`): projections and
MLPs run once over all their tokens, each chunk attends over the context and itself alone, at its
own positions, so nothing is padded and a short chunk costs what its share of a long forward costs
(on SmolLM2-135M over MuSiQue's ~300-token chunks: 1.02-1.05x a 512-token forward's tokens per CPU
second, against 0.93-0.97x chunk by chunk; `benchmarks/scale/README.md`).
A chunk's cache comes out bit for bit the same whatever other chunks share its pack (rows of a
matmul are computed independently, and its attention is its own; but MKL computes a matmul of at most
3 rows with another kernel, so a chunk of 1-3 tokens forwarded alone differs by ~1e-7 from the same
chunk in a pack). A Ray cluster is dealt the packs a local run makes, so an index built on one
process or spread over a cluster stores identical caches, given the same torch thread count (for
another, BLAS may pick other kernels on small shapes: a 3-token chunk's cache differed by 7e-8
between 1 and 2 threads). The writer keeps at most `depth` caches waiting (memory stays bounded); a
failed write (`StorageFullError`) is raised to the caller at the next `put` or at `flush`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from ..config import Config
from ..engine.cache import ChunkKV
from ..engine.model import ModelAdapter
from ..store.kvstore import KVStore

log = logging.getLogger(__name__)

PACK_CHUNKS = 4  # a packed forward holds at most this many full chunks' worth of tokens


def pack_tokens(config: Config) -> int:
    """The most tokens a packed forward holds for an index of `config` (2,048 for 512-token chunks)."""
    return PACK_CHUNKS * config.chunk_tokens


def compute_caches(
    adapter: ModelAdapter, chunks: Sequence[tuple[int, ...]], context: tuple[int, ...], max_tokens: int
) -> Iterator[tuple[int, ChunkKV]]:
    """Prefill each chunk behind `context`, in packs of at most `max_tokens` tokens (`token_packs`);
    yields (index in `chunks`, cache)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
    if not chunks:
        return
    past = adapter.prefill_packed([context])[0] if context else None  # L x [H_kv, P, D] each
    for pack in token_packs(chunks, max_tokens):
        for i, (keys, values) in zip(pack, adapter.prefill_packed([chunks[i] for i in pack], past)):
            yield i, ChunkKV(keys, values, len(context))


def token_packs(chunks: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Indices of `chunks` in packs of consecutive chunks of at most `max_tokens` tokens together (a
    longer chunk is a pack of its own)."""
    packs: list[list[int]] = []
    size = 0
    for i, ids in enumerate(chunks):
        if not packs or size + len(ids) > max_tokens:
            packs.append([])
            size = 0
        packs[-1].append(i)
        size += len(ids)
    return packs


class WriteBehind:
    """Stores caches into a `KVStore` on one background thread, at most `depth` waiting.

    `put` returns at once unless `depth` writes are pending (then it waits for the oldest); `flush`
    waits for all of them. Either raises the first error a write raised. Leaving a `with` block
    flushes; when the block raised, the pending writes are still completed (each is a whole entry)
    and the block's error is the one raised.
    """

    def __init__(self, store: KVStore, depth: int = 4) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth!r}")
        self.store = store
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-writer")
        self._pending: deque[Future[None]] = deque()

    def put(self, key: str, kv: ChunkKV) -> None:
        while len(self._pending) >= self.depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self.store.put, key, kv))

    def flush(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except Exception as write_error:  # the block's own error is the one the caller must see
            log.warning("a KV cache write failed while indexing was being aborted: %s", write_error)
