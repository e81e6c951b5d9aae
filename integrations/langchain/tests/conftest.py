"""The LangChain tests' retriever and the demo question asked with what it retrieves (the demo index and
engine are `integrations/conftest.py`'s)."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage
from langchain_rag_kvcache import RagKVCacheRetriever, rag_message

from rag_kvcache import ServingEngine

from ...testing import QUESTION


@pytest.fixture(scope="module")
def retriever(demo_engine: ServingEngine) -> RagKVCacheRetriever:
    """The demo index's 3 best chunks for a question."""
    return RagKVCacheRetriever(engine=demo_engine, k=3)


@pytest.fixture(scope="module")
def rag_question(retriever: RagKVCacheRetriever) -> HumanMessage:
    """The demo question after its 3 retrieved chunks, as `rag_message` builds it."""
    return rag_message(retriever.invoke(QUESTION), QUESTION)
