"""Hiding documents in a fused prompt, against fusing the kept ones again (issue 36 item 4: the agent's generate
step over the prompt it already fused). From the repository root, in `.venv`:

    flock /tmp/bench.lock nice -n 5 .venv/bin/python benchmarks/chat/masked.py INDEX OUT.json

INDEX: the index `agentic.py` builds (the demo documents, 128-token chunks, the default caches and fusion). For each
of `agentic.py`'s 8 questions, its top-4 chunks are fused once into a shared prompt (`SharedPrompt`, the index's
default fusion); for every set of 2 or 3 of them kept (10 a question, 80 in all):

- the reference: `full` over the kept chunks' own prompt, and its greedy answer (`agentic.MAX_TOKENS`, 32, at most);
- *rebuilt*: the kept chunks' prompt fused again by the default method (what the graph's generate step does today);
- *masked*: the shared prompt with the other chunks hidden, only the question computed again.

The reference answer is forced through both (teacher-forced KL and top-1 agreement against the reference, paired,
with bootstrap confidence intervals of the means and of the per-set difference), and each one's time to its first
token is taken from a one-token answer (`Answer.ttft_s`; the two alternate, rebuilt first).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from agentic import QUESTIONS, forced, full_reference, scored

from rag_kvcache import GenerationConfig, KVIndex
from rag_kvcache.bench.metrics import bootstrap_ci
from rag_kvcache.query.agent import SharedPrompt
from rag_kvcache.query.answers import collect_answer
from rag_kvcache.query.generator import FusedGenerator

FIRST = GenerationConfig(max_new_tokens=1)
TOP_K = 4


def main() -> None:
    index_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    index = KVIndex.open(index_dir, KVIndex.config_of(index_dir).with_storage(conversation_bytes=0))
    generator, fusion = FusedGenerator(index), index.config.query.fusion
    fmt, tokenizer = index.format, index.adapter.tokenizer
    rows = []
    for question in QUESTIONS:
        chunks = [hit.chunk for hit in index.search(question, TOP_K)]
        prompt = SharedPrompt(generator, question, chunks, fusion)
        for keep in (k for n in (2, 3) for k in itertools.combinations(range(TOP_K), n)):
            segments = fmt.segments([chunks[i].token_ids for i in keep], fmt.question_ids(tokenizer, question))
            answer, ref = full_reference(generator, segments)
            if ref is None:
                continue
            rebuilt = generator.fuse(segments, fusion).result
            logits = {
                "rebuilt": forced(generator, rebuilt, answer),
                "masked": prompt.forced_logits(keep, answer),
            }  # [T, V] each
            row = {"question": question, "keep": keep, "answer_tokens": len(answer), "fuse_all_s": prompt.fuse_s}
            for name, got in logits.items():
                row |= {f"{name}_{k}": v for k, v in scored(ref, got, answer).items()}
            row["rebuilt_ttft_s"] = collect_answer(generator.stream(segments, fusion, FIRST), None).ttft_s
            row["masked_ttft_s"] = prompt.answer(keep, FIRST).ttft_s
            rows.append(row)
        print(
            f"{question[:44]:44s} kl rebuilt {statistics.fmean(r['rebuilt_tf_kl'] for r in rows[-10:]):.3f} "
            f"masked {statistics.fmean(r['masked_tf_kl'] for r in rows[-10:]):.3f}",
            flush=True,
        )
    index.close()
    summary: dict = {"sets": len(rows), "fusion": fusion.method}
    for metric in ("tf_kl", "tf_top1", "ttft_s"):
        for name in ("rebuilt", "masked"):
            values = np.array([r[f"{name}_{metric}"] for r in rows])
            summary[f"{name}_{metric}"] = {"mean": float(values.mean()), "ci95": bootstrap_ci(values)}
        diff = np.array([r[f"masked_{metric}"] - r[f"rebuilt_{metric}"] for r in rows])
        summary[f"masked_minus_rebuilt_{metric}"] = {"mean": float(diff.mean()), "ci95": bootstrap_ci(diff)}
    summary["ttft_median_rebuilt_over_masked"] = statistics.median(
        r["rebuilt_ttft_s"] / r["masked_ttft_s"] for r in rows
    )
    summary["fuse_all_s_median"] = statistics.median(r["fuse_all_s"] for r in rows)
    out.write_text(json.dumps({"summary": summary, "rows": rows, "command": sys.argv}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
