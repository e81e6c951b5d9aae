"""Cacheblend TTFT of LangChain's tutorial-chain prompt, and of LlamaIndex's default query engine's,
beside `create_kv_rag_chain`'s, same question and chunks, interleaved in one process (issue 11's "done when").

Two settings: the bundled demo documents (the default: 10 questions about them, 128-token chunks, top-4,
~400-token prompts), or with `--dataset` the first `--limit` questions of a QA set (MuSiQue JSON, as
`rag-kvcache bench` reads it) over the chunks the index retrieves for each (`KVIndex.search`, top
`--top-k`), as `bench` retrieves them: at 512-token chunks and top-6, ~2,900-token prompts. An existing
`--index` is opened as it is (it must have `--chunk-tokens`; nothing is added to it but the caches of the
layouts' heads, of first chunks behind them and of template text); a missing one is built from those
questions' passages, written to `docs/` beside it (`bench.corpus.build_index`).

Both layouts are built as `ChatRagKVCache` builds them (`chat_segments`, then the chunks found by their
token ids): `create_kv_rag_chain` sends one user message of chunk blocks and the question (the fused
prompt's own layout); the tutorial chain sends a system message of instructions with the documents
joined by `format_docs`, then the question; LlamaIndex's sends its text-QA system message, then the
default text-QA template over the stripped chunk texts (`rag_kvcache.bench.prompts`), its text after the
chunks read from the cache the generator learned it into (`FusionConfig.template_text`), and once more
with that text computed (`llamaindex, template computed`: the same prompt, the layout before template caching).

Every question is first asked once in each layout untimed (the tutorial head's cache, and its first
chunk's behind that head, are computed and stored then, and the template text after the chunks is
learned, as a pipeline's first requests do), then `--repeats` times, the order of the layouts reversed
every other repeat. Printed: per question and layout, where the prompt's tokens are (computed:
no cache; cached inexact: CacheBlend's candidates; cached exact) split by place (head, first chunk, the
other chunks, edges between chunks, learned template text, after the last chunk), and the tokens CacheBlend recomputed; then the
medians of TTFT and of its stages per layout, and the median over questions of the per-question ratio
to `create_kv_rag_chain` (each question's median over repeats), with a 95% bootstrap CI over questions,
for the TTFT alone, with the prompt's building (rendering, tokenising, matching) added, and for the
process's CPU time over both (`time.process_time`: the work done, which other processes on a shared
machine disturb far less than the wall clock; with `--threads 1` it is the single-thread TTFT's cost).

    .venv/bin/python benchmarks/transparent-reuse/tutorial_ttft.py --index /tmp/ttft/idx --repeats 5 --threads 1
    .venv/bin/python benchmarks/transparent-reuse/tutorial_ttft.py --index /tmp/bench/musique/work/index \
        --dataset /work/shared/data/musique_dev.json --limit 12 --chunk-tokens 512 --top-k 6 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import replace
from functools import partial
from importlib.resources import as_file, files
from pathlib import Path

import numpy as np
import torch
from scipy.stats import bootstrap

from rag_kvcache.bench.corpus import build_index
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.prompts import style_messages
from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.prompt import ChatTurn, ChunkPart, Segment, chat_segments
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.retrieval.database import exists

TUTORIAL_SYSTEM = (  # the system prompt of the integration's tutorial-chain tests
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. Keep the answer concise.\n\n{context}"
)
QUESTIONS = (  # about the bundled demo documents
    "What is the name of the main telescope of the Veldmark Observatory?",
    "Who founded the Veldmark Observatory?",
    "What does the Saltmere bakery sell?",
    "When was the lighthouse on Tessaly lit?",
    "What is the harbour town called?",
    "How much rain falls on the Veldmark coast in a year?",
    "When was the breakwater of Orrin's Ford built?",
    "Who kept the Tessaly lighthouse for forty years?",
    "What does the water mill in Saltmere grind?",
    "Where was Tobias Quell born?",
)


def index_and_questions(args: argparse.Namespace) -> tuple[KVIndex, list[str]]:
    """The demo index (built or brought up to date) and its questions, or with `args.dataset` the index
    of its passages (opened as it is, or built from the first `args.limit` questions') and those questions."""
    cfg = Config(index=IndexSettings(chunk_tokens=args.chunk_tokens), query=QueryConfig(top_k=args.top_k))
    if args.dataset is None:
        with as_file(files("rag_kvcache") / "demo") as docs:
            return KVIndex.build(docs, args.index, cfg, progress=False), list(QUESTIONS)
    examples = load_dataset(args.dataset)[: args.limit]
    questions = list(dict.fromkeys(ex.question for ex in examples))
    if not exists(args.index):
        index, _ = build_index(examples, args.index.parent, cfg, ModelAdapter.load(cfg), False, args.index.name)
        return index, questions
    built = KVIndex.config_of(args.index).index.chunk_tokens
    if built != args.chunk_tokens:
        raise ValueError(f"index {args.index} has {built}-token chunks, not --chunk-tokens {args.chunk_tokens}")
    return KVIndex.open(args.index), questions


def laid_out(index: KVIndex, segments: list[Segment]) -> FusionInput:
    """The prompt's layout with the caches the index serves for it (as `FusedGenerator.fuse` builds it)."""
    caches = index.caches.open(segments)
    return FusionInput.build(segments, caches.sources, caches.contexts, device=index.adapter.device)


def places(inp: FusionInput) -> Counter:
    """Prompt tokens by what the fusion does with them (`computed`: no cache, `inexact`: a cache that
    CacheBlend may recompute, `exact`: a cache equal to a full prefill's) and by place in the prompt
    (`head` before the first chunk, `chunk1`, `chunks` the others, `edges` between chunks, `template`
    the learned template text, `tail` the rest after the last chunk)."""
    parts = inp.parts
    chunk_at = [i for i, p in enumerate(parts) if p.kv is not None and p.segment.label.startswith("chunk")]
    out: Counter = Counter()
    for i, p in enumerate(parts):
        kind = "computed" if p.kv is None else "exact" if p.exact else "inexact"
        if p.segment.label.startswith("template"):
            place = "template"
        elif not chunk_at or i < chunk_at[0]:
            place = "head"
        elif i > chunk_at[-1]:
            place = "tail"
        elif p.kv is None:
            place = "edges"
        else:
            place = "chunk1" if i == chunk_at[0] else "chunks"
        out[f"{kind}:{place}"] += len(p.segment.ids)
    return out


def median_ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """The median of per-question ratios and its 95% percentile-bootstrap CI over questions."""
    ci = bootstrap(
        (np.asarray(ratios),), np.median, confidence_level=0.95, n_resamples=10_000, method="percentile", random_state=0
    ).confidence_interval
    return statistics.median(ratios), float(ci.low), float(ci.high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--index",
        type=Path,
        required=True,
        help="The demo's index (built if missing), or with --dataset an index of its passages.",
    )
    parser.add_argument("--dataset", type=Path, help="Ask this QA set's questions instead of the demo's.")
    parser.add_argument("--limit", type=int, default=12, help="How many of --dataset's first questions.")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=128,
        help="Chunk size; an existing --dataset index must have been built with it.",
    )
    parser.add_argument("--top-k", type=int, default=4, help="Chunks retrieved per question.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="Also write every timed row here.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"pid {os.getpid()}, load average at start {os.getloadavg()}", flush=True)
    index, questions = index_and_questions(args)
    if len(questions) < 2:
        raise ValueError(
            f"the CI over questions needs 2 or more distinct questions, got {len(questions)}: raise --limit"
        )
    generator = FusedGenerator(index)
    tokenizer, system = index.adapter.tokenizer, index.config.index.system_prompt
    fusion, generation = FusionConfig(method="cacheblend", template_text=True), GenerationConfig(max_new_tokens=1)

    def kv_rag_chain(hits, question):
        parts = tuple(ChunkPart(h.chunk.token_ids, f"chunk:{h.chunk.id}") for h in hits)
        return generator.layout.find_chunks(
            chat_segments(tokenizer, system, [ChatTurn("user", (*parts, question))]), fusion
        )

    def tutorial_chain(hits, question):
        context = "\n\n".join(h.chunk.text for h in hits)
        turns = [ChatTurn("system", (TUTORIAL_SYSTEM.format(context=context),)), ChatTurn("user", (question,))]
        return generator.layout.find_chunks(chat_segments(tokenizer, system, turns), fusion)

    def llamaindex_engine(hits, question, matching=fusion):
        messages = style_messages("llamaindex", [h.chunk.text for h in hits], question)
        return generator.layout.find_chunks(
            chat_segments(tokenizer, system, [ChatTurn(m["role"], (m["content"],)) for m in messages]), matching
        )

    layouts = {
        "create_kv_rag_chain": kv_rag_chain,
        "tutorial": tutorial_chain,
        "llamaindex": llamaindex_engine,
        "llamaindex, template computed": partial(llamaindex_engine, matching=replace(fusion, template_text=False)),
    }
    hits = {q: index.search(q, args.top_k) for q in questions}
    for question in questions:  # untimed: heads' caches are computed, template text learned, the first time seen
        for name, layout in layouts.items():
            *_, answer = generator.stream(layout(hits[question], question), fusion, generation)
            print(
                name,
                json.dumps(
                    {
                        "question": question,
                        "recomputed": answer.recomputed_tokens,
                        "untimed_kv_load_s": round(answer.stages["kv_load"], 4),
                        **places(laid_out(index, layout(hits[question], question))),
                    }
                ),
            )
    rows: list[dict] = []
    for repeat in range(args.repeats):
        for question in questions:
            for name in layouts if repeat % 2 == 0 else reversed(layouts):
                t0, c0 = time.perf_counter(), time.process_time()
                segments = layouts[name](hits[question], question)
                build_s = time.perf_counter() - t0
                *_, answer = generator.stream(segments, fusion, generation)
                ttft, recomputed, stages = answer.ttft_s, answer.recomputed_tokens, answer.stages
                rows.append(
                    {
                        "layout": name,
                        "question": question,
                        "repeat": repeat,
                        "ttft_s": ttft,
                        "prompt_tokens": sum(len(s.ids) for s in segments),
                        "build_s": build_s,
                        "cpu_s": time.process_time() - c0,
                        "recomputed": recomputed,
                        "stages": stages,
                    }
                )
    load_end = os.getloadavg()
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in layouts:
        mine = [r for r in rows if r["layout"] == name]
        stages = {s: round(statistics.median(r["stages"].get(s, 0.0) for r in mine), 4) for s in mine[0]["stages"]}
        print(
            f"{name}: TTFT median {statistics.median(r['ttft_s'] for r in mine):.3f} s, build median "
            f"{statistics.median(r['build_s'] for r in mine) * 1000:.1f} ms, prompt tokens median "
            f"{statistics.median(r['prompt_tokens'] for r in mine)}, recomputed median "
            f"{statistics.median(r['recomputed'] for r in mine)}, stages (median s) {stages}"
        )

    def per_question(layout: str, key) -> list[float]:
        runs: dict[tuple[str, str], list[float]] = {}
        for r in rows:
            runs.setdefault((r["layout"], r["question"]), []).append(key(r))
        med = {k: statistics.median(v) for k, v in runs.items()}
        return [med[layout, q] / med["create_kv_rag_chain", q] for q in questions]

    for layout, (what, key) in itertools.product(
        list(layouts)[1:],
        (
            ("TTFT", lambda r: r["ttft_s"]),
            ("TTFT + prompt build", lambda r: r["ttft_s"] + r["build_s"]),
            ("CPU time (prompt build + TTFT)", lambda r: r["cpu_s"]),
        ),
    ):
        ratios = per_question(layout, key)
        mid, low, high = median_ratio_ci(ratios)
        print(
            f"{layout} / create_kv_rag_chain, {what}: median of {len(ratios)} per-question ratios {mid:.3f} "
            f"[95% CI {low:.3f}, {high:.3f}]; per question {[round(x, 3) for x in ratios]}"
        )
    print(
        f"{args.repeats} repeats x {len(questions)} questions x {len(layouts)} layouts; load average at end {load_end}"
    )


if __name__ == "__main__":
    main()
