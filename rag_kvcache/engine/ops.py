"""Fusion math: small pure functions on tensors.

Conventions: one sequence (no batch dimension); keys/values per KV head `[H_kv, T, D]`, never
repeated for GQA; positions are absolute token positions in the fused prompt. RoPE follows the
Llama "rotate half" layout. Angles are always derived from the model's `inv_freq`, never from a
scaled rotary output, so re-rotation is exact for every RoPE variant whose scaling lives in
`inv_freq` alone (default, linear, llama3); the model adapter refuses the others.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, D] for `positions` (float32 math, as transformers does), cast to `dtype` once (as
    transformers casts them to the model's dtype). The sin table's first half is negated: the sign that
    "rotate half" puts on the swapped halves, so `apply_rope` is one swap and one multiply-add."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D/2]
    sin = freqs.sin()  # [T, D/2]
    return torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)  # [T, D] x 2


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [H, T, D] by per-token angles given as `rope_cos_sin` tables [T, D] ("rotate half":
    x * cos plus (-x2, x1) * sin, the sign in the table), in float32: x * cos, plus the halves swapped
    (one `roll`, a fraction of a `flip`'s cost on a CPU) times the signed sin in one multiply-add."""
    x32 = x if x.dtype == torch.float32 else x.float()  # [H, T, D]
    out = torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, -1), sin)  # [H, T, D]
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def rotation(delta: torch.Tensor | int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T or 1, D] (float32, the sin's first half negated as in `rope_cos_sin`) of the RoPE rotation
    that moves keys by `delta` positions: an int (one angle per frequency for all tokens) or a tensor [T].
    Angles are formed in float64 so a large shift adds no error of its own."""
    d = torch.as_tensor(delta, dtype=torch.float64, device=inv_freq.device).reshape(-1, 1)  # [T or 1, 1]
    angles = d * inv_freq.to(torch.float64)  # [T or 1, D/2]
    cos, sin = angles.cos().float(), angles.sin().float()  # [T or 1, D/2]
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T or 1, D] x 2


@torch.no_grad()  # writes through out=, which autograd refuses
def rotate_keys(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply a `rotation` to keys [H_kv, T, D] (into `out` if given; `out` may be `keys` itself). RoPE
    rotations compose, so rotating keys computed at positions p by the angle of `delta` equals computing
    them at p + delta. Float32 math: the halves swapped in the keys' dtype (one `roll`, a copy: exact),
    then one product and one multiply-add against the float32 tables, which promote half-precision
    operands exactly (no float32 copy of the keys made first; into `out` itself when it is float32)."""
    swapped = keys.roll(keys.shape[-1] // 2, -1)  # [H_kv, T, D], (k2, k1): read before `out` is written
    if out is not None and out.dtype == torch.float32:
        return torch.mul(keys, cos, out=out).addcmul_(swapped, sin)  # [H_kv, T, D]
    turned = torch.addcmul(keys * cos, swapped, sin)  # [H_kv, T, D], float32
    return turned.to(keys.dtype) if out is None else out.copy_(turned)


def causal_mask_for(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Exact causal mask for scattered queries: query at position i sees key at j iff j <= i.

    Returns a bool mask [Q, N] (True = attend), the form SDPA takes. Unlike a bottom-right
    aligned mask, a recomputed token never sees keys that come after it in the prompt.
    """
    return key_positions[None, :] <= query_positions[:, None]  # [Q, N]


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask [M, n] (True = attend) as the additive bias the attention kernels take: 0 or -inf."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)  # [M, n]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Grouped-query attention of q [H_q, Q, D] over k, v [H_kv, N, D] under a bool mask [Q, N]
    (`None`: plain causal, for Q == N)."""
    out = F.scaled_dot_product_attention(
        q[None],
        k[None],
        v[None],
        attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )  # [1, H_q, Q, D]
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [Q, H_q * D]


def attend_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B?, H, M, D] over k, v [B?, H, n, D] (B: an optional batch axis) under an additive
    bias [M, n] (`mask_bias`), or one that broadcasts to [B?, H, M, n] (None: every key), with each query's
    log-sum-exp of scores [B?, H, M] (float32), so partial results over disjoint key sets merge exactly
    (`merge_attention`, `merge_splits`). On CPU, SDPA's flash kernel returns both at the cost of a plain SDPA
    call; on CUDA its memory-efficient kernel does; elsewhere the scores are formed explicitly. CPU only:
    `causal` (query i sees keys 0..i, M == n, no bias), and q may have G times k's heads (query head h
    reads KV head h // G)."""
    batched = q.dim() == 4
    q4, k4, v4 = (t if batched else t[None] for t in (q, k, v))  # [B, H, M, D], [B, H, n, D] x 2
    if bias is not None:
        bias = bias[(None,) * (4 - bias.dim())]  # [1 or B, 1 or H, M, n]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=bias, scale=scale
        )[:2]  # [B, H, M, D], [B, H, M]
    elif causal or q4.shape[1] != k4.shape[1]:
        raise ValueError(
            f"attend_lse on {q.device.type}: causal={causal}, {q4.shape[1]} query heads over "
            f"{k4.shape[1]} KV heads (the causal and grouped forms are CPU-only)"
        )
    elif q.device.type == "cuda":
        if bias is not None:
            bias = bias.to(q.dtype)  # [1 or B, 1 or H, M, n]
            if bias.stride(-2) % 16:  # the kernel reads bias rows 16-element aligned
                n = bias.shape[-1]
                padded = bias.new_empty(*bias.shape[:-1], -(-n // 16) * 16)  # [.., M, n rounded up to 16]
                bias = padded[..., :n].copy_(bias)  # [.., M, n], rows 16-aligned
            bias = bias.expand(q4.shape[0], q4.shape[1], *bias.shape[-2:])  # [B, H, M, n], no copy
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q4, k4, v4, bias, True, scale=scale)[:2]
        lse = lse[..., : q.shape[-2]]  # [B, H, M] (the kernel rounds M up)
    else:
        scores = torch.matmul(q4.float(), k4.float().transpose(-1, -2)) * scale  # [B, H, M, n]
        if bias is not None:
            scores = scores + bias.float()  # [B, H, M, n]
        lse = scores.logsumexp(dim=-1)  # [B, H, M]
        out = torch.matmul((scores - lse[..., None]).exp(), v4.float()).to(q.dtype)  # [B, H, M, D]
    return (out, lse) if batched else (out[0], lse[0])


def attend_split(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_lse` of q [H, M, D] over keys k, v [H, >= n, D] 0..n-1 under bias [M, n] (n divisible by
    `splits`), with the keys cut into `splits` equal parts attended side by side in one call (the parts
    as a batch axis; k, v and the bias as views, q repeated) and merged by log-sum-exp (`merge_splits`).
    A kernel that gives each (head, tile of queries) one thread block walks all n keys in each block:
    few queries over many keys (reuse's ~64 rows over ~2,300 keys) leave most of a GPU idle, and parts
    multiply the blocks (flash-decoding's split-K). Returns [H, M, D] and the log-sum-exp [H, M]."""
    h, m, d = q.shape
    n = bias.shape[1]
    if n % splits:
        raise ValueError(f"{n} keys do not cut into {splits} equal parts")
    parts = (splits, n // splits)
    qs = q[:, None].expand(h, splits, m, d).contiguous()  # [H, S, M, D]
    ks, vs = (t[:, :n].unflatten(1, parts) for t in (k, v))  # [H, S, n/S, D] x 2, views
    bs = bias.unflatten(1, parts).transpose(0, 1)  # [S, M, n/S], a view
    out, lse = attend_lse(qs, ks, vs, bs, scale)  # [H, S, M, D], [H, S, M]
    seen = bs.amax(-1) > -math.inf  # [S, M]: the part holds a key the query sees (else the kernels' lse is 0 or -inf)
    return merge_splits(out, lse.masked_fill(~seen, -math.inf))  # [H, M, D], [H, M]


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of S disjoint key sets from each set's output [..., S, M, D] and
    log-sum-exp [..., S, M]: each set weighted by exp(lse - max), in float32. A set a query sees no key
    of has lse -inf (or NaN): weight 0, whatever output the kernel wrote for it. Returns the
    merged output [..., M, D] (out's dtype) and log-sum-exp [..., M]."""
    lse32 = lse.float().nan_to_num(-math.inf)  # [..., S, M]
    top = lse32.amax(-2, keepdim=True)  # [..., 1, M]
    w = (lse32 - top).exp()  # [..., S, M]
    total = w.sum(-2)  # [..., M]
    merged = (out.float() * w[..., None]).nansum(-3) / total[..., None]  # [..., M, D]
    return merged.to(out.dtype), top.squeeze(-2) + total.log()  # [..., M, D], [..., M]


def merge_attention(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's output [..., M, D] and
    log-sum-exp [..., M] (into `out` if given). Set a's weight is exp(lse_a) / (exp(lse_a) + exp(lse_b)),
    a sigmoid of the difference, so one lerp merges them: in place for float32, through float32 otherwise
    (a half-precision weight would cost more than the result's one rounding)."""
    w_a = torch.sigmoid(lse_a.float() - lse_b.float())[..., None]  # [..., M, 1]
    if out_b.dtype == torch.float32:
        return torch.lerp(out_b, out_a, w_a, out=out)  # [..., M, D]
    merged = torch.lerp(out_b.float(), out_a.float(), w_a).to(out_b.dtype)  # [..., M, D]
    return merged if out is None else out.copy_(merged)


def query_blocks(positions: Sequence[int], block: int) -> list[tuple[int, int]]:
    """Split ascending query positions into runs [s, e) of at most `block` queries spanning at most
    `block` positions: a run's keys before its first position are seen by all of its queries."""
    runs, s = [], 0
    while s < len(positions):
        e = bisect.bisect_right(positions, positions[s] + block - 1, s, min(s + block, len(positions)))
        runs.append((s, e))
        s = e
    return runs


@dataclass(frozen=True)
class RunCost:
    """Modelled cost of attending a run of queries (`plan_runs`), in units of one query-key score of the
    CPU flash kernel. Fitted to 2,758 calls timed on a MuSiQue prompt's CacheBlend layers (SmolLM2,
    2 threads, AMD EPYC, calls of 1-404 queries over 1-2,600 keys, median error 5-6%): a score cost
    15.1 ns masked or not; a call 18-19 us, plus 0.20 (unmasked) / 0.55 (masked) us per query and
    0.06 / 0.08 us per key; merging two partial results by log-sum-exp ~15 us."""

    call: float = 1_200  # a call's fixed cost
    merge: float = 1_000  # merging two partial results by log-sum-exp
    open_query: float = 13  # each query of an unmasked call
    open_key: float = 4  # each key of an unmasked call
    masked_query: float = 36  # each query of a masked call
    masked_key: float = 5  # each key of a masked call

    def run(self, n_queries: int, first: int, last: int, open_end: int) -> float:
        """Queries at positions first..last (ascending, `n_queries` of them) seeing keys [0, open_end)
        in one unmasked call (none when `open_end` is 0) and keys [open_end, last] under a mask."""
        span = last + 1 - open_end
        cost = n_queries * (last + 1) + self.call + self.masked_query * n_queries + self.masked_key * span
        if open_end:
            cost += self.call + self.merge + self.open_query * n_queries + self.open_key * open_end
        return cost


def plan_runs(
    positions: Sequence[int],
    block: int | None = None,
    atom: int = 32,
    cost: RunCost = RunCost(),
) -> list[tuple[int, int, int]]:
    """Split ascending query positions into runs (start, end, open_end) at the least `cost`: each run's
    queries see keys [0, open_end) whole and the keys from there up to its last query under a mask, no
    masked part spanning more than `block` positions (None: no bound). Runs are unions of consecutive
    atoms (`query_blocks(positions, atom)`), chosen by dynamic programming over the atoms; a run opens
    at its first query, except that the first run may take every key before it into its masked part
    (one call, nothing merged: few scattered queries)."""
    bound = math.inf if block is None else block
    atoms = query_blocks(positions, min(atom, block or atom))
    floor = [0] + list(itertools.accumulate(p + 1 for p in positions))  # scores of queries [0, i) under no waste
    best, back = [0.0] + [math.inf] * len(atoms), [(0, 0)] * (len(atoms) + 1)
    for j in range(1, len(atoms) + 1):
        end = atoms[j - 1][1]
        last = positions[end - 1]
        for i in range(j - 1, -1, -1):
            start = atoms[i][0]
            first = positions[start]
            if last - first >= bound or floor[start] + (end - start) * (last + 1) >= best[j]:
                break  # longer runs only add queries that see more keys than they need
            for open_end in (first, 0) if i == 0 and first and last < bound else (first,):
                c = best[i] + cost.run(end - start, first, last, open_end)
                if c < best[j]:
                    best[j], back[j] = c, (i, open_end)
    runs, j = [], len(atoms)
    while j:
        i, open_end = back[j]
        runs.append((atoms[i][0], atoms[j - 1][1], open_end))
        j = i
    return runs[::-1]


@dataclass(frozen=True)
class QueryRun:
    """Queries [start, end) of a plan: every one sees keys [0, open_end) whole (one unmasked attention)
    and keys [open_end, open_end + n) under `bias` [G * (end - start), n] (one masked attention, its keys
    cut into `splits` parts: `attend_split`)."""

    start: int
    end: int
    open_end: int
    bias: torch.Tensor  # [G * B, n]
    splits: int = 1


@dataclass(frozen=True)
class AttentionPlan:
    """How `causal_attend` computes exact causal attention for queries at ascending `positions` [Q] over
    keys at 0..n_keys-1, made once per set of queries (`attention_plan`) and used by every layer that
    computes that set. `runs` empty: one causal pass, over the queries' own positions first.. when they
    are contiguous from there (`first`; an unmasked pass over the keys before them merged in), else
    (`first` None) over all n_keys positions."""

    positions: torch.Tensor  # [Q]
    n_keys: int
    runs: tuple[QueryRun, ...]
    first: int | None = None


def attention_plan(
    positions: torch.Tensor,
    n_keys: int,
    group: int,
    dtype: torch.dtype,
    block: int | None = None,
    single_call: bool | None = None,
) -> AttentionPlan:
    """Plan the attention of queries at ascending `positions` [Q] (with `group` query heads per KV head)
    over keys 0..n_keys-1.

    Queries go in runs (`plan_runs`, no masked part spanning more than `block` positions). A run's
    queries all see every key before its first position: that part is one unmasked attention; only the
    keys inside the run's span need the mask, a small masked attention; the two merge by log-sum-exp.
    The run boundaries minimise the modelled cost of the calls (`RunCost`): against fixed runs of 512
    positions (the plan before), CacheBlend's layers (~400 of ~3,050 positions) took 14.2 ms against
    15.2 and EPIC's (~110) 6-10% less (2 threads, under the bench lock, 84 layers of 3 MuSiQue prompts). Few
    scattered queries (reuse's separators and question) come out as one masked call over every key up to
    the last. When the queries are (nearly) the whole prompt, one causal kernel over all positions costs
    less (no runs): it computes n_keys^2 / 2 scores, when the runs would compute at least as many.
    Queries at contiguous positions (CacheBlend's first layer and `prefix`: every token after the exact
    first chunk) need no runs on CPU: one causal kernel over their own positions, merged with one
    unmasked call over the keys before them, computes no more scores than any runs would, and no padded
    rows: CacheBlend's first layer 170 -> 146 ms on a MuSiQue prompt (2,522 queries after 530 exact
    tokens, 1 thread).
    `single_call` (default: on CUDA) plans the queries as one masked call over every key: per layer one
    kernel, whatever the runs, and no device sync.
    """
    if positions.device.type == "cuda" if single_call is None else single_call:
        # One masked call for every query over every key (the runs' bias rows, whole; no device sync): on a GPU
        # each call is a launch the host pays for, and the kernel skips no work the runs would save it.
        keys = torch.arange(n_keys, device=positions.device)  # [N]
        bias = mask_bias(causal_mask_for(positions, keys), dtype).repeat(group, 1)  # [G * Q, N]
        return AttentionPlan(positions, n_keys, (QueryRun(0, positions.numel(), 0, bias),))
    pos = positions.tolist()  # one device sync, once per plan
    if positions.device.type == "cpu" and pos[-1] - pos[0] + 1 == len(pos):
        return AttentionPlan(positions, n_keys, (), pos[0])
    runs = plan_runs(pos, block)
    if sum((e - s) * (pos[e - 1] + 1) for s, e, _ in runs) >= n_keys * n_keys // 2:
        return AttentionPlan(positions, n_keys, ())
    return AttentionPlan(
        positions,
        n_keys,
        tuple(
            QueryRun(
                s,
                e,
                first,
                mask_bias(
                    causal_mask_for(positions[s:e], torch.arange(first, pos[e - 1] + 1, device=positions.device)), dtype
                ).repeat(group, 1),
            )  # [G * B, m]
            for s, e, first in runs
        ),
    )


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """`attend` under `causal_mask_for`, for keys k, v [H_kv, N, D] at positions 0..N-1 and queries
    q [H_q, Q, D] at the ascending positions of `plan` (`attention_plan`). The G query heads that share
    a KV head are folded into the query axis ([H_kv, G * B, D]), so K/V are never repeated. Without
    runs, contiguous queries from `plan.first` run one causal kernel over their own positions, merged
    with an unmasked pass over the keys before them; scattered ones are placed at their positions in an
    all-zero [H_q, N, D], one causal kernel runs over all N positions and the other rows are dropped."""
    (h_q, n_q, d), h_kv = q.shape, k.shape[0]
    g = h_q // h_kv
    if not plan.runs and plan.first is None:
        padded = q.new_zeros(h_q, plan.n_keys, d)  # [H_q, N, D]
        padded[:, plan.positions] = q
        return attend(padded, k, v, None, scale)[plan.positions]  # [Q, H_q * D]
    if not plan.runs:
        first, end = plan.first, plan.first + n_q
        if not first:
            return attend(q, k[:, :end], v[:, :end], None, scale)  # [Q, H_q * D]
        out = q.new_empty(n_q, h_q, d)  # [Q, H_q, D]
        o, lse = attend_lse(q, k[:, first:end], v[:, first:end], None, scale, causal=True)  # [H_q, Q, D], [H_q, Q]
        merge_attention(*attend_lse(q, k[:, :first], v[:, :first], None, scale), o, lse, out=out.transpose(0, 1))
        return out.view(n_q, h_q * d)  # [Q, H_q * D]
    grouped = q.reshape(h_kv, g, n_q, d)  # [H_kv, G, Q, D]
    out = q.new_empty(n_q, h_kv, g, d)  # [Q, H_kv, G, D], laid out as [Q, H_q * D]
    for run in plan.runs:
        s, e, first = run.start, run.end, run.open_end
        end = first + run.bias.shape[1]
        qb = grouped[:, :, s:e].reshape(h_kv, g * (e - s), d)  # [H_kv, G * B, D]
        kb, vb = k[:, first:end], v[:, first:end]  # [H_kv, n, D] x 2
        if run.splits > 1:
            o, lse = attend_split(qb, kb, vb, run.bias, scale, run.splits)  # [H_kv, G * B, D], [H_kv, G * B]
        else:
            o, lse = attend_lse(qb, kb, vb, run.bias, scale)  # [H_kv, G * B, D], [H_kv, G * B]
        o = o.reshape(h_kv, g, e - s, d)  # [H_kv, G, B, D]
        dst = out[s:e].permute(1, 2, 0, 3)  # [H_kv, G, B, D], a view of out
        if first > 0:
            o_open, lse_open = attend_lse(
                qb, k[:, :first], v[:, :first], None, scale
            )  # [H_kv, G * B, D], [H_kv, G * B]
            merge_attention(
                o_open.reshape(h_kv, g, e - s, d),
                lse_open.reshape(h_kv, g, e - s),
                o,
                lse.reshape(h_kv, g, e - s),
                out=dst,
            )  # [H_kv, G, B, D]
        else:
            dst.copy_(o)
    return out.view(n_q, h_q * d)  # [Q, H_q * D]


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token L2 distance between freshly computed and cached K (or V) [H_kv, T, D] -> [T]."""
    diff = fresh.to(torch.float32) - cached.to(torch.float32)  # [H_kv, T, D]
    return diff.square().sum(dim=(0, 2)).sqrt()  # [T]


def select_tokens(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Indices of the `n_keep` highest scores [T], in ascending (prompt) order."""
    n_keep = max(0, min(n_keep, scores.numel()))
    top = torch.topk(scores, n_keep, sorted=False).indices  # [n_keep]
    return top.sort().values  # [n_keep]


def pick_rows(
    scores: torch.Tensor, forced: torch.Tensor, real: torch.Tensor, n_keep: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_tokens` for a step of fixed size (`graphs.LayerStep`), with no host sync: the rows of the
    `n_keep` (a device scalar) highest `scores` [A] among the `real` rows [A], every `forced` row [A] first,
    as `size` rows, the padding first and then the picked rows in row order (the rows' order is the prompt's).
    Returns the rows [size] and which of them are picked [size] (the others are padding)."""
    ranked = scores.masked_fill(forced, math.inf).masked_fill(~real, -math.inf)  # [A]
    top = torch.topk(ranked, size).indices  # [size], highest first
    picked = torch.arange(size, device=scores.device) < n_keep  # [size]
    order = torch.where(picked, top, -1).sort().indices  # [size]: padding first, then by row
    return top[order], picked[order]  # [size] x 2
