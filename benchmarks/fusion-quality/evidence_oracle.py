"""Where does a fused prompt lose a paraphrased fact? An oracle: EPIC's heads plus every token of the chunk that
holds the planted fact (known here from the answer), recomputed in context. If the fact comes back, what is lost
sits in the evidence chunk's cache (beyond the fact's own sentence, which `epic_evidence` recomputes); if not, in
the other chunks' caches. Reads a `rag-kvcache bench` run of planted facts (its `--out` folder: the index, the
records of `full` and the other methods), answers each question whose fact chunk was retrieved once more with the
oracle on the same prompt, and counts planted-fact hits on the questions `full` answers.

    python benchmarks/fusion-quality/evidence_oracle.py planted-paraphrased /tmp/evp40 [OUT.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rag_kvcache.bench.corpus import place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.metrics import contains_answer
from rag_kvcache.config import FusionConfig, GenerationConfig
from rag_kvcache.engine.fusion import selective_prefill
from rag_kvcache.engine.methods import chunk_heads, register
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator

kind, out = sys.argv[1], Path(sys.argv[2])
plan = json.loads((out / "plan.json").read_text())
index = KVIndex.open(out / "work" / "index", KVIndex.config_of(out / "work" / "index"))
generator = FusedGenerator(index)
records: dict[str, dict[str, dict]] = {}
for line in (out / "records.jsonl").read_text().splitlines():
    r = json.loads(line)
    records.setdefault(r["id"], {})[r["method"]] = r
evidence_label = [""]  # the prompt segment holding the fact, set per question


@register("oracle_chunk")
def oracle_chunk(adapter, inp, cfg, clock=None, reader=None):
    whole = inp.token_mask(lambda p: p.segment.label == evidence_label[0])  # [N]
    active = inp.fresh | chunk_heads(inp, cfg.epic_k) | (whole & inp.reusable)  # [N]
    return selective_prefill(adapter, inp, active.nonzero()[:, 0], clock=clock, reader=reader)


generation = GenerationConfig(max_new_tokens=plan["max_new_tokens"])
rows = []
for ex in load_dataset(f"{kind}:/work/shared/data/musique_dev.json", top_k=plan["top_k"])[: len(records)]:
    hits, found = place_evidence(index.search(ex.question, plan["top_k"]), ex)
    if found is None or ex.id not in records:
        continue
    evidence_label[0] = f"chunk{ex.evidence_rank}"  # PromptFormat.segments labels chunk i "chunk{i}"
    answer = generator.ask(ex.question, hits, fusion=FusionConfig(method="oracle_chunk"), generation=generation)
    m = records[ex.id]
    rows.append(
        {
            "id": ex.id,
            "full_hit": m["full"]["exact_hit"],
            "oracle_hit": contains_answer(answer.answer, ex.answers),
            "oracle_recomputed": answer.recomputed_tokens,
            **{f"{k}_hit": v["exact_hit"] for k, v in m.items() if k != "full"},
        }
    )
right = [r for r in rows if r["full_hit"]]
summary = {
    "questions": len(rows),
    "full_right": len(right),
    "oracle_right_of_those": sum(r["oracle_hit"] for r in right),
    "oracle_recomputed_mean": sum(r["oracle_recomputed"] for r in rows) / len(rows),
    **{
        k: sum(bool(r.get(k)) for r in right)
        for k in sorted({k for r in rows for k in r if k.endswith("_hit")})
        if k not in ("full_hit", "oracle_hit")
    },
}
print(json.dumps(summary, indent=1))
if len(sys.argv) > 3:
    Path(sys.argv[3]).write_text(json.dumps({"summary": summary, "questions": rows}, indent=1))
