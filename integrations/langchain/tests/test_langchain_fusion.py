"""Chunk identity survives retriever -> blocks -> model, and the model fuses exactly what the core would."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.messages.content import create_plaintext_block
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_rag_kvcache import ChatRagKVCache, RagKVCacheRetriever, create_kv_rag_chain, rag_message
from langchain_rag_kvcache.chat_models import _prompt

from rag_kvcache import ConfigError, FusionConfig, GenerationConfig, KVIndex, Options, ServingEngine

from ...testing import QUESTION

pytestmark = pytest.mark.smollm2  # every test runs on the demo index built with SmolLM2-135M


@pytest.fixture(scope="module")
def model(demo_engine: ServingEngine) -> ChatRagKVCache:
    return ChatRagKVCache(engine=demo_engine, max_tokens=24)


def test_retriever_documents_carry_chunk_identity(retriever: RagKVCacheRetriever, demo_engine: ServingEngine) -> None:
    docs = retriever.invoke(QUESTION)
    engine = demo_engine
    records = engine.run(engine.index.chunks.get, [doc.id for doc in docs])
    assert [doc.page_content for doc in docs] == [record.text for record in records]
    assert all(doc.metadata["chunk_id"] == doc.id for doc in docs)
    assert docs[0].metadata["source"] == "observatory.md"
    scores = [doc.metadata["score"] for doc in docs]
    assert scores == sorted(scores, reverse=True)


def test_chain_answers_from_fused_chunk_caches(retriever: RagKVCacheRetriever, model: ChatRagKVCache) -> None:
    answer = create_kv_rag_chain(retriever, model).invoke(QUESTION)
    assert "Harrow" in answer.text
    assert answer.response_metadata["cache_misses"] == 0
    assert answer.response_metadata["method"] == FusionConfig().method  # the library's default
    usage = answer.usage_metadata
    assert usage is not None
    assert usage["input_token_details"]["cache_read"] > usage["input_tokens"] // 2


def test_chain_lays_the_documents_out_in_the_chunk_order(retriever: RagKVCacheRetriever) -> None:
    """The chain's message holds the retriever's documents (best first) reversed by default, the best next to the
    question as `ask` lays out what it retrieves; `best_first` keeps retrieval's order; an unknown order is
    refused when the chain is made."""
    seen: list = []
    listener = RunnableLambda(lambda messages: seen.append(messages) or AIMessage("ok"))  # stands in the model's place
    docs = retriever.invoke(QUESTION)
    for kwargs, expected in (({}, docs[::-1]), ({"chunk_order": "best_first"}, docs)):
        create_kv_rag_chain(retriever, listener, **kwargs).invoke(QUESTION)
        assert seen[-1] == [rag_message(expected, QUESTION)]
    with pytest.raises(ConfigError, match="chunk_order must be one of best_last, best_first, got 'middle'"):
        create_kv_rag_chain(retriever, listener, chunk_order="middle")


def test_model_prompt_equals_the_core_fused_prompt(demo_index: str) -> None:
    """A user message of chunk blocks and a question is the prompt `FusedGenerator.ask` fuses: the same answer,
    prompt tokens and tokens recomputed. On an engine of its own with no conversation cache, so that neither reads
    what the other, or an earlier test, left there."""
    config = KVIndex.config_of(demo_index).with_storage(conversation_bytes=0)
    with ServingEngine(demo_index, config) as engine:
        hits = engine.search(QUESTION, 3)
        core = engine.run(lambda: engine.generator.ask(QUESTION, hits, generation=GenerationConfig(max_new_tokens=24)))
        docs = RagKVCacheRetriever(engine=engine, k=3).invoke(QUESTION)
        message = ChatRagKVCache(engine=engine, max_tokens=24).invoke([rag_message(docs, QUESTION)])
    assert message.text == core.answer
    assert message.usage_metadata["input_tokens"] == core.prompt_tokens
    assert message.response_metadata["recomputed_tokens"] == core.recomputed_tokens


def test_streaming_matches_invoke(rag_question: HumanMessage, model: ChatRagKVCache) -> None:
    messages = [rag_question]
    pieces = [chunk.text for chunk in model.stream(messages)]
    assert len(pieces) > 2
    assert "".join(pieces).strip() == model.invoke(messages).text


def test_text_without_chunk_ids_is_found_in_the_cache(model: ChatRagKVCache, retriever: RagKVCacheRetriever) -> None:
    """Plain text blocks (no chunk id) holding the retrieved chunks: the chunks are found by their ids."""
    docs = retriever.invoke(QUESTION)
    blocks = [create_plaintext_block(text=doc.page_content) for doc in docs]
    messages = [HumanMessage([*blocks, {"type": "text", "text": QUESTION}])]
    assert _matched(model, messages) >= 0.9 * _chunk_tokens(model, docs)
    message = model.invoke(messages)
    assert _cache_read(message) > 0 and message.response_metadata["cache_misses"] == 0


def test_tutorial_chain_reads_the_chunks_from_cache(model: ChatRagKVCache, retriever: RagKVCacheRetriever) -> None:
    """LangChain's own RAG tutorial chain: `format_docs` joins the documents into a prompt template."""
    prompt = ChatPromptTemplate.from_messages(
        [
            (
                "system",
                "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                "context to answer the question. Keep the answer concise.\n\n{context}",
            ),
            ("human", "{question}"),
        ]
    )
    docs = retriever.invoke(QUESTION)
    chain = (
        {"context": retriever | (lambda ds: "\n\n".join(d.page_content for d in ds)), "question": RunnablePassthrough()}
        | prompt
        | model
    )
    answer = chain.invoke(QUESTION)
    assert "Harrow" in answer.text
    assert _cache_read(answer) > 0
    messages = prompt.invoke({"context": "\n\n".join(d.page_content for d in docs), "question": QUESTION}).to_messages()
    assert _matched(model, messages) >= 0.9 * _chunk_tokens(model, docs)


