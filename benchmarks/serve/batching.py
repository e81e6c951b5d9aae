"""Would batching concurrent requests raise the server's throughput on this machine?

Times forward passes of `--model` (SmolLM2-135M by default) batched and one by one: one decoding
step for B sequences each with a `--past`-token KV cache (random K/V: the cost does not depend on the
values), as the server decodes (`ModelAdapter.decode_rows`: projections and MLP batched, the rows'
caches slots of one `DecodePool`, attended in one call a layer), and a plain prefill of `--prefill`
tokens for B prompts. Batching pays where one
batched step costs less than B single steps; the ratio printed is (B single steps) / (one batched
step), so 1.0 means no gain. The column `transformers` is one step of the model's own forward over
a B-row padded cache of the same length, for comparison (it is not what the server runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from rag_kvcache.config import Config, IndexSettings
from rag_kvcache.engine.decoding import DecodePool
from rag_kvcache.engine.model import ModelAdapter


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--past", type=int, default=3000, help="KV cache length of each sequence when decoding")
    p.add_argument("--prefill", type=int, default=256, help="prompt tokens per sequence when prefilling")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=Config().index.model, help="a model name or directory (default: %(default)s)")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    adapter = ModelAdapter.load(Config(index=IndexSettings(model=args.model, dtype=args.dtype)))
    model, layout = adapter.model, adapter.layout
    vocab = model.config.vocab_size
    print(
        f"{args.model}, {args.threads} threads; decode step over a {args.past}-token cache, prefill of "
        f"{args.prefill} tokens"
    )
    print(
        "| B | decode step, batched (ms) | B single steps (ms) | gain | transformers, batched (ms) | "
        "prefill, batched (ms) | B single (ms) | gain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    single_decode = single_prefill = None
    row = [torch.randn(layout.n_kv_heads, args.past, layout.head_dim) for _ in range(layout.n_layers)]
    for b in (int(x) for x in args.batches.split(",")):
        room = 2 * (args.repeats + 1)  # every timed call appends one token to each cache it steps
        pool = DecodePool()
        caches = [pool.admit(row, row, room) for _ in range(b)]
        tokens = torch.randint(0, vocab, (b,)).tolist()
        d = timed(lambda tokens=tokens, caches=caches: adapter.decode_rows(tokens, caches), args.repeats)
        if single_decode is None:
            single_decode = timed(
                lambda tokens=tokens, caches=caches: adapter.decode_rows(tokens[:1], caches[:1]), args.repeats
            )

        shape = (b, layout.n_kv_heads, args.past, layout.head_dim)
        cache = DynamicCache()
        for layer in range(layout.n_layers):
            cache.update(torch.randn(shape), torch.randn(shape), layer)
        token = torch.randint(0, vocab, (b, 1))
        positions = torch.full((b, 1), args.past)

        def hf_decode(token=token, positions=positions, cache=cache) -> None:
            with torch.inference_mode():
                model(input_ids=token, position_ids=positions, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the step just appended

        prompt = torch.randint(0, vocab, (b, args.prefill))

        def prefill(prompt=prompt) -> None:
            with torch.inference_mode():
                model(input_ids=prompt, use_cache=True)

        hf, f = timed(hf_decode, args.repeats), timed(prefill, args.repeats)
        single_prefill = single_prefill or f
        print(
            f"| {b} | {d * 1e3:.1f} | {b * single_decode * 1e3:.1f} | {b * single_decode / d:.2f}x | "
            f"{hf * 1e3:.1f} | {f * 1e3:.0f} | {b * single_prefill * 1e3:.0f} | {b * single_prefill / f:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
