"""Fixtures for every test folder: a tiny random-weight Llama (seconds on CPU) and, for marked tests, SmolLM2.

The suite by layer: unit/ (the tiny model, pure functions), integration/ (servers, Redis, processes, mounts,
notebooks, vLLM), e2e/ (the real SmolLM2), gpu/ (CUDA). Helpers shared across folders live here, beside this
file: tiny_model.py, synthetic.py, redis_server.py; pyproject's `pythonpath` puts this folder and the four on
sys.path, so a test imports another folder's test module by its name (`from test_faults import write_docs`)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest
from tiny_model import MINILM_DIR, tiny_llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rag_kvcache.config import Config, RuntimeConfig
from rag_kvcache.engine.model import ModelAdapter


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
