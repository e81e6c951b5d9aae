"""LlamaIndex LLM, retriever and query engine, end to end on the demo index and SmolLM2-135M-Instruct."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms import MockLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.llms.rag_kvcache import KVCacheSynthesizer, RagKVCacheLLM, create_kv_query_engine
from llama_index.retrievers.rag_kvcache import RagKVCacheRetriever

from rag_kvcache import ChatTurn, GenerationConfig, RequestError, ServingEngine, chat_prompt

from .support import QUESTION, Prompts, matched_tokens

pytestmark = pytest.mark.smollm2  # every test runs on the demo index built with SmolLM2-135M


@pytest.fixture(scope="module")
def llm(demo_engine: ServingEngine) -> RagKVCacheLLM:
    return RagKVCacheLLM(engine=demo_engine, max_tokens=24)


def test_query_engine_answers_with_source_nodes(llm: RagKVCacheLLM) -> None:
    engine = create_kv_query_engine(llm, similarity_top_k=3)
    assert isinstance(engine, RetrieverQueryEngine)
    response = engine.query(QUESTION)
    assert "Harrow" in response.response
    assert len(response.source_nodes) == 3
    assert response.source_nodes[0].node.metadata["source"] == "observatory.md"
    assert set(response.metadata) == {n.node_id for n in response.source_nodes}


def test_retrieved_node_ids_are_chunk_ids(demo_engine: ServingEngine, chunk_ids: list[str]) -> None:
    engine = demo_engine
    hits = engine.search(QUESTION, 3)
    assert chunk_ids == [hit.chunk.id for hit in hits]


def test_complete_fuses_the_chunks_like_the_core(
    llm: RagKVCacheLLM, demo_engine: ServingEngine, chunk_ids: list[str]
) -> None:
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


def test_chat_merges_turns_and_takes_chunks_in_the_last_user_message(llm: RagKVCacheLLM, chunk_ids: list[str]) -> None:
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


def test_plain_chat_reads_no_chunk_cache(llm: RagKVCacheLLM, demo_engine: ServingEngine) -> None:
    """A chat with no chunks reads no chunk cache. What it does not compute is its head (the chat template's system
    turn: an exact cache of request text, made by the first prompt that has it) or what the conversation cache holds
    of an earlier chat it begins as: whichever other tests ran before on the session's engine."""
    (head, *_) = demo_engine.run(chat_prompt, demo_engine.generator, [ChatTurn("user", ("Hello",))]).segments
    assert head.cacheable
    stats = llm.chat([ChatMessage(role=MessageRole.USER, content="Hello")]).additional_kwargs
    assert stats["cached_tokens"] in (0, len(head.ids), stats["conversation_tokens"])
    assert stats["cached_tokens"] < stats["prompt_tokens"]


def test_metadata(llm: RagKVCacheLLM) -> None:
    meta = llm.metadata
    assert meta.is_chat_model
    assert meta.model_name == "SmolLM2-135M-Instruct"
    assert meta.context_window == 8192
    assert meta.num_output == 24


def test_refusals(llm: RagKVCacheLLM, demo_engine: ServingEngine, tmp_path) -> None:
    with pytest.raises(RequestError, match="0123456789abcdef") as refused:  # the parameter at fault named
        llm.complete(QUESTION, chunk_ids=["0123456789abcdef"])
    assert (refused.value.param, refused.value.code) == ("chunk_ids", "unknown_chunk")
    with pytest.raises(ValueError, match="no tool calling"):
        llm.chat([ChatMessage(role=MessageRole.TOOL, content="3")])
    some_chunk = demo_engine.run(lambda: next(iter(demo_engine.index.chunks.all_chunks())).id)
    with pytest.raises(ValueError, match="must be a user message"):
        llm.chat([ChatMessage(role=MessageRole.ASSISTANT, content="hi")], chunk_ids=[some_chunk])
    with pytest.raises(TypeError, match="top_k"):
        llm.complete(QUESTION, top_k=3)
    with pytest.raises(TypeError, match="MockLLM"):
        KVCacheSynthesizer(llm=MockLLM())
    with pytest.raises(ValueError, match="max_new_tokens"):
        RagKVCacheLLM(engine=demo_engine, max_new_tokens=5)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        RagKVCacheRetriever(tmp_path / "missing")


def _chunk_tokens(llm: RagKVCacheLLM, ids: list[str]) -> int:
    engine = llm.serving_engine
    return sum(len(r.token_ids) for r in engine.run(engine.index.chunks.get, ids))


