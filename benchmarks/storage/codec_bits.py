"""How many bits keys and values need: teacher-forced KL of `full`'s greedy answer forced through its own K/V,
quantised chunk by chunk as an index stores them, against the unquantised K/V.

Each MuSiQue question's six passages and the question make a chat prompt (up to 3,000 tokens). Its K/V from one
prefill are quantised per span of `--chunk-tokens` tokens (each size in turn), as each chunk's cache is, except
the first 32 tokens (the system prefix and the attention sink, a cache of its own) and the question with the chat
template's tail (computed at query time); the answer's own K/V are computed over the quantised ones. Schemes:
symmetric int8 per channel (`int8-channel`), and asymmetric 4 bits (16 levels between a low and a high end) per
channel over groups of 64 tokens (as `int8k-int4v` stores values) or over the whole chunk, or per token over the
channels, on keys, values or both.

    python benchmarks/storage/codec_bits.py --data ../shared/data/musique_dev.json --questions 20 \
        --chunk-tokens 128 512 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from rag_kvcache import Config
from rag_kvcache.engine.generation import teacher_forced_logits
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.store.codecs import INT8_CHANNEL, Packed4, TensorCodec

HEAD, MAX_PROMPT, MAX_ANSWER = 32, 3000, 24
Quantise = Callable[[torch.Tensor], torch.Tensor]  # [H_kv, T, D] -> [H_kv, T, D], quantised and back


def stored(codec: TensorCodec) -> Quantise:
    """A tensor as the index stores and reads it back with `codec`."""
    return lambda x: codec.decode(codec.encode(x), x.dtype)  # [H_kv, T, D]


def per_token_4_bits(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric 4 bits per token over the channels (no codec of the package stores this one)."""
    low = x.amin(dim=-1, keepdim=True)  # [H_kv, T, 1]
    scale = ((x.amax(dim=-1, keepdim=True) - low) / 15).clamp_min(1e-12)  # [H_kv, T, 1]
    return ((x - low) / scale).round().clamp(0, 15) * scale + low  # [H_kv, T, D]


def schemes(chunk: int) -> dict[str, tuple[Quantise, Quantise]]:
    """name -> how keys and values are quantised, for chunks of `chunk` tokens."""
    int8, ch4, tok4 = stored(INT8_CHANNEL), stored(Packed4()), per_token_4_bits
    return {
        "K int8-channel, V int8-channel": (int8, int8),
        "K 4-bit channel, V 4-bit token": (ch4, tok4),
        "K 4-bit channel, V 4-bit channel": (ch4, ch4),
        "K 4-bit channel, V int8-channel": (ch4, int8),
        "K int8-channel, V 4-bit token": (int8, tok4),
        "K int8-channel, V 4-bit channel, one range a chunk": (int8, stored(Packed4(group=chunk))),
        "K int8-channel, V 4-bit channel (int8k-int4v)": (int8, ch4),
    }


def chunked(t: torch.Tensor, quantise: Quantise, tail: int, chunk: int) -> torch.Tensor:
    """`t` [H_kv, N, D] with positions HEAD..N-tail quantised per `chunk`-token span."""
    end = t.shape[1] - tail
    spans = [quantise(t[:, i : min(i + chunk, end)]) for i in range(HEAD, end, chunk)]
    return torch.cat([t[:, :HEAD], *spans, t[:, end:]], dim=1)  # [H_kv, N, D]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[128])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    adapter = ModelAdapter.load(Config())
    tok = adapter.tokenizer
    runs = {(chunk, name): quantise for chunk in args.chunk_tokens for name, quantise in schemes(chunk).items()}
    kl: dict[tuple[int, str], list[float]] = {run: [] for run in runs}
    top1: dict[tuple[int, str], list[float]] = {run: [] for run in runs}
    for ex in tqdm(json.loads(args.data.read_text())[: args.questions], desc="questions"):
        question = f"Answer briefly. {ex['question']}"
        context = "\n\n".join(c["text"] for c in ex["ctxs"][:6])
        ids = tok.apply_chat_template(
            [{"role": "user", "content": f"{context}\n\n{question}"}], add_generation_prompt=True, return_dict=True
        )["input_ids"][-MAX_PROMPT:]
        tail = len(tok(question)["input_ids"]) + 8  # the question and the template after it, computed at query time
        keys, values, _ = adapter.prefill(torch.tensor([ids[:-1]]))
        keys, values = [k[0] for k in keys], [v[0] for v in values]  # L x [H_kv, N - 1, D]

        def first_logits(k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
            return adapter.decode([ids[-1]], adapter.make_cache(k, v), len(ids) - 1)[-1]  # [V]

        first = first_logits(keys, values)
        cache, answer = adapter.make_cache(keys, values, room=MAX_ANSWER + 1), []
        logits = adapter.decode([ids[-1]], cache, len(ids) - 1)[-1]  # [V]
        while len(answer) < MAX_ANSWER and (t := int(logits.argmax())) not in adapter.eos_token_ids:
            answer.append(t)
            logits = adapter.decode([t], cache, len(ids) - 1 + len(answer))[-1]
        if not answer:
            continue
        ref = teacher_forced_logits(adapter, keys, values, first, answer).log_softmax(-1)  # [A, V]
        for (chunk, name), (qk, qv) in runs.items():
            k = [chunked(x, qk, tail, chunk) for x in keys]
            v = [chunked(x, qv, tail, chunk) for x in values]
            got = teacher_forced_logits(adapter, k, v, first_logits(k, v), answer).log_softmax(-1)  # [A, V]
            kl[chunk, name].append((ref.exp() * (ref - got)).sum(-1).mean().item())
            top1[chunk, name].append((got.argmax(-1) == ref.argmax(-1)).float().mean().item())
    rows = {
        f"{chunk}-token chunks: {name}": {
            "tf_kl_mean": float(np.mean(kl[chunk, name])),
            "tf_kl_median": float(np.median(kl[chunk, name])),
            "tf_kl_max": float(np.max(kl[chunk, name])),
            "tf_top1": float(np.mean(top1[chunk, name])),
            "tf_kl": kl[chunk, name],  # per question, for paired comparisons
            "questions": len(kl[chunk, name]),
        }
        for chunk, name in runs
    }
    args.out.write_text(json.dumps(rows, indent=1))
    for name, r in rows.items():
        print(
            f"{name:70s} TF KL mean {r['tf_kl_mean']:.2e} median {r['tf_kl_median']:.2e} max {r['tf_kl_max']:.2e}"
            f" top-1 {r['tf_top1']:.3f} ({r['questions']} questions)"
        )


if __name__ == "__main__":
    main()
