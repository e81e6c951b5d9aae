"""Model adapter: supported architectures work, unsupported ones are refused with the reason."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_fusion import ATOL, rag_prompt
from transformers import AutoConfig, AutoModelForCausalLM

from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.methods import get_method
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.spec import UnsupportedModelError

SMALL = dict(
    vocab_size=30522,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def build(model_type: str, **overrides):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("mistral", {"head_dim": 16, "sliding_window": None}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 16}),
        (
            "llama",
            {
                "head_dim": 16,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                },
            },
        ),
    ],
)
def test_llama_family_fuses_exactly(tokenizer, model_type, extra):
    adapter = ModelAdapter(build(model_type, **extra), tokenizer, name=model_type)
    inp = rag_prompt(adapter)
    ref = get_method("full")(adapter, inp, FusionConfig(method="full"))
    out = get_method("cacheblend")(adapter, inp, FusionConfig(ratio=1.0))
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "model_type,extra,reason",
    [
        ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4}, "model_type 'gpt2' is not supported"),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },
            "rope_type 'yarn'",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
            "rope_type 'dynamic'",
        ),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, "sliding-window"),
    ],
)
def test_unsupported_models_are_refused(tokenizer, model_type, extra, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelAdapter(build(model_type, **extra), tokenizer, name=model_type)


def test_fingerprint_tracks_weights(tokenizer):
    from tiny_model import tiny_llama

    a = ModelAdapter(tiny_llama(seed=0), tokenizer, "a").fingerprint
    assert a == ModelAdapter(tiny_llama(seed=0), tokenizer, "a").fingerprint
    assert a != ModelAdapter(tiny_llama(seed=1), tokenizer, "a").fingerprint


def test_fingerprint_ignores_the_transformers_release_that_wrote_the_config(tokenizer, monkeypatch):
    """An index built under one transformers release missed every cache under another (the vLLM venv pins an
    older one): the config's `transformers_version` (the running release's, written by `to_dict`) changes no
    K/V. Any other config value still counts."""
    from tiny_model import tiny_llama
    from transformers import configuration_utils

    a = ModelAdapter(tiny_llama(seed=0), tokenizer, "a").fingerprint
    monkeypatch.setattr(configuration_utils, "__version__", "5.19.0")
    assert tiny_llama(seed=0).config.to_diff_dict()["transformers_version"] == "5.19.0"
    assert ModelAdapter(tiny_llama(seed=0), tokenizer, "a").fingerprint == a
    other_eps = tiny_llama(seed=0)
    other_eps.config.rms_norm_eps = 1e-3
    assert ModelAdapter(other_eps, tokenizer, "a").fingerprint != a


@pytest.mark.parametrize("hidden_act", ["silu", "gelu"])
def test_finish_equals_the_decoder_layer_bit_for_bit(tokenizer, hidden_act):
    """`finish` (o_proj, residuals, the MLP with its activation and product in place, gate and up in one
    projection) is the same arithmetic as transformers' own decoder layer: equal bit for bit with SiLU, and
    its input left untouched. GELU's kernel rounds a strided input (the gate half of the fused projection)
    differently from a contiguous one in the last bit, so GELU is compared to float tolerance."""
    from tiny_model import tiny_llama

    adapter = ModelAdapter(tiny_llama(hidden_act=hidden_act), tokenizer, "tiny")
    torch.manual_seed(1)
    h, attn_out = torch.randn(7, 64), torch.randn(7, 64)  # [T, E], [T, H_q * D]
    block = adapter.model.model.layers[1]
    r = h + block.self_attn.o_proj(attn_out)  # [T, E]
    expected = r + block.mlp(block.post_attention_layernorm(r))  # [T, E]
    before = h.clone()
    with torch.inference_mode():
        got = adapter.finish(1, h, attn_out)  # [T, E]
    assert adapter.silu == (hidden_act == "silu")
    if hidden_act == "silu":
        assert torch.equal(got, expected)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(h, before)


def test_the_adapter_calls_transformers_without_deprecated_arguments(tiny):
    """The reference prefill and the injected-cache decode pass the cache by the installed transformers' own name:
    no FutureWarning (`past_key_values` is deprecated since transformers 5.2x, and printed on every `ask`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        keys, values, _ = tiny.prefill(torch.tensor([[5, 6, 7, 8]]))
        tiny.decode([9], tiny.make_cache(keys, values), position=4)
