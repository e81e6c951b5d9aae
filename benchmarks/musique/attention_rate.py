"""CacheBlend's attention in FLOPs per second, against the causal kernel a full prefill runs over the same
prompt: how much of CacheBlend's distance from its share of full's work is its attention's (issue 10).

    .venv/bin/python benchmarks/musique/attention_rate.py --data ../shared/data/musique_dev.json \
        --index /tmp/bench/musique/work/index --questions 3

Every `causal_attend` call of a CacheBlend fuse is timed (the third fuse of each question, its caches in
the memory tier); its FLOPs are 4 x H_q x D per (query, key) pair a query may see (keys 0..p for a query
at p). The pairs its plan computes are counted too (a run's masked span is computed whole), so the rate
splits into the kernels' own speed and the scores computed only to be masked. The causal kernel is timed
over the prompt's length with random tensors of its shapes. Time only on a quiet machine, under the bench lock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rag_kvcache import FusedGenerator, FusionConfig, GenerationConfig, KVIndex
from rag_kvcache.engine import fusion
from rag_kvcache.engine.ops import AttentionPlan, attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="MuSiQue JSON (a list of questions)")
    parser.add_argument(
        "--index", type=Path, required=True, help="an index of its passages (`rag-kvcache bench` builds one)"
    )
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = json.loads(args.data.read_text(encoding="utf-8"))[: args.questions]
    index = KVIndex.open(args.index, rewrite=False)
    generator = FusedGenerator(index)

    calls: list[tuple[AttentionPlan, float]] = []  # per call: its plan, seconds
    attend_causally = fusion.causal_attend

    def timed(q, k, v, plan, scale):
        start = time.perf_counter()
        out = attend_causally(q, k, v, plan, scale)
        calls.append((plan, time.perf_counter() - start))
        return out

    fusion.causal_attend = timed
    head = index.adapter.model.config
    h_q, h_kv, d = head.num_attention_heads, head.num_key_value_heads, index.adapter.head_dim
    for example in data:
        hits = index.search(example["question"], 6)
        for _ in range(3):
            calls.clear()
            fused = generator.ask(
                example["question"],
                hits,
                fusion=FusionConfig(method="cacheblend"),
                generation=GenerationConfig(max_new_tokens=1),
            )
        n = fused.prompt_tokens
        seconds = sum(t for _, t in calls)
        needed = sum((plan.positions + 1).sum().item() for plan, _ in calls)
        flops = needed * 4 * h_q * d
        computed = sum(computed_pairs(plan) for plan, _ in calls)
        q, k, v = torch.randn(h_q, n, d), torch.randn(h_kv, n, d), torch.randn(h_kv, n, d)  # [H, N, D]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            attend(q, k, v, None, d**-0.5)
            times.append(time.perf_counter() - start)
        rate = n * (n + 1) / 2 * 4 * h_q * d / statistics.median(times)
        print(
            f"N={n}: CacheBlend's attention {seconds * 1e3:.0f} ms at {flops / seconds / 1e9:.0f} GFLOP/s; "
            f"full's causal kernel {rate / 1e9:.0f} GFLOP/s, at which CacheBlend's would take {flops / rate * 1e3:.0f} ms; "
            f"pairs computed / needed {computed / needed:.3f}"
        )


def computed_pairs(plan: AttentionPlan) -> int:
    """(query, key) pairs the plan's kernels compute: per run its keys before the run whole and its masked span
    whole; without runs, one causal kernel (over the queries' own contiguous span after an unmasked pass over
    the keys before it, or over every position)."""
    q = plan.positions.numel()
    if plan.runs:
        return sum((r.end - r.start) * (r.open_end + r.bias.shape[1]) for r in plan.runs)
    if plan.first is not None:
        return q * plan.first + q * (q + 1) // 2
    return plan.n_keys * (plan.n_keys + 1) // 2


if __name__ == "__main__":
    main()
