"""A demo index (the demo folder bundled in rag_kvcache, 128-token chunks, SmolLM2-135M) built once per test
session and shared by both integrations' suites, and an empty index per test module for their vector stores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rag_kvcache import Config, IndexSettings, KVIndex, ServingEngine

from .testing import DEMO_DOCS, empty_engine


@pytest.fixture(scope="session")
def demo_index(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("rag-kvcache-integrations") / "demo-index"
    KVIndex.build(DEMO_DOCS, path, Config(index=IndexSettings(chunk_tokens=128)), progress=False)
    return str(path)


@pytest.fixture(scope="session")
def demo_engine(demo_index: str) -> Iterator[ServingEngine]:
    """One opened demo index and model, shared by the session's models and retrievers."""
    with ServingEngine(demo_index) as engine:
        yield engine


@pytest.fixture(scope="module")
def store_engine(tmp_path_factory: pytest.TempPathFactory, demo_engine: ServingEngine) -> Iterator[ServingEngine]:
    """An empty index on the demo engine's model, one per test module (a vector store's documents go in it)."""
    with empty_engine(tmp_path_factory.mktemp("store") / "index", demo_engine) as engine:
        yield engine
