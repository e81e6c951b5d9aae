"""`create_agentic_rag_graph`: the agentic RAG graph of LangGraph's tutorial, retrieve -> grade documents ->
generate, built from any retriever, grader and chat model.

With `RagKVCacheRetriever`, `RagKVCacheGrader` and `ChatRagKVCache` every step reads the chunk caches: the
grader computes only the check question for all documents in one batched forward, and the answer fuses the
kept documents' caches. With a plain chat model and `ChatModelGrader` it is the same graph as it runs
elsewhere (each grading prompt and the answer prefilled in full): the baseline `benchmarks/chat/agentic.py`
measures it against.
"""

from __future__ import annotations

from typing import Any, TypedDict

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable

from .chains import rag_message

try:
    from langgraph.graph import END, START, StateGraph
except ImportError as e:  # the one line a user needs, not a traceback into langgraph
    raise ImportError("the agentic RAG graph needs LangGraph: pip install 'langchain-rag-kvcache[graph]'") from e


class AgenticRAGState(TypedDict, total=False):
    """The graph's state: the question, the documents (retrieved, then those kept by the grader) and the answer."""

    question: str
    documents: list[Document]
    graded: list[Document]  # the documents the grader judged relevant (empty: none was)
    answer: AIMessage


def create_agentic_rag_graph(
    retriever: BaseRetriever,
    grader: Runnable[dict, list[Document]],
    model: BaseChatModel,
) -> Any:
    """A compiled LangGraph graph: `retrieve` (the question's documents), `grade` (`grader` takes
    `{"question", "documents"}` and returns the relevant ones), `generate` (`model` answers from the kept
    documents; when none was judged relevant, from every retrieved one). Invoke it with `{"question": str}`;
    the final state holds `documents` (those the answer read), `graded` and `answer`."""

    def retrieve(state: AgenticRAGState) -> AgenticRAGState:
        return {"documents": retriever.invoke(state["question"])}

    def grade(state: AgenticRAGState) -> AgenticRAGState:
        graded = grader.invoke({"question": state["question"], "documents": state["documents"]})
        return {"graded": graded, "documents": graded or state["documents"]}

    def generate(state: AgenticRAGState) -> AgenticRAGState:
        return {"answer": model.invoke([rag_message(state["documents"], state["question"])])}

    graph = StateGraph(AgenticRAGState)
    for name, node in (("retrieve", retrieve), ("grade", grade), ("generate", generate)):
        graph.add_node(name, node)
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "grade")
    graph.add_edge("grade", "generate")
    graph.add_edge("generate", END)
    return graph.compile(name="agentic_rag")
