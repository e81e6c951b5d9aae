"""CacheBlend's narrowed rows attending every key before them: the attention forms a captured step could use,
each checked against a float64 reference and timed side by side on one GPU.

At Llama-3.2-1B's shape (8 KV heads of 4 query heads, head dim 64) a 2,246-token MuSiQue prompt leaves CacheBlend
~400 rows after its pick, at ascending scattered positions, padded to 512 in the captured step (`graphs.LayerStep`:
padded rows first, at the scratch position past the prompt, seeing every key). On an H100 that step's
memory-efficient kernel under a dense bias took ~133 us a layer for them, more than `full`'s flash causal pass
over all 2,246 positions (benchmarks/RESULTS.md, issue 30, session 27). The forms:

- `bias`: today's, one masked call over every key (`ops.causal_attend` with one `QueryRun`);
- `split-N`: the keys cut into N parts attended side by side and merged (`ops.attend_split`);
- `scatter`: the rows placed at their positions in an all-zero query, one causal pass over every position;
- `flex`: FlexAttention (compiled by Triton) under a block mask made from the rows' positions, which skips the
  key blocks that a block of rows sees none of;
- `flex-rows`: the same kernel under a block mask made inside the call from each block of rows' lowest and highest
  position (`rows_block_mask`: what a captured step would make per prompt, with no host sync).

    python benchmarks/gpu/narrow_attention.py --device cuda --rows 400 --pad 512 --keys 2304

Each form is captured in a CUDA graph and replayed (as the step runs it), timed by CUDA events; `flex` is timed
eagerly if it cannot be captured (said in its row). On a CPU it checks the eager forms at the size given and its
times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch

from rag_kvcache.engine.ops import AttentionPlan, QueryRun, causal_attend, causal_mask_for, mask_bias


def layout(rows: int, pad: int, keys: int, gen: torch.Generator) -> torch.Tensor:
    """Positions of a padded step's rows [pad]: `pad - rows` at the scratch position `keys` first, then `rows`
    distinct ascending positions below `keys`, the last one `keys - 1` (the question's last token)."""
    picked = torch.randperm(keys - 1, generator=gen)[: rows - 1].sort().values  # [rows - 1]
    return torch.cat([torch.full((pad - rows,), keys), picked, torch.tensor([keys - 1])])  # [pad]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 attention of the rows at `at` [R] (q [H_q, R, D]) over keys 0..at (k, v [H_kv, K, D]): [R, H_q * D]."""
    group = q.shape[0] // k.shape[0]
    kk, vv = (t.double().repeat_interleave(group, 0) for t in (k, v))  # [H_q, K, D] x 2
    scores = (q.double() @ kk.transpose(1, 2)) * scale  # [H_q, R, K]
    scores.masked_fill_(~causal_mask_for(at, torch.arange(k.shape[1], device=at.device)), -math.inf)
    return (scores.softmax(-1) @ vv).transpose(0, 1).reshape(q.shape[1], -1)  # [R, H_q * D]


def forms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, keys: int, scale: float, splits: int
) -> dict[str, Callable[[], torch.Tensor]]:
    """Each form as a call giving the padded rows' output [pad, H_q * D] (k, v hold keys + 1 columns, the last the
    scratch column; the padded rows' outputs are whatever the form gives them)."""
    group = q.shape[0] // k.shape[0]
    bias = mask_bias(causal_mask_for(at, torch.arange(keys, device=at.device)), q.dtype).repeat(group, 1)  # [G * P, K]
    out = {
        "bias": AttentionPlan(at, keys, (QueryRun(0, at.numel(), 0, bias),)),
        f"split-{splits}": AttentionPlan(at, keys, (QueryRun(0, at.numel(), 0, bias, splits),)),
        "scatter": AttentionPlan(at, keys + 1, ()),
    }
    calls = {name: (lambda plan=plan: causal_attend(q, k, v, plan, scale)) for name, plan in out.items()}
    if q.device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(
            lambda b, h, qi, ki: ki <= at[qi], B=None, H=None, Q_LEN=at.numel(), KV_LEN=keys + 1, device=q.device
        )
        flex = torch.compile(flex_attention)

        def flexed(mask) -> torch.Tensor:
            o = flex(q[None], k[None], v[None], block_mask=mask, scale=scale, enable_gqa=True)  # [1, H_q, P, D]
            return o[0].transpose(0, 1).reshape(at.numel(), -1)  # [P, H_q * D]

        calls["flex"] = lambda: flexed(block_mask)
        calls["flex-rows"] = lambda: flexed(rows_block_mask(at, keys + 1))  # made in the call, as a step would
    return calls


