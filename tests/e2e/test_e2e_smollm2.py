"""End to end on the real SmolLM2-135M-Instruct: index the demo folder, ask, get the planted fact."""

from __future__ import annotations

from importlib.resources import files

import pytest

from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings, QueryConfig
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator

pytestmark = pytest.mark.smollm2

DEMO = files("rag_kvcache") / "demo"
QUESTION = "What is the name of the main telescope of the Veldmark Observatory?"


def build(smollm2, tmp_path_factory, **index) -> KVIndex:
    cfg = Config(
        index=IndexSettings(chunk_tokens=128, **index),
        query=QueryConfig(top_k=4, generation=GenerationConfig(max_new_tokens=24)),
    )
    return KVIndex.build(DEMO, tmp_path_factory.mktemp("demo") / "idx", cfg, adapter=smollm2, progress=False)


@pytest.fixture(scope="module")
def demo_index(smollm2, tmp_path_factory) -> KVIndex:
    return build(smollm2, tmp_path_factory)  # the default caches: cached_neighbours


@pytest.fixture(scope="module")
def behind_prefix_index(smollm2, tmp_path_factory) -> KVIndex:
    return build(smollm2, tmp_path_factory, chunk_prefill="behind_prefix")


@pytest.mark.parametrize(
    "method,caches",
    [
        ("full", "default"),
        ("epic_match", "default"),
        ("epic", "default"),
        ("prefix", "default"),
        # on grouped caches (the default before) CacheBlend 0.15 answers this one with the distractor's telescope (Hobb's Eye)
        # while reuse, EPIC and epic_match keep it (benchmarks/RESULTS.md, session 25): its own caches here
        ("cacheblend", "behind_prefix"),
    ],
)
def test_planted_fact_comes_back(request, method, caches):
    index = request.getfixturevalue("demo_index" if caches == "default" else "behind_prefix_index")
    answer = FusedGenerator(index).ask(QUESTION, fusion=FusionConfig(method=method))
    assert answer.chunks[0].source == "observatory.md"
    assert "Harrow" in answer.answer, answer.answer


def test_cacheblend_matches_full_first_token(demo_index):
    gen = FusedGenerator(demo_index)
    hits = demo_index.search(QUESTION, 4)
    full = gen.ask(QUESTION, hits, fusion=FusionConfig(method="full"))
    blend = gen.ask(QUESTION, hits, fusion=FusionConfig(method="cacheblend"))
    assert full.first_token_logits.argmax() == blend.first_token_logits.argmax()
    assert blend.recomputed_tokens < 0.3 * blend.prompt_tokens
