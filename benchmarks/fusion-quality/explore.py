"""Quick teacher-forced exploration of fusion variants on the bench's retrieved prompts (not timed).

For each question: retrieve as the bench does (planted chunk moved to its rank), build the prompt's
segments, then score every variant against `full` by forcing full's greedy answer through the
variant's fused cache (`bench.metrics.teacher_forced`), and check whether its own greedy answer holds
the planted fact. A variant is (how chunk caches are made, method, FusionConfig changes):

- caches "prefix": the index's caches (each chunk behind the system prefix);
- caches "nbr<m>": every chunk after the first computed behind prefix + its m most similar corpus
  chunks (by the index's embedder, itself excluded), separators as in a prompt, most similar last;
- caches "filler<m>": behind prefix + the same m corpus chunks for every chunk (a fixed context: the
  last chunks of the corpus, from the last question's passages; that question is not scored).

Usage: python explore.py DATASET OUT.jsonl LIMIT VARIANTS_JSON
       python explore.py summary OUT.jsonl
       python explore.py probe DATASET LIMIT   (a quality gate's estimate per question, behind-prefix caches)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rag_kvcache.bench.corpus import build_index, place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.fidelity import greedy_answer_ids
from rag_kvcache.bench.metrics import contains_answer, teacher_forced
from rag_kvcache.config import Config, IndexSettings, QueryConfig
from rag_kvcache.engine.fusion import FusionInput, selective_prefill
from rag_kvcache.engine.generation import teacher_forced_logits
from rag_kvcache.engine.methods import get_method
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.ops import kv_deviation
from rag_kvcache.query.answers import Fused


def context_caches(index, hits, mode: str, filler: list[tuple[int, ...]]):
    """Per chunk of the prompt: (cache, context) for cache mode `mode`."""
    fmt, sep = index.format, index.format.separator_ids
    out = []
    for rank, hit in enumerate(hits):
        ids = hit.chunk.token_ids
        if mode == "prefix" or rank == 0:
            ctx = fmt.prefix_ids
            out.append((index.store.open(index.addressing.key(ids, ctx)), ctx))
            continue
        m = int(mode.removeprefix("nbr").removeprefix("filler"))
        if mode.startswith("nbr"):
            near = [h.chunk.token_ids for h in index.search(hit.chunk.text, m + 1) if h.chunk.id != hit.chunk.id][:m]
        else:
            near = filler[:m]
        ctx = tuple(fmt.prefix_ids)
        for n_ids in reversed(near):  # most similar right before the chunk
            ctx += tuple(n_ids) + tuple(sep)
        kv = next(index.maker.recipe.compute([ids], ctx))[1]
        out.append((kv, ctx))
    return out


def main() -> None:
    dataset, out_path, limit, variants = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    torch.set_num_threads(1)
    config = Config(index=IndexSettings(chunk_tokens=128), query=QueryConfig(top_k=6)).with_generation(
        max_new_tokens=32
    )
    adapter = ModelAdapter.load(config)
    examples = load_dataset(dataset, top_k=config.query.top_k)[:limit]
    work = Path("/tmp/q13/explore-work") / Path(dataset.split(":")[-1]).stem
    index, _ = build_index(examples, work, config, adapter, progress=False)
    filler = [c.token_ids for c in list(index.chunks.all_chunks())[-4:]]  # the last question's passages
    fmt = index.format
    with out_path.open("a") as f:
        for ex in examples[:-1]:  # the last question gives the filler
            hits, _ = place_evidence(index.search(ex.question, config.query.top_k), ex)
            q_ids = fmt.question_ids(adapter.tokenizer, ex.question)
            segments = fmt.segments([h.chunk.token_ids for h in hits], q_ids)
            cache_sets: dict[str, list] = {}

            def fuse(mode: str, method: str, changes: dict) -> Fused:
                if mode not in cache_sets:
                    cache_sets[mode] = context_caches(index, hits, mode, filler)
                chunk_iter = iter(cache_sets[mode])
                caches, contexts = [], []
                for seg in segments:
                    if seg.label == "prefix":
                        caches.append(index.store.open(index.addressing.key(seg.ids, ())))
                        contexts.append(())
                    elif seg.cacheable:
                        kv, ctx = next(chunk_iter)
                        caches.append(kv)
                        contexts.append(ctx)
                    else:
                        caches.append(None)
                        contexts.append(())
                inp = FusionInput.build(segments, caches, contexts)
                fusion = replace(config.query.fusion, method=method, **changes).for_chunks(config.index.chunk_tokens)
                result = get_method(method)(adapter, inp, fusion)
                return Fused(result, inp.n_tokens, 0)

            ref = fuse("prefix", "full", {})
            answer_ids = greedy_answer_ids(adapter, ref, config.query.generation)
            if not answer_ids:
                continue
            ref_text = adapter.tokenizer.decode(answer_ids, skip_special_tokens=True)
            ref_logits = teacher_forced_logits(
                adapter, ref.result.keys, ref.result.values, ref.result.logits, answer_ids
            ).numpy()
            full_hit = ex.task == "exact" and contains_answer(ref_text, ex.answers)
            for name, (mode, method, changes) in variants.items():
                fused = fuse(mode, method, changes)
                logits = teacher_forced_logits(
                    adapter, fused.result.keys, fused.result.values, fused.result.logits, answer_ids
                ).numpy()
                text = adapter.tokenizer.decode(
                    greedy_answer_ids(adapter, fused, config.query.generation), skip_special_tokens=True
                )
                rec = {
                    "id": ex.id,
                    "variant": name,
                    **teacher_forced(ref_logits, logits, answer_ids),
                    "compute_fraction": fused.result.compute_fraction,
                    "full_hit": full_hit,
                    "hit": ex.task == "exact" and contains_answer(text, ex.answers),
                }
                f.write(json.dumps(rec) + "\n")
                f.flush()


def summary(path: Path) -> None:
    recs = [json.loads(line) for line in path.open()]
    names = dict.fromkeys(r["variant"] for r in recs)
    rng = np.random.default_rng(0)
    for name in names:
        mine = [r for r in recs if r["variant"] == name]
        kl = np.array([r["tf_kl"] for r in mine])
        boots = [kl[rng.integers(0, len(kl), len(kl))].mean() for _ in range(1000)]
        planted = [r["hit"] for r in mine if r["full_hit"]]
        print(
            f"{name:28s} n={len(mine):3d} tf_kl {kl.mean():.4f} [{np.percentile(boots, 2.5):.4f}, "
            f"{np.percentile(boots, 97.5):.4f}] top1 {np.mean([r['tf_top1'] for r in mine]):.3f} "
            f"planted {np.mean(planted) if planted else float('nan'):.3f} ({len(planted)}) "
            f"compute {np.mean([r['compute_fraction'] for r in mine]):.3f}"
        )


def relative_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> float:
    """||fresh - cached|| / ||fresh|| over K (or V) [H_kv, T, D]: the quality gate's estimate (not kept)."""
    return float(kv_deviation(fresh, cached).norm() / fresh.to(torch.float32).norm())


