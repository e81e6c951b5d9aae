"""`KVCacheSynthesizer`: hands the retrieved nodes' ids to `RagKVCacheLLM` so their caches are fused,
and `create_kv_query_engine`, a `RetrieverQueryEngine` built from it."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from llama_index.core.base.llms.types import CompletionResponseAsyncGen
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryType
from llama_index.core.types import RESPONSE_TEXT_TYPE

from .llms import RagKVCacheLLM
from .retrievers import RagKVCacheRetriever


class KVCacheSynthesizer(BaseSynthesizer):
    """Answers over the retrieved nodes by their ids: the LLM splices in the chunks' stored tokens and
    fuses their caches, in the index's prompt layout (the synthesizer has no prompt templates).

    Called with text only (`get_response` without `chunk_ids`), it prefills the texts instead.
    """

    def __init__(
        self, llm: RagKVCacheLLM, streaming: bool = False, callback_manager: CallbackManager | None = None
    ) -> None:
        if not isinstance(llm, RagKVCacheLLM):
            raise TypeError(f"KVCacheSynthesizer needs a RagKVCacheLLM to fuse chunk caches, got {type(llm).__name__}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        if prompts_dict:
            raise ValueError(f"KVCacheSynthesizer has no prompt templates to update: {sorted(prompts_dict)!r}")

    def synthesize(
        self, query: QueryType, nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None, **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        chunk_ids = [n.node.node_id for n in nodes]
        return super().synthesize(query, nodes, additional_source_nodes, chunk_ids=chunk_ids, **response_kwargs)

    async def asynthesize(
        self, query: QueryType, nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None, **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        chunk_ids = [n.node.node_id for n in nodes]
        return await super().asynthesize(query, nodes, additional_source_nodes, chunk_ids=chunk_ids, **response_kwargs)

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], chunk_ids: Sequence[str] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        prompt, chunk_ids = _prompt(query_str, text_chunks, chunk_ids)
        if self._streaming:
            responses = self._llm.stream_complete(prompt, chunk_ids=chunk_ids, **response_kwargs)
            return (r.delta for r in responses if r.delta)
        return self._llm.complete(prompt, chunk_ids=chunk_ids, **response_kwargs).text

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], chunk_ids: Sequence[str] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        prompt, chunk_ids = _prompt(query_str, text_chunks, chunk_ids)
        if self._streaming:
            return _deltas(await self._llm.astream_complete(prompt, chunk_ids=chunk_ids, **response_kwargs))
        return (await self._llm.acomplete(prompt, chunk_ids=chunk_ids, **response_kwargs)).text


def _prompt(query_str: str, text_chunks: Sequence[str], chunk_ids: Sequence[str] | None) -> tuple[str, Sequence[str]]:
    """The question with the chunks named by id, or (no ids) the texts before it as plain text."""
    if chunk_ids is None:
        return "\n\n".join([*text_chunks, query_str]), ()
    if len(chunk_ids) != len(text_chunks):
        raise ValueError(f"{len(chunk_ids)} chunk ids for {len(text_chunks)} text chunks")
    return query_str, chunk_ids


async def _deltas(responses: CompletionResponseAsyncGen) -> AsyncGenerator[str, None]:
    async for response in responses:
        if response.delta:
            yield response.delta


def create_kv_query_engine(
    llm: RagKVCacheLLM, similarity_top_k: int = 4, streaming: bool = False
) -> RetrieverQueryEngine:
    """A `RetrieverQueryEngine` over the LLM's index whose answers fuse the retrieved chunks' caches."""
    return RetrieverQueryEngine(
        retriever=RagKVCacheRetriever(engine=llm.serving_engine, similarity_top_k=similarity_top_k),
        response_synthesizer=KVCacheSynthesizer(llm=llm, streaming=streaming),
    )
