"""Probes of EPIC on neighbour caches where it loses planted facts: the chunk right after the exact first one.

Over a finished `bench` run with `epic:k=K@neighbours` (its `--out`), for every question full answers, each
probe's greedy answer (fact kept or not) and its teacher-forced KL from full's answer on the same prompt
(the bench's protocol), by the rank the fact's chunk was placed at. Probes (`--probes NAME=KIND[:ARG]`, K
is `--k`):

- `epic`          EPIC's heads of k on every inexact chunk (must repeat the run's answers);
- `fact`          EPIC plus the fact's chunk recomputed whole (an oracle: it knows where the fact is);
- `between`       EPIC plus every chunk between the fact and the question recomputed whole (an oracle);
- `ranked`        heads falling linearly from the first inexact chunk to the last, k per chunk on average;
- `far:L`         EPIC plus the first inexact chunk recomputed whole through layer L-1 (its head after);
- `scaled:S`      EPIC with the inexact chunks' cached keys scaled by S (an attention temperature of 1/S
                  on the reused tokens, as APE does for parallel-encoded context).

The oracles spend more than any method's budget on purpose: they locate the error, they are not methods.

    .venv/bin/python benchmarks/fusion-quality/rank_probes.py /tmp/b13/p88 /tmp/b13/planted-3.jsonl --k 19 \\
        --ranks 1,2 --probes epic=epic fact=fact between=between --out /tmp/b13/oracle.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from rag_kvcache.bench.corpus import place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.fidelity import greedy_answer_ids
from rag_kvcache.bench.metrics import contains_answer, teacher_forced
from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.fusion import DirectReader, FusionInput, LayerReader, SegmentKV, selective_prefill
from rag_kvcache.engine.generation import teacher_forced_logits
from rag_kvcache.engine.methods import register
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator


def inexact(inp: FusionInput) -> list[SegmentKV]:
    return [p for p in inp.parts if p.kv is not None and not p.exact]


def heads(inp: FusionInput, ks: list[int]) -> torch.Tensor:
    """The first ks[i] tokens of the i-th inexact chunk [N]."""
    mask = inp.token_mask(lambda p: False)  # [N]
    for p, k in zip(inexact(inp), ks):
        mask[p.start : p.start + min(k, len(p.segment.ids))] = True
    return mask


class ScaledKeys:
    """A reader whose inexact chunks' cached keys come scaled by `s`."""

    def __init__(self, base: LayerReader, inp: FusionInput, s: float) -> None:
        self.base, self.s = base, s
        self.scaled = inp.reusable  # [N], the tokens of inexact caches

    def get(self, layer: int) -> torch.Tensor:
        kv = self.base.get(layer)  # [2, H_kv, N, D]
        kv[0, :, self.scaled] *= self.s
        return kv


