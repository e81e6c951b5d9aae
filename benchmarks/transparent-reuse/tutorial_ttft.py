"""Cacheblend TTFT of LangChain's tutorial-chain prompt beside `create_kv_rag_chain`'s, same question and
chunks, interleaved in one process (issue 11's "done when").

Both layouts are built as `ChatRagKVCache` builds them (`chat_segments`, then the chunks found by their
token ids): `create_kv_rag_chain` sends one user message of chunk blocks and the question (the fused
prompt's own layout); the tutorial chain sends a system message of instructions with the documents
joined by `format_docs`, then the question. Prints per question the TTFT, its stages, the tokens
computed (no cache) and recomputed, then the medians and their ratio.

    .venv/bin/python benchmarks/transparent-reuse/tutorial_ttft.py --index /tmp/ttft/idx --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.resources import as_file, files
from pathlib import Path

import torch

from rag_kvcache.config import Config, FusionConfig, GenerationConfig
from rag_kvcache.engine.prompt import ChatTurn, ChunkPart, chat_segments
from rag_kvcache.generator import FusedGenerator
from rag_kvcache.index import KVIndex

TUTORIAL_SYSTEM = (  # the system prompt of the integration's tutorial-chain tests
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. Keep the answer concise.\n\n{context}"
)
QUESTIONS = (
    "What is the name of the main telescope of the Veldmark Observatory?", "Who founded the Veldmark Observatory?",
    "What does the Saltmere bakery sell?", "When was the lighthouse on Tessaly lit?", "What is the harbour town called?",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=Path, required=True, help="Where the demo index is (built if missing).")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = Config(chunk_tokens=128, top_k=4)
    with as_file(files("rag_kvcache") / "demo") as docs:
        index = KVIndex.build(docs, args.index, cfg, progress=False)
    generator = FusedGenerator(index)
    tokenizer, system = index.adapter.tokenizer, index.config.system_prompt
    fusion, generation = FusionConfig(method="cacheblend"), GenerationConfig(max_new_tokens=1)

    def kv_rag_chain(hits, question):
        parts = tuple(ChunkPart(h.chunk.token_ids, f"chunk:{h.chunk.id}") for h in hits)
        return generator.find_chunks(chat_segments(tokenizer, system, [ChatTurn("user", (*parts, question))]), fusion)

    def tutorial_chain(hits, question):
        context = "\n\n".join(h.chunk.text for h in hits)
        turns = [ChatTurn("system", (TUTORIAL_SYSTEM.format(context=context),)), ChatTurn("user", (question,))]
        return generator.find_chunks(chat_segments(tokenizer, system, turns), fusion)

    layouts = {"create_kv_rag_chain": kv_rag_chain, "tutorial": tutorial_chain}
    rows: dict[str, list[dict]] = {name: [] for name in layouts}
    for repeat in range(args.repeats):
        for question in QUESTIONS:
            hits = index.search(question, cfg.top_k)
            order = list(layouts) if repeat % 2 == 0 else list(reversed(layouts))
            for name in order:
                t0 = time.perf_counter()
                segments = layouts[name](hits, question)
                build_s = time.perf_counter() - t0
                *_, answer = generator.stream(segments, fusion, generation)
                rows[name].append({
                    "question": question, "ttft_s": answer.ttft_s, "prompt_build_s": build_s,
                    "prompt_tokens": answer.prompt_tokens, "recomputed": answer.recomputed_tokens,
                    "computed": sum(len(s.ids) for s in segments if not s.cacheable),
                    "stages": {k: round(v, 4) for k, v in answer.stages.items()},
                })
    for name, measured in rows.items():
        for row in measured:
            print(name, json.dumps(row))
    medians = {name: statistics.median(r["ttft_s"] for r in measured) for name, measured in rows.items()}
    ratios = [t["ttft_s"] / n["ttft_s"] for t, n in zip(rows["tutorial"], rows["create_kv_rag_chain"])]
    for name, measured in rows.items():
        print(f"{name}: TTFT median {medians[name]:.3f} s, recomputed median "
              f"{statistics.median(r['recomputed'] for r in measured)}, computed median "
              f"{statistics.median(r['computed'] for r in measured)}")
    print(f"tutorial / create_kv_rag_chain: ratio of medians {medians['tutorial'] / medians['create_kv_rag_chain']:.2f}, "
          f"median of per-question ratios {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