def _cache_read(message) -> int:
    return message.usage_metadata["input_token_details"]["cache_read"]


def _matched(model: ChatRagKVCache, messages) -> int:
    """Prompt tokens of `messages` found in the index's chunks (read from their caches)."""
    engine = model._handle.get()
    segments = engine.run(_prompt, engine.generator, messages, Options(fusion=model.fusion)).segments
    return sum(len(s.ids) for s in segments if s.cacheable and s.label.startswith("chunk:"))


def _chunk_tokens(model: ChatRagKVCache, docs) -> int:
    engine = model._handle.get()
    return sum(len(r.token_ids) for r in engine.run(engine.index.chunks.get, [d.id for d in docs]))


def test_full_method_reads_no_chunk_cache(demo_engine: ServingEngine, rag_question: HumanMessage) -> None:
    """`full` reads no chunk cache: what it does not compute comes from the conversation cache, where only an
    earlier `full` prompt of this engine put exact K/V (any test's: the engine is the session's). Asked twice,
    the second reads the first's prompt from there and answers the same."""
    full = ChatRagKVCache(engine=demo_engine, max_tokens=8, fusion=FusionConfig(method="full"))
    prompt = [rag_question]
    first, second = full.invoke(prompt), full.invoke(prompt)
    for message in (first, second):
        usage, meta = message.usage_metadata, message.response_metadata
        assert usage is not None
        assert usage["input_token_details"]["cache_read"] == meta["conversation_tokens"]
        assert meta["recomputed_tokens"] == usage["input_tokens"] - meta["conversation_tokens"]
    assert second.response_metadata["conversation_tokens"] == second.usage_metadata["input_tokens"] - 1
    assert second.content == first.content


def test_edited_chunk_text_is_refused(model: ChatRagKVCache, retriever: RagKVCacheRetriever) -> None:
    doc = retriever.invoke(QUESTION)[0]
    doc.page_content = doc.page_content.upper()
    with pytest.raises(ValueError, match="other text than the chunk"):
        model.invoke([rag_message([doc], QUESTION)])


def test_unknown_chunk_id_is_refused(model: ChatRagKVCache) -> None:
    block = create_plaintext_block(text="some text", chunk_id="0123456789abcdef")
    with pytest.raises(KeyError, match="0123456789abcdef"):
        model.invoke([HumanMessage([block, {"type": "text", "text": QUESTION}])])


def test_tool_messages_are_refused(model: ChatRagKVCache) -> None:
    with pytest.raises(ValueError, match="no tool calling"):
        model.invoke([HumanMessage("hi"), ToolMessage("3", tool_call_id="t1")])


def test_bad_arguments_fail_loudly(model: ChatRagKVCache, demo_engine: ServingEngine, tmp_path) -> None:
    with pytest.raises(TypeError, match="frequency_penalty"):
        model.invoke("hi", frequency_penalty=1.0)
    with pytest.raises(ValueError, match="another model needs its own index"):
        model.invoke("hi", model="gpt-4o")
    with pytest.raises(ValueError, match="max_token"):
        ChatRagKVCache(engine=demo_engine, max_token=5)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ChatRagKVCache(index=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        ChatRagKVCache(engine=demo_engine, index=str(demo_engine.path))
    with pytest.raises(ValueError, match="neither"):
        ChatRagKVCache()


def test_a_model_given_an_index_opens_and_closes_its_own_engine(demo_engine: ServingEngine) -> None:
    own = ChatRagKVCache(index=str(demo_engine.path), max_tokens=4)
    assert own.invoke("Veldmark telescope?").usage_metadata["output_tokens"] >= 1
    engine = own._handle.get()
    assert engine is not demo_engine
    own.close()
    with pytest.raises(RuntimeError, match="shutdown"):
        engine.search("telescope", 1)  # its worker thread has ended
    assert demo_engine.search("telescope", 1)  # the shared engine is untouched


def test_a_chats_next_turn_reads_the_turn_before_from_the_conversation_cache(
    model: ChatRagKVCache, rag_question: HumanMessage
) -> None:
    """The engine keeps each answered prompt's K/V and its answer's: the next turn of the chat (the same
    messages, the answer, a new question) reads them and computes only what is new."""
    first = [rag_question]
    answer = model.invoke(first)
    second = model.invoke([*first, answer, HumanMessage("Who founded the observatory?")])
    conversation = second.response_metadata["conversation_tokens"]
    assert conversation >= answer.usage_metadata["input_tokens"]  # the whole first prompt, and the answer's start
    assert _cache_read(second) >= conversation and second.response_metadata["recomputed_tokens"] < 64
