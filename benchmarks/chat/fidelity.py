"""Teacher-forced fidelity of a chat's later turns read from the conversation cache (warm) against the same
turns fused from the chunk caches alone (cold), issue 36.

A chat over the demo documents (the first message quotes the documents retrieved for its question, then
follow-up questions; the warm generator's answers are the history). At each turn `full`'s greedy answer is
forced through three caches of the same prompt: `full`'s, the method's warm one (the earlier turns' K/V
from the conversation cache, only the new tokens computed) and its cold one (the whole prompt fused from
the chunk caches); reported per turn: the mean per-token KL(full || method) and top-1 agreement with
full, warm and cold, and the prompt tokens each computed.

    python benchmarks/chat/fidelity.py --index /tmp/chat-idx --out benchmarks/chat/fidelity-results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversation import QUESTIONS, build_index  # noqa: E402

from rag_kvcache.config import FusionConfig, GenerationConfig
from rag_kvcache.engine.generation import teacher_forced_logits
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.store.conversations import ConversationCache


def forced(gen: FusedGenerator, segments, fusion: FusionConfig, answer: list[int]) -> tuple[torch.Tensor, int]:
    """Log-probabilities [T, V] of `answer` forced through the prompt's fused cache, and the tokens it computed."""
    fused = gen.fuse(segments, fusion).result
    logits = teacher_forced_logits(gen.adapter, fused.keys, fused.values, fused.logits, answer)
    return torch.log_softmax(logits.float(), -1), fused.recomputed_tokens


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    kl = (ref.exp() * (ref - got)).sum(-1)  # [T]
    return {"kl": float(kl.mean()), "top1": float((ref.argmax(-1) == got.argmax(-1)).float().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="cacheblend,epic,reuse")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.index.exists():
        build_index(args.index)
    index = KVIndex.open(args.index)
    documents = "\n\n".join(h.chunk.text for h in index.search(QUESTIONS[0], 3))
    rows = []
    for method in args.methods.split(","):
        fusion, generation = FusionConfig(method=method), GenerationConfig(max_new_tokens=args.max_tokens)
        warm, cold = FusedGenerator(index, ConversationCache(1 << 30)), FusedGenerator(index)
        messages: list[dict] = []
        for i, question in enumerate(QUESTIONS[: args.turns]):
            messages.append(
                {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: {question}" if i == 0 else question}
            )
            segments = cold.layout.prompt_segments(messages, fusion)
            live = cold.start(segments, FusionConfig(method="full"), generation)
            cold.settle(live)
            for _ in live.decoder.run(live.first_token):
                pass
            answer = live.decoder.ids or [live.first_token]  # full's greedy answer (its end of sequence if empty)
            ref, _ = forced(cold, segments, FusionConfig(method="full"), answer)
            got = {name: forced(gen, segments, fusion, answer) for name, gen in (("warm", warm), ("cold", cold))}
            row = {
                "method": method,
                "turn": i + 1,
                "answer_tokens": len(answer),
                **{f"{name}_{k}": v for name, (lp, _) in got.items() for k, v in compare(ref, lp).items()},
                **{f"{name}_computed": n for name, (_, n) in got.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            messages.append(
                {"role": "assistant", "content": warm.complete(messages, fusion=fusion, generation=generation).answer}
            )
    summary = {}
    for method in args.methods.split(","):
        later = [r for r in rows if r["method"] == method and r["turn"] > 1]
        summary[method] = {
            f"{name}_{k}_mean": statistics.fmean(r[f"{name}_{k}"] for r in later)
            for name in ("warm", "cold")
            for k in ("kl", "top1", "computed")
        }
        summary[method]["turns_warm_kl_lower"] = sum(r["warm_kl"] < r["cold_kl"] for r in later)
        summary[method]["turns"] = len(later)
        print(method, json.dumps(summary[method]), flush=True)
    args.out.write_text(json.dumps({"summary": summary, "turns": rows, "command": sys.argv}, indent=1) + "\n")


if __name__ == "__main__":
    main()
