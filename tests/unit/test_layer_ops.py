"""The fused step's per-layer pieces (issue 30): fused projections, RMSNorm and RoPE in fewer operators,
each equal to the transformers modules it replaces on tiny random models."""

from __future__ import annotations

import pytest
import torch
from test_model import build
from tiny_model import tiny_llama
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.ops import apply_rope, rope_cos_sin


def reference_qkv(adapter: ModelAdapter, layer: int, h: torch.Tensor, positions: torch.Tensor):
    """q [H_q, T, D], k, v [H_kv, T, D] as transformers' own modules compute them (separate projections,
    its RMSNorm, its rotary embedding and `apply_rotary_pos_emb`)."""
    model = adapter.model.model
    attn = model.layers[layer].self_attn
    x = model.layers[layer].input_layernorm(h)  # [T, E]
    q = attn.q_proj(x).view(h.shape[0], -1, adapter.head_dim)  # [T, H_q, D]
    k = attn.k_proj(x).view(h.shape[0], -1, adapter.head_dim)  # [T, H_kv, D]
    v = attn.v_proj(x).view(h.shape[0], -1, adapter.head_dim).transpose(0, 1)  # [H_kv, T, D]
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = model.rotary_emb(h[None], positions[None])  # [1, T, D]
    q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)  # [1, H, T, D]
    return q[0], k[0], v


@pytest.mark.parametrize("model_type,extra", [("llama", {"head_dim": 16}), ("qwen2", {}), ("qwen3", {"head_dim": 16})])
def test_fused_projections_equal_the_modules(tokenizer, model_type, extra):
    """`qkv` (one projection, q and k rotated together) and the `kv` / `q` pair the fusion uses around a
    refine equal transformers' separate projections, norm and rotary embedding (Qwen2's biases, Qwen3's
    per-head norms included)."""
    adapter = ModelAdapter(build(model_type, **extra), tokenizer, name=model_type)
    torch.manual_seed(3)
    h = torch.randn(9, 64)  # [T, E]
    positions = torch.tensor([0, 1, 2, 40, 41, 300, 301, 302, 900])  # [T]
    cos, sin = rope_cos_sin(positions, adapter.inv_freq, adapter.dtype)  # [T, D]
    with torch.inference_mode():
        for layer in range(adapter.layout.n_layers):
            q_ref, k_ref, v_ref = reference_qkv(adapter, layer, h, positions)
            x = adapter.attention_input(layer, h)  # [T, E]
            q, k, v = adapter.qkv(layer, x, cos, sin)
            k2, v2 = adapter.kv(layer, x, cos, sin)
            q2 = adapter.q(layer, x, cos, sin)
            for got, want in ((q, q_ref), (k, k_ref), (v, v_ref), (q2, q_ref), (k2, k_ref), (v2, v_ref)):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_weights_are_held_once(tokenizer):
    """The modules' q, k, v and gate, up weights are views into the fused ones: no weight is held twice,
    and transformers' own forward reads the same memory the fused step does."""
    adapter = ModelAdapter(tiny_llama(), tokenizer, "tiny")
    for block, w in zip(adapter.model.model.layers, adapter.layers):
        fused = w.qkv.untyped_storage().data_ptr()
        for proj in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj):
            assert proj.weight.untyped_storage().data_ptr() == fused
        assert block.mlp.gate_proj.weight.untyped_storage().data_ptr() == w.gate_up.untyped_storage().data_ptr()
        assert block.mlp.up_proj.weight.untyped_storage().data_ptr() == w.gate_up.untyped_storage().data_ptr()
        assert w.qkv.untyped_storage().nbytes() == sum(
            p.weight.nbytes for p in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj)
        )


def test_attention_input_equals_the_module(tiny):
    """`F.rms_norm` (one operator) equals transformers' LlamaRMSNorm, bit for bit in float32."""
    torch.manual_seed(4)
    h = torch.randn(11, 64) * 3  # [T, E]
    with torch.inference_mode():
        for layer, block in enumerate(tiny.model.model.layers):
            assert torch.equal(tiny.attention_input(layer, h), block.input_layernorm(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_equals_rotate_half(dtype):
    """One swap and one multiply-add with the signed sin table equal transformers' x * cos + rotate_half(x) * sin,
    for a strided input (q and k heads of one projection) as for a contiguous one."""
    torch.manual_seed(5)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))  # [D/2]
    positions = torch.tensor([0, 5, 17, 1000, 3001])  # [T]
    y = torch.randn(5, 6, 16, dtype=dtype)  # [T, H, D]
    x = y[:, :4].transpose(0, 1)  # [H, T, D], strided
    freqs = positions.float()[:, None] * inv_freq[None]  # [T, D/2]
    angles = torch.cat((freqs, freqs), -1)  # [T, D]
    cos_ref, sin_ref = angles.cos().to(dtype), angles.sin().to(dtype)  # [T, D]
    x32 = x.float()  # [H, T, D]
    rotated = torch.cat((-x32[..., 8:], x32[..., :8]), -1)  # [H, T, D]
    want = (x32 * cos_ref + rotated * sin_ref).to(dtype)  # [H, T, D]
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)  # [T, D]
    assert cos.dtype == sin.dtype == dtype
    got = apply_rope(x, cos, sin)  # [H, T, D]
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)
    torch.testing.assert_close(apply_rope(x.contiguous(), cos, sin), got, atol=0, rtol=0)


def test_prefill_packed_keeps_no_projection_alive(tiny):
    """Each chunk's K/V from `prefill_packed` own their memory: not views of a layer's fused projection,
    which would keep every layer's q (and the other chunks) alive as long as a cache."""
    out = tiny.prefill_packed([[5, 6, 7, 8], [9, 10, 11]])
    for keys, values in out:
        for t in (*keys, *values):
            assert t.is_contiguous()
            assert t.untyped_storage().nbytes() == t.nbytes
