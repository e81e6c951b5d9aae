"""`RagKVCacheLLM`: a LlamaIndex LLM that fuses the KV caches of retrieved chunks named by id.

`complete(prompt, chunk_ids=[...])` answers `prompt` over the index's chunks with those ids: their
stored token ids are spliced into the prompt and their caches loaded, so only the rest is computed.
Per-call settings (`temperature`, `max_tokens`, `top_p`, `seed`, `stop`, `json_schema`) override the
LLM's; `json_schema` decodes the answer constrained to that JSON Schema, which `structured_predict`
uses to return validated objects.
`chat(messages, chunk_ids=[...])` puts the chunks at the head of the last user message. Any prompt,
with or without `chunk_ids` (the ones LlamaIndex's own synthesizers build: `compact`, `refine`,
`tree_summarize`, custom templates), is rendered with the chat template and tokenised, and every run
of an indexed chunk's token ids found in it is read from that chunk's cache; the rest is prefilled.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

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
from llama_index.core.program.utils import FlexibleModel
from llama_index.core.prompts import BasePromptTemplate
from pydantic import BaseModel
from typing_extensions import Self

from rag_kvcache import (
    Answer,
    ChatTurn,
    EngineHandle,
    FusionConfig,
    Options,
    ServingEngine,
    chat_prompt,
    generation_of,
)

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}
_CALL_OPTIONS = frozenset({"temperature", "max_tokens", "top_p", "seed", "stop", "json_schema"})
Model = TypeVar("Model", bound=BaseModel)


class RagKVCacheLLM(CustomLLM):
    """LLM over a rag-kvcache index, with the index's model (SmolLM2-135M-Instruct by default).

    ```python
    from llama_index.llms.rag_kvcache import RagKVCacheLLM
    from llama_index.retrievers.rag_kvcache import RagKVCacheRetriever

    llm = RagKVCacheLLM(index="demo-index", max_tokens=48)
    nodes = RagKVCacheRetriever(engine=llm.serving_engine, similarity_top_k=4).retrieve("Veldmark telescope")
    print(llm.complete("What is the telescope called?", chunk_ids=[n.node_id for n in nodes]).text)
    ```

    A conversation without a system message gets the index's system prompt, the one its chunk
    caches were computed behind; messages of one role in a row are merged. `temperature` 0 decodes
    greedily. Each response's `raw["usage"]` holds its token counts (`prompt_tokens`, `completion_tokens`,
    `total_tokens`, and `cached_tokens`: prompt tokens whose KV came from the cache), which LlamaIndex's
    `TokenCountingHandler` reads; its `additional_kwargs` report them too, with the fusion's numbers
    (`ttft_s`, `recomputed_tokens`, ...). `llm.tokenizer` is the index's tokenizer as the callable
    LlamaIndex takes (`Settings.tokenizer = llm.tokenizer`, `TokenCountingHandler(tokenizer=llm.tokenizer)`).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    engine: ServingEngine | None = Field(
        default=None, exclude=True, description="An opened `ServingEngine`, shared with a retriever."
    )
    index: str | None = Field(
        default=None,
        description="Or the folder of a rag-kvcache index; the LLM opens its own engine on first use.",
    )
    fusion: FusionConfig = Field(default_factory=FusionConfig, description="How chunk caches are fused.")
    max_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate; None: the index's default (64)."
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy decoding.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    device: str | None = Field(default=None, description="Torch device of the model (None: the index's, cpu).")
    dtype: str | None = Field(default=None, description="Model dtype (None: the one the index was built with).")
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds a call may take; checked after each generated token (the fused "
        "prefill is not interrupted), past it the call raises TimeoutError.",
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        description="Accepted as LlamaIndex's LLMs take it; the model runs in this process, with no "
        "request that could fail transiently, so no call is ever retried.",
    )

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="after")
    def _open_handle(self) -> Self:
        # fails here for a folder that is no index, or device/dtype beside an engine already loaded
        self._handle = EngineHandle(self.engine, self.index, self.device, self.dtype)
        return self

    @property
    def serving_engine(self) -> ServingEngine:
        """The engine this LLM serves from (opened on first use when it was given `index`)."""
        return self._handle.get()

    def close(self) -> None:
        """Close the engine this LLM opened for `index` (a given `engine` is its owner's to close)."""
        self._handle.close()

    @classmethod
    def class_name(cls) -> str:
        return "RagKVCacheLLM"

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """The index's own tokenizer (loaded with its model, offline), as text -> token ids."""
        tokenizer = self._handle.get().index.adapter.tokenizer
        return lambda text: tokenizer.encode(text, add_special_tokens=False)

    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """LlamaIndex's structured prediction (its prompt with the schema, its parser), the answer decoded
        constrained to `output_cls`'s JSON Schema, so it always parses into a validated `output_cls`."""
        return super().structured_predict(output_cls, prompt, _constrained(llm_kwargs, output_cls), **prompt_args)

    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        return await super().astructured_predict(
            output_cls, prompt, _constrained(llm_kwargs, output_cls), **prompt_args
        )

    def stream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Model | FlexibleModel, None, None]:
        return super().stream_structured_predict(
            output_cls, prompt, _constrained(llm_kwargs, output_cls), **prompt_args
        )

    async def astream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[Model | FlexibleModel, None]:
        return await super().astream_structured_predict(
            output_cls, prompt, _constrained(llm_kwargs, output_cls), **prompt_args
        )

    @property
    def metadata(self) -> LLMMetadata:
        engine = self._handle.get()
        return LLMMetadata(
            context_window=engine.index.adapter.model.config.max_position_embeddings,
            num_output=generation_of(engine.index, self._options({})).max_new_tokens,
            is_chat_model=True,
            model_name=self._handle.model_name,
        )

    @llm_completion_callback()
    def complete(
        self, prompt: str, formatted: bool = False, *, chunk_ids: Sequence[str] = (), **kwargs: Any
    ) -> CompletionResponse:
        *_, last = self._completions(prompt, formatted, chunk_ids, kwargs)
        return CompletionResponse(text=last.text.strip(), raw=last.raw, additional_kwargs=last.additional_kwargs)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, *, chunk_ids: Sequence[str] = (), **kwargs: Any
    ) -> CompletionResponseGen:
        return self._completions(prompt, formatted, chunk_ids, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], *, chunk_ids: Sequence[str] = (), **kwargs: Any) -> ChatResponse:
        *_, last = self._chat_responses(messages, chunk_ids, kwargs)
        message = ChatMessage(role=MessageRole.ASSISTANT, content=last.message.content.strip())
        return ChatResponse(message=message, raw=last.raw, additional_kwargs=last.additional_kwargs)

    @llm_chat_callback()
    def stream_chat(
        self, messages: Sequence[ChatMessage], *, chunk_ids: Sequence[str] = (), **kwargs: Any
    ) -> ChatResponseGen:
        return self._chat_responses(messages, chunk_ids, kwargs)

    def _completions(
        self, prompt: str, formatted: bool, chunk_ids: Sequence[str], options: dict[str, Any]
    ) -> Iterator[CompletionResponse]:
        user_text = prompt if formatted else self.completion_to_prompt(prompt)
        for delta, text, usage, stats in self._steps([ChatTurn("user", (user_text,))], chunk_ids, options):
            yield CompletionResponse(text=text, delta=delta, raw=usage, additional_kwargs=stats)

    def _chat_responses(
        self, messages: Sequence[ChatMessage], chunk_ids: Sequence[str], options: dict[str, Any]
    ) -> Iterator[ChatResponse]:
        turns = [ChatTurn(_role(message), tuple(_texts(message))) for message in messages]
        for delta, text, usage, stats in self._steps(turns, chunk_ids, options):
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=message, delta=delta, raw=usage, additional_kwargs=stats)

    def _steps(
        self, turns: list[ChatTurn], chunk_ids: Sequence[str], options: dict[str, Any]
    ) -> Iterator[tuple[str, str, dict[str, Any] | None, dict[str, Any]]]:
        """(delta, text so far, raw, stats) per generated piece; raw (`{"usage": ...}`) and stats only on
        the last, empty, step."""
        engine = self._handle.get()
        request = replace(self._options(options), chunk_ids=list(chunk_ids) or None)
        prompt = engine.run(chat_prompt, engine.generator, turns, request)
        text = ""
        for step in engine.stream(prompt.segments, prompt.fusion, prompt.generation, self.timeout):
            if isinstance(step, Answer):
                yield (
                    "",
                    text,
                    {"usage": step.usage},
                    {**step.usage, "prompt_tokens": step.prompt_tokens, **step.fusion_stats},
                )
            elif step:
                text += step
                yield step, text, None, {}

    def _options(self, options: dict[str, Any]) -> Options:
        """This LLM's settings under a call's `options`, as the library's request options (the index's own
        settings under both)."""
        if unknown := options.keys() - _CALL_OPTIONS:
            raise TypeError(f"RagKVCacheLLM got unexpected arguments {sorted(unknown)!r}")
        schema = options.get("json_schema")
        return Options(
            fusion=self.fusion,
            max_tokens=options.get("max_tokens", self.max_tokens),
            temperature=options.get("temperature", self.temperature),
            top_p=options.get("top_p", self.top_p),
            seed=options.get("seed", self.seed),
            stop=options.get("stop", self.stop),
            json_schema=schema if schema is None or isinstance(schema, str) else json.dumps(schema),
        )


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


def _constrained(llm_kwargs: Mapping[str, Any] | None, output_cls: type[BaseModel]) -> dict[str, Any]:
    """`llm_kwargs` with the answer constrained to `output_cls`'s JSON Schema."""
    return {**(llm_kwargs or {}), "json_schema": output_cls.model_json_schema()}
