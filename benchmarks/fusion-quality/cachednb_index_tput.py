"""Indexing throughput of chunk_prefill behind_prefix, cached_neighbours, neighbours over the same documents
(issue 33 item 1): one index each, built from scratch, each preceded by a plain-forward measurement."""

import json
import sys
import time
from pathlib import Path

import torch

from rag_kvcache.bench.corpus import forward_throughput
from rag_kvcache.config import Config, IndexSettings
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.index import KVIndex

docs, out = Path(sys.argv[1]), Path(sys.argv[2])
modes = sys.argv[3].split(",")
torch.set_num_threads(2)
base = Config(index=IndexSettings(chunk_tokens=128, codec="none"))
adapter = ModelAdapter.load(base)
rows = {}
for mode in modes:
    cfg = Config(index=IndexSettings(chunk_tokens=128, chunk_prefill=mode, codec="none"))
    fwd = forward_throughput(adapter)
    index = KVIndex.create(out / f"index-{mode}", cfg, adapter)
    t0 = time.perf_counter()
    report = index.update(docs, progress=False)
    s = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in report.new_chunks)
    rows[mode] = {
        "chunks": len(report.new_chunks),
        "tokens": tokens,
        "seconds": s,
        "tokens_per_s": tokens / s,
        "forward_tokens_per_s": fwd,
        "fraction_of_forward": tokens / s / fwd,
        "caches": len(index.maker.live_keys()),
    }
    print(mode, json.dumps(rows[mode]), flush=True)
(out / "index_tput.json").write_text(json.dumps(rows, indent=1))
