"""Computing chunk caches at indexing time: forward passes over packs of chunks, each cache encoded and
handed to a writer thread so the next pack's compute does not wait for the disk.

A pack is several chunks end to end in one forward (`ModelSpec.prefill_packed`): projections and
MLPs run once over all their tokens, each chunk attends over the context and itself alone, at its
own positions, so nothing is padded and a short chunk costs what its share of a long forward costs
(on SmolLM2-135M over MuSiQue's ~300-token chunks: 1.02-1.05x a 512-token forward's tokens per CPU
second, against 0.93-0.97x chunk by chunk; `benchmarks/scale/README.md`).
A chunk's cache comes out the same, to float rounding, whatever other chunks share its pack (rows of a
matmul are computed independently, and its attention is its own), not always bit for bit: a BLAS picks its
kernel and blocking by the matmul's shape (MKL takes another kernel for at most 3 rows; on an AVX-512 machine
chunks packed together and forwarded alone differed by up to 1.5e-7). A Ray cluster is dealt the packs a local
run makes, so an index built on one
process or spread over a cluster stores identical caches, given the same torch thread count (for
another, BLAS may pick other kernels on small shapes: a 3-token chunk's cache differed by 7e-8
between 1 and 2 threads). The writer keeps at most `depth` caches waiting (memory stays bounded); a
failed write (`StorageFullError`) is raised to the caller at the next `put` or at `flush`.

`compute_grouped` prefills groups of chunks, each group one sequence behind a context, and cuts each chunk's
cache from its group's K/V (`chunk_prefill="grouped"`).

`compute_behind_cached` prefills a chunk behind a context read from caches instead of recomputed from
its text (`chunk_prefill="cached_neighbours"`): the context's K/V are stored caches laid end to end,
each one's keys re-rotated to the positions it takes there (`cached_context`), so only the chunk's own
tokens (and a short tail before it, such as a separator) are computed, attending to the longer context.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

import torch

from ..config import Config
from ..engine.cache import ChunkKV, LayerSource
from ..engine.ops import rotate_keys, rotation
from ..engine.spec import ModelSpec, Pause
from ..store.backend import encode_entry
from ..store.kvstore import KVStore

log = logging.getLogger(__name__)

PACK_CHUNKS = 4  # a packed forward holds at most this many full chunks' worth of tokens


def pack_tokens(config: Config) -> int:
    """The most tokens a packed forward holds for an index of `config` (2,048 for 512-token chunks)."""
    return PACK_CHUNKS * config.index.chunk_tokens


def compute_caches(
    adapter: ModelSpec,
    chunks: Sequence[tuple[int, ...]],
    context: tuple[int, ...],
    max_tokens: int,
    pause: Pause | None = None,
) -> Iterator[tuple[int, ChunkKV]]:
    """Prefill each chunk behind `context`, in packs of at most `max_tokens` tokens (`token_packs`);
    yields (index in `chunks`, cache). `pause`: called before each layer (`ModelSpec.prefill_packed`)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
    if not chunks:
        return
    past = adapter.prefill_packed([context], pause=pause)[0] if context else None  # L x [H_kv, P, D] each
    for pack in token_packs(chunks, max_tokens):
        for i, (keys, values) in zip(pack, adapter.prefill_packed([chunks[i] for i in pack], past, pause)):
            yield i, ChunkKV(keys, values, len(context))


def group_sequence(group: Sequence[tuple[int, ...]], separator: tuple[int, ...]) -> tuple[int, ...]:
    """A group's chunks laid out as a prompt lays chunks out: `separator` between two."""
    return tuple(t for k, ids in enumerate(group) for t in (*(separator if k else ()), *ids))


