"""Does what `epic_match` recomputes say which questions it will get wrong? (issue 33 item 3, for the default
method). `epic_match` computes each inexact chunk's head and the sentences that echo the question while the
rest of the chunk is read from its cache; for those recomputed tokens both K/V exist at every layer, the fresh
(in this prompt) and the cached (in the chunk's indexing context). Their relative deviation,
sqrt(sum ||fresh - cached||^2 / sum ||cached||^2), is a per-question estimate of how far this prompt's context
is from the caches' that costs nothing to compute. This script records it at every layer, for the heads and
for the echoing sentences apart, beside each question's teacher-forced KL to `full` (full's greedy answer
forced through both caches), and reports the rank correlation (Spearman, bootstrap 95%) of each estimate with
the KL, beside trivial predictors (the prompt's length, the tokens recomputed). The estimate named before the
run is `all_k_mean` (heads and echoes together, K, the mean over layers); the per-layer scan is exploratory, so
its best predictor is also chosen on the first half of the questions and judged on the second. `all_k_early`
(layers 1-5) was named after the first run, on questions 0-39, and is judged on a held-out set (`--skip 40`). From the
repository root:

    flock /tmp/bench.lock nice -n 5 .venv/bin/python benchmarks/fusion-quality/epic_drift.py \
        --data ../shared/data/musique_dev.json --work /tmp/epicdrift --questions 40 OUT.json
    ... --work /tmp/epicdrift-heldout --skip 40 --questions 40 OUT2.json

The passages are written under --work and indexed there with the defaults (grouped caches) at run time. The
fused prefill is `epic_match`'s own (`methods.epic_match_tokens`), run with a `refine` that only records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from rag_kvcache import FusedGenerator, FusionConfig, GenerationConfig
from rag_kvcache.bench.corpus import question_index
from rag_kvcache.bench.datasets import load_musique
from rag_kvcache.bench.fidelity import greedy_answer_ids
from rag_kvcache.bench.metrics import spearman, spearman_ci, teacher_forced
from rag_kvcache.engine.fusion import selective_prefill
from rag_kvcache.engine.generation import teacher_forced_logits
from rag_kvcache.engine.methods import chunk_heads, epic_match_tokens, register

PROBE = "epic_match_probe"
EARLY = range(1, 6)  # `all_k_early`'s layers: named after the first run (questions 0-39), judged on 40-79


class Probe:
    """Per layer, the recomputed cached tokens' squared deviation and squared cached norm, heads and echoes
    apart (K and V), for the question being fused."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def refine(self, heads: torch.Tensor, reusable: torch.Tensor):
        def record(layer: int, active: torch.Tensor, fresh_kv, layer_cache) -> None:
            row: dict[str, float] = {}
            for part, mask in (("head", heads[active] & reusable[active]), ("echo", ~heads[active] & reusable[active])):
                for name, fresh, cached in zip("kv", fresh_kv, layer_cache):
                    f, c = fresh[:, mask].float(), cached[:, active[mask]].float()  # [H_kv, R, D] x 2
                    row[f"{part}_{name}_dev"] = float((f - c).square().sum())
                    row[f"{part}_{name}_norm"] = float(c.square().sum())
            self.rows.append(row)
            return None  # nothing narrowed: the fusion is epic_match's

        return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="MuSiQue JSON (a list of questions with ctxs)")
    parser.add_argument("--work", type=Path, required=True, help="where the passages and the index go")
    parser.add_argument("out", type=Path)
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--skip", type=int, default=0, help="questions of --data passed over first (a held-out set)")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    data = load_musique(args.data)[args.skip : args.skip + args.questions]
    index = question_index(data, args.work, args.chunk_tokens)
    generator, adapter, fmt = FusedGenerator(index), index.adapter, index.format
    probe = Probe()

    @register(PROBE)
    def _epic_match_probe(adapter, inp, cfg, clock=None, reader=None):
        record = probe.refine(chunk_heads(inp, cfg.epic_k), inp.reusable)
        return selective_prefill(
            adapter, inp, epic_match_tokens(adapter, inp, cfg).nonzero()[:, 0], record, clock=clock, reader=reader
        )

    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    questions = []
    for example in data:
        hits = index.search(example.question, args.top_k)
        segments = fmt.segments(
            [h.chunk.token_ids for h in hits], fmt.question_ids(adapter.tokenizer, example.question)
        )
        reference = generator.fuse(segments, FusionConfig(method="full"))
        answer = greedy_answer_ids(adapter, reference, generation)
        probe.rows = []
        fused = generator.fuse(segments, FusionConfig(method=PROBE)).result
        if not answer:
            continue
        ref, got = (
            teacher_forced_logits(adapter, r.keys, r.values, r.logits, answer).cpu().numpy()
            for r in (reference.result, fused)
        )  # [T, V] x 2
        questions.append(
            {
                "question": example.question,
                "tf_kl": teacher_forced(ref, got, answer)["tf_kl"],
                "prompt_tokens": int(sum(len(s.ids) for s in segments)),
                "computed_tokens": int(fused.recomputed_tokens),
                "layers": probe.rows,
            }
        )
        print(f"{len(questions):3d} tf_kl {questions[-1]['tf_kl']:.3f} {example.question[:60]}", flush=True)

    kl = np.array([q["tf_kl"] for q in questions])  # [Q]
    predictors = {
        "prompt_tokens": np.array([q["prompt_tokens"] for q in questions], dtype=np.float64),
        "computed_tokens": np.array([q["computed_tokens"] for q in questions], dtype=np.float64),
    }
    n_layers = len(questions[0]["layers"])
    for part in ("head", "echo", "all"):
        for name in "kv":
            for layer in range(n_layers):
                parts = ("head", "echo") if part == "all" else (part,)
                dev = np.array([sum(q["layers"][layer][f"{p}_{name}_dev"] for p in parts) for q in questions])
                norm = np.array([sum(q["layers"][layer][f"{p}_{name}_norm"] for p in parts) for q in questions])
                predictors[f"{part}_{name}_layer{layer}"] = np.sqrt(dev / np.maximum(norm, np.finfo(np.float64).tiny))
    per_layer = [k for k in predictors if k.startswith("all_k_layer")]
    predictors["all_k_mean"] = np.mean([predictors[k] for k in per_layer], axis=0)  # [Q]
    predictors["all_k_early"] = np.mean([predictors[f"all_k_layer{i}"] for i in EARLY], axis=0)  # [Q]
    table = {key: (spearman(x, kl), *spearman_ci(x, kl)) for key, x in predictors.items() if np.ptp(x) > 0}
    best = sorted(table.items(), key=lambda kv: -kv[1][0])
    half = len(questions) // 2
    chosen = max(
        (k for k, x in predictors.items() if np.ptp(x[:half]) > 0 and np.ptp(x[half:]) > 0),
        key=lambda k: spearman(predictors[k][:half], kl[:half]),
        default=None,
    )  # None: too few questions to split
    summary = {
        "questions": len(questions),
        "tf_kl_mean": float(kl.mean()),
        "all_k_mean": table["all_k_mean"],
        "all_k_early": table["all_k_early"],
        "split_half": None
        if chosen is None
        else {
            "chosen_on_first_half": chosen,
            "first_half": spearman(predictors[chosen][:half], kl[:half]),
            "second_half": (
                spearman(predictors[chosen][half:], kl[half:]),
                *spearman_ci(predictors[chosen][half:], kl[half:]),
            ),
        },
        "spearman_with_tf_kl": {k: v for k, v in best},
        "best_five": [k for k, _ in best[:5]],
    }
    args.out.write_text(json.dumps({"summary": summary, "questions": questions}, indent=1), encoding="utf-8")
    print(json.dumps({k: summary[k] for k in ("questions", "tf_kl_mean", "split_half", "best_five")}, indent=1))
    for key in (*best[:8], *((k, table[k]) for k in ("all_k_mean", "all_k_early", "prompt_tokens", "computed_tokens"))):
        name, (rho, lo, hi) = key
        print(f"{name:28s} Spearman {rho:+.2f} [{lo:+.2f}, {hi:+.2f}]")


if __name__ == "__main__":
    main()
