"""Storage benchmark: TTFT with cold and warm caches, pipelined and not; bytes and quality of the codecs.

    .venv/bin/python benchmarks/storage/run.py --data ../shared/data/musique_dev.json --work /tmp/storage-bench

Builds one index (SmolLM2-135M, 128-token chunks) over the first `--passages` passages of the first
`--questions` MuSiQue questions, then, for each question and its top-6 chunks:

- timing: the fused prefill (CacheBlend, ratio 0.15) under eight conditions, in rotated order, each
  repeated: caches on the disk tier with the page cache dropped (`posix_fadvise(DONTNEED)`) or warm,
  in the memory tier, or behind a simulated 50 MB/s link (a slow network store); each read layer
  by layer in the fusion's thread (`prefetch_layers=0`) or by the background reader (2 ahead). `kv_wait` is the time the fusion waited for cached layers: all of the reading
  when sequential, what the recompute did not hide when pipelined.
- quality: the caches transcoded to each codec (so only the codec differs), answered with
  CacheBlend 0.15; F1 against the `full` prefill's answer and against the gold answers, the
  first-token KL from `full`, and the bytes on disk.

Writes `results.json` and `RESULTS.md` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from rag_kvcache.bench.corpus import write_corpus
from rag_kvcache.bench.datasets import load_musique
from rag_kvcache.bench.metrics import f1_score, kl_divergence, max_f1
from rag_kvcache.config import (
    Config,
    FusionConfig,
    GenerationConfig,
    IndexSettings,
    QueryConfig,
    RuntimeConfig,
    StorageConfig,
)
from rag_kvcache.engine.cache import LayerSource
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.store.codecs import CODECS
from rag_kvcache.store.kvstore import KVStore

log = logging.getLogger("storage-bench")

CONDITIONS = (
    "cold/sequential",
    "cold/pipelined",
    "warm/sequential",
    "warm/pipelined",
    "memory/sequential",
    "memory/pipelined",
    "slow/sequential",
    "slow/pipelined",
)
FUSION = FusionConfig(method="cacheblend", ratio=0.15)
SLOW_BYTES_PER_S = 50e6  # a slow network store: its loading is about as long as the recompute on this CPU


class Throttled:
    """A layer source that takes `nbytes / bytes_per_s` to deliver each layer (sleeping, like I/O, without the GIL)."""

    def __init__(self, source: LayerSource, bytes_per_s: float) -> None:
        self.source, self.bytes_per_s, self.position = source, bytes_per_s, source.position

    n_tokens = property(lambda self: self.source.n_tokens)
    n_layers = property(lambda self: self.source.n_layers)

    def layer(self, i: int):
        k, v = self.source.layer(i)
        time.sleep((k.nbytes + v.nbytes) / self.bytes_per_s)
        return k, v


class ThrottledStore(KVStore):
    """The page-cached disk tier behind a slow link."""

    def open(self, key: str) -> LayerSource | None:
        source = super().open(key)
        return None if source is None else Throttled(source, SLOW_BYTES_PER_S)


def timing(gen: FusedGenerator, index: KVIndex, examples: list, top_k: int, repeats: int) -> list[dict]:
    disk_store = index.store
    memory_store = KVStore(disk_store.root, disk_store.codec.name, replace(disk_store.config, memory_bytes=4 << 30))
    slow_store = ThrottledStore(disk_store.root, disk_store.codec.name, disk_store.config)
    records = []
    for qi, ex in enumerate(examples):
        hits = index.search(ex.question, top_k)
        fmt = index.format
        segments = fmt.segments(
            [h.chunk.token_ids for h in hits], fmt.question_ids(index.adapter.tokenizer, ex.question)
        )
        keys = [index.addressing.key(h.chunk.token_ids) for h in hits]
        for key in keys:
            memory_store.get(key)  # fill the memory tier once
        for rep in range(repeats):
            order = CONDITIONS[(qi + rep) % len(CONDITIONS) :] + CONDITIONS[: (qi + rep) % len(CONDITIONS)]
            for condition in order:
                tier, mode = condition.split("/")
                index.store = {"memory": memory_store, "slow": slow_store}.get(tier, disk_store)
                if tier == "cold":
                    disk_store.disk.drop_page_cache()
                elif tier in ("warm", "slow"):
                    for key in keys:
                        disk_store.get(key)
                index.config = index.config.with_storage(prefetch_layers=2 if mode == "pipelined" else 0)
                start = time.perf_counter()
                fused = gen.fuse(segments, FUSION)
                ttft = time.perf_counter() - start
                result, n_prompt, misses = fused.result, fused.prompt_tokens, fused.cache_misses
                assert misses == 0
                records.append(
                    {
                        "question": qi,
                        "repeat": rep,
                        "condition": condition,
                        "ttft_s": ttft,
                        "kv_wait_s": result.stages.get("kv_wait", 0.0),
                        "kv_load_s": result.stages.get("kv_load", 0.0),
                        "prompt_tokens": n_prompt,
                        "stages": result.stages,
                    }
                )
                log.info(
                    "q%d rep%d %-17s ttft %.3f s, kv_wait %.3f s", qi, rep, condition, ttft, records[-1]["kv_wait_s"]
                )
    index.store = disk_store
    return records


def quality(gen: FusedGenerator, index: KVIndex, examples: list, top_k: int, work: Path, max_new: int) -> dict:
    source = index.store
    stores = {"none": source}
    for codec in [name for name in CODECS if name != "none"]:
        stores[codec] = KVStore(work / f"kv-{codec}", codec, StorageConfig(memory_bytes=0))
        for path in source.disk.files():
            if path.stem not in stores[codec]:
                stores[codec].put(path.stem, source.get(path.stem))
    generation = GenerationConfig(max_new_tokens=max_new)
    rows: dict[str, list[dict]] = {codec: [] for codec in stores}
    for qi, ex in enumerate(examples):
        hits = index.search(ex.question, top_k)
        reference = gen.generate(ex.question, hits, FusionConfig(method="full"), generation)
        for codec, store in stores.items():
            index.store = store
            ans = gen.generate(ex.question, hits, FUSION, generation)
            rows[codec].append(
                {
                    "question": qi,
                    "answer": ans.answer,
                    "full_answer": reference.answer,
                    "f1_vs_full": f1_score(ans.answer, reference.answer),
                    "f1_gold": max_f1(ans.answer, ex.answers),
                    "full_f1_gold": max_f1(reference.answer, ex.answers),
                    "kl_vs_full": kl_divergence(reference.first_token_logits.numpy(), ans.first_token_logits.numpy()),
                }
            )
            log.info(
                "q%d %-12s f1 vs full %.2f: %r (full: %r)",
                qi,
                codec,
                rows[codec][-1]["f1_vs_full"],
                ans.answer,
                reference.answer,
            )
    index.store = source
    sizes = {codec: sum(p.stat().st_size for p in store.disk.files()) for codec, store in stores.items()}
    return {"rows": rows, "bytes": sizes}


def report(out: Path, meta: dict, times: list[dict], qual: dict) -> None:
    def med(cond: str, field: str) -> float:
        return statistics.median(r[field] for r in times if r["condition"] == cond)

    lines = [
        "# Storage tiers, pipelined loading and KV codecs",
        "",
        f"Machine: {meta['machine']}, torch threads {meta['threads']}; model {meta['model']} ({meta['dtype']}); "
        f"{meta['questions']} MuSiQue questions, index of {meta['chunks']} chunks of {meta['chunk_tokens']} tokens, "
        f"top-{meta['top_k']} (median prompt {meta['prompt_tokens']} tokens, {meta['kv_mb_per_prompt']:.1f} MB of KV per "
        f"prompt); CacheBlend ratio {FUSION.ratio}; {meta['repeats']} repeats per condition in rotated order.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "## TTFT (fused prefill) by where the caches are and how they are read",
        "",
        "| condition | TTFT median (s) | kv_wait median (s) | opening entries (s) |",
        "|---|---|---|---|",
    ]
    for cond in CONDITIONS:
        lines.append(
            f"| {cond} | {med(cond, 'ttft_s'):.3f} | {med(cond, 'kv_wait_s'):.4f} | {med(cond, 'kv_load_s'):.4f} |"
        )
    for temp in ("cold", "warm", "slow"):
        seq, pipe = med(f"{temp}/sequential", "kv_wait_s"), med(f"{temp}/pipelined", "kv_wait_s")
        hidden = 1 - pipe / seq if seq > 0 else 0.0
        lines.append("")
        lines.append(
            f"- {temp}: reading the caches layer by layer costs {seq * 1e3:.1f} ms of waiting when sequential and "
            f"{pipe * 1e3:.1f} ms pipelined: the recompute hides {hidden:.0%} of it; TTFT "
            f"{med(f'{temp}/sequential', 'ttft_s'):.3f} s -> {med(f'{temp}/pipelined', 'ttft_s'):.3f} s."
        )
    base = qual["bytes"]["none"]
    lines += [
        "",
        "## Codecs: bytes on disk and quality (CacheBlend 0.15 on the transcoded caches)",
        "",
        "| codec | bytes on disk | vs fp32 | F1 vs full answer | F1 vs gold | first-token KL vs full |",
        "|---|---|---|---|---|---|",
    ]
    for codec, rows in qual["rows"].items():
        lines.append(
            f"| {codec} | {qual['bytes'][codec] / 2**20:.1f} MiB | {qual['bytes'][codec] / base:.2f} | "
            f"{statistics.mean(r['f1_vs_full'] for r in rows):.3f} | {statistics.mean(r['f1_gold'] for r in rows):.3f} | "
            f"{statistics.mean(r['kl_vs_full'] for r in rows):.4f} |"
        )
    full_gold = statistics.mean(r["full_f1_gold"] for r in qual["rows"]["none"])
    lines += ["", f"`full` itself scores F1 {full_gold:.3f} against the gold answers."]
    (out / "RESULTS.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--passages", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    examples = [
        replace(ex, documents=ex.documents[: args.passages]) for ex in load_musique(args.data)[: args.questions]
    ]
    write_corpus(examples, args.work / "docs")
    cfg = Config(
        index=IndexSettings(chunk_tokens=128),
        query=QueryConfig(top_k=args.top_k),
        runtime=RuntimeConfig(storage=StorageConfig(memory_bytes=0)),
    )
    index = KVIndex.build(args.work / "docs", args.work / "idx", cfg)
    gen = FusedGenerator(index)
    hits = index.search(examples[0].question, args.top_k)
    gen.generate(examples[0].question, hits, FUSION, GenerationConfig(max_new_tokens=2))  # warm-up
    times = timing(gen, index, examples, args.top_k, args.repeats)
    qual = quality(gen, index, examples, args.top_k, args.work, args.max_new_tokens)
    prompt = int(statistics.median(r["prompt_tokens"] for r in times))
    meta = {
        "machine": f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads)",
        "threads": args.threads,
        "model": cfg.index.model,
        "dtype": cfg.index.dtype,
        "questions": len(examples),
        "chunks": len(index.chunks),
        "chunk_tokens": cfg.index.chunk_tokens,
        "top_k": args.top_k,
        "repeats": args.repeats,
        "prompt_tokens": prompt,
        "kv_mb_per_prompt": prompt * index.kv_bytes_per_token / 1e6,
        "command": "python benchmarks/storage/run.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out",)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "timing": times, "quality": qual}, indent=1))
    report(args.out, meta, times, qual)


if __name__ == "__main__":
    main()
