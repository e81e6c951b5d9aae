"""Does the evidence's place in the prompt decide whether a fused prompt keeps a planted fact?

Over a finished `bench` run on planted facts (its `--out`), for each question whose fact `full` answered there:
the evidence chunk is placed at each of `--positions` among the retrieved chunks (`bench.corpus.place_evidence`,
the others in rank order), and the prompt is answered greedily by `full` and by `--method` over `--index` (the
run's default index unless named). One JSON line per question: `full<p>` and `fused<p>`, whether each answered the
fact with the evidence at position p. Session 40 in `benchmarks/RESULTS.md`.

    .venv/bin/python benchmarks/fusion-quality/position_probe.py /tmp/s37/l88r \\
        planted:/work/shared/data/musique_dev.json --out /tmp/s40/rank_grouped.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
from restore_probe import greedy_over

from rag_kvcache.bench.corpus import place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.metrics import contains_answer
from rag_kvcache.config import FusionConfig
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench --out directory on planted facts")
    ap.add_argument("dataset", help="the planted-fact dataset the run used")
    ap.add_argument("--index", type=Path, help="the index to fuse over (default: the run's work/index)")
    ap.add_argument("--method", default="epic_match")
    ap.add_argument("--k", type=int, default=16, help="the method's epic_k")
    ap.add_argument("--positions", default="1,3,5", help="comma-separated positions of the evidence chunk")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per question")
    args = ap.parse_args()
    torch.set_num_threads(2)

    records = [json.loads(line) for line in (args.run / "records.jsonl").open()]
    facts = sorted(
        {r["id"] for r in records if r["label"] == "full" and r["exact_hit"]}, key=lambda s: int(s.rsplit("-", 1)[1])
    )
    index = KVIndex.open(args.index or args.run / "work" / "index")
    generator, adapter, fmt = FusedGenerator(index), index.adapter, index.format
    examples = {e.id: e for e in load_dataset(args.dataset)}
    methods = {"full": FusionConfig(method="full"), "fused": FusionConfig(method=args.method, epic_k=args.k)}
    with args.out.open("w") as out:
        for qid in facts:
            example = examples[qid]
            row: dict[str, object] = {"id": qid, "planted_rank": example.evidence_rank}
            retrieved = index.search(example.question, index.config.query.top_k)
            for position in map(int, args.positions.split(",")):
                hits, found = place_evidence(retrieved, replace(example, evidence_rank=position))
                if found is None:  # the evidence was not retrieved
                    break
                segments = fmt.segments(
                    [tuple(h.chunk.token_ids) for h in hits], fmt.question_ids(adapter.tokenizer, example.question)
                )
                prompt = [t for seg in segments for t in seg.ids]
                head = len(prompt) - len(segments[-1].ids)  # the question is computed over the fused cache
                for name, fusion in methods.items():
                    result = generator.fuse(segments, fusion).result
                    answer = greedy_over(adapter, result.keys, result.values, head, prompt[head:], args.max_new_tokens)
                    row[f"{name}{position}"] = contains_answer(answer, example.answers)
            print(json.dumps(row), file=out, flush=True)


if __name__ == "__main__":
    main()
