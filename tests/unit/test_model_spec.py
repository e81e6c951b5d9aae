"""A model's spec without its weights (`ModelSpec.load`, what the vLLM connector's processes hold): the loaded
model's identity and shape, read from the checkpoint; it computes nothing, and an index over it opens a
prompt's caches without making the missing ones, laid out as the made ones are."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_faults import CFG, QUESTION, replace_model, tiny_model_dir, write_docs  # noqa: F401

from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.spec import ModelSpec
from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.store.opening import Unmade


def test_the_spec_is_the_loaded_models_identity_and_shape(tiny_model_dir):  # noqa: F811
    config = replace_model(CFG, tiny_model_dir)
    spec, loaded = ModelSpec.load(config), ModelAdapter.load(config)
    assert spec.fingerprint == loaded.fingerprint  # every cache key of an index built with the loaded model
    assert (spec.layout, spec.scale, spec.n_q_heads, spec.sliding_window) == (
        loaded.layout,
        loaded.scale,
        loaded.n_q_heads,
        loaded.sliding_window,
    )
    assert torch.equal(spec.inv_freq, loaded.inv_freq)
    assert (spec.context_length, spec.eos_token_ids) == (loaded.context_length, loaded.eos_token_ids)
    assert not [k for k, v in vars(spec).items() if isinstance(v, (torch.nn.Module, torch.nn.Parameter))]


def test_the_spec_fingerprint_follows_one_changed_weight(tiny_model_dir, tmp_path):  # noqa: F811
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(other / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    changed = ModelSpec.load(replace_model(CFG, other))
    assert changed.fingerprint != ModelSpec.load(replace_model(CFG, tiny_model_dir)).fingerprint
    assert changed.fingerprint == ModelAdapter.load(replace_model(CFG, other)).fingerprint


def test_a_spec_computes_nothing(tiny_model_dir):  # noqa: F811
    spec = ModelSpec.load(replace_model(CFG, tiny_model_dir))
    with pytest.raises(RagKVCacheError, match="without weights"):
        spec.prefill_packed([[5, 6, 7]])


def test_an_index_over_a_spec_opens_without_making(tiny_model_dir, tmp_path):  # noqa: F811
    """A missing cache is `Unmade` (nothing computed or stored) and the prompt's layout, exact parts included,
    is the one the made cache gives: what the connector's scheduler reports, its worker then loads. Opened
    without its embedder, the index embeds nothing (the connector's processes load none)."""
    config = replace_model(CFG, tiny_model_dir)
    built = KVIndex.build(write_docs(tmp_path / "docs", 3), tmp_path / "idx", config, progress=False)
    asked = FusedGenerator(built).ask(QUESTION, top_k=3)
    records = built.chunks.get([c.id for c in asked.chunks])
    fmt = built.format
    segments = fmt.segments([r.token_ids for r in records], fmt.question_ids(built.model.tokenizer, QUESTION))
    first = built.store.disk.path(built.addressing.key(records[0].token_ids, fmt.prefix_ids))
    first.unlink()  # the first chunk, exact behind the system prefix: its cache missing
    files = sorted(p.name for p in built.store.disk.root.rglob("*.safetensors"))

    planned = KVIndex.open(built.path, config, adapter=ModelSpec.load(config), embeds=False)
    with pytest.raises(RagKVCacheError, match="opened without its embedder"):  # it finds chunks by their tokens
        planned.search(QUESTION, 3)
    caches = planned.caches.open(segments, make=False)
    unmade = [s for s in caches.sources if isinstance(s, Unmade)]
    assert len(unmade) == 1 and unmade[0].n_tokens == len(records[0].token_ids)
    assert sorted(p.name for p in built.store.disk.root.rglob("*.safetensors")) == files  # nothing stored
    with pytest.raises(RagKVCacheError, match="no layers"):
        unmade[0].layer(0)

    made = built.caches.open(segments)  # the transformers model makes it (and stores it)
    plan = FusionInput.build(segments, caches.sources, caches.contexts)
    real = FusionInput.build(segments, made.sources, made.contexts)
    assert [(p.start, p.kv is None, p.exact) for p in plan.parts] == [
        (p.start, p.kv is None, p.exact) for p in real.parts
    ]
    assert plan.parts[1].exact and made.missing == 1
