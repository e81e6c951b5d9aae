"""A full prefill and greedy decoding through transformers on CUDA, with SDPA's cuDNN backend on and off,
side by side, over prompts of lengths not seen before (as a RAG server meets them): cuDNN's attention
builds a plan for every new sequence length, so every new prompt and every decoding step pays it.

    python benchmarks/gpu/sdpa_backends.py --model /tmp/llama-1b --lengths 8 --steps 16

Token ids are random (the timing does not depend on them); each length is used once per setting.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def run(model, n: int, steps: int) -> tuple[float, float]:
    """Seconds of the prefill of a random n-token prompt, and the median seconds of a decoding step."""
    ids = torch.randint(1000, model.config.vocab_size, (1, n), device="cuda")
    out = {}
    prefill = timed(lambda: out.setdefault("p", model(input_ids=ids, use_cache=True)))
    cache, token = out["p"].past_key_values, out["p"].logits[:, -1:].argmax(-1)
    step_s = []
    for _ in range(steps):
        res = {}
        step_s.append(timed(lambda: res.setdefault("s", model(input_ids=token, past_key_values=cache, use_cache=True))))
        cache, token = res["s"].past_key_values, res["s"].logits[:, -1:].argmax(-1)
    return prefill, statistics.median(step_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local model folder (benchmarks/gpu/random_llama.py)")
    parser.add_argument("--lengths", type=int, default=8, help="prompt lengths per setting, 2,000-3,100 tokens")
    parser.add_argument("--steps", type=int, default=16, help="decoding steps per prompt")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    for warm in (1500, 1501):  # kernels, handles and the allocator, outside the timed lengths
        torch.backends.cuda.enable_cudnn_sdp(warm == 1500)
        run(model, warm, 2)
    rows = {True: [], False: []}
    for i in range(args.lengths):  # settings alternate; every length is new to both
        base = 2000 + i * 1100 // args.lengths
        for cudnn, n in ((True, base), (False, base + 1)):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            rows[cudnn].append(run(model, n, args.steps))
    print(
        f"| SDPA cuDNN | prefill median (ms) | decoding step median (ms) | {args.lengths} new lengths, {args.steps} steps each |"
    )
    print("|---|---:|---:|---|")
    for cudnn, r in rows.items():
        print(
            f"| {'on' if cudnn else 'off'} | {statistics.median(p for p, _ in r) * 1e3:.1f} | "
            f"{statistics.median(s for _, s in r) * 1e3:.2f} | prefill "
            + " ".join(f"{p * 1e3:.0f}" for p, _ in r)
            + " |"
        )


if __name__ == "__main__":
    main()
