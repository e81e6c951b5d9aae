"""How close cached-neighbour caches come to the recomputed-text neighbour caches (issue 33 item 1): per chunk,
per context j (the cached-neighbour index stores one, behind all j), per layer, relative L2 of K and V against
the neighbours index's cache, for the cached_neighbours cache and for the chunk's behind-prefix cache moved to
the same position (what plain reuse reads)."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from rag_kvcache.config import Config, IndexSettings
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.ops import rotate_keys, rotation
from rag_kvcache.index import KVIndex

out = Path(sys.argv[1])
torch.set_num_threads(1)


def cfg(m):
    return Config(index=IndexSettings(chunk_tokens=128, chunk_prefill=m, codec="none"))


adapter = ModelAdapter.load(cfg("behind_prefix"))
nb = KVIndex.open(out / "index-neighbours", cfg("neighbours"), adapter)
cn = KVIndex.open(out / "index-cached_neighbours", cfg("cached_neighbours"), adapter)


def rel(x, ref):
    return float((x - ref).norm() / ref.norm())


rows = {}  # j -> list of per-chunk [layer] arrays
same = differ = 0
for chunk in nb.chunks.all_chunks():
    ids = chunk.token_ids
    near_nb, near_cn = (
        nb.addressing.neighbours.get(nb.addressing.neighbour_key(ids)),
        cn.addressing.neighbours.get(cn.addressing.neighbour_key(ids)),
    )
    if near_nb is None or near_nb != near_cn:
        differ += 1
        continue
    same += 1
    bp = cn.store.get(cn.addressing.key(ids))
    for nearest in cn.addressing.neighbour_sets(near_cn):  # the cached-neighbour caches the index stores
        j, ctx = len(nearest), cn.addressing.neighbour_context(nearest)
        ref, mine = nb.store.get(nb.addressing.key(ids, ctx)), cn.store.get(cn.addressing.key(ids, ctx))
        assert ref.position == mine.position == len(ctx)
        stats = []
        for layer in range(ref.n_layers):
            bp_k = rotate_keys(bp.keys[layer], *rotation(ref.position - bp.position, adapter.inv_freq))
            stats.append(
                [
                    rel(mine.keys[layer], ref.keys[layer]),
                    rel(bp_k, ref.keys[layer]),
                    rel(mine.values[layer], ref.values[layer]),
                    rel(bp.values[layer], ref.values[layer]),
                ]
            )
        rows.setdefault(j, []).append(stats)
summary = {"chunks_compared": same, "chunks_with_other_neighbours": differ}
for j, per_chunk in sorted(rows.items()):
    a = np.array(per_chunk)  # [chunks, layers, 4]
    summary[f"j={j}"] = {
        "n": len(per_chunk),
        "mean_over_layers": dict(
            zip(["K cached", "K behind_prefix", "V cached", "V behind_prefix"], a.mean((0, 1)).round(4).tolist())
        ),
        "last_layer": dict(
            zip(["K cached", "K behind_prefix", "V cached", "V behind_prefix"], a[:, -1].mean(0).round(4).tolist())
        ),
    }
print(json.dumps(summary, indent=1))
(out / "deviation.json").write_text(json.dumps(summary, indent=1))