def compute_grouped(
    adapter: ModelSpec,
    groups: Sequence[Sequence[tuple[int, ...]]],
    past: tuple[list[torch.Tensor], list[torch.Tensor]],
    separator: tuple[int, ...],
    max_tokens: int,
) -> Iterator[tuple[tuple[int, ...], ChunkKV]]:
    """Prefill each group of chunks behind `past` (a context's per-layer K/V [H_kv, P, D]) as one sequence,
    laid out as a prompt lays chunks out (`separator` between two), the groups in packs of at most
    `max_tokens` tokens (`token_packs`); yields each chunk's ids and its cache, cut from its group's K/V:
    the chunk computed behind the context and the chunks before it in its group."""
    p = past[0][0].shape[1]
    sequences = [group_sequence(g, separator) for g in groups]
    for pack in token_packs(sequences, max_tokens):
        for g, (keys, values) in zip(pack, adapter.prefill_packed([sequences[g] for g in pack], past)):
            start = 0  # where the chunk starts in its group's sequence
            for k, ids in enumerate(groups[g]):
                start += len(separator) if k else 0
                cut = slice(start, start + len(ids))
                yield (
                    ids,
                    ChunkKV(
                        [x[:, cut].contiguous() for x in keys],  # L x [H_kv, T, D]
                        [x[:, cut].contiguous() for x in values],  # L x [H_kv, T, D]
                        p + start,
                    ),
                )
                start += len(ids)


def cached_context(
    sources: Sequence[LayerSource],
    inv_freq: torch.Tensor,
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer K/V [H_kv, P, D] of a context made of cached sequences: `sources` laid end to end from
    position 0, each one's keys moved from the position it was computed at to the one it takes here (one
    `rotation` per source, made once and applied to every layer; RoPE composes, so a source already in
    place is exact). Nothing is computed but the rotations."""
    if not sources:
        raise ValueError("a cached context needs at least one cached sequence, got none")
    layers = {s.n_layers for s in sources}
    if len(layers) != 1:
        raise ValueError(f"the cached sequences of a context have different layer counts {sorted(layers)}")
    starts = [0]
    for s in sources[:-1]:
        starts.append(starts[-1] + s.n_tokens)
    freq = inv_freq.to(device)  # [D/2]
    turns = [None if s.position == at else rotation(at - s.position, freq) for s, at in zip(sources, starts)]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(layers.pop()):
        read = [s.layer(layer) for s in sources]  # per source: [H_kv, T_i, D] x 2
        ks = [k.to(device, dtype) for k, _ in read]  # [H_kv, T_i, D]
        keys.append(torch.cat([k if t is None else rotate_keys(k, *t) for k, t in zip(ks, turns)], 1))  # [H_kv, P, D]
        values.append(torch.cat([v.to(device, dtype) for _, v in read], 1))  # [H_kv, P, D]
    return keys, values


def compute_behind_cached(
    adapter: ModelSpec,
    chunk: Sequence[int],
    sources: Sequence[LayerSource],
    tail: Sequence[int] = (),
    pause: Pause | None = None,
) -> ChunkKV:
    """The cache of `chunk` computed behind a context read from caches (`cached_context` of `sources`) and
    then the `tail` tokens, which are computed in the same forward as the chunk (one `prefill_packed` over
    tail + chunk) and dropped from the result: the chunk's keys/values [H_kv, T, D] at positions
    P + len(tail) onwards. Where `sources` hold exactly what a prefill of their tokens gives, this equals
    `compute_caches` behind their tokens and the tail, to float tolerance. `pause`: called before each layer."""
    if not chunk:
        raise ValueError("compute_behind_cached needs a non-empty chunk, got 0 tokens")
    past = cached_context(sources, adapter.inv_freq, adapter.device, adapter.dtype)  # L x [H_kv, P, D] each
    ((keys, values),) = adapter.prefill_packed([(*tail, *chunk)], past, pause)  # L x [H_kv, len(tail) + T, D]
    t = len(tail)
    return ChunkKV(
        [k[:, t:].contiguous() for k in keys], [v[:, t:].contiguous() for v in values], past[0][0].shape[1] + t
    )


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
    """Stores caches into a `KVStore`: each is encoded on the caller's thread, and written (file writes,
    `fsync`s, a remote tier's round trip) on one background thread, at most `depth` waiting.

    The encoding is CPU work: on a background thread it would preempt one of the compute's OpenMP threads,
    and both would wait at the next barrier (on 2 cores, several times its own CPU time). The writes wait on
    the disk or the network, which the compute should not.

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
        self._pending: deque[Future[bool]] = deque()

    def put(self, key: str, kv: ChunkKV) -> None:
        while len(self._pending) >= self.depth:
            self._pending.popleft().result()
        data = encode_entry(kv, self.store.codec)  # on the caller's thread: see the class's docstring
        self._pending.append(self._pool.submit(self.store.write, key, data, kv.n_tokens))

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
