"""How much a relevance check loses by reading a chunk's cache where that cache is not exact: on an index of the
default grouped caches, every retrieved chunk of each MuSiQue question checked twice, side by side, by
`RelevanceCheck(exact=True)` (a chunk computed behind its group's earlier chunks is computed again: each
verdict a full prefill's) and by the default `RelevanceCheck()` (every cache read, re-rotated: only the check
question computed). From the repository root, in `.venv`:

    flock /tmp/bench.lock nice -n 5 .venv/bin/python benchmarks/chat/relevance_fidelity.py \
        --data ../shared/data/musique_dev.json --work /tmp/relevance OUT.json

Reports, over the chunks whose caches are not exact in the check prompt (the others are the same in both):
verdict agreement at the check's threshold and at the exact P(yes)'s median (a threshold that splits them),
|P(yes) read - P(yes) exact| (mean, max), Spearman's rank correlation of the two, and, as a weak label, the mean
P(yes) of the chunks that contain a gold answer string against the others' (whether the model's check says
anything here); and both checks' seconds per question (the same chunks, the calls alternating). The passages are written under --work at run time (never committed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from rag_kvcache import FusedGenerator
from rag_kvcache.bench.corpus import question_index
from rag_kvcache.bench.datasets import load_musique
from rag_kvcache.bench.metrics import spearman
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.query.relevance import RELEVANCE_CHECK, RelevanceCheck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="MuSiQue JSON (a list of questions with ctxs)")
    parser.add_argument("--work", type=Path, required=True, help="where the passages and the index go")
    parser.add_argument("out", type=Path, help="JSON with every chunk's two verdicts and the summary")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    args = parser.parse_args()

    data = load_musique(args.data)[: args.questions]
    index = question_index(data, args.work, args.chunk_tokens, chunk_prefill="grouped")
    if (mode := index.config.index.chunk_prefill) != "grouped":
        parser.error(f"{args.work / 'index'} has {mode!r} caches; this compares checks on grouped ones")
    generator = FusedGenerator(index)
    read, exact = RelevanceCheck(generator), RelevanceCheck(generator, exact=True)
    fmt, tokenizer = index.format, index.adapter.tokenizer

    rows, seconds = [], {"read": [], "exact": []}
    warm = [hit.chunk for hit in index.search(data[0].question, args.top_k)]
    read(data[0].question, warm), exact(data[0].question, warm)
    for qi, example in enumerate(data):
        chunks = [hit.chunk for hit in index.search(example.question, args.top_k)]
        verdicts = {}
        for name, check in (("read", read), ("exact", exact)) if qi % 2 == 0 else (("exact", exact), ("read", read)):
            t0 = time.perf_counter()
            verdicts[name] = check(example.question, chunks)
            seconds[name].append(time.perf_counter() - t0)
        answers = [a.lower() for a in example.answers]
        check_ids = fmt.question_ids(tokenizer, RELEVANCE_CHECK.format(question=example.question))
        for chunk, r, e in zip(chunks, verdicts["read"], verdicts["exact"]):
            segments = fmt.segments([chunk.token_ids], check_ids)
            opened = index.caches.open(segments)
            rows.append(
                {
                    "question": qi,
                    "chunk": chunk.id,
                    "cache_exact": FusionInput.build(segments, opened.sources, opened.contexts).parts[1].exact,
                    "has_answer": any(a in chunk.text.lower() for a in answers),
                    "p_yes_read": r.p_yes,
                    "p_yes_exact": e.p_yes,
                    "computed_read": r.computed_tokens,
                    "computed_exact": e.computed_tokens,
                }
            )
    moved = [r for r in rows if not r["cache_exact"]]
    if not moved:
        parser.error("every retrieved chunk's cache is exact in its check prompt: nothing to compare")
    got, want = (np.array([r[key] for r in moved]) for key in ("p_yes_read", "p_yes_exact"))  # [M] x 2
    gold = np.array([r["has_answer"] for r in moved])  # [M]
    median = float(np.median(want))
    summary = {
        "questions": len(data),
        "chunks_checked": len(rows),
        "chunks_not_exact": len(moved),
        "verdict_agreement": float(np.mean((got >= read.threshold) == (want >= read.threshold))),
        "kept_read": int((got >= read.threshold).sum()),
        "kept_exact": int((want >= read.threshold).sum()),
        "verdict_agreement_at_median": float(np.mean((got >= median) == (want >= median))),
        "p_yes_abs_diff_mean": float(np.abs(got - want).mean()),
        "p_yes_abs_diff_max": float(np.abs(got - want).max()),
        "spearman": spearman(got, want),
        "answer_chunks_not_exact": int(gold.sum()),
        "p_yes_exact_answer_chunks": float(want[gold].mean()) if gold.any() else None,
        "p_yes_exact_other_chunks": float(want[~gold].mean()) if (~gold).any() else None,
        "computed_tokens_read": statistics.mean(r["computed_read"] for r in rows),
        "computed_tokens_exact": statistics.mean(r["computed_exact"] for r in rows),
        "seconds_read_median": statistics.median(seconds["read"]),
        "seconds_exact_median": statistics.median(seconds["exact"]),
    }
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
