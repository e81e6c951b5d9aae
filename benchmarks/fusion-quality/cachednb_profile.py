"""Where the time of cached-neighbour contexts goes: a few chunks' contexts recomputed (caches exist), profiled."""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

from rag_kvcache.config import Config, IndexSettings
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.precompute import cached_context

torch.set_num_threads(2)
cfg = Config(index=IndexSettings(chunk_tokens=128, chunk_prefill="cached_neighbours", codec="none"))
adapter = ModelAdapter.load(cfg)
idx = KVIndex.open(Path(sys.argv[1]) / "index-cached_neighbours", cfg, adapter)
chunks = [c for c in idx.chunks.all_chunks()][:6]
work = [(c.token_ids, idx.addressing.neighbours[idx.addressing.neighbour_key(c.token_ids)]) for c in chunks]
idx.maker.recipe.behind_neighbours(*work[0][:1], work[0][1][:1])  # warm
t = time.perf_counter()
pr = cProfile.Profile()
pr.enable()
n = 0
for ids, near in work:
    for j in range(1, len(near) + 1):
        idx.maker.recipe.behind_neighbours(ids, near[:j])
        n += len(ids)
pr.disable()
s = time.perf_counter() - t
print(f"cached contexts: {n} chunk tokens in {s:.1f} s = {n / s:.1f} tok/s")
t = time.perf_counter()
m = 0
for ids, near in work:
    for j in range(1, len(near) + 1):
        adapter.prefill_packed([ids])
        m += len(ids)
print(f"plain single-chunk forwards: {m / (time.perf_counter() - t):.1f} tok/s")
t = time.perf_counter()
for ids, near in work[:2]:
    prefix, sep = idx.format.prefix_ids, idx.format.separator_ids
    srcs = [idx.maker.recipe.cached(prefix, ())] + [idx.maker.recipe.cached(tuple(x), prefix) for x in near]
    cached_context(srcs, adapter.inv_freq, adapter.device, adapter.dtype)
print(f"cached_context alone (2 contexts of 3 neighbours): {time.perf_counter() - t:.2f} s")
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
