"""`create_agentic_rag_graph`: the agentic RAG graph of LangGraph's tutorial, retrieve -> grade documents ->
generate, built from any retriever, grader and chat model.

With `RagKVCacheRetriever`, `RagKVCacheGrader` and `ChatRagKVCache` every step reads the chunk caches: the
grader computes only the check question for all documents in one batched forward, and the answer fuses the
kept documents' caches. With a plain chat model and `ChatModelGrader` it is the same graph as it runs
elsewhere (each grading prompt and the answer prefilled in full): the baseline `benchmarks/chat/agentic.py`
measures it against.

`create_shared_prompt_rag_graph`: the same three steps over one fused prompt (`rag_kvcache.SharedPrompt`):
`grade` fuses the answer's prompt over every retrieved document and checks each one over it, `generate` answers
from that prompt with the documents judged irrelevant hidden by an attention mask, computing only the question
again, instead of fusing the kept documents a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable

from rag_kvcache import (
    RELEVANCE_CHECK,
    ChunkOrder,
    FusionConfig,
    QueryConfig,
    RagKVCacheError,
    RelevanceCheck,
    ServingEngine,
    SharedPrompt,
    Verdict,
)

from .chains import rag_message
from .chat_models import CHUNK_ID_KEY, answer_metadata
from .graders import RELEVANCE_KEY

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
    chunk_order: ChunkOrder = QueryConfig().chunk_order,
) -> Any:
    """A compiled LangGraph graph: `retrieve` (the question's documents), `grade` (`grader` takes
    `{"question", "documents"}` and returns the relevant ones), `generate` (`model` answers from the kept
    documents, laid out in `chunk_order` as `create_kv_rag_chain` lays them out; when none was judged relevant,
    from every retrieved one). Invoke it with `{"question": str}`; the final state holds `documents` (those the
    answer read, best first), `graded` and `answer`."""
    order = QueryConfig(chunk_order=chunk_order)  # refuses an unknown order

    def retrieve(state: AgenticRAGState) -> AgenticRAGState:
        return {"documents": retriever.invoke(state["question"])}

    def grade(state: AgenticRAGState) -> AgenticRAGState:
        graded = grader.invoke({"question": state["question"], "documents": state["documents"]})
        return {"graded": graded, "documents": graded or state["documents"]}

    def generate(state: AgenticRAGState) -> AgenticRAGState:
        return {"answer": model.invoke([rag_message(order.in_prompt_order(state["documents"]), state["question"])])}

    return _chain(AgenticRAGState, "agentic_rag", retrieve=retrieve, grade=grade, generate=generate)


def _chain(state: type, name: str, **steps: Callable[[Any], Any]) -> Any:
    """A compiled graph of `steps` one after the other, from START to END."""
    graph = StateGraph(state)
    for step, node in steps.items():
        graph.add_node(step, node)
    names = [START, *steps, END]
    for a, b in zip(names, names[1:]):
        graph.add_edge(a, b)
    return graph.compile(name=name)


class SharedPromptState(AgenticRAGState, total=False):
    """`AgenticRAGState` and the fused prompt the grade and generate steps share (engine-side K/V: the graph
    runs without a checkpointer, which could not save them)."""

    prompt: SharedPrompt
    keep: list[int]  # the documents the answer reads, by their place in the prompt


def create_shared_prompt_rag_graph(
    retriever: BaseRetriever,
    engine: ServingEngine,
    *,
    fusion: FusionConfig | None = None,
    max_tokens: int | None = None,
    template: str = RELEVANCE_CHECK,
    threshold: float = 0.5,
) -> Any:
    """A compiled LangGraph graph, retrieve -> grade -> generate as `create_agentic_rag_graph`'s, over one fused
    prompt: `grade` fuses the answer's prompt over the retrieved documents (`retriever` must be a
    `RagKVCacheRetriever` over `engine`'s index: each document's chunk id is read) and judges each one over it
    (`template`, `threshold`: `RelevanceCheck`'s), `generate` answers from it with the documents judged irrelevant
    hidden (none judged relevant: from every one). `fusion` and `max_tokens`: the answer's (None: the index's).
    The final state holds `documents` (those the answer read, with `metadata["relevance"]`), `graded` and
    `answer`, whose `response_metadata["ttft_s"]` is the generate step's alone."""
    generation = engine.index.config.query.generation
    if max_tokens is not None:
        generation = generation.with_options(max_new_tokens=max_tokens)
    check = RelevanceCheck(engine.generator, template, threshold)

    def retrieve(state: SharedPromptState) -> SharedPromptState:
        return {"documents": retriever.invoke(state["question"])}

    def grade(state: SharedPromptState) -> SharedPromptState:
        documents = state["documents"]
        missing = [d.page_content[:60] for d in documents if d.metadata.get(CHUNK_ID_KEY) is None]
        if missing:
            raise RagKVCacheError(f"documents without a chunk id (not from RagKVCacheRetriever): {missing}")

        def fuse_and_check(question: str, ids: list[str]) -> tuple[SharedPrompt, list[Verdict]]:  # engine thread
            prompt = SharedPrompt(engine.generator, question, engine.index.chunks.get(ids), fusion)
            return prompt, prompt.check(check)

        laid = engine.index.config.query.in_prompt_order(list(range(len(documents))))  # the documents, as laid out
        ids = [documents[i].metadata[CHUNK_ID_KEY] for i in laid]
        prompt, verdicts = engine.run(fuse_and_check, state["question"], ids)  # verdicts in the prompt's order
        verdict = {i: v for i, v in zip(laid, verdicts)}  # document -> its verdict
        scored = [
            d.model_copy(update={"metadata": {**d.metadata, RELEVANCE_KEY: verdict[i].p_yes}})
            for i, d in enumerate(documents)
        ]
        keep = [place for place, v in enumerate(verdicts) if v.relevant]  # by place in the prompt
        graded = [scored[i] for i in sorted(laid[place] for place in keep)]  # best first, as retrieved
        return {
            "prompt": prompt,
            "keep": keep or list(range(len(scored))),
            "graded": graded,
            "documents": graded or scored,
        }

    def generate(state: SharedPromptState) -> SharedPromptState:
        answer = engine.run(state["prompt"].answer, state["keep"], generation)
        usage, metadata = answer_metadata(answer, engine.index.config.index.model)
        return {"answer": AIMessage(answer.answer, usage_metadata=usage, response_metadata=metadata)}

    return _chain(SharedPromptState, "shared_prompt_rag", retrieve=retrieve, grade=grade, generate=generate)
