"""The demo question's retrieved chunk ids, and the prompts LlamaIndex sends to LLMs, recorded through its
instrumentation (the demo index and engine are `integrations/conftest.py`'s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_index.core.instrumentation import get_dispatcher
from llama_index.retrievers.rag_kvcache import RagKVCacheRetriever

from rag_kvcache import ServingEngine

from .support import QUESTION, Prompts


@pytest.fixture(scope="session")
def chunk_ids(demo_engine: ServingEngine) -> list[str]:
    """The demo question's 3 retrieved chunks."""
    return [n.node_id for n in RagKVCacheRetriever(engine=demo_engine, similarity_top_k=3).retrieve(QUESTION)]


@pytest.fixture
def prompts() -> Iterator[Prompts]:
    handler = Prompts(turns=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)
