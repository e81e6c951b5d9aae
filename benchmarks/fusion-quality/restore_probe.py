"""Where a fused cache loses a planted fact: full's K/V put back into it, one piece at a time.

Over a finished `bench` run on planted facts with `METHOD@neighbours` (its `--out`), for each question the
run's `--label` row lost (or the `--ids` given): the prompt is fused by the method and by `full`; then, for
each retrieved chunk after the first, full's K/V replace the fused ones over that chunk (every layer), the
question is recomputed over the hybrid, and the greedy answer is read. Inside each chunk that holds the
fact or another question's fact, the same for its planted sentence alone, the rest of the chunk, and each
half of the layers. An oracle that locates the error, not a method (session 9's RESULTS, issue 13).

    .venv/bin/python benchmarks/fusion-quality/restore_probe.py /tmp/b14/p88g /tmp/b13/planted-3.jsonl \\
        --label "epic@neighbours k=19" --method epic --k 19
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rag_kvcache.bench.corpus import distractors_in, place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.metrics import contains_answer
from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.fusion import FusionResult
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator


def greedy_over(adapter: ModelAdapter, keys, values, start: int, suffix: list[int], max_new_tokens: int) -> str:
    """The greedy answer when the prompt's first `start` tokens have K/V `keys`, `values` (L x [H_kv, N, D])
    and the `suffix` after them is computed over them."""
    cache = adapter.make_cache([k[:, :start].clone() for k in keys], [v[:, :start].clone() for v in values])
    logits = adapter.decode(suffix, cache, start)[-1]  # [V]
    position, out = start + len(suffix), []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        if token == adapter.tokenizer.eos_token_id:
            break
        out.append(token)
        logits = adapter.decode([token], cache, position)[-1]  # [V]
        position += 1
    return adapter.tokenizer.decode(out)


@dataclass(frozen=True)
class Hybrid:
    """One prompt fused two ways: `fused` by the method, `full` by a full prefill (FusionResults)."""

    adapter: ModelAdapter
    fused: FusionResult
    full: FusionResult
    prompt: list[int]
    head: int  # tokens before the recomputed tail (the question)
    answers: tuple[str, ...]
    max_new_tokens: int

    def restored(self, positions: list[int], layers: range) -> bool:
        """Is the fact answered when the fused cache takes full's K/V at `positions` in `layers`?"""
        keys, values = [k.clone() for k in self.fused.keys], [v.clone() for v in self.fused.values]
        at = torch.tensor(positions, dtype=torch.long)
        for layer in layers:
            keys[layer][:, at] = self.full.keys[layer][:, at]
            values[layer][:, at] = self.full.values[layer][:, at]
        answer = greedy_over(self.adapter, keys, values, self.head, self.prompt[self.head :], self.max_new_tokens)
        return contains_answer(answer, self.answers)


def sentence_of(adapter: ModelAdapter, ids: tuple[int, ...], values: list[str]) -> list[int]:
    """Positions in `ids` of the sentence that holds any of `values` (empty if none does)."""
    pieces = [adapter.tokenizer.decode([t]) for t in ids]
    ends = torch.tensor([len(p) for p in pieces]).cumsum(0).tolist()
    text = "".join(pieces).lower()
    for value in values:
        at = text.find(value.lower())
        if at >= 0:
            begin = text.rfind(". ", 0, at) + 1
            end = text.find(".", at + len(value))
            end = len(text) if end < 0 else end + 1
            return [j for j, e in enumerate(ends) if e > begin and e - len(pieces[j]) < end]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench --out directory on planted facts, with work/index-neighbours")
    ap.add_argument("dataset", help="the planted-fact dataset the run used")
    ap.add_argument("--label", default="epic@neighbours k=19", help="the run's row whose lost facts are probed")
    ap.add_argument("--ids", default="", help="comma-separated question ids instead of the row's lost facts")
    ap.add_argument("--method", default="epic")
    ap.add_argument("--k", type=int, default=19, help="the method's epic_k")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, help="JSON lines, one per question")
    args = ap.parse_args()
    torch.set_num_threads(1)

    records = [json.loads(line) for line in (args.run / "records.jsonl").open()]
    full_ok = {r["id"] for r in records if r["label"] == "full" and r["exact_hit"]}
    ids = (
        args.ids.split(",")
        if args.ids
        else [r["id"] for r in records if r["label"] == args.label and r["id"] in full_ok and not r["exact_hit"]]
    )
    index = KVIndex.open(args.run / "work" / "index")
    neighbours = KVIndex.open(args.run / "work" / "index-neighbours", adapter=index.adapter)
    reference, generator = FusedGenerator(index), FusedGenerator(neighbours)
    adapter, fmt = index.adapter, index.format
    examples = {e.id: e for e in load_dataset(args.dataset)}
    facts = frozenset(a for e in examples.values() if e.task == "exact" for a in e.answers)
    fusion = FusionConfig(method=args.method, epic_k=args.k)
    n_layers = adapter.layout.n_layers
    out = args.out.open("a") if args.out else None

    for qid in ids:
        ex = examples[qid]
        hits, _ = place_evidence(index.search(ex.question, index.config.query.top_k), ex)
        order = [tuple(h.chunk.token_ids) for h in hits]
        segments = fmt.segments(order, fmt.question_ids(adapter.tokenizer, ex.question))
        spans, start = {}, 0
        for seg in segments:
            if tuple(seg.ids) in order:
                spans[order.index(tuple(seg.ids))] = (start, start + len(seg.ids))
            start += len(seg.ids)
        probe = Hybrid(
            adapter,
            generator.fuse(segments, fusion).result,
            reference.fuse(segments, FusionConfig(method="full")).result,
            [t for seg in segments for t in seg.ids],
            max(end for _, end in spans.values()),
            tuple(ex.answers),
            args.max_new_tokens,
        )
        restored = probe.restored
        others = distractors_in(hits, ex, facts)

        row = {
            "id": qid,
            "evidence_rank": ex.evidence_rank,
            "distractors": others,
            "distractor_ranks": [i for i, h in enumerate(hits) if others and contains_answer(h.chunk.text, others)],
            "fused": restored([], range(0)),
            "chunks": {},
            "inside": {},
        }
        for rank, (a, b) in sorted(spans.items()):
            if rank == 0:
                continue
            row["chunks"][rank] = restored(list(range(a, b)), range(n_layers))
            sentence = [a + j for j in sentence_of(adapter, order[rank], [*ex.answers, *others])]
            if sentence:
                rest = [p for p in range(a, b) if p not in sentence]
                half = n_layers // 2
                row["inside"][rank] = {
                    "sentence": restored(sentence, range(n_layers)),
                    "rest": restored(rest, range(n_layers)),
                    "first_half_layers": restored(list(range(a, b)), range(half)),
                    "second_half_layers": restored(list(range(a, b)), range(half, n_layers)),
                }
        print(json.dumps(row), flush=True)
        if out:
            print(json.dumps(row), file=out, flush=True)


if __name__ == "__main__":
    main()
