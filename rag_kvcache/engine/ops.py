"""Fusion math: small pure functions on tensors.

Conventions: one sequence (no batch dimension); keys/values per KV head `[H_kv, T, D]`, never
repeated for GQA; positions are absolute token positions in the fused prompt. RoPE follows the
Llama "rotate half" layout. Angles are always derived from the model's `inv_freq`, never from a
scaled rotary output, so re-rotation is exact for every RoPE variant whose scaling lives in
`inv_freq` alone (default, linear, llama3); the model adapter refuses the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for `positions` (float32 math, as transformers does)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [..., D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [H, T, D] by per-token angles given as cos/sin [T, D]."""
    x32 = x.to(torch.float32)
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)  # [H, T, D]


def rerotate_keys(
    keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Move keys [H_kv, T, D] computed at positions p to positions p + delta (into `out` if given).

    RoPE rotations compose, so rotating by the angle of `delta` equals computing at the new offset.
    `delta` is an int (one angle per frequency for all tokens: no per-token table) or a tensor [T].
    Angles are formed in float64 so a large shift adds no error of its own.
    """
    half = keys.shape[-1] // 2
    d = torch.as_tensor(delta, dtype=torch.float64, device=keys.device).reshape(-1, 1)  # [T or 1, 1]
    angles = d * inv_freq.to(keys.device, torch.float64)  # [T or 1, D/2]
    cos, sin = angles.cos().float(), angles.sin().float()  # [T or 1, D/2]
    k32 = keys.to(torch.float32)  # [H_kv, T, D], no copy for float32 keys
    k1, k2 = k32[..., :half], k32[..., half:]  # [H_kv, T, D/2]
    out = torch.empty_like(keys) if out is None else out  # [H_kv, T, D]
    out[..., :half] = k1 * cos - k2 * sin  # [H_kv, T, D/2]
    out[..., half:] = k2 * cos + k1 * sin  # [H_kv, T, D/2]
    return out


def causal_mask_for(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Exact causal mask for scattered queries: query at position i sees key at j iff j <= i.

    Returns a bool mask [Q, N] (True = attend), the form SDPA takes. Unlike a bottom-right
    aligned mask, a recomputed token never sees keys that come after it in the prompt.
    """
    return key_positions[None, :] <= query_positions[:, None]  # [Q, N]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention of q [H_q, Q, D] over k, v [H_kv, N, D] under a bool mask [Q, N]
    (`None`: plain causal, for Q == N)."""
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None], is_causal=mask is None,
        scale=scale, enable_gqa=q.shape[0] != k.shape[0],
    )  # [1, H_q, Q, D]
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [Q, H_q * D]


def causal_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, scale: float,
    block: int = 256,
) -> torch.Tensor:
    """`attend` under `causal_mask_for`, for keys k, v [H_kv, N, D] at positions 0..N-1 and queries
    q [H_q, Q, D] at ascending `query_positions` [Q].

    A masked SDPA kernel computes every score it is given, masked or not, at about twice the cost per
    score of SDPA's causal kernel, which skips the masked half. So the queries go in blocks of
    `block`, each over only the keys up to its last position; and when that is still more work than
    a causal pass over all N positions (e.g. prefix caching, which computes most of the prompt), the
    queries are placed at their positions in an all-zero [H_q, N, D] and run through the causal
    kernel, whose rows for the other positions are dropped.
    """
    n, n_q = k.shape[1], q.shape[1]
    starts = range(0, n_q, block)
    seen = (query_positions[[min(s + block, n_q) - 1 for s in starts]] + 1).tolist()  # keys per block
    masked_scores = sum(min(block, n_q - s) * m for s, m in zip(starts, seen))
    if 2 * masked_scores >= n * n // 2:  # 2: a masked score's cost in units of a causal one
        padded = q.new_zeros(q.shape[0], n, q.shape[2])  # [H_q, N, D]
        padded[:, query_positions] = q
        return attend(padded, k, v, None, scale)[query_positions]  # [Q, H_q * D]
    out = []
    for s, m in zip(starts, seen):
        pos = query_positions[s : s + block]  # [B]
        mask = causal_mask_for(pos, torch.arange(m, device=pos.device))  # [B, m]
        out.append(attend(q[:, s : s + block], k[:, :m], v[:, :m], mask, scale))  # [B, H_q * D]
    return torch.cat(out)  # [Q, H_q * D]


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token L2 distance between freshly computed and cached K (or V) [H_kv, T, D] -> [T]."""
    diff = fresh.to(torch.float32) - cached.to(torch.float32)  # [H_kv, T, D]
    return diff.square().sum(dim=(0, 2)).sqrt()  # [T]


def select_tokens(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Indices of the `n_keep` highest scores [T], in ascending (prompt) order."""
    n_keep = max(0, min(n_keep, scores.numel()))
    top = torch.topk(scores, n_keep, sorted=False).indices  # [n_keep]
    return top.sort().values  # [n_keep]
