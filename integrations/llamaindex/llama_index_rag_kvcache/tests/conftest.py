"""A demo index (the demo folder bundled in rag_kvcache, 128-token chunks, SmolLM2-135M) built once per test
session, and the prompts LlamaIndex sends to LLMs, recorded through its instrumentation."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import files
from typing import Any

import pytest
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent, LLMCompletionStartEvent

from llama_index_rag_kvcache.llms import _role, _texts
from rag_kvcache import ChatTurn, Config, Engine, KVIndex

DEMO_DOCS = files("rag_kvcache") / "demo"


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


class Prompts(BaseEventHandler):
    """The prompts LlamaIndex sends to LLMs, as chat turns (a completion prompt as one user turn)."""

    turns: list[list[ChatTurn]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "Prompts"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatStartEvent):
            self.turns.append([ChatTurn(_role(m), tuple(_texts(m))) for m in event.messages])
        elif isinstance(event, LLMCompletionStartEvent):
            self.turns.append([ChatTurn("user", (event.prompt,))])


@pytest.fixture
def prompts() -> Iterator[Prompts]:
    handler = Prompts(turns=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)