def rows_block_mask(at: torch.Tensor, kv_len: int, block: int = 128):
    """FlexAttention's block mask of rows at positions `at` [P] (P a multiple of `block`) each seeing the keys at or
    before its position, from each block of rows' lowest and highest position alone (no host sync, no mask
    evaluated over every pair): the key blocks below every row's position are full, those up to the highest
    row's are partial (the mask decides inside them), the rest skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    n_kv = -(-kv_len // block)
    rows = at.view(-1, block)  # [P / block, block]
    full = (rows.amin(1) + 1) // block  # [Q_blocks] key blocks every row of the block sees whole
    seen = rows.amax(1) // block + 1  # [Q_blocks] key blocks some row of the block sees
    blocks = torch.arange(n_kv, device=at.device, dtype=torch.int32)  # [KV_blocks]
    partial_at = (full[:, None] + blocks).clamp(max=n_kv - 1).to(torch.int32)  # [Q_blocks, KV_blocks]
    every = blocks.expand(rows.shape[0], n_kv).contiguous()  # [Q_blocks, KV_blocks]: the kernel reads them contiguous
    return BlockMask.from_kv_blocks(
        (seen - full).to(torch.int32)[None, None],  # [1, 1, Q_blocks]
        partial_at[None, None],  # [1, 1, Q_blocks, KV_blocks]
        full.to(torch.int32)[None, None],  # [1, 1, Q_blocks]
        every[None, None],  # [1, 1, Q_blocks, KV_blocks]
        BLOCK_SIZE=block,
        mask_mod=lambda b, h, qi, ki: ki <= at[qi],
        seq_lengths=(at.numel(), kv_len),
        compute_q_blocks=False,
    )


def device_us(call: Callable[[], torch.Tensor], repeats: int) -> tuple[float, bool]:
    """Median microseconds of one call replayed from a CUDA graph (False: captured it could not be, timed eagerly),
    over `repeats` events-timed runs."""
    for _ in range(3):
        call()
    graph, captured = torch.cuda.CUDAGraph(), True
    try:
        with torch.cuda.graph(graph):
            call()
        run = graph.replay
    except RuntimeError:  # a form that syncs or allocates in a way capture refuses
        captured, run = False, call
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--rows", type=int, default=400, help="rows the pick kept (the question's last among them)")
    parser.add_argument("--pad", type=int, default=512, help="rows of the step's bucket")
    parser.add_argument("--keys", type=int, default=2304, help="the prompt's positions (its bucket)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads a KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--splits", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not 0 < args.rows <= args.pad or args.rows > args.keys or args.keys % args.splits:
        parser.error(f"need 0 < rows <= pad, rows <= keys, keys divisible by splits; got {vars(args)}")
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    h_q, d = args.kv_heads * args.group, args.head_dim
    q = torch.randn(h_q, args.pad, d, generator=gen).to(dev, dt)  # [H_q, P, D]
    k, v = (torch.randn(args.kv_heads, args.keys + 1, d, generator=gen).to(dev, dt) for _ in range(2))  # [H_kv, K+1, D]
    at = layout(args.rows, args.pad, args.keys, gen).to(dev)  # [P]
    scale, real = d**-0.5, slice(args.pad - args.rows, None)
    want = reference(q[:, real], k[:, : args.keys], v[:, : args.keys], at[real], scale)  # [R, H_q * D]
    print(
        f"{args.rows} rows (padded to {args.pad}) over {args.keys} keys, {args.kv_heads}x{args.group} heads of {d}, "
        f"{args.dtype} on {dev}"
    )
    print("| form | max abs error (real rows) | us a call | timed |")
    print("|---|---:|---:|---|")
    for name, call in forms(q, k, v, at, args.keys, scale, args.splits).items():
        error = (call()[real].double() - want).abs().max().item()
        if dev.type == "cuda":
            us, captured = device_us(call, args.repeats)
            print(f"| {name} | {error:.2e} | {us:.1f} | {'graph replay' if captured else 'eager'} |")
        else:
            print(f"| {name} | {error:.2e} | - | not on a CPU |")


if __name__ == "__main__":
    main()
