"""Indexing throughput against the model's plain forward throughput, side by side in one run.

    .venv/bin/python benchmarks/scale/throughput.py --data ../shared/data/musique_dev.json --out /tmp/scale-throughput

Writes the distinct passages of the first `--questions` MuSiQue questions (read at run time, never
committed) as documents, split into `--rounds` folders, and loads the default model (SmolLM2-135M-Instruct,
fp32, 512-token chunks). Each round times, back to back:

1. the plain forward: `--forwards` transformers forwards over one 512-token input each (`adapter.prefill`,
   batch 1, keys and values kept, only the last token's logits), before and after step 2;
2. indexing one folder into the index (`KVIndex.update`: reading, chunking, embedding, KV precompute
   with the writes behind it, commit), counted in chunk tokens per second;
3. the indexing forward alone over the same chunks (`compute_caches`, packed behind the prefix as
   indexing does; no embedding, nothing stored): how much of the gap is the model on these chunks and
   how much the rest of indexing.

The ratio of each round is its indexing rate over the mean of its two forward rates; rounds pair the
two measurements in time, so load from other processes on the machine hits both. Each rate is taken
twice: by wall-clock time, and by the CPU time of this process (all its threads, the writer's
included: `time.process_time`), which other processes' load does not inflate; the CPU-time ratio is
the work indexing does per token relative to the forward alone, the wall-clock one what a user waits
(fsync waits and writes not hidden count there only). `--threads` sets torch's threads (1 keeps a
loaded machine from stalling torch's parallel regions on a descheduled thread). Also reported: the
time the writer thread spent in `KVStore.put` (hidden behind the compute when it overlaps) and in the
embedder. With `--ray-workers 1 2`, the same folders are then indexed again into fresh indexes by that
many Ray actors on a local Ray cluster (one CPU each), and their tokens/s reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from rag_kvcache.bench.corpus import write_corpus
from rag_kvcache.bench.datasets import load_musique
from rag_kvcache.config import Config, IndexSettings, RuntimeConfig
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.precompute import compute_caches, pack_tokens
from rag_kvcache.retrieval.chunk_index import ChunkIndex
from rag_kvcache.store.kvstore import KVStore

SPENT: dict[str, float] = defaultdict(float)  # seconds inside the wrapped methods, per name


def _timed(cls: type, name: str) -> None:
    """Add the seconds spent in `cls.name` to SPENT[name] (whichever thread calls it)."""
    method = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - start

    setattr(cls, name, wrapper)


class Clock:
    """Wall-clock and process CPU seconds of a block."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def forward_rate(adapter: ModelAdapter, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """Tokens per wall-clock second and per CPU second of plain forwards over `inputs`."""
    with Clock() as clock:
        for ids in inputs:
            adapter.prefill(ids)
    tokens = sum(ids.shape[1] for ids in inputs)
    return tokens / clock.wall, tokens / clock.cpu


def split_corpus(data: Path, questions: int, rounds: int, work: Path) -> list[Path]:
    """The passages as documents, dealt round-robin into `rounds` folders (distinct names throughout)."""
    write_corpus(load_musique(data)[:questions], work / "all")
    files = sorted((work / "all").iterdir())
    folders = [work / f"round{r}" for r in range(rounds)]
    for r, folder in enumerate(folders):
        folder.mkdir()
        for f in files[r::rounds]:
            f.rename(folder / f.name)
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="musique_dev.json")
    parser.add_argument("--out", type=Path, required=True, help="work folder (emptied); results.json goes here")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--forwards", type=int, default=3, help="512-token forwards before and after each round")
    parser.add_argument("--ray-workers", type=int, nargs="*", default=[])
    parser.add_argument(
        "--chunk-prefill",
        default="behind_prefix",
        help="the index's caches (behind_prefix: one a chunk, the work the forward compares with; the default "
        "index's cached_neighbours makes two)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    folders = split_corpus(args.data, args.questions, args.rounds, args.out / "docs")
    config = Config(
        index=IndexSettings(chunk_prefill=args.chunk_prefill),
        runtime=RuntimeConfig(
            cache_dir=Path(os.environ.get("RAG_KVCACHE_CACHE_DIR", Path.home() / ".cache" / "rag-kvcache"))
        ),
    )
    adapter = ModelAdapter.load(config)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, adapter.model.config.vocab_size, (1, 512), generator=gen) for _ in range(args.forwards)]
    index = KVIndex.create(args.out / "index", config, adapter)
    forward_rate(adapter, inputs[:1])  # warm-up
    _timed(KVStore, "put")
    _timed(ChunkIndex, "_embed")

    rounds = []
    for folder in folders:
        before = forward_rate(adapter, inputs)
        SPENT.clear()
        with Clock() as clock:
            report = index.update(folder, progress=False)
        after = forward_rate(adapter, inputs)
        tokens = sum(len(c.token_ids) for c in report.new_chunks)
        wall, cpu = tokens / clock.wall, tokens / clock.cpu
        with Clock() as chunk_clock:  # the indexing forward alone: the same chunks, no embedding, nothing stored
            for _ in compute_caches(
                adapter, [c.token_ids for c in report.new_chunks], index.chunk_context, pack_tokens(config)
            ):
                pass
        chunk_forward = {"wall": tokens / chunk_clock.wall, "cpu": tokens / chunk_clock.cpu}
        rounds.append(
            {
                "documents": len(report.added),
                "chunks": len(report.new_chunks),
                "tokens": tokens,
                "wall_s": clock.wall,
                "cpu_s": clock.cpu,
                "index_tokens_per_s": {"wall": wall, "cpu": cpu},
                "forward_tokens_per_s": {"wall": [before[0], after[0]], "cpu": [before[1], after[1]]},
                "ratio": {
                    "wall": wall / statistics.mean([before[0], after[0]]),
                    "cpu": cpu / statistics.mean([before[1], after[1]]),
                },
                "chunk_forward_tokens_per_s": chunk_forward,
                "ratio_to_chunk_forward": {"wall": wall / chunk_forward["wall"], "cpu": cpu / chunk_forward["cpu"]},
                "write_s": SPENT["put"],
                "embed_s": SPENT["_embed"],
                "load_avg_1m": os.getloadavg()[0],
            }
        )
        print(
            f"{folder.name}: {tokens} tokens; indexing {wall:.0f} tok/s wall, {cpu:.0f} per CPU s; forward "
            f"{before[0]:.0f} / {after[0]:.0f} wall, {before[1]:.0f} / {after[1]:.0f} per CPU s; ratio "
            f"{rounds[-1]['ratio']['wall']:.2f} wall, {rounds[-1]['ratio']['cpu']:.2f} CPU; forward over the same chunks "
            f"{chunk_forward['wall']:.0f} wall, {chunk_forward['cpu']:.0f} per CPU s; writes "
            f"{SPENT['put']:.1f} s (writer thread), embedding {SPENT['_embed']:.1f} s of {clock.wall:.1f} s; "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )

    ray_runs = []
    if args.ray_workers:
        import ray

        ray.init(num_cpus=max(args.ray_workers), include_dashboard=False)
        for n in args.ray_workers:
            ray_index = KVIndex.create(
                args.out / f"index-ray{n}",
                Config(index=config.index, runtime=RuntimeConfig(ray_workers=n, cache_dir=config.runtime.cache_dir)),
                adapter,
            )
            with ray_index.ray_workers() as workers:
                before = forward_rate(adapter, inputs)
                with Clock() as clock:
                    tokens = sum(
                        len(c.token_ids)
                        for folder in folders
                        for c in ray_index.update(folder, progress=False, workers=workers).new_chunks
                    )
                after = forward_rate(adapter, inputs)
            ray_runs.append(
                {
                    "workers": n,
                    "tokens": tokens,
                    "wall_s": clock.wall,
                    "index_tokens_per_s": tokens / clock.wall,
                    "forward_tokens_per_s": [before[0], after[0]],
                    "load_avg_1m": os.getloadavg()[0],
                }
            )
            print(
                f"Ray, {n} worker(s): {tokens} tokens in {clock.wall:.1f} s = {tokens / clock.wall:.0f} tok/s wall; "
                f"forward {before[0]:.0f} / {after[0]:.0f} tok/s wall (this process)",
                flush=True,
            )

    summary = {
        clock: {
            "median_ratio": statistics.median(r["ratio"][clock] for r in rounds),
            "median_ratio_to_chunk_forward": statistics.median(r["ratio_to_chunk_forward"][clock] for r in rounds),
            "index_tokens_per_s": sum(r["tokens"] for r in rounds) / sum(r[f"{clock}_s"] for r in rounds),
            "forward_tokens_per_s": statistics.median(f for r in rounds for f in r["forward_tokens_per_s"][clock]),
        }
        for clock in ("wall", "cpu")
    }
    for clock, s in summary.items():
        print(
            f"{clock}: median ratio {s['median_ratio']:.2f} ({s['median_ratio_to_chunk_forward']:.2f} to the forward over "
            f"the same chunks); indexing {s['index_tokens_per_s']:.0f} tok/s overall; "
            f"forward {s['forward_tokens_per_s']:.0f} tok/s (median)"
        )
    meta = {
        "model": config.index.model,
        "dtype": config.index.dtype,
        "chunk_tokens": config.index.chunk_tokens,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "questions": args.questions,
    }
    (args.out / "results.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "rounds": rounds, "ray": ray_runs}, indent=1)
    )


if __name__ == "__main__":
    main()
