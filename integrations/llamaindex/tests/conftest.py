"""A demo index (the demo folder bundled in rag_kvcache, 128-token chunks, SmolLM2-135M) built once per test
session, and the prompts LlamaIndex sends to LLMs, recorded through its instrumentation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_index.core.instrumentation import get_dispatcher
from llama_index.retrievers.rag_kvcache import RagKVCacheRetriever

from rag_kvcache import Config, Engine, KVIndex

from .support import DEMO_DOCS, QUESTION, Prompts


@pytest.fixture(scope="session")
def demo_index(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("llama-index-rag-kvcache") / "demo-index"
    KVIndex.build(DEMO_DOCS, path, Config(chunk_tokens=128), progress=False)
    return str(path)


@pytest.fixture(scope="session")
def demo_engine(demo_index: str) -> Iterator[Engine]:
    """One opened demo index and model, shared by the session's models and retrievers."""
    with Engine(demo_index) as engine:
        yield engine


@pytest.fixture(scope="session")
def chunk_ids(demo_engine: Engine) -> list[str]:
    """The demo question's 3 retrieved chunks."""
    return [n.node_id for n in RagKVCacheRetriever(engine=demo_engine, similarity_top_k=3).retrieve(QUESTION)]


@pytest.fixture
def prompts() -> Iterator[Prompts]:
    handler = Prompts(turns=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)
