"""`RagKVCacheLLM`: a LlamaIndex LLM that fuses the KV caches of retrieved chunks named by id.

`complete(prompt, chunk_ids=[...])` answers `prompt` over the index's chunks with those ids: their
stored token ids are spliced into the prompt and their caches loaded, so only the rest is computed.
`chat(messages, chunk_ids=[...])` puts the chunks at the head of the last user message. Any prompt,
with or without `chunk_ids` (the ones LlamaIndex's own synthesizers build: `compact`, `refine`,
`tree_summarize`, custom templates), is rendered with the chat template and tokenised, and every run
of an indexed chunk's token ids found in it is read from that chunk's cache; the rest is prefilled.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from typing_extensions import Self

from rag_kvcache import (
    Answer,
    ChatTurn,
    ChunkPart,
    Engine,
    EngineHandle,
    FusedGenerator,
    FusionConfig,
    GenerationConfig,
    KVIndex,
    Segment,
    chat_segments,
)

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


class RagKVCacheLLM(CustomLLM):
    """LLM over a rag-kvcache index, with the index's model (SmolLM2-135M-Instruct by default).

    ```python
    from llama_index.llms.rag_kvcache import RagKVCacheLLM
    from llama_index.retrievers.rag_kvcache import RagKVCacheRetriever

    llm = RagKVCacheLLM(index="demo-index", max_new_tokens=48)
    nodes = RagKVCacheRetriever(engine=llm.serving_engine, similarity_top_k=4).retrieve("Veldmark telescope")
    print(llm.complete("What is the telescope called?", chunk_ids=[n.node_id for n in nodes]).text)
    ```

    A conversation without a system message gets the index's system prompt, the one its chunk
    caches were computed behind; messages of one role in a row are merged. `temperature` 0 decodes
    greedily. Each response's `additional_kwargs` report token counts (`cached_tokens`: prompt
    tokens whose KV came from the cache) and the fusion (`ttft_s`, `recomputed_tokens`, ...).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    engine: Engine | None = Field(default=None, exclude=True, description="An opened `Engine`, shared with a retriever.")
    index: str | None = Field(
        default=None, description="Or the folder of a rag-kvcache index; the LLM opens its own engine on first use.",
    )
    fusion: FusionConfig = Field(default_factory=FusionConfig, description="How chunk caches are fused.")
    max_new_tokens: int | None = Field(default=None, ge=1, description="None: the index's default (64).")
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy decoding.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="after")
    def _open_handle(self) -> Self:
        self._handle = EngineHandle(self.engine, self.index)  # fails here for a folder that is no index
        return self

    @property
    def serving_engine(self) -> Engine:
        """The engine this LLM serves from (opened on first use when it was given `index`)."""
        return self._handle.get()

    def close(self) -> None:
        """Close the engine this LLM opened for `index` (a given `engine` is its owner's to close)."""
        self._handle.close()

    @classmethod
    def class_name(cls) -> str:
        return "RagKVCacheLLM"

    @property
    def metadata(self) -> LLMMetadata:
        engine = self._handle.get()
        return LLMMetadata(
            context_window=engine.index.adapter.model.config.max_position_embeddings,
            num_output=self._generation(engine.index).max_new_tokens,
            is_chat_model=True,
            model_name=self._handle.model_name,
        )

    @llm_completion_callback()
    def complete(
        self, prompt: str, formatted: bool = False, *, chunk_ids: Sequence[str] = (), **kwargs: Any
    ) -> CompletionResponse:
        *_, last = self._completions(prompt, formatted, chunk_ids, kwargs)
        return CompletionResponse(text=last.text.strip(), additional_kwargs=last.additional_kwargs)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, *, chunk_ids: Sequence[str] = (), **kwargs: Any
    ) -> CompletionResponseGen:
        return self._completions(prompt, formatted, chunk_ids, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], *, chunk_ids: Sequence[str] = (), **kwargs: Any) -> ChatResponse:
        *_, last = self._chat_responses(messages, chunk_ids, kwargs)
        message = ChatMessage(role=MessageRole.ASSISTANT, content=last.message.content.strip())
        return ChatResponse(message=message, additional_kwargs=last.additional_kwargs)

    @llm_chat_callback()
    def stream_chat(
        self, messages: Sequence[ChatMessage], *, chunk_ids: Sequence[str] = (), **kwargs: Any
    ) -> ChatResponseGen:
        return self._chat_responses(messages, chunk_ids, kwargs)

    def _completions(
        self, prompt: str, formatted: bool, chunk_ids: Sequence[str], options: dict[str, Any]
    ) -> Iterator[CompletionResponse]:
        _refuse_options(options)
        user_text = prompt if formatted else self.completion_to_prompt(prompt)
        for delta, text, stats in self._steps([ChatTurn("user", (user_text,))], chunk_ids):
            yield CompletionResponse(text=text, delta=delta, additional_kwargs=stats)

    def _chat_responses(
        self, messages: Sequence[ChatMessage], chunk_ids: Sequence[str], options: dict[str, Any]
    ) -> Iterator[ChatResponse]:
        _refuse_options(options)
        turns = [ChatTurn(_role(message), tuple(_texts(message))) for message in messages]
        for delta, text, stats in self._steps(turns, chunk_ids):
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=message, delta=delta, additional_kwargs=stats)

    def _steps(self, turns: list[ChatTurn], chunk_ids: Sequence[str]) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """(delta, text so far, stats) per generated piece; stats only on the last, empty, step."""
        engine = self._handle.get()
        segments = engine.run(_segments, engine.generator, turns, list(chunk_ids), self.fusion)
        text = ""
        for step in engine.stream(segments, self.fusion, self._generation(engine.index)):
            if isinstance(step, Answer):
                yield "", text, {**step.usage, "prompt_tokens": step.prompt_tokens, **step.fusion_stats}
            elif step:
                text += step
                yield step, text, {}

    def _generation(self, index: KVIndex) -> GenerationConfig:
        return index.config.generation.with_options(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            stop=self.stop,
        )


def _segments(
    generator: FusedGenerator, turns: list[ChatTurn], chunk_ids: list[str], fusion: FusionConfig
) -> list[Segment]:
    """The prompt's segments, with the chunks named by id at the head of the last (user) turn, and the
    indexed chunks found in the rest of the text read from their caches too."""
    index = generator.index
    if chunk_ids:
        if not turns or turns[-1].role != "user":
            raise ValueError("chunk_ids go into the last message, which must be a user message")
        chunks = tuple(ChunkPart(record.token_ids, f"chunk:{record.id}") for record in index.chunks.get(chunk_ids))
        turns = [*turns[:-1], ChatTurn("user", chunks + turns[-1].parts)]
    return generator.find_chunks(chat_segments(index.adapter.tokenizer, index.config.system_prompt, turns), fusion)


def _role(message: ChatMessage) -> str:
    if message.role not in _ROLES:
        raise ValueError(
            f"RagKVCacheLLM takes system, user and assistant messages; got a {message.role.value!r} message "
            "(the model has no tool calling)"
        )
    return _ROLES[message.role]


def _texts(message: ChatMessage) -> Iterator[str]:
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise ValueError(f"RagKVCacheLLM takes text blocks; got a {block.block_type!r} block")
        yield block.text


def _refuse_options(options: dict[str, Any]) -> None:
    if options:
        raise TypeError(f"RagKVCacheLLM got unexpected arguments {sorted(options)!r}")
