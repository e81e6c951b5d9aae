"""The agentic RAG graph (`create_agentic_rag_graph`: retrieve 4 chunks, grade each one's relevance, answer from
those judged relevant) as a LangGraph graph, twice over the same engine: on the caches (`RagKVCacheGrader`, then
`ChatRagKVCache` with its default fusion) and as a plain chat model runs it (`ChatModelGrader` over
`ChatRagKVCache(fusion=full)`: every grading prompt and the answer prefilled in full). From the repository root,
in `.venv`:

    flock /tmp/bench.lock nice -n 5 .venv/bin/python benchmarks/chat/agentic.py INDEX OUT.json

INDEX: the demo documents indexed with 128-token chunks (built there if missing). The engine keeps no
conversation cache (both runs would otherwise read earlier prompts' K/V). The plain grader judges each document
by the first token of its answer ("yes" or not); the cached one by P(yes) >= 0.5 of the same first token (it
reads no text). End-to-end seconds per question for both, each question once after a warm-up; the final
answers' fidelity: the plain run's answer forced through the cached run's fused prompt (teacher-forced KL, top-1
agreement; `bench.metrics.teacher_forced`), for the questions whose two runs kept the same documents.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from functools import partial
from importlib.resources import files
from pathlib import Path

from langchain_core.messages import HumanMessage
from langchain_rag_kvcache import (
    ChatModelGrader,
    ChatRagKVCache,
    RagKVCacheGrader,
    RagKVCacheRetriever,
    rag_message,
)
from langchain_rag_kvcache.chat_models import _prompt
from langchain_rag_kvcache.graph import create_agentic_rag_graph

from rag_kvcache import Config, Engine, FusionConfig, GenerationConfig, IndexSettings, KVIndex
from rag_kvcache.bench.fidelity import greedy_answer_ids
from rag_kvcache.bench.metrics import teacher_forced
from rag_kvcache.engine.generation import teacher_forced_logits
from rag_kvcache.request import Options

QUESTIONS = (
    "What is the main telescope of the Veldmark Observatory named?",
    "Who founded the observatory?",
    "How often is there a public viewing night?",
    "Where is the logbook kept?",
    "What is the harbour called?",
    "Who was Tobias Quell?",
    "What is Tessaly known for?",
    "What is Saltmere?",
)
FULL = FusionConfig(method="full")
MAX_TOKENS = 32


def main() -> None:
    index_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    if not (index_dir / "index.sqlite").is_file():
        KVIndex.build(
            files("rag_kvcache") / "demo", index_dir, Config(index=IndexSettings(chunk_tokens=128)), progress=False
        ).close()
    config = KVIndex.config_of(index_dir).with_storage(conversation_bytes=0)
    rows = []
    with Engine(index_dir, config) as engine:
        retriever = RagKVCacheRetriever(engine=engine, k=4)
        cached_model = ChatRagKVCache(engine=engine, max_tokens=MAX_TOKENS)
        plain_model = ChatRagKVCache(engine=engine, fusion=FULL, max_tokens=MAX_TOKENS)
        graphs = [
            create_agentic_rag_graph(retriever, RagKVCacheGrader(engine=engine), cached_model),
            create_agentic_rag_graph(retriever, ChatModelGrader(model=plain_model), plain_model),
        ]

        def run(graph, question: str):
            state = graph.invoke({"question": question})
            return state["documents"], state["answer"]

        cached, plain = (partial(run, graph) for graph in graphs)

        cached(QUESTIONS[0]), plain(QUESTIONS[0])  # warm-up
        for question in QUESTIONS:
            t0 = time.perf_counter()
            kept_c, answer_c = cached(question)
            t1 = time.perf_counter()
            kept_p, answer_p = plain(question)
            t2 = time.perf_counter()
            row = {
                "question": question,
                "cached_s": t1 - t0,
                "plain_s": t2 - t1,
                "kept_cached": [d.id for d in kept_c],
                "kept_plain": [d.id for d in kept_p],
                "answer_cached": answer_c.text,
                "answer_plain": answer_p.text,
            }
            if row["kept_cached"] == row["kept_plain"]:
                row |= engine.run(fidelity, engine, [rag_message(kept_c, question)], cached_model.fusion)
            rows.append(row)
            print(
                f"{question[:50]:50s} cached {row['cached_s']:.2f} s, plain {row['plain_s']:.2f} s, kept "
                f"{len(kept_c)}/{len(kept_p)}, tf_kl {row.get('tf_kl', float('nan')):.3f}",
                flush=True,
            )
    ratio = statistics.median(r["plain_s"] / r["cached_s"] for r in rows)
    same = [r for r in rows if "tf_kl" in r]
    summary = {
        "questions": len(rows),
        "median_plain_over_cached": ratio,
        "cached_s_median": statistics.median(r["cached_s"] for r in rows),
        "plain_s_median": statistics.median(r["plain_s"] for r in rows),
        "same_documents_kept": len(same),
        "tf_kl_mean": statistics.mean(r["tf_kl"] for r in same) if same else None,
        "tf_top1_mean": statistics.mean(r["tf_top1"] for r in same) if same else None,
    }
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))


def fidelity(engine: Engine, messages: list[HumanMessage], fusion: FusionConfig) -> dict:
    """The plain run's answer (full prefill, greedy) forced through the cached run's fused prompt."""
    generator, adapter = engine.generator, engine.generator.adapter
    segments = _prompt(generator, messages, Options(fusion=fusion)).segments
    reference = generator.fuse(segments, FULL)
    answer = greedy_answer_ids(adapter, reference, GenerationConfig(max_new_tokens=MAX_TOKENS))
    if not answer:
        return {}
    fused = generator.fuse(segments, fusion).result
    ref, got = (
        teacher_forced_logits(adapter, r.keys, r.values, r.logits, answer).cpu().numpy()
        for r in (reference.result, fused)
    )  # [T, V] x 2
    scores = teacher_forced(ref, got, answer)
    return {"tf_kl": scores["tf_kl"], "tf_top1": scores["tf_top1"]}


if __name__ == "__main__":
    main()
