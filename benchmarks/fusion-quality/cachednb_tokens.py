import json
import sys
from pathlib import Path

from rag_kvcache.config import Config, IndexSettings
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.index import KVIndex

out = Path(sys.argv[1])


def cfg(m):
    return Config(index=IndexSettings(chunk_tokens=128, chunk_prefill=m, codec="none"))


a = ModelAdapter.load(cfg("neighbours"))
nb = KVIndex.open(out / "index-neighbours", cfg("neighbours"), a)
uniq = {c.token_ids for c in nb.chunks.all_chunks()}
base = sum(map(len, uniq))
near = {ids: nb.addressing.neighbours[nb.addressing.neighbour_key(ids)] for ids in uniq}
ctxs = [(ids, ctx) for ids in uniq for ctx in nb.addressing.neighbour_contexts(near[ids])]
text = sum(len(ctx) + len(ids) for ids, ctx in ctxs)
cached = sum(len(ids) + len(nb.format.separator_ids) for ids in uniq if near[ids])  # one context a chunk
r = {
    "unique_chunk_tokens": base,
    "contexts": len(ctxs),
    "prefix_tokens": len(nb.format.prefix_ids),
    "separator_tokens": len(nb.format.separator_ids),
    "computed_tokens": {"behind_prefix": base, "neighbours": base + text, "cached_neighbours": base + cached},
    "x_behind_prefix": {
        "neighbours": round((base + text) / base, 2),
        "cached_neighbours": round((base + cached) / base, 2),
    },
}
print(json.dumps(r, indent=1))
(out / "tokens.json").write_text(json.dumps(r, indent=1))
