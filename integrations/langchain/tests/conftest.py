"""A demo index (the demo folder bundled in rag_kvcache, 128-token chunks, SmolLM2-135M) built once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import files

import pytest

from rag_kvcache import Config, Engine, KVIndex

DEMO_DOCS = files("rag_kvcache") / "demo"


@pytest.fixture(scope="session")
def demo_index(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("langchain-rag-kvcache") / "demo-index"
    KVIndex.build(DEMO_DOCS, path, Config(chunk_tokens=128), progress=False)
    return str(path)


@pytest.fixture(scope="session")
def demo_engine(demo_index: str) -> Iterator[Engine]:
    """One opened demo index and model, shared by the session's models and retrievers."""
    with Engine(demo_index) as engine:
        yield engine
