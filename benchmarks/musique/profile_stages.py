"""Per-stage profile of the fused prefill: each method's `fuse` on the same retrieved chunks of a few
MuSiQue questions, timed side by side (methods alternate within each repeat), with the share of
full's work its compute fraction implies.

    .venv/bin/python benchmarks/musique/profile_stages.py --data ../shared/data/musique_dev.json \
        --work /tmp/profile --questions 3 --repeats 2

On a GPU, with a random model of a given shape (benchmarks/gpu/random_llama.py) and `--profile` for the
operators' host and device times:

    python benchmarks/musique/profile_stages.py --data musique_dev.json --work /tmp/ps --questions 3 --repeats 5 \
        --model /tmp/llama-1b --device cuda --dtype bfloat16 --threads 8 --profile

The passages are written under --work at run time (never committed). Time only on a quiet machine:
two threads that share their cores with another job report that job's load, not the code.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from rag_kvcache import Config, FusedGenerator, FusionConfig, IndexSettings, KVIndex, QueryConfig, RuntimeConfig
from rag_kvcache.bench.corpus import write_question_passages
from rag_kvcache.bench.datasets import load_musique
from rag_kvcache.cli.common import model_process
from rag_kvcache.config import CHUNK_PREFILLS, StorageConfig
from rag_kvcache.engine.graphs import LayerGraphs

METHODS = ("full", "prefix", "reuse", "epic", "cacheblend", "cacheblend_repick")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="MuSiQue JSON (a list of questions with ctxs)")
    parser.add_argument("--work", type=Path, required=True, help="where the passages and the index go")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=6, help="chunks per prompt (512 tokens each)")
    parser.add_argument(
        "--model", default=IndexSettings.model, help="the LLM (a local folder: benchmarks/gpu/random_llama.py)"
    )
    parser.add_argument("--embedder", default=IndexSettings.embedder)
    parser.add_argument("--chunk-prefill", default=IndexSettings.chunk_prefill, choices=CHUNK_PREFILLS)
    parser.add_argument("--device", default=RuntimeConfig.device)
    parser.add_argument("--dtype", default=IndexSettings.dtype)
    parser.add_argument(
        "--prefetch-layers",
        type=int,
        default=StorageConfig.prefetch_layers,
        help="layers the reader thread reads ahead (0: read in the fusion's thread)",
    )
    parser.add_argument(
        "--memory-mib",
        type=int,
        default=StorageConfig.memory_bytes >> 20,
        help="the memory tier's budget (a prompt's caches must fit it for the timed runs to hit it)",
    )
    parser.add_argument(
        "--memory-on-device",
        action="store_true",
        help="keep the memory tier on the model's device (a GPU's memory), not in host memory",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, full first")
    parser.add_argument(
        "--epic-k",
        type=int,
        default=FusionConfig.epic_k,
        help="EPIC's recomputed leading tokens per chunk (default: an eighth of the chunk size, 64; the paper's: 16)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also run each method once more under torch.profiler and print its top operators "
        "(on CUDA: host time against device time, i.e. launch-bound or compute-bound)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_process()  # as every CLI command that loads a model: cuDNN attention off on CUDA
    logging.basicConfig(level=logging.WARNING)

    data = load_musique(args.data)[: args.questions]
    docs = args.work / "docs"
    write_question_passages(data, docs)
    cfg = Config(
        index=IndexSettings(
            chunk_tokens=512,
            model=args.model,
            embedder=args.embedder,
            dtype=args.dtype,
            chunk_prefill=args.chunk_prefill,
        ),
        query=QueryConfig(top_k=args.top_k),
        runtime=RuntimeConfig(
            device=args.device,
            storage=StorageConfig(
                prefetch_layers=args.prefetch_layers,
                memory_bytes=args.memory_mib << 20,
                memory_on_device=args.memory_on_device,
            ),
        ),
    )
    index = KVIndex.build(docs, args.work / "index", cfg, progress=False)
    generator = FusedGenerator(index)
    fmt = index.format

    methods = args.methods.split(",")
    if methods[0] != "full" or not set(methods) <= set(METHODS):
        parser.error(f"--methods {args.methods!r}: full first, then any of {', '.join(METHODS[1:])}")
    adapter = index.adapter
    captured = adapter.graphs  # on CUDA: the settled layers as captured graphs (RuntimeConfig.cuda_graphs)
    variants = [(m, m, captured) for m in methods]  # (row, method, graphs)
    if captured is not None:  # each fused method also with its attention's keys in one part, and op by op
        whole = LayerGraphs(adapter, captured.limit, processors=0)
        variants += [(f"{m} (keys in one part)", m, whole) for m in methods[1:]]
        variants += [(f"{m} (op by op)", m, None) for m in methods[1:]]

    def fuse(method: str, graphs) -> object:
        adapter.graphs = graphs
        return generator.fuse(segments, FusionConfig(method=method, epic_k=args.epic_k))

    runs: dict[str, list] = {row: [] for row, _, _ in variants}
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for example in data:
        hits = index.search(example.question, args.top_k)
        segments = fmt.segments(
            [h.chunk.token_ids for h in hits], fmt.question_ids(adapter.tokenizer, example.question)
        )
        for _, method, graphs in variants:  # warm-up: first touch of the caches and the kernels, graphs captured
            fuse(method, graphs)
        for _ in range(args.repeats):
            for row, method, graphs in variants:
                t0 = time.perf_counter()
                fused = fuse(method, graphs)
                fused.result.logits.argmax().item()  # on CUDA: wait for the device, as sampling the first token does
                runs[row].append(
                    (time.perf_counter() - t0, fused.result.stages, fused.result.compute_fraction, fused.prompt_tokens)
                )

    dispatched = {}  # row -> PyTorch operators dispatched per layer, the host's work the issue counts
    n_layers = adapter.layout.n_layers
    for row, method, graphs in variants:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fuse(method, graphs)  # the last question's prompt
        dispatched[row] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / n_layers
        if args.profile:
            with torch.profiler.profile(activities=torch.profiler.supported_activities()) as prof:
                fuse(method, graphs)
            sort = "self_cuda_time_total" if adapter.device.type == "cuda" else "self_cpu_time_total"
            events = prof.key_averages()
            busy = sum(e.self_device_time_total for e in events) / 1e3  # ms in device kernels and copies
            print(f"\n## {row}: {busy:.2f} ms of device time\n" + events.table(sort_by=sort, row_limit=12))

    full_s = statistics.median(r[0] for r in runs["full"])
    tier = f"memory tier on {index.store.memory.device} ({index.store.memory.nbytes >> 20} MiB held)"
    print(
        f"{tier}; {args.questions} questions x {args.repeats} repeats, prompts of {statistics.median(r[3] for r in runs['full']):.0f} "
        f"tokens (median), {args.threads} threads, load average {load_before} before the timed runs, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after"
    )
    print(
        "| method | fuse (ms) | speedup | compute fraction | time / (fraction x full) | aten ops / layer | stages (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for row, rows in runs.items():
        seconds = statistics.median(r[0] for r in rows)
        fraction = statistics.mean(r[2] for r in rows)
        stages = {name: statistics.median(r[1].get(name, 0.0) for r in rows) for name in rows[0][1]}
        print(
            f"| {row} | {seconds * 1e3:.1f} | {full_s / seconds:.1f}x | {fraction:.3f} | "
            f"{seconds / (fraction * full_s):.2f} | {dispatched[row]:.0f} | "
            + " ".join(f"{k}={v * 1e3:.1f}" for k, v in stages.items())
            + " |"
        )


if __name__ == "__main__":
    main()
