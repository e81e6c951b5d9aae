"""A neighbour pass over the upper layers only (issue 33, session 50): can the neighbour cache be made for less than
the shipped pass by recomputing only layers L0.. behind the neighbours?

A chunk's hidden state at layer L0 is its behind-prefix pass's (the layers below L0 computed behind the prefix's
cache alone, as indexing computes a chunk's first cache: here recomputed, untimed); layers L0.. are computed again,
the chunk attending there over the context the shipped pass reads (the prefix's cache, each neighbour's
behind-prefix cache re-rotated into place, the separator's cache between two; the separator before the chunk
computed, every layer, as the shipped pass computes it). The cache it would store: the behind-prefix cache below
L0, the mean of the late pass's and the behind-prefix cache from L0 up (at L0 = 0 the shipped mean, exactly).

Printed: per layer, how far the shipped mean is from the behind-prefix cache (relative L2, keys and values); per L0,
the late pass's time a chunk against the shipped pass's (`CacheRecipe.behind_neighbours`) on the same chunks, and
how far its mean is from the shipped one, over the behind-prefix cache's distance to it (0: the shipped mean; 1:
no nearer than the behind-prefix cache).

usage: late_neighbour_pass.py INDEX N_CHUNKS L0[,L0...]   (INDEX: a `cached_neighbours` index's folder)
"""

import sys
import time
from pathlib import Path

import torch

from rag_kvcache.engine.cache import BlendKV, ChunkKV, LayerSource, all_layers
from rag_kvcache.engine.ops import attention_plan, causal_attend, rope_cos_sin, rotate_keys, rotation
from rag_kvcache.engine.spec import ModelSpec
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.precompute import cached_context

Past = tuple[list[torch.Tensor], list[torch.Tensor]]


