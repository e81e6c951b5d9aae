"""`ChatRagKVCache`: a LangChain chat model that fuses the KV caches of retrieved chunks.

Any prompt is fused: the messages are rendered with the chat template and tokenised, and every run
of an indexed chunk's token ids found in them (a retrieved document joined by `format_docs` into a
`ChatPromptTemplate`, a quoted passage, part of a chunk) is read from that chunk's cache; the rest is
prefilled at query time. Retrieved chunks may also travel as standard `text-plain` content blocks
whose `extras` carry the chunk id (`chunk_block` makes one from a retriever's `Document`): their
stored token ids are spliced into the prompt as they are, never re-tokenised.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.content import PlainTextContentBlock, create_plaintext_block
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from typing_extensions import Self

from rag_kvcache import (
    Answer,
    ChatTurn,
    ChunkPart,
    Engine,
    EngineHandle,
    FusedGenerator,
    FusionConfig,
    KVIndex,
    Segment,
    chat_segments,
)

CHUNK_ID_KEY = "chunk_id"
"""The key, in a `text-plain` block's `extras` and a `Document`'s metadata, of the chunk id."""

_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_CALL_OPTIONS = frozenset({"temperature", "max_tokens", "top_p", "seed", "fusion", "model"})


def chunk_block(document: Document) -> PlainTextContentBlock:
    """A `text-plain` content block for a retrieved document; it carries the chunk id when the
    document came from a rag-kvcache index (see `RagKVCacheRetriever`), so its cache is fused."""
    chunk_id = document.metadata.get(CHUNK_ID_KEY)
    if chunk_id is None:
        return create_plaintext_block(text=document.page_content, title=document.metadata.get("source"))
    return create_plaintext_block(
        text=document.page_content, id=chunk_id, title=document.metadata.get("source"), **{CHUNK_ID_KEY: chunk_id}
    )


class ChatRagKVCache(BaseChatModel):
    """Chat model over a rag-kvcache index, with the index's model (SmolLM2-135M-Instruct by default).

    ```python
    from langchain_core.messages import HumanMessage
    from langchain_rag_kvcache import ChatRagKVCache, RagKVCacheRetriever, chunk_block

    model = ChatRagKVCache(index="demo-index", max_tokens=48)
    docs = RagKVCacheRetriever(index="demo-index", k=4).invoke("Veldmark telescope")
    message = HumanMessage([*map(chunk_block, docs), {"type": "text", "text": "What is the telescope called?"}])
    print(model.invoke([message]).text)
    ```

    Messages of one role in a row are merged. A conversation without a system message gets the
    index's system prompt, the one its chunk caches were computed behind. `temperature` 0 or
    unset decodes greedily. `response_metadata` reports the fusion (`ttft_s`, `recomputed_tokens`,
    `cache_misses`, ...) and `usage_metadata["input_token_details"]["cache_read"]` the prompt
    tokens whose KV came from the cache.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    engine: Engine | None = Field(default=None, exclude=True, description="An opened `Engine`, shared with a retriever.")
    index: str | None = Field(
        default=None, description="Or the folder of a rag-kvcache index; the model opens its own engine on first use.",
    )
    fusion: FusionConfig = Field(default_factory=FusionConfig, description="How chunk caches are fused.")
    temperature: float | None = Field(default=None, ge=0.0, description="0 or None: greedy decoding.")
    max_tokens: int | None = Field(default=None, ge=1, description="None: the index's default (64).")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="after")
    def _open_handle(self) -> Self:
        self._handle = EngineHandle(self.engine, self.index)  # fails here for a folder that is no index
        return self

    @property
    def model_name(self) -> str:
        """The LLM the index was built with."""
        return self._handle.model_name

    def close(self) -> None:
        """Close the engine this model opened for `index` (a given `engine` is its owner's to close)."""
        self._handle.close()

    @property
    def _llm_type(self) -> str:
        return "rag-kvcache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"index": str(self._handle.index_path), "model_name": self.model_name, "fusion": self.fusion}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="rag_kvcache", ls_model_name=kwargs.get("model", self.model_name), ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop or self.stop:
            params["ls_stop"] = stop
        return params

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    def _stream(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if unknown := kwargs.keys() - _CALL_OPTIONS:
            raise TypeError(f"{type(self).__name__} got unexpected call options {sorted(unknown)!r}")
        if kwargs.get("model", self.model_name) != self.model_name:
            raise ValueError(
                f"index {self._handle.index_path} serves {self.model_name!r}, not {kwargs['model']!r}: another model needs "
                "its own index"
            )
        engine = self._handle.get()
        generation = engine.index.config.generation.with_options(
            max_new_tokens=kwargs.get("max_tokens", self.max_tokens), temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p), seed=kwargs.get("seed", self.seed), stop=stop or self.stop,
        )
        fusion = kwargs.get("fusion", self.fusion)
        segments = engine.run(_segments, engine.generator, messages, fusion)
        for step in engine.stream(segments, fusion, generation):
            if isinstance(step, Answer):
                yield self._last_chunk(step)
            elif step:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=step))
                if run_manager is not None:
                    run_manager.on_llm_new_token(step, chunk=chunk)
                yield chunk

    def _last_chunk(self, answer: Answer) -> ChatGenerationChunk:
        """The closing chunk: usage and the fusion's numbers, no text (it was streamed)."""
        usage = answer.usage
        usage_metadata = UsageMetadata(
            input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
            total_tokens=usage["total_tokens"], input_token_details={"cache_read": usage["cached_tokens"]},
        )
        metadata = {
            "model_name": self.model_name, "model_provider": "rag_kvcache", "finish_reason": answer.finish_reason,
            "prompt_tokens": answer.prompt_tokens, **answer.fusion_stats,
        }
        message = AIMessageChunk(
            content="", usage_metadata=usage_metadata, response_metadata=metadata, chunk_position="last"
        )
        return ChatGenerationChunk(message=message)


def _segments(generator: FusedGenerator, messages: Sequence[BaseMessage], fusion: FusionConfig) -> list[Segment]:
    """The prompt of `messages` as segments: chunk blocks as their stored token ids, and the indexed
    chunks found in the rest of the text read from their caches too."""
    index = generator.index
    turns = [ChatTurn(_role(message), tuple(_parts(index, message))) for message in messages]
    return generator.find_chunks(chat_segments(index.adapter.tokenizer, index.config.system_prompt, turns), fusion)


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    if message.type not in _ROLES:
        raise ValueError(
            f"ChatRagKVCache takes system, human, AI and chat messages; got a {message.type!r} message "
            "(the model has no tool calling)"
        )
    return _ROLES[message.type]


def _parts(index: KVIndex, message: BaseMessage) -> Iterator[str | ChunkPart]:
    for block in message.content_blocks:
        if block["type"] == "text":
            yield block["text"]
        elif block["type"] == "text-plain" and "text" in block:
            chunk_id = block.get("extras", {}).get(CHUNK_ID_KEY)
            if chunk_id is None:
                yield block["text"]
                continue
            (record,) = index.chunks.get([chunk_id])
            if record.text != block["text"]:
                raise ValueError(
                    f"text-plain block for chunk {chunk_id!r} holds other text than the chunk in index "
                    f"{index.path}: {block['text'][:80]!r} vs {record.text[:80]!r}"
                )
            yield ChunkPart(record.token_ids, label=f"chunk:{chunk_id}")
        else:
            raise ValueError(
                f"ChatRagKVCache takes text and text-plain (with text) content blocks; got {block!r}"
            )
