"""Model adapter: supported architectures work, unsupported ones are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from test_fusion import ATOL, rag_prompt
from transformers import AutoConfig, AutoModelForCausalLM

from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.methods import get_method
from rag_kvcache.engine.model import ModelAdapter, UnsupportedModelError

SMALL = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)


def build(model_type: str, **overrides):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("model_type,extra", [
    ("mistral", {"head_dim": 16, "sliding_window": None}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 16}),
    ("llama", {"head_dim": 16, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),
])
def test_llama_family_fuses_exactly(tokenizer, model_type, extra):
    adapter = ModelAdapter(build(model_type, **extra), tokenizer, name=model_type)
    inp = rag_prompt(adapter)
    ref = get_method("full")(adapter, inp, FusionConfig(method="full"))
    out = get_method("cacheblend")(adapter, inp, FusionConfig(ratio=1.0))
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type,extra,reason", [
    ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4}, "model_type 'gpt2' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
               "original_max_position_embeddings": 256}}, "rope_type 'yarn'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type 'dynamic'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, "sliding-window"),
])
def test_unsupported_models_are_refused(tokenizer, model_type, extra, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelAdapter(build(model_type, **extra), tokenizer, name=model_type)


def test_fingerprint_tracks_weights(tokenizer):
    from conftest import tiny_llama

    a = ModelAdapter(tiny_llama(seed=0), tokenizer, "a").fingerprint
    assert a == ModelAdapter(tiny_llama(seed=0), tokenizer, "a").fingerprint
    assert a != ModelAdapter(tiny_llama(seed=1), tokenizer, "a").fingerprint


def test_kv_bytes_per_token(tiny):
    assert tiny.layout.bytes_per_token == 2 * 4 * 2 * 16 * 4
