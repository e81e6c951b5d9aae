"""Computing chunk caches at indexing time: forward passes over batches of equal-length chunks, each
cache handed to a writer thread so the next batch's compute does not wait for the disk.

Batches hold chunks of one length only: a batch needs no padding and no attention mask, and a
chunk's cache comes out bit for bit the same whatever other chunks share its batch (the rows of a
batched matmul are computed independently), so an index built on one process or spread over a
cluster stores identical caches, given the same torch thread count (for another, BLAS may pick other
kernels on small shapes: a 3-token chunk's cache differed by 7e-8 between 1 and 2 threads). Padding
chunks of other lengths into one batch would change them (by ~3e-5 on SmolLM2-135M). The writer
keeps at most `depth` caches waiting (memory stays bounded); a failed write (`StorageFullError`) is
raised to the caller at the next `put` or at `flush`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

import torch

from ..engine.cache import ChunkKV
from ..engine.model import ModelAdapter
from ..store.kvstore import KVStore

log = logging.getLogger(__name__)


def compute_caches(
    adapter: ModelAdapter, chunks: Sequence[tuple[int, ...]], context: tuple[int, ...], batch_size: int = 4
) -> Iterator[tuple[int, ChunkKV]]:
    """Prefill each chunk behind `context`, `batch_size` chunks of one length per forward pass;
    yields (index in `chunks`, cache)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    if not chunks:
        return
    past = adapter.prefill(torch.tensor([context]))[:2] if context else None
    for batch in equal_length_batches(chunks, batch_size):
        ids = torch.tensor([chunks[i] for i in batch])  # [B, T]
        batch_past = None if past is None else tuple([t.expand(len(batch), -1, -1, -1) for t in p] for p in past)
        keys, values, _ = adapter.prefill(ids, batch_past)  # L x [B, H_kv, T, D]
        for j, i in enumerate(batch):
            yield i, ChunkKV([k[j] for k in keys], [v[j] for v in values], len(context))


def equal_length_batches(chunks: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Indices of `chunks` in batches of at most `batch_size` chunks of one length, longest first."""
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(chunks):
        by_length.setdefault(len(ids), []).append(i)
    return [group[s : s + batch_size] for _, group in sorted(by_length.items(), reverse=True)
            for s in range(0, len(group), batch_size)]


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
