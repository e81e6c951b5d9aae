"""The fusion invariants on a tiny random-weight Llama: `prefix` exact, CacheBlend at ratio 1.0 equal to `full`,
re-rotation equal to computing at the offset, generation from an injected cache, the exact causal mask."""

from __future__ import annotations

import pytest
import torch

from rag_kvcache.config import FusionConfig, GenerationConfig
from rag_kvcache.engine.fusion import FusionInput, selective_prefill
from rag_kvcache.engine.generation import Decoder
from rag_kvcache.engine.methods import filter_schedule, get_method
from rag_kvcache.engine.ops import (
    attend,
    attention_plan,
    causal_attend,
    causal_mask_for,
    query_blocks,
    rotate_keys,
    rotation,
)
from rag_kvcache.engine.prompt import Segment
from rag_kvcache.store.kvstore import ChunkKV

ATOL = 1e-4


def chunk_kv(adapter, ids: tuple[int, ...], context: tuple[int, ...]) -> ChunkKV:
    """A chunk's cache computed behind `context` (the way the indexer does it)."""
    past = None
    if context:
        k, v, _ = adapter.prefill(torch.tensor([context]))
        past = (k, v)
    keys, values, _ = adapter.prefill(torch.tensor([ids]), past)
    return ChunkKV([k[0] for k in keys], [v[0] for v in values], position=len(context))


def rag_prompt(adapter, seed: int = 0, n_chunks: int = 3, chunk_len: int = 24, isolated: bool = False):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: tuple(torch.randint(1000, 20000, (n,), generator=g).tolist())  # noqa: E731
    prefix, sep, question = rand(7), rand(2), rand(9)
    chunks = [rand(chunk_len - i) for i in range(n_chunks)]
    segments = [Segment(prefix, True, "prefix")]
    for i, c in enumerate(chunks):
        if i:
            segments.append(Segment(sep, False, "sep"))
        segments.append(Segment(c, True, f"chunk{i}"))
    segments.append(Segment(question, False, "question"))
    ctx = () if isolated else prefix
    caches = [chunk_kv(adapter, s.ids, () if s.label == "prefix" else ctx) if s.cacheable else None for s in segments]
    contexts = [() if s.label == "prefix" else ctx for s in segments]
    return FusionInput.build(segments, caches, contexts, device=adapter.device)


def run(adapter, inp, method, **cfg):
    return get_method(method)(adapter, inp, FusionConfig(method=method, **{"epic_k": 16, **cfg}))


