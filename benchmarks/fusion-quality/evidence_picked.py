"""Does `epic_evidence` pick the planted fact's sentence? For each planted question of a `rag-kvcache bench`
run (its `--out` folder, reusing its index): the prompt's chunks as the bench lays them out (retrieved, the
fact's chunk moved to its rank), the sentences the first chunk's cache does not make exact scored by the
index's embedder (`sentences.sentence_relevance`), the `evidence_sentences` best taken (`closest_sentences`),
and whether one of them holds the fact's answer; beside it, `full`'s and `epic_evidence`'s planted-fact hit.
No model is run: the question is embedded from its own tokens (the bench's prompt wraps it in a template).

    python benchmarks/fusion-quality/evidence_picked.py planted-paraphrased /tmp/evp40 MODEL_DIR [OUT.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rag_kvcache.bench.corpus import place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.sentences import Lexicon, closest_sentences, sentence_ids, sentence_relevance
from rag_kvcache.retrieval.chunk_index import ChunkIndex
from rag_kvcache.retrieval.embedder import load_embedder

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
n_sentences = FusionConfig().evidence_sentences
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
