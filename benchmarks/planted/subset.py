"""Planted facts over a smaller corpus: each question keeps the passage its fact was planted in and the
first N-1 of its other passages, written as the bench's plain JSONL (read with `--dataset FILE.jsonl`).

    .venv/bin/python benchmarks/planted/subset.py ../shared/data/musique_dev.json 4 /tmp/planted-4.jsonl

A neighbours index prefills each chunk behind its neighbours too (~4.4x the default index's work):
over MuSiQue's ten passages per question that is hours on a 2-core CPU; four keep the task (the fact
is retrieved from among the question's and every other question's passages) at 40% of the corpus.
The output quotes the dataset: write it outside the repository.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from rag_kvcache.bench.datasets import load_dataset, write_jsonl
from rag_kvcache.bench.metrics import contains_answer


def main(passages_file: str, keep: int, out: str) -> None:
    if keep < 1:
        raise SystemExit(f"passages per question must be >= 1, got {keep}")
    examples = []
    for ex in load_dataset(f"planted:{passages_file}"):
        planted = [d for d in ex.documents if contains_answer(d.text, ex.answers)]
        if len(planted) != 1:
            raise SystemExit(f"{ex.id}: expected one passage holding {ex.answers[0]!r}, found {len(planted)}")
        others = [d for d in ex.documents if d is not planted[0]][: keep - 1]
        examples.append(replace(ex, documents=tuple(d for d in ex.documents if d is planted[0] or d in others)))
    write_jsonl(examples, out)
    print(f"{len(examples)} planted questions, {keep} passages each -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
