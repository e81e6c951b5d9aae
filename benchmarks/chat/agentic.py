"""The agentic RAG graph (`create_agentic_rag_graph`: retrieve 4 chunks, grade each one's relevance, answer from
those judged relevant) as a LangGraph graph, three times over the same engine: on the caches (`RagKVCacheGrader`,
then `ChatRagKVCache` with its default fusion), over one shared fused prompt (`create_shared_prompt_rag_graph`: the
checks and the answer read one prompt, rejected documents hidden) and as a plain chat model runs it
(`ChatModelGrader` over `ChatRagKVCache(fusion=full)`: every grading prompt and the answer prefilled in full). From
the repository root, in `.venv`:

    flock /tmp/bench.lock nice -n 5 .venv/bin/python benchmarks/chat/agentic.py INDEX OUT.json
    flock /tmp/bench.lock .venv/bin/python benchmarks/chat/agentic.py INDEX OUT.json \
        --dataset ../shared/data/musique_dev.json --limit 16

INDEX is built there if missing: by default from the demo documents at 128-token chunks (LangChain's agentic RAG
tutorial splits its documents into 100-token chunks) and asked `QUESTIONS`; with `--dataset`, from the passages of a
QA set's first `--limit` questions (`bench.datasets.load_dataset`; `bench.corpus.build_index` writes them to `docs`
beside INDEX) at the index's default chunk size, and asked those questions. `--chunk-tokens` and `--dtype` set the
size and the model's dtype for either. The engine keeps no conversation cache (both runs would otherwise read
earlier prompts' K/V). Every graph lays its documents out in the index's chunk order (`QueryConfig.chunk_order`: the
best last). The plain grader judges each document by the first token of its answer ("yes" or not); the
cached one by P(yes) >= 0.5 of the same first token (it reads no text; the shared graph's checks read each chunk
where it sits in the answer's prompt). End-to-end seconds per question for each, the three run in turn for each
question, once after a warm-up; the final answers' fidelity: the plain run's answer forced through the cached run's
fused prompt, and through the shared run's with its hidden documents (teacher-forced KL, top-1 agreement;
`bench.metrics.teacher_forced`), for the questions whose runs kept the same documents as the plain one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from importlib.resources import files
from pathlib import Path

import torch
from langchain_core.messages import HumanMessage
from langchain_rag_kvcache import (
    ChatModelGrader,
    ChatRagKVCache,
    RagKVCacheGrader,
    RagKVCacheRetriever,
    rag_message,
)
from langchain_rag_kvcache.chat_models import _prompt
from langchain_rag_kvcache.graph import create_agentic_rag_graph, create_shared_prompt_rag_graph

from rag_kvcache import Config, FusionConfig, GenerationConfig, IndexSettings, KVIndex, ServingEngine
from rag_kvcache.bench.corpus import build_index
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.fidelity import greedy_answer_ids
from rag_kvcache.bench.metrics import teacher_forced
from rag_kvcache.config import DTYPE_NAMES
from rag_kvcache.engine.fusion import FusionResult
from rag_kvcache.engine.generation import teacher_forced_logits
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.prompt import Segment
from rag_kvcache.query.agent import SharedPrompt
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.query.request import Options

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


def arguments() -> argparse.Namespace:
    defaults = IndexSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("index", type=Path, help="the index folder (built there if missing)")
    parser.add_argument("out", type=Path, help="where to write the JSON results")
    parser.add_argument("--dataset", help="a QA set (as `rag-kvcache bench --dataset`): its passages and questions")
    parser.add_argument("--limit", type=int, default=16, help="how many of the QA set's questions (default 16)")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        help=f"chunk size of a new index (default: 128 for the demo documents, {defaults.chunk_tokens} for a QA set)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=defaults.dtype,
        help=f"the model's dtype for a new index (default {defaults.dtype})",
    )
    args = parser.parse_args()
    if args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    return args


def questions_and_index(args: argparse.Namespace) -> tuple[list[str], Path]:
    """The questions to ask, and the index folder, built from the documents they are asked about if missing."""
    index_dir = args.index
    examples = load_dataset(args.dataset)[: args.limit] if args.dataset else None
    if not (index_dir / "index.sqlite").is_file():
        size = args.chunk_tokens or (IndexSettings().chunk_tokens if examples else 128)
        config = Config(index=IndexSettings(chunk_tokens=size, dtype=args.dtype))
        if examples is None:
            KVIndex.build(files("rag_kvcache") / "demo", index_dir, config, progress=False).close()
        else:  # the passages written beside it, in `docs`, as `rag-kvcache bench` lays out its work folder
            build_index(examples, index_dir.parent, config, ModelAdapter.load(config), True, index_dir.name)[0].close()
    return ([ex.question for ex in examples] if examples else list(QUESTIONS)), index_dir


def main() -> None:
    args = arguments()
    questions, index_dir = questions_and_index(args)
    config = KVIndex.config_of(index_dir).with_storage(conversation_bytes=0)
    rows = []
    with ServingEngine(index_dir, config) as engine:
        retriever = RagKVCacheRetriever(engine=engine, k=4)
        cached_model = ChatRagKVCache(engine=engine, max_tokens=MAX_TOKENS)
        plain_model = ChatRagKVCache(engine=engine, fusion=FULL, max_tokens=MAX_TOKENS)
        order = config.query  # how every graph lays its documents out (`QueryConfig.chunk_order`)
        graphs = {
            "cached": create_agentic_rag_graph(
                retriever, RagKVCacheGrader(engine=engine), cached_model, order.chunk_order
            ),
            "shared": create_shared_prompt_rag_graph(retriever, engine, max_tokens=MAX_TOKENS),
            "plain": create_agentic_rag_graph(
                retriever, ChatModelGrader(model=plain_model), plain_model, order.chunk_order
            ),
        }

        def run(graph, question: str):
            state = graph.invoke({"question": question})
            return state["documents"], state["answer"]

        runs = {name: partial(run, graph) for name, graph in graphs.items()}
        for go in runs.values():  # warm-up
            go(questions[0])
        for question in questions:
            row: dict = {"question": question}
            for name, go in runs.items():
                t0 = time.perf_counter()
                kept, answer = go(question)
                row |= {f"{name}_s": time.perf_counter() - t0, f"kept_{name}": [d.id for d in kept]}
                row |= {f"answer_{name}": answer.text, f"answer_ttft_{name}": answer.response_metadata["ttft_s"]}
            docs, fusion = retriever.invoke(question), cached_model.fusion
            laid = order.in_prompt_order(docs)  # as the graphs lay them out
            if row["kept_cached"] == row["kept_plain"]:
                kept = [d for d in laid if d.id in row["kept_cached"]]
                row |= engine.run(fidelity, engine, [rag_message(kept, question)], fusion)
            if row["kept_shared"] == row["kept_plain"]:
                ids, keep = (
                    [d.metadata["chunk_id"] for d in laid],
                    [i for i, d in enumerate(laid) if d.id in row["kept_shared"]],
                )
                shared = engine.run(shared_fidelity, engine, question, ids, keep, fusion)
                row |= {f"shared_{k}": v for k, v in shared.items()}
            rows.append(row)
            print(
                f"{question[:44]:44s} cached {row['cached_s']:.2f} s, shared {row['shared_s']:.2f} s, plain "
                f"{row['plain_s']:.2f} s, kept {len(row['kept_cached'])}/{len(row['kept_shared'])}/"
                f"{len(row['kept_plain'])}, tf_kl {row.get('tf_kl', float('nan')):.3f} / "
                f"{row.get('shared_tf_kl', float('nan')):.3f}",
                flush=True,
            )
    same = [r for r in rows if "tf_kl" in r]
    same_shared = [r for r in rows if "shared_tf_kl" in r]
    summary = {
        "questions": len(rows),
        "median_plain_over_cached": statistics.median(r["plain_s"] / r["cached_s"] for r in rows),
        "median_plain_over_shared": statistics.median(r["plain_s"] / r["shared_s"] for r in rows),
        "median_cached_over_shared": statistics.median(r["cached_s"] / r["shared_s"] for r in rows),
        "plain_over_cached_of_means": statistics.mean(r["plain_s"] for r in rows)
        / statistics.mean(r["cached_s"] for r in rows),
        **{f"{name}_s_median": statistics.median(r[f"{name}_s"] for r in rows) for name in graphs},
        "same_documents_kept": len(same),
        "tf_kl_mean": statistics.mean(r["tf_kl"] for r in same) if same else None,
        "tf_top1_mean": statistics.mean(r["tf_top1"] for r in same) if same else None,
        "shared_same_documents_kept": len(same_shared),
        "shared_tf_kl_mean": statistics.mean(r["shared_tf_kl"] for r in same_shared) if same_shared else None,
        "shared_tf_top1_mean": statistics.mean(r["shared_tf_top1"] for r in same_shared) if same_shared else None,
    }
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))


def full_reference(generator: FusedGenerator, segments: list[Segment]) -> tuple[list[int], torch.Tensor | None]:
    """`full`'s greedy answer over the prompt (at most `MAX_TOKENS`) and its teacher-forced logits there [T, V]
    (no answer: `[]`, None)."""
    reference = generator.fuse(segments, FULL)
    answer = greedy_answer_ids(generator.adapter, reference, GenerationConfig(max_new_tokens=MAX_TOKENS))
    if not answer:
        return [], None
    return answer, forced(generator, reference.result, answer)


def forced(generator: FusedGenerator, result: FusionResult, answer: list[int]) -> torch.Tensor:
    """`answer` teacher-forced through a fused prompt: the next-token logits at each of its positions [T, V]."""
    return teacher_forced_logits(generator.adapter, result.keys, result.values, result.logits, answer)


def scored(reference: torch.Tensor, got: torch.Tensor, answer: list[int]) -> dict:
    scores = teacher_forced(reference.cpu().numpy(), got.cpu().numpy(), answer)
    return {"tf_kl": scores["tf_kl"], "tf_top1": scores["tf_top1"]}


def fidelity(engine: ServingEngine, messages: list[HumanMessage], fusion: FusionConfig) -> dict:
    """The plain run's answer (full prefill, greedy) forced through the cached run's fused prompt."""
    generator = engine.generator
    segments = _prompt(generator, messages, Options(fusion=fusion)).segments
    answer, ref = full_reference(generator, segments)
    if ref is None:
        return {}
    fused = generator.fuse(segments, fusion).result
    return scored(ref, forced(generator, fused, answer), answer)


def shared_fidelity(
    engine: ServingEngine, question: str, ids: list[str], keep: list[int], fusion: FusionConfig
) -> dict:
    """The plain run's answer (full prefill of the kept documents, greedy) forced through the shared prompt with
    the others hidden: the question computed again over the kept chunks, then the answer a token at a time (on
    the engine's thread)."""
    generator, fmt = engine.generator, engine.generator.index.format
    chunks = generator.index.chunks.get(ids)
    kept = fmt.segments([chunks[i].token_ids for i in keep], fmt.question_ids(generator.adapter.tokenizer, question))
    answer, ref = full_reference(generator, kept)
    if ref is None:
        return {}
    return scored(ref, SharedPrompt(generator, question, chunks, fusion).forced_logits(keep, answer), answer)


if __name__ == "__main__":
    main()
