"""The fused path on CUDA. Tests marked `gpu` need a device and are skipped without one (CI has none); the
device-agnostic ones (the attention kernels against a float64 reference, reading layers, the device-resident
tier, the settled-layer steps against the op-by-op forward) run on the CPU too, where the step is not captured
but built and run eagerly: CI runs those."""

from __future__ import annotations

import pytest
import torch
from test_fusion import rag_prompt
from test_sentences import FIRST, SECOND, prompt
from tiny_model import tiny_llama

from rag_kvcache.config import FusionConfig, GenerationConfig
from rag_kvcache.engine.cache import ChunkKV, SliceKV, read_layer
from rag_kvcache.engine.generation import Decoder, sample_token
from rag_kvcache.engine.graphs import LayerGraphs
from rag_kvcache.engine.methods import get_method
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.ops import attend_lse, attend_split, causal_mask_for, mask_bias
from rag_kvcache.store.tiers import MemoryTier

GPU = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]  # a test that runs on either


def gpu(test):
    """Marks a test that needs a CUDA device."""
    for mark in GPU:
        test = mark(test)
    return test


@gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_fusion_invariants_on_cuda(tokenizer, dtype, atol):
    adapter = ModelAdapter(tiny_llama().to("cuda", dtype), tokenizer, name="tiny-cuda")
    inp = rag_prompt(adapter)
    ref = get_method("full")(adapter, inp, FusionConfig(method="full"))
    for method, cfg in (("prefix", {}), ("cacheblend", {"ratio": 1.0})):
        out = get_method(method)(adapter, inp, FusionConfig(method=method, **cfg))
        torch.testing.assert_close(out.logits, ref.logits, atol=atol, rtol=0)
    blend = get_method("cacheblend")(adapter, inp, FusionConfig())
    gen = GenerationConfig(max_new_tokens=5, temperature=0.7, seed=0)
    dec = Decoder(adapter, gen)
    steps = list(dec.steps(blend.keys, blend.values, blend.logits, sample_token(blend.logits, gen, dec.rng)))
    assert steps and blend.keys[0].device.type == "cuda"


