"""`create_agentic_rag_graph`: LangGraph's agentic RAG graph (retrieve -> grade -> generate) over the chunk caches,
and the same graph on a plain chat model (`ChatModelGrader`, full prefills); `create_shared_prompt_rag_graph`, the
same steps over one fused prompt whose rejected documents are hidden."""

from __future__ import annotations

import importlib
import sys

import pytest
from langchain_rag_kvcache import (
    CHUNK_ID_KEY,
    RELEVANCE_KEY,
    ChatModelGrader,
    ChatRagKVCache,
    RagKVCacheGrader,
    RagKVCacheRetriever,
    rag_message,
)

from rag_kvcache import FusionConfig, RagKVCacheError, ServingEngine

from ...testing import QUESTION


@pytest.mark.smollm2
def test_the_graph_answers_from_the_documents_its_grader_keeps(demo_engine: ServingEngine) -> None:
    from langchain_rag_kvcache.graph import create_agentic_rag_graph

    retriever, grader = RagKVCacheRetriever(engine=demo_engine, k=4), RagKVCacheGrader(engine=demo_engine)
    model = ChatRagKVCache(engine=demo_engine, max_tokens=12)
    docs = retriever.invoke(QUESTION)
    graded = grader.invoke({"question": QUESTION, "documents": docs})
    for order, laid_out in (("best_last", (graded or docs)[::-1]), ("best_first", graded or docs)):
        state = create_agentic_rag_graph(retriever, grader, model, chunk_order=order).invoke({"question": QUESTION})
        assert [d.id for d in state["graded"]] == [d.id for d in graded]
        assert [d.id for d in state["documents"]] == [d.id for d in graded or docs]  # best first, as retrieved
        assert state["answer"].text == model.invoke([rag_message(laid_out, QUESTION)]).text


def test_the_graph_refuses_an_unknown_chunk_order() -> None:
    from langchain_core.language_models import FakeListChatModel
    from langchain_core.runnables import RunnableLambda
    from langchain_rag_kvcache.graph import create_agentic_rag_graph

    from rag_kvcache import ConfigError

    nothing = RunnableLambda(lambda _: [])
    with pytest.raises(ConfigError, match="chunk_order must be one of best_last, best_first, got 'middle'"):
        create_agentic_rag_graph(nothing, nothing, FakeListChatModel(responses=[""]), chunk_order="middle")


@pytest.mark.smollm2
def test_a_plain_chat_model_grades_as_the_cached_check_reads(demo_engine: ServingEngine) -> None:
    """The same graph on full prefills: a document the plain model answers "yes" about (its greedy first token) has
    P(yes) >= 1/2 in the cached check of the same prompt, whose logits are a full prefill's."""
    from langchain_rag_kvcache.graph import create_agentic_rag_graph

    retriever = RagKVCacheRetriever(engine=demo_engine, k=4)
    plain = ChatRagKVCache(engine=demo_engine, fusion=FusionConfig(method="full"), max_tokens=12)
    state = create_agentic_rag_graph(retriever, ChatModelGrader(model=plain), plain).invoke({"question": QUESTION})
    cached = RagKVCacheGrader(engine=demo_engine).invoke(
        {"question": QUESTION, "documents": retriever.invoke(QUESTION)}
    )
    assert {d.id for d in state["graded"]} <= {d.id for d in cached}
    assert state["answer"].text


@pytest.mark.smollm2
def test_the_shared_prompt_graph_keeping_every_document_answers_as_the_chat_model(demo_engine: ServingEngine) -> None:
    """Every document judged relevant (threshold 0): nothing is hidden, and the answer decoded from the shared
    prompt is `ChatRagKVCache`'s over the same documents laid out in the index's chunk order, the best last (the
    index's layout is the chat model's)."""
    from langchain_rag_kvcache.graph import create_shared_prompt_rag_graph

    retriever = RagKVCacheRetriever(engine=demo_engine, k=4)
    graph = create_shared_prompt_rag_graph(retriever, demo_engine, max_tokens=12, threshold=0.0)
    state = graph.invoke({"question": QUESTION})
    docs = retriever.invoke(QUESTION)
    assert [d.id for d in state["graded"]] == [d.id for d in docs] == [d.id for d in state["documents"]]
    assert all(0.0 <= d.metadata[RELEVANCE_KEY] <= 1.0 for d in state["documents"])
    model = ChatRagKVCache(engine=demo_engine, max_tokens=12)
    assert state["answer"].text == model.invoke([rag_message(docs[::-1], QUESTION)]).text
    assert state["answer"].usage_metadata["output_tokens"] >= 1


@pytest.mark.smollm2
def test_the_shared_prompt_graph_hides_the_documents_its_check_rejects(demo_engine: ServingEngine) -> None:
    """A threshold between the documents' P(yes): those under it are hidden, the answer is `SharedPrompt`'s over
    the kept ones, laid out best last as the graph lays them out."""
    from langchain_rag_kvcache.graph import create_shared_prompt_rag_graph

    from rag_kvcache import RelevanceCheck, SharedPrompt

    retriever = RagKVCacheRetriever(engine=demo_engine, k=4)
    docs = retriever.invoke(QUESTION)
    laid = docs[::-1]  # the index's default chunk order: the best last

    def shared(threshold: float) -> tuple[list[float], str]:
        generator = demo_engine.generator
        prompt = SharedPrompt(generator, QUESTION, generator.index.chunks.get([d.metadata[CHUNK_ID_KEY] for d in laid]))
        p = [v.p_yes for v in prompt.check(RelevanceCheck(generator, threshold=threshold))]
        keep = [i for i, x in enumerate(p) if x >= threshold]
        config = generator.index.config.query.generation.with_options(max_new_tokens=12)
        return p, prompt.answer(keep, config).answer

    p, _ = demo_engine.run(shared, 0.5)
    threshold = sorted(p)[len(p) // 2]  # keeps the upper half
    _, want = demo_engine.run(shared, threshold)
    state = create_shared_prompt_rag_graph(retriever, demo_engine, max_tokens=12, threshold=threshold).invoke(
        {"question": QUESTION}
    )
    p_of = {d.id: x for d, x in zip(laid, p)}
    kept = [d.id for d in docs if p_of[d.id] >= threshold]  # best first, as retrieved
    assert 0 < len(kept) < len(docs)
    assert [d.id for d in state["documents"]] == kept
    assert state["answer"].text == want


@pytest.mark.smollm2
def test_the_shared_prompt_graph_refuses_documents_without_a_chunk_id(demo_engine: ServingEngine) -> None:
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
    from langchain_rag_kvcache.graph import create_shared_prompt_rag_graph

    class Plain(BaseRetriever):  # documents from elsewhere: no cache to read
        def _get_relevant_documents(self, query: str, *, run_manager) -> list[Document]:
            return [Document("The harbour is called Saltmere.")]

    with pytest.raises(RagKVCacheError, match="without a chunk id"):
        create_shared_prompt_rag_graph(Plain(), demo_engine).invoke({"question": QUESTION})


def test_without_langgraph_the_import_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "langgraph.graph", None)  # what an environment without LangGraph imports
    monkeypatch.delitem(sys.modules, "langchain_rag_kvcache.graph", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'langchain-rag-kvcache\[graph\]'"):
        importlib.import_module("langchain_rag_kvcache.graph")