def rerotate(keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [H_kv, T, D] computed at positions p, moved to p + delta."""
    return rotate_keys(keys, *rotation(delta, inv_freq))


def test_rerotation_equals_computing_at_offset(tiny):
    ids = torch.randint(1000, 20000, (1, 20))
    at_zero = tiny.model(input_ids=ids, position_ids=torch.arange(20)[None], use_cache=True).cache
    offset = 137
    at_p = tiny.model(input_ids=ids, position_ids=torch.arange(offset, offset + 20)[None], use_cache=True).cache
    for a, b in zip(at_zero.layers, at_p.layers):
        torch.testing.assert_close(rerotate(a.keys[0], offset, tiny.inv_freq), b.keys[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(a.values[0], b.values[0], atol=ATOL, rtol=0)


def test_rerotation_is_per_token_and_invertible(tiny):
    k = torch.randn(2, 5, 16)
    deltas = torch.tensor([0, 3, -7, 100, 2048])
    moved = rerotate(k, deltas, tiny.inv_freq)
    torch.testing.assert_close(moved[:, 0], k[:, 0])
    torch.testing.assert_close(rerotate(moved, -deltas, tiny.inv_freq), k, atol=1e-5, rtol=0)


def test_rerotation_in_place_and_identity_are_exact(tiny):
    """`KVPlacement.place` rotates a layer's keys in place over the span of moved segments, with the identity for the
    tokens in it that do not move: in place equals out of place, and the identity leaves keys bit for bit."""
    k = torch.randn(2, 5, 16)
    cos, sin = rotation(torch.tensor([0, 3, -7, 0, 2048]), tiny.inv_freq)
    moved = k.clone()
    rotate_keys(moved, cos, sin, out=moved)
    assert torch.equal(moved, rotate_keys(k, cos, sin))
    assert torch.equal(moved[:, [0, 3]], k[:, [0, 3]])
    half = k.to(torch.bfloat16)
    rotate_keys(half, cos, sin, out=half)
    assert torch.equal(half, rotate_keys(k.to(torch.bfloat16), cos, sin))


@pytest.mark.parametrize("isolated", [False, True])
@pytest.mark.parametrize(
    "method,cfg", [("prefix", {}), ("cacheblend", {"ratio": 1.0}), ("cacheblend", {"ratio": 1.0, "filter_steps": 2})]
)
def test_exact_methods_equal_full(tiny, method, cfg, isolated):
    inp = rag_prompt(tiny, isolated=isolated)
    ref = run(tiny, inp, "full")
    out = run(tiny, inp, method, **cfg)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    for k, kr in zip(out.keys, ref.keys):
        torch.testing.assert_close(k, kr, atol=ATOL, rtol=0)
    assert out.logits.argmax() == ref.logits.argmax()


def test_exact_methods_same_greedy_text(tiny):
    inp = rag_prompt(tiny, seed=3)
    gen = GenerationConfig(max_new_tokens=12)
    outs = []
    for method, cfg in (("full", {}), ("cacheblend", {"ratio": 1.0}), ("prefix", {})):
        r = run(tiny, inp, method, **cfg)
        steps = Decoder(tiny, gen).steps(r.keys, r.values, r.logits, int(r.logits.argmax()))
        outs.append([s.token_id for s in steps])
    assert outs[0] == outs[1] == outs[2]


def test_prefix_reuses_head_exactly(tiny):
    inp = rag_prompt(tiny)
    out = run(tiny, inp, "prefix")
    head = len(inp.parts[0].segment.ids) + len(inp.parts[1].segment.ids)  # prefix + chunk 1 are exact
    assert out.active_per_layer[0] == inp.n_tokens - head


def test_reuse_and_epic_compute_what_they_claim(tiny):
    inp = rag_prompt(tiny)
    n_fresh = int(inp.fresh.sum())
    reuse = run(tiny, inp, "reuse")
    assert reuse.active_per_layer == [n_fresh] * 4
    # the last layer's attention and MLP run for the last token alone: nothing else reads their output
    assert reuse.compute_fraction == pytest.approx((3 * n_fresh + 1) / (4 * inp.n_tokens))
    assert run(tiny, inp, "epic", epic_k=4).active_per_layer == [n_fresh + 2 * 4] * 4  # chunks 2 and 3
    torch.testing.assert_close(run(tiny, inp, "epic", epic_k=0).logits, run(tiny, inp, "reuse").logits)


def test_cacheblend_selects_ratio_at_check_layer(tiny):
    inp = rag_prompt(tiny)
    n_fresh, n_reusable = int(inp.fresh.sum()), int(inp.reusable.sum())
    out = run(tiny, inp, "cacheblend", ratio=0.25, check_layer=1)
    kept = n_fresh + round(0.25 * n_reusable)
    # layer 0 runs every token; the check layer's attention and MLP already run only the kept ones
    assert out.active_per_layer == [n_fresh + n_reusable] + [kept] * 3
    assert out.recomputed_tokens == kept


def test_gradual_filtering_schedule():
    assert filter_schedule(FusionConfig(ratio=0.15), n_layers=4) == {1: 0.15}
    sched = filter_schedule(FusionConfig(ratio=0.1, check_layer=1, filter_steps=3), n_layers=4)
    assert list(sched) == [1, 2, 3]
    assert sched[1] == pytest.approx(0.2) and sched[2] == pytest.approx(0.15) and sched[3] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="reaches layer 4, beyond the model's 4 layers"):
        filter_schedule(FusionConfig(check_layer=2, filter_steps=3), n_layers=4)


def test_gradual_filtering_narrows_layer_by_layer(tiny):
    inp = rag_prompt(tiny)
    n_fresh, n_reusable = int(inp.fresh.sum()), int(inp.reusable.sum())
    out = run(tiny, inp, "cacheblend", ratio=0.2, check_layer=1, filter_steps=3)
    kept = [n_fresh + round(f * n_reusable) for f in (0.4, 0.3, 0.2)]
    assert out.active_per_layer == [n_fresh + n_reusable, *kept]
    assert out.recomputed_tokens == kept[-1]


def test_causal_mask_for_scattered_queries():
    mask = causal_mask_for(torch.tensor([2, 5, 9]), torch.arange(10))
    assert mask.tolist() == [[j <= i for j in range(10)] for i in (2, 5, 9)]


@pytest.mark.parametrize("block", [1, 3, 128])
def test_causal_attend_in_blocks_equals_one_masked_call(block):
    q, k, v = torch.randn(4, 7, 8), torch.randn(2, 20, 8), torch.randn(2, 20, 8)  # GQA: 4 query heads, 2 KV
    positions = torch.tensor([0, 3, 4, 9, 15, 18, 19])
    ref = attend(q, k, v, causal_mask_for(positions, torch.arange(20)), 0.35)  # [7, 4 * 8]
    torch.testing.assert_close(causal_attend(q, k, v, attention_plan(positions, 20, 2, q.dtype, block), 0.35), ref)


@pytest.mark.parametrize("block", [4, 16, 64])
def test_causal_attend_merging_open_and_masked_parts_equals_one_masked_call(block):
    """Scattered queries (a CacheBlend-like 15% plus a question at the end) over 300 keys: each run's
    unmasked pass over the keys before it, merged by log-sum-exp with its small masked pass."""
    g = torch.Generator().manual_seed(3)
    positions = torch.cat([torch.randperm(280, generator=g)[:42].sort().values, torch.arange(280, 300)])
    q = torch.randn(6, len(positions), 8, generator=g)  # GQA: 6 query heads over 2 KV heads
    k, v = torch.randn(2, 300, 8, generator=g), torch.randn(2, 300, 8, generator=g)
    ref = attend(q, k, v, causal_mask_for(positions, torch.arange(300)), 0.35)  # [62, 6 * 8]
    plan = attention_plan(positions, 300, 3, q.dtype, block)
    assert len(plan.runs) > 1 and any(run.open_end > 0 for run in plan.runs)  # merged parts, not one call
    torch.testing.assert_close(causal_attend(q, k, v, plan, 0.35), ref)


def test_causal_attend_few_queries_in_one_masked_call_equals_the_mask():
    """Reuse-like queries (a few lone separators and a question at the end) cost least as one masked
    attention over every key up to the last query: one run, nothing merged."""
    positions = torch.tensor([50, 101, 152, 203, *range(280, 300)])
    q, k, v = torch.randn(6, len(positions), 8), torch.randn(2, 300, 8), torch.randn(2, 300, 8)
    plan = attention_plan(positions, 300, 3, q.dtype)
    assert [(r.start, r.end, r.open_end) for r in plan.runs] == [(0, len(positions), 0)]
    ref = attend(q, k, v, causal_mask_for(positions, torch.arange(300)), 0.35)  # [24, 6 * 8]
    torch.testing.assert_close(causal_attend(q, k, v, plan, 0.35), ref)


def test_query_blocks_bound_count_and_span():
    pos = [0, 1, 2, 10, 11, 40, 41, 42, 43, 44, 90]
    runs = query_blocks(pos, 4)
    assert [i for s, e in runs for i in range(s, e)] == list(range(len(pos)))  # every query once, in order
    assert all(e - s <= 4 and pos[e - 1] - pos[s] < 4 for s, e in runs)
    assert runs == [(0, 3), (3, 5), (5, 9), (9, 10), (10, 11)]


def test_causal_attend_over_every_position_equals_the_mask():
    q, k, v = torch.randn(4, 12, 8), torch.randn(2, 12, 8), torch.randn(2, 12, 8)
    ref = attend(q, k, v, causal_mask_for(torch.arange(12), torch.arange(12)), 0.35)  # [12, 4 * 8]
    plan = attention_plan(torch.arange(12), 12, 2, q.dtype)
    assert plan.runs == ()  # one causal pass
    torch.testing.assert_close(causal_attend(q, k, v, plan, 0.35), ref)


def test_scattered_recompute_sees_no_future_keys(tiny):
    """Recompute scattered tokens over otherwise exact caches: must reproduce the full prefill exactly.

    With a bottom-right aligned mask (the public CacheBlend/LMCache bug) the early recomputed tokens
    would attend to later keys and their K/V, and so the logits, would change.
    """
    ids = tuple(torch.randint(1000, 20000, (40,)).tolist())
    body, question = ids[:32], ids[32:]
    cache = chunk_kv(tiny, body, ())
    inp = FusionInput.build([Segment(body, True), Segment(question, False)], [cache, None], [(-1,), ()])
    assert not inp.parts[0].exact  # context differs on purpose, so its tokens may be recomputed
    ref = run(tiny, inp, "full")
    scattered = torch.tensor([3, 4, 11, 20, 21, 30] + list(range(32, 40)))
    out = selective_prefill(tiny, inp, scattered)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    for k, kr in zip(out.keys, ref.keys):
        torch.testing.assert_close(k, kr, atol=ATOL, rtol=0)


def test_generation_from_injected_cache_equals_generate(tiny):
    ids = torch.randint(1000, 20000, (1, 30))
    keys, values, logits = tiny.prefill(ids)
    first = int(logits[0].argmax())
    steps = Decoder(tiny, GenerationConfig(max_new_tokens=10)).steps(keys, values, logits[0], first)
    ours = [s.token_id for s in steps if s.token_id is not None]
    ref = tiny.model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, 30:].tolist()


def test_missing_chunk_cache_is_recomputed(tiny):
    inp = rag_prompt(tiny)
    parts = inp.parts
    caches = [p.kv for p in parts]
    caches[3] = None  # chunk 2 missed in the store
    contexts = [() if i == 0 else parts[0].segment.ids for i in range(len(parts))]
    missed = FusionInput.build([p.segment for p in parts], caches, contexts)
    ref = run(tiny, missed, "full")
    out = run(tiny, missed, "reuse")
    assert out.active_per_layer[0] == int(inp.fresh.sum()) + len(parts[3].segment.ids)
    torch.testing.assert_close(run(tiny, missed, "prefix").logits, ref.logits, atol=ATOL, rtol=0)


def test_gqa_caches_stay_per_kv_head(tiny):
    inp = rag_prompt(tiny)
    out = run(tiny, inp, "cacheblend")
    assert out.keys[0].shape == (tiny.layout.n_kv_heads, inp.n_tokens, tiny.layout.head_dim)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown fusion method 'nope'"):
        get_method("nope")


def test_an_active_set_without_every_uncached_token_is_refused(tiny):
    """Positions without a cache are not written by the layout (their memory is stale until the layer
    computes them): a method that leaves one out of its active set is refused, not served garbage."""
    inp = rag_prompt(tiny)
    fresh = inp.fresh.nonzero()[:, 0]  # [F]
    with pytest.raises(ValueError, match="every token without a cache"):
        selective_prefill(tiny, inp, fresh[1:])


@pytest.mark.parametrize("keep", ["all but the last", "none"])
def test_a_refine_that_drops_the_last_token_is_refused(tiny, keep):
    """The logits are the last token's: a narrowing that leaves it out is refused (checked once the forward is
    queued, so that no narrowing waits on the device), not served."""
    inp = rag_prompt(tiny)

    def refine(layer, active, fresh_kv, layer_cache):
        return torch.arange(active.numel() - 1 if keep == "none" else 0, active.numel() - 1)  # [A - 1] or []

    match = "kept no token" if keep == "none" else "dropped the last prompt token"
    with pytest.raises(ValueError, match=match):
        selective_prefill(tiny, inp, (inp.fresh | inp.reusable).nonzero()[:, 0], refine, settled=2)


def test_an_unset_epic_k_is_an_eighth_of_the_chunk_size_and_a_method_refuses_it_unset(tiny):
    """`epic_k` unset recomputes the same share of a chunk at any chunk size (16 of 128 tokens, 64 of 512); one
    given is kept; a method handed it unset refuses it rather than guessing."""
    assert FusionConfig().for_chunks(128).epic_k == 16 and FusionConfig().for_chunks(512).epic_k == 64
    assert FusionConfig(epic_k=5).for_chunks(512).epic_k == 5
    with pytest.raises(ValueError, match="epic_k is unset"):
        get_method("epic")(tiny, rag_prompt(tiny), FusionConfig(method="epic"))
