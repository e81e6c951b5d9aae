"""The attention plan's run boundaries (`plan_runs`, a dynamic program over a cost model) and the
log-sum-exp merge: any plan is exact, and the plan is the cheapest the model allows."""

from __future__ import annotations

import itertools

import pytest
import torch

from rag_kvcache.engine.ops import (
    RunCost,
    attend,
    attend_lse,
    attend_split,
    attention_plan,
    causal_attend,
    causal_mask_for,
    mask_bias,
    merge_attention,
    plan_runs,
)


def plan_cost(positions, runs, cost=RunCost()):
    return sum(cost.run(e - s, positions[s], positions[e - 1], open_end) for s, e, open_end in runs)


def scattered(n_keys: int, n_queries: int, question: int, seed: int) -> list[int]:
    """CacheBlend-like query positions: a random share of the prompt, then the question's tokens."""
    g = torch.Generator().manual_seed(seed)
    body = torch.randperm(n_keys - question, generator=g)[:n_queries].sort().values.tolist()
    return body + list(range(n_keys - question, n_keys))


@pytest.mark.parametrize("block", [None, 3, 40, 300])
def test_plan_runs_cover_every_query_once_within_block(block):
    pos = scattered(600, 90, 12, seed=1)
    runs = plan_runs(pos, block)
    assert [i for s, e, _ in runs for i in range(s, e)] == list(range(len(pos)))  # every query once, in order
    for s, e, open_end in runs:
        assert open_end in (pos[s], 0) and (
            open_end == pos[s] or s == 0
        )  # opens at its first query, or the first run at 0
        assert block is None or pos[e - 1] - open_end < block  # no masked part spans more than block


@pytest.mark.parametrize("seed", range(6))
def test_plan_runs_is_the_cheapest_partition(seed):
    """Against every partition of a few queries into consecutive runs (atoms of one query), each with
    each allowed opening: the dynamic program finds the least modelled cost."""
    g = torch.Generator().manual_seed(seed)
    pos = sorted(torch.randperm(20_000, generator=g)[:9].tolist())
    cost = RunCost(call=400, merge=300)  # cheap calls, so that the optimum is not one run
    best = min(
        plan_cost(pos, runs, cost)
        for cuts in itertools.product((False, True), repeat=len(pos) - 1)
        for bounds in [[0, *(i + 1 for i, cut in enumerate(cuts) if cut), len(pos)]]
        for first_open in {pos[0], 0}
        for runs in [[(s, e, first_open if s == 0 else pos[s]) for s, e in zip(bounds, bounds[1:])]]
    )
    runs = plan_runs(pos, None, atom=1, cost=cost)
    assert plan_cost(pos, runs, cost) == pytest.approx(best)


def test_plan_runs_split_where_the_queries_lie_apart():
    """Three clusters far apart: a run each (one call over the keys before it, one small masked call)."""
    pos = [*range(100, 140), *range(5_000, 5_040), *range(9_000, 9_040)]
    assert plan_runs(pos) == [(0, 40, 0), (40, 80, 5_000), (80, 120, 9_000)]


def test_causal_attend_cacheblend_like_plan_equals_the_mask():
    """15% of 600 positions and a question, planned with the default cost model: several runs, some
    merged with an unmasked part, and the result equals one masked attention."""
    positions = torch.tensor(scattered(600, 90, 12, seed=2))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, len(positions), 8, generator=g)  # GQA: 6 query heads over 2 KV heads
    k, v = torch.randn(2, 600, 8, generator=g), torch.randn(2, 600, 8, generator=g)
    plan = attention_plan(positions, 600, 3, q.dtype)
    assert len(plan.runs) > 1 and any(run.open_end > 0 for run in plan.runs)
    ref = attend(q, k, v, causal_mask_for(positions, torch.arange(600)), 0.35)  # [102, 6 * 8]
    torch.testing.assert_close(causal_attend(q, k, v, plan, 0.35), ref)


