"""`create_agentic_rag_graph`: LangGraph's agentic RAG graph (retrieve -> grade -> generate) over the chunk caches,
and the same graph on a plain chat model (`ChatModelGrader`, full prefills)."""

from __future__ import annotations

import importlib
import sys

import pytest
from langchain_rag_kvcache import (
    ChatModelGrader,
    ChatRagKVCache,
    RagKVCacheGrader,
    RagKVCacheRetriever,
    rag_message,
)

from rag_kvcache import Engine, FusionConfig

QUESTION = "What is the main telescope of the Veldmark Observatory called?"


@pytest.mark.smollm2
def test_the_graph_answers_from_the_documents_its_grader_keeps(demo_engine: Engine) -> None:
    from langchain_rag_kvcache.graph import create_agentic_rag_graph

    retriever, grader = RagKVCacheRetriever(engine=demo_engine, k=4), RagKVCacheGrader(engine=demo_engine)
    model = ChatRagKVCache(engine=demo_engine, max_tokens=12)
    state = create_agentic_rag_graph(retriever, grader, model).invoke({"question": QUESTION})
    docs = retriever.invoke(QUESTION)
    graded = grader.invoke({"question": QUESTION, "documents": docs})
    assert [d.id for d in state["graded"]] == [d.id for d in graded]
    assert [d.id for d in state["documents"]] == [d.id for d in graded or docs]
    assert state["answer"].text == model.invoke([rag_message(graded or docs, QUESTION)]).text


@pytest.mark.smollm2
def test_a_plain_chat_model_grades_as_the_cached_check_reads(demo_engine: Engine) -> None:
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


def test_without_langgraph_the_import_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "langgraph.graph", None)  # what an environment without LangGraph imports
    monkeypatch.delitem(sys.modules, "langchain_rag_kvcache.graph", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'langchain-rag-kvcache\[graph\]'"):
        importlib.import_module("langchain_rag_kvcache.graph")
