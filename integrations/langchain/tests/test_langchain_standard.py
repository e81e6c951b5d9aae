"""The standard suites of `langchain-tests`, on the demo index and SmolLM2-135M-Instruct."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_rag_kvcache import ChatRagKVCache, RagKVCacheRetriever, rag_message
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from rag_kvcache import ServingEngine

from ...testing import QUESTION

pytestmark = pytest.mark.smollm2  # every test runs on the demo index built with SmolLM2-135M


class _OnDemoIndex:
    """Points the suite's constructor parameters at the session's demo index."""

    engine: ServingEngine

    @pytest.fixture(autouse=True)
    def _use_demo_engine(self, demo_engine: ServingEngine) -> None:
        self.engine = demo_engine


class _ChatModelOnDemoIndex(_OnDemoIndex):
    """`ChatRagKVCache` on the demo index, for the unit and the integration suite."""

    @property
    def chat_model_class(self) -> type[ChatRagKVCache]:
        return ChatRagKVCache

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": self.engine}


class TestChatRagKVCacheUnit(_ChatModelOnDemoIndex, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # api_key authenticates to a remote API; a local model has none, and the class refuses
        # arguments it does not know instead of ignoring them.
        params = super().standard_chat_model_params
        return {k: v for k, v in params.items() if k != "api_key"}


class TestChatRagKVCacheIntegration(_ChatModelOnDemoIndex, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {**super().chat_model_params, "max_tokens": 64}  # room for the structured-output tests' JSON jokes

    @property
    def supports_model_override(self) -> bool:
        return False  # an index's caches belong to the one model it was built with

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        retriever = RagKVCacheRetriever(engine=self.engine, k=3)
        model = ChatRagKVCache(engine=self.engine, max_tokens=16)
        messages = [rag_message(retriever.invoke(QUESTION), QUESTION)]
        if not stream:
            return model.invoke(messages)
        full: AIMessageChunk | None = None
        for chunk in model.stream(messages):
            full = chunk if full is None else full + chunk
        assert full is not None
        return full


class TestRagKVCacheRetriever(_OnDemoIndex, RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[RagKVCacheRetriever]:
        return RagKVCacheRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"engine": self.engine, "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return QUESTION
