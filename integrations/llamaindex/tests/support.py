"""What the LlamaIndex tests share beside their fixtures: the demo question, a recorder of the prompts
LlamaIndex sends to LLMs, and the count of a prompt's tokens read from the index's chunk caches."""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent, LLMCompletionStartEvent
from llama_index.llms.rag_kvcache import RagKVCacheLLM
from llama_index.llms.rag_kvcache.base import _role, _texts

from rag_kvcache import ChatTurn, chat_prompt

from ...testing import QUESTION  # noqa: F401 (re-exported for the LlamaIndex tests)


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


def matched_tokens(llm: RagKVCacheLLM, turns: list[ChatTurn]) -> int:
    """Prompt tokens of `turns` found in the index's chunks (read from their caches)."""
    engine = llm.serving_engine
    prompt = engine.run(chat_prompt, engine.generator, turns, llm._options({}))
    return sum(len(s.ids) for s in prompt.segments if s.cacheable and s.label.startswith("chunk:"))
