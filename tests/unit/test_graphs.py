"""The settled layers as one padded static step (`engine.graphs`): on a CPU it runs eagerly, and must give what the
layer-by-layer forward gives, method for method, whatever bucket the prompt lands in and whatever an earlier prompt
left in the step's buffers. On CUDA the same step is captured (tests/gpu/test_gpu.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_fusion import rag_prompt
from tiny_model import tiny_llama

from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.cache import SliceKV, pack_layer, pack_layers
from rag_kvcache.engine.graphs import LayerGraphs, bucket, key_splits
from rag_kvcache.engine.methods import get_method
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.store.loading import LayerFeed

METHODS = {
    "prefix": {},
    "reuse": {},
    "epic": {"epic_k": 3},
    "cacheblend": {"ratio": 0.3, "check_layer": 1},
    "cacheblend_repick": {"ratio": 0.3, "check_layer": 0, "repick_layers": (2,)},
}


@pytest.fixture(scope="module")
def adapter(tokenizer) -> ModelAdapter:
    return ModelAdapter(tiny_llama(seed=3), tokenizer, name="tiny-graphs")


def fuse(adapter, inp, method, graphs, reader=None):
    adapter.graphs = graphs
    try:
        return get_method(method)(adapter, inp, FusionConfig(method=method, **METHODS[method]), reader=reader)
    finally:
        adapter.graphs = None


@pytest.mark.parametrize("processors", [0, 64])  # 64: the attention's keys cut into parts (on CUDA, by its SMs)
@pytest.mark.parametrize("method", METHODS)
def test_settled_step_equals_the_layer_by_layer_forward(adapter, method, processors):
    graphs = LayerGraphs(adapter, limit=8, capture=False, processors=processors)
    # later prompts land in buckets an earlier prompt filled; the last one's chunks are most of its bucket's keys
    for seed, n_chunks, chunk_len in ((0, 3, 24), (1, 2, 24), (2, 3, 24), (3, 3, 64)):
        inp = rag_prompt(adapter, seed=seed, n_chunks=n_chunks, chunk_len=chunk_len)
        ref = fuse(adapter, inp, method, None)
        got = fuse(adapter, inp, method, graphs)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)
        for a, b in zip(got.keys + got.values, ref.keys + ref.values):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert got.active_per_layer == ref.active_per_layer
        assert got.compute_fraction == ref.compute_fraction
        assert "layers" in got.stages
    assert 1 <= len(graphs) <= 4
    picking = method.startswith("cacheblend")  # CacheBlend's selection in the step: every layer in it, from 0
    assert all(bool(step.picks) == picking and (step.start == 0) >= picking for step in graphs._steps.values())
    # rows that are most of the prompt attend in one causal pass over every position (CacheBlend's first layers,
    # `prefix`); the few after a pick under a bias
    passes = {(i, bool(plan.runs)) for step in graphs._steps.values() for i, plan in enumerate(step.plans)}
    assert {"prefix": {(0, False)}, "cacheblend": {(0, False), (1, True)}}.get(method, set()) <= passes
    splits = {
        run.splits for step in graphs._steps.values() for plan in (*step.plans, step.last_plan) for run in plan.runs
    }
    assert splits == ({1} if processors == 0 else {4})  # four parts of 64 of the 256 keys


def test_a_pick_at_the_last_layer_runs_cacheblend_layer_by_layer(adapter):
    # a step narrows to the last token at the last layer, so a pick there cannot join it: the layers run op by op
    graphs = LayerGraphs(adapter, limit=2, capture=False)
    inp = rag_prompt(adapter)
    cfg = FusionConfig(method="cacheblend", ratio=0.3, check_layer=adapter.layout.n_layers - 1)
    ref = get_method("cacheblend")(adapter, inp, cfg)
    adapter.graphs = graphs
    try:
        got = get_method("cacheblend")(adapter, inp, cfg)
    finally:
        adapter.graphs = None
    assert not any(step.picks for step in graphs._steps.values())
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)


def test_key_splits_fill_the_processors_in_aligned_parts():
    # 1B reuse on an H100: 64 active tokens x 4 query heads a KV head, 8 KV heads -> 32 blocks, cut 8 ways
    assert key_splits(256, 8, 2304, 132) == 8
    assert key_splits(4, 8, 2304, 132) == 16  # the last layer's one token: 8 blocks; 2,304 / 32 is not a multiple of 16
    assert key_splits(2048, 8, 2304, 132) == 1  # CacheBlend's ~400 tokens already give 256 blocks
    assert key_splits(256, 8, 256, 132) == 4  # parts of at least 64 keys
    assert key_splits(256, 8, 2304, 0) == 1


def test_a_layer_feed_fills_the_step_too(adapter):
    # the pipelined reader hands the settled layers over one by one: the same answer as the direct read
    inp = rag_prompt(adapter)
    graphs = LayerGraphs(adapter, limit=2, capture=False)
    ref = fuse(adapter, inp, "cacheblend", None)
    with LayerFeed(inp.sources, inp.placement(adapter), adapter.layout.n_layers, depth=2) as feed:
        got = fuse(adapter, inp, "cacheblend", graphs, reader=feed)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)


def test_pack_layers_equals_packing_each_layer(adapter):
    # one concatenation for every layer (a slice and an uncached segment among the sources)
    inp = rag_prompt(adapter)
    sources = [*inp.sources[:2], SliceKV(inp.sources[3], 2, 9), None]
    packed = pack_layers(sources, range(1, 4), "cpu")
    assert packed.shape[0] == 3
    for i, layer in enumerate(range(1, 4)):
        assert torch.equal(packed[i], pack_layer(sources, layer, "cpu"))
    assert pack_layers([None, None], range(2), "cpu") is None


def test_concurrent_fusions_share_steps_safely(adapter):
    # fusions in several threads use the same steps (their static buffers): each gets its own prompt's answer
    graphs = LayerGraphs(adapter, limit=4, capture=False)
    prompts = [rag_prompt(adapter, seed=seed) for seed in range(6)]
    refs = [fuse(adapter, inp, "reuse", None).logits for inp in prompts]
    adapter.graphs = graphs
    try:
        with ThreadPoolExecutor(3) as pool:
            got = list(
                pool.map(lambda inp: get_method("reuse")(adapter, inp, FusionConfig(method="reuse")), prompts * 3)
            )
    finally:
        adapter.graphs = None
    for i, result in enumerate(got):
        torch.testing.assert_close(result.logits, refs[i % len(prompts)], atol=1e-5, rtol=0)


def test_steps_kept_are_bounded(adapter):
    graphs = LayerGraphs(adapter, limit=1, capture=False)
    for method in ("reuse", "cacheblend"):  # different first settled layers: different steps
        fuse(adapter, rag_prompt(adapter), method, graphs)
        assert len(graphs) == 1


def test_bucket_rounds_up():
    assert [bucket(n, 16, 1024) for n in (1, 16, 17, 40, 1024, 1025)] == [16, 16, 32, 64, 1024, 2048]
    assert [bucket(n, 256, 256) for n in (1, 256, 257, 2246)] == [256, 256, 512, 2304]


def test_a_step_needs_room():
    with pytest.raises(ValueError, match="limit=0"):
        LayerGraphs(object(), limit=0)
