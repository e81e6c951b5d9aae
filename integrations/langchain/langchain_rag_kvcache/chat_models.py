"""`ChatRagKVCache`: a LangChain chat model that fuses the KV caches of retrieved chunks.

Any prompt is fused: the messages are rendered with the chat template and tokenised, and every run
of an indexed chunk's token ids found in them (a retrieved document joined by `format_docs` into a
`ChatPromptTemplate`, a quoted passage, part of a chunk) is read from that chunk's cache; the rest is
prefilled at query time. Retrieved chunks may also travel as standard `text-plain` content blocks
whose `extras` carry the chunk id (`chunk_block` makes one from a retriever's `Document`): their
stored token ids are spliced into the prompt as they are, never re-tokenised.

`with_structured_output(schema)` decodes under the schema (grammar-constrained, through the
`response_format` call option) and returns validated objects; `get_num_tokens*` count with the
index's own tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage, ChatMessage, HumanMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.content import PlainTextContentBlock, create_plaintext_block
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, Field

from rag_kvcache import (
    Answer,
    ChatTurn,
    ChunkPart,
    FusedGenerator,
    FusionConfig,
    KVIndex,
    Options,
    Prompt,
    chat_prompt,
)

from .engines import EngineBacked

CHUNK_ID_KEY = "chunk_id"
"""The key, in a `text-plain` block's `extras` and a `Document`'s metadata, of the chunk id."""

_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_CALL_OPTIONS = frozenset({"temperature", "max_tokens", "top_p", "seed", "fusion", "model", "response_format"})


def chunk_block(document: Document) -> PlainTextContentBlock:
    """A `text-plain` content block for a retrieved document; it carries the chunk id when the
    document came from a rag-kvcache index (see `RagKVCacheRetriever`), so its cache is fused."""
    chunk_id = document.metadata.get(CHUNK_ID_KEY)
    if chunk_id is None:
        return create_plaintext_block(text=document.page_content, title=document.metadata.get("source"))
    return create_plaintext_block(
        text=document.page_content, id=chunk_id, title=document.metadata.get("source"), **{CHUNK_ID_KEY: chunk_id}
    )


class ChatRagKVCache(BaseChatModel, EngineBacked):
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
    unset decodes greedily. `temperature`, `max_tokens`, `top_p`, `seed`, `stop`, `fusion` and
    `response_format` (OpenAI's `{"type": "json_schema", "json_schema": {"schema": ...}}` or
    `{"type": "json_object"}`: the answer is decoded constrained to it) may also be given per call
    (`invoke(..., temperature=0.5)`, `bind(...)`). `response_metadata` reports the fusion (`ttft_s`,
    `recomputed_tokens`, `cache_misses`, ...) and `usage_metadata["input_token_details"]["cache_read"]`
    the prompt tokens whose KV came from the cache.
    """

    fusion: FusionConfig = Field(default_factory=FusionConfig, description="How chunk caches are fused.")
    temperature: float | None = Field(default=None, ge=0.0, description="0 or None: greedy decoding.")
    max_tokens: int | None = Field(default=None, ge=1, description="None: the index's default (64).")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False
    timeout: float | None = Field(
        default=None, gt=0, description="Seconds a call may take, checked at each token: past it, TimeoutError."
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        description="Accepted as the standard chat-model parameter; the model runs in this "
        "process, with no request that could fail transiently, so no call is ever retried.",
    )

    @property
    def model_name(self) -> str:
        """The LLM the index was built with."""
        return self._handle.model_name

    @property
    def _llm_type(self) -> str:
        return "rag-kvcache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"index": str(self._handle.index_path), "model_name": self.model_name, "fusion": self.fusion}

    def get_token_ids(self, text: str) -> list[int]:
        """`text`'s token ids by the index's own tokenizer (loaded with its model, offline)."""
        return self._handle.get().index.adapter.tokenizer.encode(text, add_special_tokens=False)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """The prompt tokens `messages` make, as the model would be sent them (chat template, system prompt)."""
        if tools:
            raise ValueError("ChatRagKVCache has no tool calling, so tools take no prompt tokens; got tools")
        engine = self._handle.get()
        return engine.run(_prompt, engine.generator, messages, Options(fusion=self.fusion)).n_tokens

    def with_structured_output(
        self,
        schema: Mapping[str, Any] | type,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, Any]:
        """The model answering JSON decoded under `schema` (a Pydantic model, a TypedDict or a JSON Schema),
        parsed and validated: a Pydantic instance for a Pydantic model, a dict otherwise.

        The schema is also appended to the last user message, so that the model knows what to fill in.
        Every `method` decodes constrained to the schema, so the answer always has its shape: `json_mode`
        too (the schema is known), and `function_calling`, as the model has no tool calling, gets the same
        JSON answer. `strict` is accepted and changes nothing: the constraint is always strict. With
        `include_raw`, a dict of the `raw` message, the `parsed` value and any `parsing_error`.
        """
        if kwargs:
            raise TypeError(f"with_structured_output got unexpected arguments {sorted(kwargs)!r}")
        if method not in ("json_schema", "json_mode", "function_calling"):
            raise ValueError(f"method must be 'json_schema', 'json_mode' or 'function_calling', got {method!r}")
        json_schema = convert_to_json_schema(schema)
        model = self.bind(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": json_schema.get("title", "answer"), "schema": json_schema},
            },
            ls_structured_output_format={"kwargs": {"method": method, "strict": strict}, "schema": json_schema},
        )
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        if not include_raw:
            return model | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        return RunnableMap(raw=model) | parsed.with_fallbacks(
            [RunnablePassthrough.assign(parsed=lambda _: None)], exception_key="parsing_error"
        )

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="rag_kvcache",
            ls_model_name=kwargs.get("model", self.model_name),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop or self.stop:
            params["ls_stop"] = stop
        return params

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if unknown := kwargs.keys() - _CALL_OPTIONS:
            raise TypeError(f"{type(self).__name__} got unexpected call options {sorted(unknown)!r}")
        if kwargs.get("model", self.model_name) != self.model_name:
            raise ValueError(
                f"index {self._handle.index_path} serves {self.model_name!r}, not {kwargs['model']!r}: another model needs "
                "its own index"
            )
        engine = self._handle.get()
        json_schema = _json_schema(kwargs.get("response_format"))
        if json_schema is not None:  # the constraint keeps the shape; the model still needs to know what to fill in
            messages = [*messages, HumanMessage(f"Answer with JSON matching this JSON Schema: {json_schema}")]
        options = Options(
            fusion=kwargs.get("fusion", self.fusion),
            max_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            seed=kwargs.get("seed", self.seed),
            stop=stop or self.stop,
            json_schema=json_schema,
        )
        prompt = engine.run(_prompt, engine.generator, messages, options)
        for step in engine.stream(prompt.segments, prompt.fusion, prompt.generation, self.timeout):
            if isinstance(step, Answer):
                yield self._last_chunk(step)
            elif step:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=step))
                if run_manager is not None:
                    run_manager.on_llm_new_token(step, chunk=chunk)
                yield chunk

    def _last_chunk(self, answer: Answer) -> ChatGenerationChunk:
        """The closing chunk: usage and the fusion's numbers, no text (it was streamed)."""
        usage, metadata = answer_metadata(answer, self.model_name)
        message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message)