def probe(name: str, kind: str, arg: float | None, k: int, rank: int) -> str:
    """Register `name` for a question whose fact's chunk sits at `rank` (counting the exact first chunk as 0)."""

    @register(name)
    def method(adapter, inp: FusionInput, cfg, clock=None, reader=None):
        chunks = inexact(inp)
        m = len(chunks)
        ks = [round(k * m * (m - i) / sum(range(1, m + 1))) for i in range(m)] if kind == "ranked" else [k] * m
        base = inp.fresh | heads(inp, ks)  # [N]
        whole: list[SegmentKV] = {"fact": chunks[rank - 1 : rank], "between": chunks[rank:], "far": chunks[:1]}.get(
            kind, []
        )
        active = base | inp.token_mask(lambda p: any(p is q for q in whole))  # [N]
        refine: Callable | None = None
        if kind == "far":

            def refine(layer, act, fresh_kv, cache):  # from layer `arg` on, only EPIC's tokens go on
                return base[act].nonzero()[:, 0] if layer == int(arg) else None

        if kind == "scaled":
            reader = ScaledKeys(reader or DirectReader(inp.sources, inp.placement(adapter)), inp, float(arg))
        return selective_prefill(adapter, inp, active.nonzero()[:, 0], refine, clock=clock, reader=reader)

    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run", type=Path, help="the bench run's --out (records.jsonl, work/index, work/index-neighbours)"
    )
    parser.add_argument("dataset", help="the run's --dataset")
    parser.add_argument("--k", type=int, default=19, help="the run's EPIC k")
    parser.add_argument("--ranks", default="", help="only questions whose fact sits at these ranks (e.g. 1,2)")
    parser.add_argument("--probes", nargs="+", default=["epic=epic"], help="NAME=KIND[:ARG], see above")
    parser.add_argument("--out", type=Path, required=True, help="per-question rows (jsonl, appended)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    probes = {}
    for spec in args.probes:
        name, _, kind = spec.partition("=")
        kind, _, arg = kind.partition(":")
        if kind not in ("epic", "fact", "between", "ranked", "far", "scaled") or (kind in ("far", "scaled")) != bool(
            arg
        ):
            parser.error(f"bad probe {spec!r}")
        probes[name] = (kind, float(arg) if arg else None)
    records = [json.loads(line) for line in (args.run / "records.jsonl").open()]
    full_ok = {r["id"] for r in records if r["label"] == "full" and r["exact_hit"]}
    epic = {r["id"]: r for r in records if r["label"].startswith("epic@neighbours")}
    ranks = {int(r) for r in args.ranks.split(",")} if args.ranks else None
    examples = [
        e
        for e in load_dataset(args.dataset)
        if e.id in full_ok and (ranks is None or epic[e.id]["evidence_rank"] in ranks)
    ]
    index = KVIndex.open(args.run / "work" / "index")
    reference = FusedGenerator(index)
    generator = FusedGenerator(KVIndex.open(args.run / "work" / "index-neighbours", adapter=index.adapter))
    adapter, config, fmt = index.adapter, index.config, index.format
    with args.out.open("a", encoding="utf-8") as out:
        for ex in examples:
            hits, _ = place_evidence(index.search(ex.question, config.query.top_k), ex)
            segments = fmt.segments([h.chunk.token_ids for h in hits], fmt.question_ids(adapter.tokenizer, ex.question))
            full = reference.fuse(segments, FusionConfig(method="full"))
            answer_ids = greedy_answer_ids(adapter, full, config.query.generation)
            ref_logits = teacher_forced_logits(
                adapter, full.result.keys, full.result.values, full.result.logits, answer_ids
            ).numpy()
            row = {
                "id": ex.id,
                "rank": ex.evidence_rank,
                "bench_hit": epic[ex.id]["exact_hit"],
                "bench_kl": epic[ex.id]["tf_kl"],
            }
            for name, (kind, arg) in probes.items():
                fusion = FusionConfig(method=probe(f"probe_{name}", kind, arg, args.k, ex.evidence_rank))
                fused = generator.fuse(segments, fusion).result
                forced = teacher_forced_logits(adapter, fused.keys, fused.values, fused.logits, answer_ids).numpy()
                answer = generator.ask(ex.question, hits, fusion=fusion, generation=config.query.generation)
                row[name] = {
                    "hit": contains_answer(answer.answer, ex.answers),
                    "compute": fused.compute_fraction,
                    "kl": teacher_forced(ref_logits, forced, answer_ids)["tf_kl"],
                }
            print(json.dumps(row), file=out, flush=True)
            print(json.dumps(row), flush=True)
    rows = [json.loads(line) for line in args.out.open()]
    for name in probes:
        scored = [r for r in rows if name in r]
        by_rank = ", ".join(
            f"rank {rk} {sum(r[name]['hit'] for r in scored if r['rank'] == rk)}/{sum(r['rank'] == rk for r in scored)}"
            for rk in sorted({r["rank"] for r in scored})
        )
        print(
            f"{name}: kept {sum(r[name]['hit'] for r in scored)}/{len(scored)} ({by_rank}), TF KL "
            f"{sum(r[name]['kl'] for r in scored) / len(scored):.4f}, compute "
            f"{sum(r[name]['compute'] for r in scored) / len(scored):.3f}"
        )


if __name__ == "__main__":
    main()
