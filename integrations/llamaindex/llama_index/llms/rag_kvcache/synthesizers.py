"""`KVCacheSynthesizer`: hands the retrieved nodes' ids to `RagKVCacheLLM` so their caches are fused,
and `create_kv_query_engine`, a `RetrieverQueryEngine` built from it."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from llama_index.core.base.llms.types import CompletionResponseAsyncGen
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryType
from llama_index.core.types import RESPONSE_TEXT_TYPE
from llama_index.retrievers.rag_kvcache import RagKVCacheRetriever

from rag_kvcache import KVIndex

from .base import RagKVCacheLLM

Nodes = list[NodeWithScore]  # retrieved, best first
SourceNodes = Sequence[NodeWithScore] | None  # more nodes to cite, not to answer from
ChunkIds = Sequence[str] | None  # the nodes' chunk ids, in prompt order (None: pass them as text)


class KVCacheSynthesizer(BaseSynthesizer):
    """Answers over the retrieved nodes in one LLM call that reads the nodes' chunks from cache.

    Without a template, nodes whose ids are chunk ids of the LLM's index (`RagKVCacheRetriever`'s)
    are passed by id, in the index's `chunk_order`: the LLM splices in the chunks' stored tokens in the
    index's prompt layout. Any other nodes (another retriever's, a vector store's) are joined as text
    before the question, and the indexed text in them is found by matching. With `text_qa_template` (a
    LlamaIndex prompt template taking `context_str` and `query_str`, also set by `update_prompts`), the
    template is filled with the nodes' texts and the chunks in it are found by matching.
    """

    def __init__(
        self,
        llm: RagKVCacheLLM,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        text_qa_template: BasePromptTemplate | None = None,
    ) -> None:
        if not isinstance(llm, RagKVCacheLLM):
            raise TypeError(f"KVCacheSynthesizer needs a RagKVCacheLLM to fuse chunk caches, got {type(llm).__name__}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._text_qa_template = text_qa_template

    def _get_prompts(self) -> PromptDictType:
        return {} if self._text_qa_template is None else {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        if unknown := prompts_dict.keys() - {"text_qa_template"}:
            raise ValueError(f"KVCacheSynthesizer takes the prompt 'text_qa_template' only, got {sorted(unknown)!r}")
        if "text_qa_template" in prompts_dict:
            self._text_qa_template = prompts_dict["text_qa_template"]

    def synthesize(
        self, query: QueryType, nodes: Nodes, additional_source_nodes: SourceNodes = None, **response_kwargs: Any
    ) -> RESPONSE_TYPE:
        chunk_ids = self._chunk_ids(nodes)
        return super().synthesize(query, nodes, additional_source_nodes, chunk_ids=chunk_ids, **response_kwargs)

    async def asynthesize(
        self, query: QueryType, nodes: Nodes, additional_source_nodes: SourceNodes = None, **response_kwargs: Any
    ) -> RESPONSE_TYPE:
        chunk_ids = self._chunk_ids(nodes)
        return await super().asynthesize(query, nodes, additional_source_nodes, chunk_ids=chunk_ids, **response_kwargs)

    def _chunk_ids(self, nodes: Nodes) -> list[str] | None:
        """The nodes' ids when there is no template and all of them are chunk ids of the index, else None; the
        nodes (best first, as retrievers return them) laid out in the index's `chunk_order`."""
        if self._text_qa_template is not None or not nodes:
            return None
        engine = self._llm.serving_engine
        ids = engine.index.config.query.in_prompt_order([n.node.node_id for n in nodes])
        return ids if engine.run(_all_indexed, engine.index, ids) else None

    def _templated(self, call: Callable[..., Any], query_str: str, text_chunks: Sequence[str]) -> Any:
        """`call` (the LLM's predict or stream, sync or async) on the template filled with the chunks' texts."""
        return call(self._text_qa_template, context_str="\n\n".join(text_chunks), query_str=query_str)

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], chunk_ids: ChunkIds = None, **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        if self._text_qa_template is not None:
            return self._templated(self._llm.stream if self._streaming else self._llm.predict, query_str, text_chunks)
        prompt, chunk_ids = _prompt(query_str, text_chunks, chunk_ids)
        if self._streaming:
            responses = self._llm.stream_complete(prompt, chunk_ids=chunk_ids, **response_kwargs)
            return (r.delta for r in responses if r.delta)
        return self._llm.complete(prompt, chunk_ids=chunk_ids, **response_kwargs).text

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], chunk_ids: ChunkIds = None, **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        if self._text_qa_template is not None:
            call = self._llm.astream if self._streaming else self._llm.apredict
            return await self._templated(call, query_str, text_chunks)
        prompt, chunk_ids = _prompt(query_str, text_chunks, chunk_ids)
        if self._streaming:
            return _deltas(await self._llm.astream_complete(prompt, chunk_ids=chunk_ids, **response_kwargs))
        return (await self._llm.acomplete(prompt, chunk_ids=chunk_ids, **response_kwargs)).text


def _all_indexed(index: KVIndex, ids: list[str]) -> bool:
    """Whether every id is a chunk id of `index`."""
    try:
        index.chunks.get(ids)
    except KeyError:
        return False
    return True


def _prompt(query_str: str, text_chunks: Sequence[str], chunk_ids: ChunkIds) -> tuple[str, Sequence[str]]:
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
