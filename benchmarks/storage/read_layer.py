"""The store's read path on its own: `pack_layer` over six stored chunk caches, layer by layer, as the
fusion's reader thread calls it, and one `Entry.layer`, at a chosen cache shape and codec (entries read
through the page cache: the memory tier is off). Prints medians in microseconds, and the PyTorch operators
`pack_layer` dispatches a layer (`torch.profiler`): the host work, which unlike the time does not move with
the machine's load.

    python benchmarks/storage/read_layer.py --work /tmp/read-layer --codec int8-channel
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from rag_kvcache.config import StorageConfig
from rag_kvcache.engine.cache import ChunkKV, pack_layer
from rag_kvcache.store.kvstore import KVStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="where the store is written (emptied first)")
    parser.add_argument("--codec", default=StorageConfig.codec, help="a codec name (StorageConfig validates it)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--segments", type=int, default=6, help="chunk caches per prompt")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    shutil.rmtree(args.work, ignore_errors=True)
    store = KVStore(args.work, args.codec, StorageConfig(memory_bytes=0))
    g = torch.Generator().manual_seed(0)
    shape = (args.kv_heads, args.tokens, args.head_dim)
    keys = [f"{i:032x}" for i in range(args.segments)]
    for key in keys:
        store.put(
            key,
            ChunkKV(
                [torch.randn(shape, generator=g) for _ in range(args.layers)],
                [torch.randn(shape, generator=g) for _ in range(args.layers)],
                0,
            ),
        )
    packs, layers = [], []
    with torch.inference_mode():
        for _ in range(args.repeats):
            sources = [store.open(key) for key in keys]
            start = time.perf_counter()
            for layer in range(args.layers):
                pack_layer(sources, layer, "cpu")
            packs.append((time.perf_counter() - start) / args.layers)
            entry = store.open(keys[0])
            start = time.perf_counter()
            for layer in range(args.layers):
                entry.layer(layer)
            layers.append((time.perf_counter() - start) / args.layers)
        sources = [store.open(key) for key in keys]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for layer in range(args.layers):
                pack_layer(sources, layer, "cpu")
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / args.layers
    print(
        f"codec {args.codec}, {args.segments} segments of {shape} x {args.layers} layers, {args.threads} threads: "
        f"pack_layer {statistics.median(packs) * 1e6:.0f} us a layer, Entry.layer {statistics.median(layers) * 1e6:.0f} us, "
        f"{ops:.0f} aten ops a layer"
    )


if __name__ == "__main__":
    main()
