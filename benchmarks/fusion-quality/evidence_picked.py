"""Does `epic_evidence` (a fusion method since removed from the package: EPIC plus the sentences the index's
embedder finds closest to the question; `sentence_relevance` and `closest_sentences` below are its selection)
pick the planted fact's sentence? For each planted question of a `rag-kvcache bench`
run (its `--out` folder, reusing its index): the prompt's chunks as the bench lays them out (retrieved, the
fact's chunk moved to its rank), the sentences the first chunk's cache does not make exact scored by the
index's embedder (`sentence_relevance`), the `N_SENTENCES` best taken (`closest_sentences`),
and whether one of them holds the fact's answer; beside it, `full`'s and `epic_evidence`'s planted-fact hit.
No model is run: the question is embedded from its own tokens (the bench's prompt wraps it in a template).

    python benchmarks/fusion-quality/evidence_picked.py planted-paraphrased /tmp/evp40 MODEL_DIR [OUT.json]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rag_kvcache.bench.corpus import place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.engine.sentences import MAX_SENTENCE_TOKENS, Lexicon, sentence_ids
from rag_kvcache.retrieval.chunk_index import ChunkIndex
from rag_kvcache.retrieval.embedder import load_embedder

N_SENTENCES = 2  # epic_evidence's default: sentences recomputed a prompt


Embed = Callable[[list[str]], np.ndarray]  # texts -> [T, E] L2-normalised embeddings


def sentence_relevance(
    ids: torch.Tensor,
    lexicon: Lexicon,
    part: torch.Tensor,
    candidate: torch.Tensor,
    question: torch.Tensor,
    tokenizer: PreTrainedTokenizerFast,
    embed: Embed,
) -> torch.Tensor:
    """Each token's sentence's cosine similarity to the question [N], as `embed` reads both texts, for the
    sentences within `candidate` tokens (no longer than MAX_SENTENCE_TOKENS); -inf for every other token.
    One `embed` call for the question and every scored sentence. `ids`, `part` [N]: token ids and segment
    numbers; `candidate`, `question` [N] bool."""
    sentence = sentence_ids(lexicon.sentence_end[ids], part)  # [N]
    lengths = torch.bincount(sentence)  # [S]
    outside = torch.zeros_like(lengths).index_add_(0, sentence, (~candidate).long())  # [S], tokens not candidates
    scored = ((outside == 0) & (lengths <= MAX_SENTENCE_TOKENS)).nonzero()[:, 0]  # [S']
    relevance = torch.full(lengths.shape, -torch.inf, device=ids.device)  # [S]
    if scored.numel():
        words = torch.split(ids.cpu(), lengths.tolist())  # S tensors of token ids, the sentences in order
        asked = str(tokenizer.decode(ids[question].tolist(), skip_special_tokens=True))
        texts = [str(tokenizer.decode(words[s].tolist(), skip_special_tokens=True)) for s in scored.tolist()]
        vectors = embed([asked, *texts])  # [1 + S', E]
        cosine = torch.from_numpy(np.asarray(vectors[1:] @ vectors[0], dtype=np.float32))  # [S']
        relevance[scored] = cosine.to(ids.device)
    return relevance[sentence]  # [N]


def closest_sentences(relevance: torch.Tensor, sentence: torch.Tensor, n: int) -> torch.Tensor:
    """The tokens [N] of the `n` sentences of highest `relevance` ([N], each token its sentence's score, -inf:
    never chosen); `sentence` [N] numbers each token's sentence (`sentence_ids`)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    score = torch.full((int(sentence[-1]) + 1,), -torch.inf, device=relevance.device)  # [S]
    score = score.scatter_reduce(0, sentence, relevance, "amax")  # [S]
    best = score.topk(min(n, score.numel())).indices  # [n]
    chosen = torch.zeros_like(score, dtype=torch.bool).index_fill_(0, best, True) & score.isfinite()  # [S]
    return chosen[sentence]  # [N]


kind, out, model_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
plan = json.loads((out / "plan.json").read_text())
tok = AutoTokenizer.from_pretrained(model_dir)
lexicon = Lexicon.of(tok)
embedder = load_embedder()
chunks = ChunkIndex.open(out / "work" / "index", embedder)
records: dict[str, dict[str, dict]] = {}
for line in (out / "records.jsonl").read_text().splitlines():
    r = json.loads(line)
    records.setdefault(r["id"], {})[r["method"]] = r
n_sentences = N_SENTENCES
rows = []
for ex in load_dataset(f"{kind}:/work/shared/data/musique_dev.json", top_k=plan["top_k"])[: len(records)]:
    hits, found = place_evidence(chunks.search(ex.question, plan["top_k"]), ex)
    if found is None:
        continue
    runs = [h.chunk.token_ids for h in hits] + [tuple(tok(ex.question, add_special_tokens=False)["input_ids"])]
    ids = torch.tensor([t for run in runs for t in run])
    part = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor([len(run) for run in runs]))
    inexact = (part >= 1) & (part < len(runs) - 1)  # the first chunk's behind-prefix cache is exact
    relevance = sentence_relevance(
        ids,
        lexicon,
        part,
        inexact,
        part == len(runs) - 1,
        tok,
        chunks.embed,  # as the generator scores them (`KVIndex.embed`)
    )
    sentence = sentence_ids(lexicon.sentence_end[ids], part)
    picked = sentence[closest_sentences(relevance, sentence, n_sentences)].unique()
    texts = [tok.decode(ids[sentence == s]).lower() for s in picked.tolist()]
    m = records.get(ex.id, {})
    rows.append(
        {
            "id": ex.id,
            "fact_picked": any(ex.answers[0].lower() in t for t in texts),
            "full_hit": m.get("full", {}).get("exact_hit"),
            "evidence_hit": m.get("epic_evidence", {}).get("exact_hit"),
        }
    )
summary = {
    "questions_with_fact_retrieved": len(rows),
    "fact_picked": sum(r["fact_picked"] for r in rows),
    "full_right": sum(bool(r["full_hit"]) for r in rows),
    "full_right_and_picked": sum(bool(r["full_hit"]) and r["fact_picked"] for r in rows),
    "full_right_picked_and_epic_evidence_right": sum(
        bool(r["full_hit"]) and r["fact_picked"] and bool(r["evidence_hit"]) for r in rows
    ),
}
print(json.dumps(summary, indent=1))
if len(sys.argv) > 4:
    Path(sys.argv[4]).write_text(json.dumps({"summary": summary, "questions": rows}, indent=1))