def test_causal_attend_contiguous_queries_after_a_cached_head_equal_the_mask():
    """CacheBlend's first layer and `prefix` compute every token after the exactly cached first chunk:
    one causal pass over their own positions, merged with an unmasked pass over the keys before them."""
    positions = torch.arange(100, 600)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 500, 8, generator=g)  # GQA: 6 query heads over 2 KV heads
    k, v = torch.randn(2, 600, 8, generator=g), torch.randn(2, 600, 8, generator=g)
    plan = attention_plan(positions, 600, 3, q.dtype)
    assert plan.runs == () and plan.first == 100
    ref = attend(q, k, v, causal_mask_for(positions, torch.arange(600)), 0.35)  # [500, 6 * 8]
    torch.testing.assert_close(causal_attend(q, k, v, plan, 0.35), ref)


def test_causal_attend_nearly_every_scattered_position_pads_and_equals_the_mask():
    positions = torch.tensor([i for i in range(600) if i % 50 != 7])  # most of the prompt, not contiguous
    g = torch.Generator().manual_seed(6)
    q = torch.randn(6, len(positions), 8, generator=g)
    k, v = torch.randn(2, 600, 8, generator=g), torch.randn(2, 600, 8, generator=g)
    plan = attention_plan(positions, 600, 3, q.dtype)
    assert plan.runs == () and plan.first is None
    ref = attend(q, k, v, causal_mask_for(positions, torch.arange(600)), 0.35)  # [588, 6 * 8]
    torch.testing.assert_close(causal_attend(q, k, v, plan, 0.35), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_attention_into_a_strided_view_equals_attention_over_the_union(dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 5, 8, generator=g).to(dtype)
    k, v = torch.randn(2, 30, 8, generator=g).to(dtype), torch.randn(2, 30, 8, generator=g).to(dtype)
    o_a, lse_a = attend_lse(q, k[:, :12], v[:, :12], None, 0.35)  # [2, 5, 8], [2, 5]
    o_b, lse_b = attend_lse(q, k[:, 12:], v[:, 12:], None, 0.35)
    ref, _ = attend_lse(q, k, v, None, 0.35)  # [2, 5, 8]
    out = torch.empty(5, 2, 8, dtype=dtype)  # [M, H, D]: the merge writes through a permuted view
    merge_attention(o_a, lse_a, o_b, lse_b, out=out.permute(1, 0, 2))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # bf16: its rounding
    torch.testing.assert_close(out.permute(1, 0, 2), ref, **tol)
    torch.testing.assert_close(merge_attention(o_a, lse_a, o_b, lse_b), ref, **tol)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_attention_over_keys_cut_into_parts_equals_one_pass(splits):
    # scattered queries, some before the later parts' first key (they see nothing there: weight 0, whatever the
    # kernel leaves for them), over keys in a buffer with a column past them (the settled step's scratch key)
    g = torch.Generator().manual_seed(5)
    positions = torch.tensor(sorted(set(torch.randint(0, 128, (40,), generator=g).tolist())))  # [M]
    q = torch.randn(3, positions.numel(), 16, generator=g)  # [H, M, D]
    k, v = torch.randn(3, 129, 16, generator=g), torch.randn(3, 129, 16, generator=g)  # [H, 128 + 1, D]
    bias = mask_bias(causal_mask_for(positions, torch.arange(128)), q.dtype)  # [M, 128]
    ref, ref_lse = attend_lse(q, k[:, :128], v[:, :128], bias, 0.25)
    out, lse = attend_split(q, k, v, bias, 0.25, splits)
    assert positions[0] < 128 // splits  # a query with no key in the last part
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="128 keys do not cut into 3"):
        attend_split(q, k, v, bias, 0.25, 3)


def test_a_single_call_plan_equals_the_mask():
    """The plan CUDA gets for scattered queries (one masked call per layer, not a call per run), made
    here on the CPU: one run over every key, and the result equals the mask."""
    positions = torch.tensor(scattered(600, 90, 12, seed=3))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, len(positions), 8, generator=g)  # GQA: 6 query heads over 2 KV heads
    k, v = torch.randn(2, 600, 8, generator=g), torch.randn(2, 600, 8, generator=g)
    plan = attention_plan(positions, 600, 3, q.dtype, single_call=True)
    assert [(r.start, r.end, r.open_end) for r in plan.runs] == [(0, len(positions), 0)]
    ref = attend(q, k, v, causal_mask_for(positions, torch.arange(600)), 0.35)  # [102, 6 * 8]
    torch.testing.assert_close(causal_attend(q, k, v, plan, 0.35), ref)
