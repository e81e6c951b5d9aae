"""Where does EPIC on neighbour caches lose the planted facts placed right after the exact first chunk?

Oracle diagnostics over a finished `bench` run with `epic:k=K@neighbours` (its `--out`): for every question
full answers whose fact's chunk was placed at rank 1 or 2, the greedy answer of EPIC k=K on the neighbours
index (a check: it must repeat the run's records), then of EPIC plus the fact's chunk recomputed whole
(`fact`), then of EPIC plus every chunk between the fact and the question recomputed whole (`between`).
Both oracles spend more than any method's budget on purpose: they locate the error, they are not methods.

    .venv/bin/python benchmarks/fusion-quality/oracle_rank.py /tmp/b13/p88 /tmp/b13/planted-3.jsonl --k 19
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.metrics import contains_answer
from rag_kvcache.bench.runner import place_evidence
from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.fusion import FusionInput, SegmentKV, selective_prefill
from rag_kvcache.engine.methods import register
from rag_kvcache.generator import FusedGenerator
from rag_kvcache.index import KVIndex

ORACLES = ("epic", "fact", "between")


def oracle(name: str, k: int, rank: int, extra: Callable[[list[SegmentKV], int], list[SegmentKV]]) -> str:
    """Register `name`: EPIC's heads (k) and the uncached tokens, plus the chunk parts `extra` picks."""

    @register(name)
    def method(adapter, inp: FusionInput, cfg, clock=None, reader=None):
        chunks = [p for p in inp.parts if p.segment.label.startswith("chunk")]  # in rank order
        picked = extra(chunks, rank)
        heads = inp.token_mask(lambda p: False)  # [N]
        for p in chunks[1:]:
            heads[p.start : p.start + min(k, len(p.segment.ids))] = True
        active = inp.fresh | heads | inp.token_mask(lambda p: any(p is q for q in picked))  # [N]
        return selective_prefill(adapter, inp, active.nonzero()[:, 0], clock=clock, reader=reader)

    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the bench run's --out (records.jsonl, work/index, work/index-neighbours)")
    parser.add_argument("dataset", help="the run's --dataset")
    parser.add_argument("--k", type=int, default=19, help="the run's EPIC k")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in (args.run / "records.jsonl").open()]
    full_ok = {r["id"] for r in records if r["label"] == "full" and r["exact_hit"]}
    epic = {r["id"]: r for r in records if r["label"].startswith("epic@neighbours")}
    examples = [e for e in load_dataset(args.dataset) if e.id in full_ok and epic[e.id]["evidence_rank"] in (1, 2)]
    index = KVIndex.open(args.run / "work" / "index")
    generator = FusedGenerator(KVIndex.open(args.run / "work" / "index-neighbours", adapter=index.adapter))
    picks = {"epic": lambda chunks, rank: [], "fact": lambda chunks, rank: [chunks[rank]],
             "between": lambda chunks, rank: chunks[rank + 1 :]}
    rows: list[dict] = []
    for ex in examples:
        hits, _ = place_evidence(index.search(ex.question, index.config.top_k), ex)
        row = {"id": ex.id, "rank": ex.evidence_rank, "bench_epic": epic[ex.id]["exact_hit"]}
        for name in ORACLES:
            method = oracle(f"oracle_{name}", args.k, ex.evidence_rank, picks[name])
            answer = generator.ask(ex.question, hits, fusion=FusionConfig(method=method, epic_k=args.k),
                                   generation=index.config.generation)
            row[name] = contains_answer(answer.answer, ex.answers)
            row[f"{name}_compute"] = answer.compute_fraction
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name in ORACLES:
        for rank in (1, 2):
            sel = [r for r in rows if r["rank"] == rank]
            print(f"{name} rank {rank}: {sum(r[name] for r in sel)}/{len(sel)} kept, compute fraction "
                  f"{sum(r[name + '_compute'] for r in sel) / max(1, len(sel)):.3f}")


if __name__ == "__main__":
    main()