def test_default_query_engine_reads_the_chunks_from_cache(
    llm: RagKVCacheLLM, demo_engine: ServingEngine, chunk_ids: list[str], prompts: Prompts
) -> None:
    """LlamaIndex's own synthesizer (default response mode, its own prompt template) with our LLM."""
    engine = RetrieverQueryEngine.from_args(RagKVCacheRetriever(engine=demo_engine, similarity_top_k=3), llm=llm)
    response = engine.query(QUESTION)
    assert "Harrow" in response.response
    assert [n.node_id for n in response.source_nodes] == chunk_ids
    (turns,) = prompts.turns
    assert matched_tokens(llm, turns) >= 0.9 * _chunk_tokens(llm, chunk_ids)


@pytest.mark.parametrize("mode", ["refine", "tree_summarize"])
def test_other_response_modes_read_the_chunks_from_cache(
    llm: RagKVCacheLLM, demo_engine: ServingEngine, chunk_ids: list[str], prompts: Prompts, mode: str
) -> None:
    retriever = RagKVCacheRetriever(engine=demo_engine, similarity_top_k=3)
    RetrieverQueryEngine.from_args(retriever, llm=llm, response_mode=mode).query(QUESTION)
    assert sum(matched_tokens(llm, turns) for turns in prompts.turns) >= 0.9 * _chunk_tokens(llm, chunk_ids)


def test_plain_completion_with_chunk_text_is_fused(
    llm: RagKVCacheLLM, demo_engine: ServingEngine, chunk_ids: list[str]
) -> None:
    texts = [r.text for r in demo_engine.run(demo_engine.index.chunks.get, chunk_ids)]
    prompt = "\n\n".join([*texts, QUESTION])
    assert matched_tokens(llm, [ChatTurn("user", (prompt,))]) >= 0.9 * _chunk_tokens(llm, chunk_ids)
    response = llm.complete(prompt)
    assert response.additional_kwargs["cached_tokens"] > 0
    assert response.additional_kwargs["cache_misses"] == 0


def test_synthesizer_lays_the_nodes_out_in_the_chunk_order(llm: RagKVCacheLLM, chunk_ids: list[str]) -> None:
    """The retriever's nodes (best first) go to the LLM by id in the index's chunk order: by default the best
    last, next to the question, as `ask` lays out what it retrieves. The response keeps the nodes ranked."""
    nodes = RagKVCacheRetriever(engine=llm.serving_engine, similarity_top_k=3).retrieve(QUESTION)
    synthesizer = KVCacheSynthesizer(llm=llm)
    assert synthesizer._chunk_ids(nodes) == chunk_ids[::-1]
    response = synthesizer.synthesize(QUESTION, nodes)
    assert response.response == llm.complete(QUESTION, chunk_ids=chunk_ids[::-1]).text
    assert [n.node_id for n in response.source_nodes] == chunk_ids


def test_synthesizer_over_foreign_node_ids_matches_by_text(
    llm: RagKVCacheLLM, demo_engine: ServingEngine, chunk_ids: list[str], prompts: Prompts
) -> None:
    """Nodes from another store (ids that are no chunk ids) holding indexed text: found by matching."""
    records = demo_engine.run(demo_engine.index.chunks.get, chunk_ids)
    nodes = [NodeWithScore(node=TextNode(id_=f"other-{i}", text=r.text), score=1.0) for i, r in enumerate(records)]
    response = KVCacheSynthesizer(llm=llm).synthesize(QUESTION, nodes)
    assert "Harrow" in response.response
    (turns,) = prompts.turns
    assert matched_tokens(llm, turns) >= 0.9 * _chunk_tokens(llm, chunk_ids)


def test_synthesizer_takes_prompt_templates(
    llm: RagKVCacheLLM, demo_engine: ServingEngine, chunk_ids: list[str], prompts: Prompts
) -> None:
    first = PromptTemplate("Context:\n{context_str}\n\nQuestion: {query_str}\nAnswer:")
    synthesizer = KVCacheSynthesizer(llm=llm, text_qa_template=first)
    engine = RetrieverQueryEngine(
        retriever=RagKVCacheRetriever(engine=demo_engine, similarity_top_k=3), response_synthesizer=synthesizer
    )
    assert engine.get_prompts() == {"response_synthesizer:text_qa_template": first}
    second = PromptTemplate("Read these notes.\n\n{context_str}\n\nNow answer briefly: {query_str}")
    engine.update_prompts({"response_synthesizer:text_qa_template": second})
    assert engine.get_prompts() == {"response_synthesizer:text_qa_template": second}
    response = engine.query(QUESTION)
    assert "Harrow" in response.response
    (turns,) = prompts.turns
    (user,) = [t for t in turns if t.role == "user"]
    assert user.parts[0].startswith("Read these notes.")
    assert matched_tokens(llm, turns) >= 0.9 * _chunk_tokens(llm, chunk_ids)
    with pytest.raises(ValueError, match="refine_template"):
        synthesizer.update_prompts({"refine_template": second})
