"""LlamaIndex LLM, retriever and query engine, end to end on the demo index and SmolLM2-135M-Instruct."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine

from llama_index_rag_kvcache import (
    KVCacheSynthesizer,
    RagKVCacheLLM,
    RagKVCacheRetriever,
    create_kv_query_engine,
)
from rag_kvcache import Engine, GenerationConfig

pytestmark = pytest.mark.smollm2  # every test runs on the demo index built with SmolLM2-135M

QUESTION = "What is the main telescope of the Veldmark Observatory called?"


@pytest.fixture(scope="module")
def llm(demo_engine: Engine) -> RagKVCacheLLM:
    return RagKVCacheLLM(engine=demo_engine, max_new_tokens=24)


@pytest.fixture(scope="module")
def chunk_ids(demo_engine: Engine) -> list[str]:
    return [n.node_id for n in RagKVCacheRetriever(engine=demo_engine, similarity_top_k=3).retrieve(QUESTION)]


def test_query_engine_answers_with_source_nodes(llm: RagKVCacheLLM) -> None:
    engine = create_kv_query_engine(llm, similarity_top_k=3)
    assert isinstance(engine, RetrieverQueryEngine)
    response = engine.query(QUESTION)
    assert "Harrow" in response.response
    assert len(response.source_nodes) == 3
    assert response.source_nodes[0].node.metadata["source"] == "observatory.md"
    assert set(response.metadata) == {n.node_id for n in response.source_nodes}


def test_retrieved_node_ids_are_chunk_ids(demo_engine: Engine, chunk_ids: list[str]) -> None:
    engine = demo_engine
    hits = engine.search(QUESTION, 3)
    assert chunk_ids == [hit.chunk.id for hit in hits]


def test_complete_fuses_the_chunks_like_the_core(llm: RagKVCacheLLM, demo_engine: Engine, chunk_ids: list[str]) -> None:
    engine = demo_engine
    hits = engine.search(QUESTION, 3)
    core = engine.run(lambda: engine.generator.ask(QUESTION, hits, generation=GenerationConfig(max_new_tokens=24)))
    response = llm.complete(QUESTION, chunk_ids=chunk_ids)
    assert response.text == core.answer
    stats = response.additional_kwargs
    assert stats["prompt_tokens"] == core.prompt_tokens
    assert stats["cache_misses"] == 0
    assert stats["cached_tokens"] > stats["prompt_tokens"] // 2


def test_streaming_query_engine_matches_the_plain_one(llm: RagKVCacheLLM) -> None:
    plain = create_kv_query_engine(llm, similarity_top_k=3).query(QUESTION)
    streaming = create_kv_query_engine(llm, similarity_top_k=3, streaming=True).query(QUESTION)
    pieces = list(streaming.response_gen)
    assert len(pieces) > 2
    assert "".join(pieces).strip() == plain.response
    assert [n.node_id for n in streaming.source_nodes] == [n.node_id for n in plain.source_nodes]


async def test_async_query(llm: RagKVCacheLLM) -> None:
    engine = create_kv_query_engine(llm, similarity_top_k=3)
    assert (await engine.aquery(QUESTION)).response == engine.query(QUESTION).response


def test_stream_complete_deltas_add_up(llm: RagKVCacheLLM, chunk_ids: list[str]) -> None:
    responses = list(llm.stream_complete(QUESTION, chunk_ids=chunk_ids))
    assert "".join(r.delta for r in responses).strip() == llm.complete(QUESTION, chunk_ids=chunk_ids).text
    assert responses[-1].additional_kwargs["completion_tokens"] > 0


def test_chat_merges_turns_and_takes_chunks_in_the_last_user_message(
    llm: RagKVCacheLLM, chunk_ids: list[str]
) -> None:
    conversation = [
        ChatMessage(role=MessageRole.SYSTEM, content="You answer in a few words."),
        ChatMessage(role=MessageRole.USER, content="Hello."),
        ChatMessage(role=MessageRole.USER, content="I have a question."),
        ChatMessage(role=MessageRole.ASSISTANT, content="Sure, ask away."),
        ChatMessage(role=MessageRole.USER, content=QUESTION),
    ]
    response = llm.chat(conversation, chunk_ids=chunk_ids)
    assert response.message.role == MessageRole.ASSISTANT
    assert response.message.content
    assert response.additional_kwargs["cached_tokens"] > 0
    streamed = "".join(r.delta for r in llm.stream_chat(conversation, chunk_ids=chunk_ids))
    assert streamed.strip() == response.message.content


def test_plain_chat_is_prefilled(llm: RagKVCacheLLM) -> None:
    response = llm.chat([ChatMessage(role=MessageRole.USER, content="Hello")])
    assert response.message.content
    assert response.additional_kwargs["cached_tokens"] == 0


def test_metadata(llm: RagKVCacheLLM) -> None:
    meta = llm.metadata
    assert meta.is_chat_model
    assert meta.model_name == "SmolLM2-135M-Instruct"
    assert meta.context_window == 8192
    assert meta.num_output == 24


def test_refusals(llm: RagKVCacheLLM, demo_engine: Engine, tmp_path) -> None:
    with pytest.raises(KeyError, match="0123456789abcdef"):
        llm.complete(QUESTION, chunk_ids=["0123456789abcdef"])
    with pytest.raises(ValueError, match="no tool calling"):
        llm.chat([ChatMessage(role=MessageRole.TOOL, content="3")])
    with pytest.raises(ValueError, match="must be a user message"):
        llm.chat([ChatMessage(role=MessageRole.ASSISTANT, content="hi")], chunk_ids=["x"])
    with pytest.raises(TypeError, match="top_k"):
        llm.complete(QUESTION, top_k=3)
    with pytest.raises(TypeError, match="MockLLM"):
        KVCacheSynthesizer(llm=MockLLM())
    with pytest.raises(ValueError, match="max_tokens"):
        RagKVCacheLLM(engine=demo_engine, max_tokens=5)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        RagKVCacheRetriever(tmp_path / "missing")