def probe(dataset: str, limit: int) -> None:
    """Per question: the relative K deviation of the reusable tokens at the check layer (the gate's estimate)."""
    torch.set_num_threads(1)
    config = Config(index=IndexSettings(chunk_tokens=128), query=QueryConfig(top_k=6))
    adapter = ModelAdapter.load(config)
    examples = load_dataset(dataset, top_k=config.query.top_k)[:limit]
    index, _ = build_index(
        examples, Path("/tmp/q13/explore-work") / Path(dataset.split(":")[-1]).stem, config, adapter, False
    )
    fmt = index.format
    for ex in examples:
        hits, _ = place_evidence(index.search(ex.question, config.query.top_k), ex)
        segments = fmt.segments([h.chunk.token_ids for h in hits], fmt.question_ids(adapter.tokenizer, ex.question))
        caches = index.caches.open(segments)
        inp = FusionInput.build(segments, caches.sources, caches.contexts)
        seen = {}

        def refine(layer, active, fresh_kv, layer_cache):
            if layer == config.query.fusion.check_layer:
                mine = inp.reusable[active]  # [A]
                seen["d"] = relative_deviation(fresh_kv[0][:, mine], layer_cache[0][:, active[mine]])
            return None

        selective_prefill(adapter, inp, (inp.fresh | inp.reusable).nonzero()[:, 0], refine)
        print(json.dumps({"id": ex.id, "deviation": seen["d"]}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "summary":
        summary(Path(sys.argv[2]))
    elif sys.argv[1] == "probe":
        probe(sys.argv[2], int(sys.argv[3]))
    else:
        main()