def answer_metadata(answer: Answer, model_name: str) -> tuple[UsageMetadata, dict[str, Any]]:
    """An answer's usage (the prompt tokens read from the cache as `cache_read`) and response metadata (the
    fusion's numbers), as an `AIMessage` carries them."""
    usage = answer.usage
    usage_metadata = UsageMetadata(
        input_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
        input_token_details={"cache_read": usage["cached_tokens"]},
    )
    metadata = {
        "model_name": model_name,
        "model_provider": "rag_kvcache",
        "finish_reason": answer.finish_reason,
        "prompt_tokens": answer.prompt_tokens,
        **answer.fusion_stats,
    }
    return usage_metadata, metadata


def _json_schema(response_format: Mapping[str, Any] | type[BaseModel] | None) -> str | None:
    """The JSON Schema, as text, that an OpenAI-style `response_format` (or a Pydantic model) asks for."""
    if response_format is None:
        return None
    if isinstance(response_format, type) and is_basemodel_subclass(response_format):
        return json.dumps(response_format.model_json_schema())
    if response_format.get("type") == "json_object":
        return json.dumps({"type": "object"})
    if response_format.get("type") == "json_schema" and "schema" in response_format.get("json_schema", {}):
        return json.dumps(response_format["json_schema"]["schema"])
    raise ValueError(
        "response_format must be {'type': 'json_schema', 'json_schema': {'schema': {...}}}, {'type': 'json_object'} "
        f"or a Pydantic model, got {response_format!r}"
    )


def _prompt(generator: FusedGenerator, messages: Sequence[BaseMessage], options: Options) -> Prompt:
    """The prompt of `messages` (on the engine's thread; `rag_kvcache.chat_prompt`): chunk blocks as
    their stored token ids, and the indexed chunks found in the rest of the text read from their caches too."""
    turns = [ChatTurn(_role(message), tuple(_parts(generator.index, message))) for message in messages]
    return chat_prompt(generator, turns, options)


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
            raise ValueError(f"ChatRagKVCache takes text and text-plain (with text) content blocks; got {block!r}")