@torch.inference_mode()
def run_layers(
    adapter: ModelSpec, h: torch.Tensor, past: Past, start: int, layers: range
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """`layers` of a sequence whose hidden state at the first one's input is `h` [T, E], at positions start..,
    attending over `past` (K/V [H_kv, P, D], indexed by layer) and itself: its keys and values [H_kv, T, D] per
    layer, and its hidden state after the last one."""
    positions = torch.arange(start, start + h.shape[0])  # [T]
    cos, sin = rope_cos_sin(positions, adapter.inv_freq, adapter.dtype)  # [T, D]
    group = adapter.n_q_heads // adapter.layout.n_kv_heads
    plan = attention_plan(positions, start + h.shape[0], group, adapter.dtype)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in layers:
        q, k, v = adapter.qkv(layer, adapter.attention_input(layer, h), cos, sin)  # [H_q, T, D], [H_kv, T, D] x 2
        keys.append(k.contiguous())
        values.append(v.contiguous())
        if layer == adapter.layout.n_layers - 1:
            break
        k_all = torch.cat([past[0][layer], k], 1)  # [H_kv, P + T, D]
        v_all = torch.cat([past[1][layer], v], 1)  # [H_kv, P + T, D]
        h = adapter.finish(layer, h, causal_attend(q, k_all, v_all, plan, adapter.scale))  # [T, E]
    return keys, values, h


def at(cache: ChunkKV, position: int, inv_freq: torch.Tensor) -> ChunkKV:
    """`cache` with its keys re-rotated to start at `position`."""
    turn = rotation(position - cache.position, inv_freq)
    return ChunkKV([rotate_keys(k, *turn) for k in cache.keys], cache.values, position)


def late_mean(index: KVIndex, ids: tuple[int, ...], own: ChunkKV, l0: int) -> tuple[ChunkKV, float]:
    """Chunk `ids`'s mean made by a neighbour pass over layers `l0`.. (`own`: its behind-prefix cache, as stored),
    and the seconds that pass took."""
    adapter, recipe, addressing = index.adapter, index.maker.recipe, index.addressing
    prefix, sep = index.format.prefix_ids, index.format.separator_ids
    prefix_cache = recipe.cached(prefix, ())
    with torch.inference_mode():
        behind_prefix = cached_context([prefix_cache], adapter.inv_freq, adapter.device, adapter.dtype)
        _, _, h = run_layers(adapter, adapter.embed(torch.tensor(ids)), behind_prefix, len(prefix), range(l0))  # [T, E]
        t = time.perf_counter()
        between = [recipe.cached(sep, prefix)] if sep else []
        sources: list[LayerSource] = [prefix_cache]
        for i, n in enumerate(reversed(addressing.near(ids))):
            sources += [*(between if i else []), recipe.cached(tuple(n), prefix)]
        past = cached_context(sources, adapter.inv_freq, adapter.device, adapter.dtype)  # L x [H_kv, P, D] each
        p = past[0][0].shape[1]
        if sep:  # the separator before the chunk: every layer behind the context, as the shipped pass computes it
            _, _, h_sep = run_layers(adapter, adapter.embed(torch.tensor(sep)), past, p, range(l0))  # [S, E]
            h = torch.cat([h_sep, h])  # [S + T, E]
        keys, values, _ = run_layers(adapter, h, past, p, range(l0, adapter.layout.n_layers))
        seconds = time.perf_counter() - t
    s = len(sep)
    below = at(own, p + s, adapter.inv_freq)
    late = ChunkKV(
        below.keys[:l0] + [k[:, s:] for k in keys],  # L x [H_kv, T, D]
        below.values[:l0] + [v[:, s:] for v in values],  # L x [H_kv, T, D]
        p + s,
    )
    return ChunkKV.viewing(all_layers(BlendKV((late, own), adapter.inv_freq)), late.position), seconds


def main() -> None:
    folder, n_chunks, l0s = Path(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
    torch.set_num_threads(2)
    index = KVIndex.open(folder)
    addressing, adapter = index.addressing, index.adapter
    chunks = [c.token_ids for c in index.chunks.all_chunks() if addressing.near(c.token_ids)][:n_chunks]
    stored: list[ChunkKV] = []  # each chunk's behind-prefix cache, read once
    shipped: list[ChunkKV] = []
    own: list[ChunkKV] = []  # the behind-prefix cache at the shipped mean's positions
    shipped_s = 0.0
    for ids in chunks:
        clean = index.store.get(addressing.key(ids))
        if clean is None:
            raise SystemExit(f"the index has no behind-prefix cache of a chunk of {len(ids)} tokens")
        stored.append(clean)
        t = time.perf_counter()
        nb = index.maker.recipe.behind_neighbours(ids, addressing.near(ids))
        shipped_s += time.perf_counter() - t
        shipped.append(ChunkKV.viewing(all_layers(BlendKV((nb, clean), adapter.inv_freq)), nb.position))
        own.append(at(clean, nb.position, adapter.inv_freq))
    tokens = sum(len(ids) for ids in chunks)
    print(
        f"{len(chunks)} chunks, {tokens} tokens; shipped neighbour pass {shipped_s / len(chunks) * 1e3:.1f} ms a chunk"
    )
    rel = [
        torch.tensor(
            [
                [float((x.layer(i)[j] - y.layer(i)[j]).norm() / y.layer(i)[j].norm()) for j in (0, 1)]
                for i in range(x.n_layers)
            ]
        )
        for x, y in zip(shipped, own)
    ]  # per chunk [L, 2]
    for layer, (k, v) in enumerate(torch.stack(rel).mean(0).tolist()):
        print(f"layer {layer:2d}: shipped mean vs behind-prefix cache, keys {k:.3f} values {v:.3f}")
    refs = [all_layers(ref).float() for ref in shipped]  # per chunk [L, 2, H_kv, T, D]
    bases = [float((all_layers(o).float() - ref).norm()) for o, ref in zip(own, refs)]  # the behind-prefix cache's
    for l0 in l0s:
        seconds, distance = 0.0, 0.0
        for ids, clean, ref, base in zip(chunks, stored, refs, bases):
            mean, s = late_mean(index, ids, clean, l0)
            seconds += s
            distance += float((all_layers(mean).float() - ref).norm()) / base
        print(
            f"L0={l0}: late pass {seconds / len(chunks) * 1e3:.1f} ms a chunk ({seconds / shipped_s:.2f}x the shipped "
            f"pass); distance to the shipped mean / the behind-prefix cache's {distance / len(chunks):.3f}"
        )


if __name__ == "__main__":
    main()