@gpu
def test_epic_match_on_cuda(tokenizer):
    # the sentence tables live on the model's device; the echoing chunk recomputed whole equals full there too
    adapter = ModelAdapter(tiny_llama().to("cuda"), tokenizer, name="tiny-cuda")
    inp = prompt(adapter, [FIRST, SECOND])
    match = get_method("epic_match")(adapter, inp, FusionConfig(method="epic_match", epic_k=0))
    full = get_method("full")(adapter, inp, FusionConfig(method="full"))
    torch.testing.assert_close(match.logits, full.logits, atol=1e-3, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_attend_lse_equals_a_float64_reference(device, dtype, tol):
    # the fused kernel's output and log-sum-exp, under a bias with masked keys, at sizes off every tile
    g = torch.Generator().manual_seed(1)
    h, m, n, d = 4, 37, 53, 64
    q, k, v = (torch.randn(h, t, d, generator=g) for t in (m, n, n))
    mask = torch.rand(m, n, generator=g) < 0.7
    mask[:, 0] = True  # no query without a key
    bias = mask_bias(mask, torch.float64)  # [M, n]
    scores = torch.einsum("hmd,hnd->hmn", q.double(), k.double()) * 0.125 + bias  # [H, M, n]
    ref_lse = scores.logsumexp(-1)  # [H, M]
    ref = torch.softmax(scores, -1) @ v.double()  # [H, M, D]
    out, lse = attend_lse(*(t.to(device, dtype) for t in (q, k, v)), bias.to(device, dtype), 0.125)
    assert lse.dtype == torch.float32 and lse.shape == (h, m) and out.shape == (h, m, d)
    assert (out.double().cpu() - ref).norm() / ref.norm() < tol
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=tol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_attend_split_equals_a_float64_reference(device, dtype, tol):
    # the keys cut into 8 parts in one call of the memory-efficient kernel, merged by log-sum-exp; the first
    # queries see no key of the later parts (whatever the kernel writes for them must weigh nothing)
    g = torch.Generator().manual_seed(6)
    h, d, n = 8, 64, 512
    positions = torch.cat([torch.arange(3, 9), torch.randperm(n, generator=g)[:57].sort().values]).unique()  # [M]
    q = torch.randn(h, positions.numel(), d, generator=g)
    k, v = torch.randn(h, n + 1, d, generator=g), torch.randn(h, n + 1, d, generator=g)  # a scratch column past n
    bias = mask_bias(causal_mask_for(positions, torch.arange(n)), torch.float64)  # [M, n]
    scores = torch.einsum("hmd,hnd->hmn", q.double(), k[:, :n].double()) * 0.125 + bias  # [H, M, n]
    ref = torch.softmax(scores, -1) @ v[:, :n].double()  # [H, M, D]
    out, lse = attend_split(*(t.to(device, dtype) for t in (q, k, v)), bias.to(device, dtype), 0.125, 8)
    assert not out.isnan().any()
    assert (out.double().cpu() - ref).norm() / ref.norm() < tol
    torch.testing.assert_close(lse.double().cpu(), scores.logsumexp(-1), atol=tol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_read_layer_equals_copying_each_segment(device):
    # host layers go over packed in one pinned transfer; a slice (not contiguous) and a cache already on
    # the device (recomputed there) keep their values, each segment its own
    g = torch.Generator().manual_seed(2)

    def cache(n: int, device: str = "cpu") -> ChunkKV:
        layers = [torch.randn(2, n, 16, generator=g).to(device, torch.bfloat16) for _ in range(6)]
        return ChunkKV(layers[:3], layers[3:], position=0)

    sources = [None, cache(5), SliceKV(cache(9), 2, 7), cache(4, device), None]
    for layer in range(3):
        got = read_layer(sources, layer, device)
        for source, kv in zip(sources, got):
            if source is None:
                assert kv is None
                continue
            for a, b in zip(kv, source.layer(layer)):
                assert a.device.type == device and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


@gpu
@pytest.mark.parametrize("method", ["prefix", "reuse", "epic", "cacheblend", "cacheblend_repick"])
def test_every_method_on_cuda_equals_the_cpu_path(tokenizer, method):
    # the same weights and prompt in float32: the device's answer is the CPU path's, method for method
    cfg = FusionConfig(method=method, repick_layers=(2, 3), epic_k=4)  # re-picks inside the tiny model's 4 layers
    cpu = ModelAdapter(tiny_llama(), tokenizer, name="tiny")
    ref = get_method(method)(cpu, rag_prompt(cpu), cfg)
    cuda = ModelAdapter(tiny_llama().to("cuda"), tokenizer, name="tiny-cuda")
    out = get_method(method)(cuda, rag_prompt(cuda), cfg)
    assert out.compute_fraction == ref.compute_fraction  # the same tokens recomputed
    torch.testing.assert_close(out.logits.cpu(), ref.logits, atol=1e-3, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_memory_tier_on_the_device_is_read_in_place(device):
    # a cache put in a device-resident tier is moved there once; reading a layer then copies nothing
    g = torch.Generator().manual_seed(3)
    host = ChunkKV(
        [torch.randn(2, 7, 16, generator=g) for _ in range(2)],
        [torch.randn(2, 7, 16, generator=g) for _ in range(2)],
        0,
    )
    tier = MemoryTier(1 << 20, "lru", device)
    tier.put("k", host)
    held = tier.get("k")
    assert held is not None and all(t.device.type == device for t in (*held.keys, *held.values))
    ((k, v),) = read_layer([held], 1, device)
    assert k.data_ptr() == held.keys[1].data_ptr() and torch.equal(v.cpu(), host.values[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_captured_settled_layers_equal_op_by_op(tokenizer, device, dtype, atol):
    # each method's settled layers recorded once as a CUDA graph per bucket and replayed for later prompts (new
    # inputs in the same buffers): logits and K/V equal the op-by-op forward's, prompt after prompt. On the CPU
    # the same steps (built per bucket, static buffers reused) run eagerly: the capture's fallback
    cuda = ModelAdapter(tiny_llama().to(device, dtype), tokenizer, name=f"tiny-{device}", graphs=8)
    if device == "cpu":  # the adapter keeps no steps off CUDA unless given them
        assert cuda.graphs is None
        cuda.graphs = LayerGraphs(cuda, 8)
    captured = cuda.graphs
    assert captured is not None and captured.capture == (device == "cuda")
    for method in ("prefix", "reuse", "epic", "cacheblend", "cacheblend_repick"):
        # the tiny model's layer 3 settled after the re-pick; EPIC's heads set for its 24-token chunks
        cfg = FusionConfig(method=method, repick_layers=(2,), epic_k=4)
        for seed, n_chunks, chunk_len in ((0, 3, 24), (1, 2, 24), (2, 3, 24), (3, 3, 64)):  # the last: one causal pass
            inp = rag_prompt(cuda, seed=seed, n_chunks=n_chunks, chunk_len=chunk_len)
            cuda.graphs = None
            ref = get_method(method)(cuda, inp, cfg)
            cuda.graphs = captured
            out = get_method(method)(cuda, inp, cfg)
            assert "layers" in out.stages and out.active_per_layer == ref.active_per_layer
            torch.testing.assert_close(out.logits, ref.logits, atol=atol, rtol=0)
            for a, b in zip(out.keys + out.values, ref.keys + ref.values):  # [H_kv, N, D]
                if dtype == torch.float32 or not method.startswith("cacheblend"):
                    torch.testing.assert_close(a, b, atol=atol, rtol=0)
                else:  # bf16: a near-tie in the pick's deviation scores can tip with the kernels' rounding
                    assert int(((a - b).abs().amax(dim=(0, 2)) > atol).sum()) <= 2  # tokens picked on one side only
    assert captured._steps and all((step.captured is not None) == captured.capture for step in captured._steps.values())


@gpu
def test_a_pinned_memory_tier_is_read_by_dma():
    # a host tier beside a GPU holds its caches page-locked; each layer (a slice of one too) is copied to the
    # device asynchronously, without a staging copy, and keeps its values
    g = torch.Generator().manual_seed(4)
    host = ChunkKV(
        [torch.randn(2, 9, 16, generator=g) for _ in range(2)],
        [torch.randn(2, 9, 16, generator=g) for _ in range(2)],
        0,
    )
    tier = MemoryTier(1 << 20, "lru", "cpu", pinned=True)
    tier.put("k", host)
    held = tier.get("k")
    assert held is not None and all(t.device.type == "cpu" and t.is_pinned() for t in (*held.keys, *held.values))
    for source, ref in ((held, host), (SliceKV(held, 2, 7), SliceKV(host, 2, 7))):
        ((k, v),) = read_layer([source], 1, "cuda")
        assert k.device.type == "cuda"
        assert torch.equal(k.cpu(), ref.layer(1)[0]) and torch.equal(v.cpu(), ref.layer(1)[1])
