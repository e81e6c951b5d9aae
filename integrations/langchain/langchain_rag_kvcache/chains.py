"""`create_kv_rag_chain`: question -> retriever -> chunk blocks -> chat model."""

from __future__ import annotations

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

from rag_kvcache import ChunkOrder, QueryConfig

from .chat_models import chunk_block


def rag_message(documents: list[Document], question: str) -> HumanMessage:
    """One user message: the documents as `text-plain` blocks (chunk ids kept), then the question."""
    if not question.strip():
        raise ValueError(f"the question is empty: {question!r}")
    return HumanMessage([*map(chunk_block, documents), {"type": "text", "text": question.strip()}])


def create_kv_rag_chain(
    retriever: BaseRetriever, model: BaseChatModel, chunk_order: ChunkOrder = QueryConfig().chunk_order
) -> Runnable[str, AIMessage]:
    """The LCEL chain `retriever -> blocks -> model` for a question string.

    Documents are not joined into one string: each becomes its own `text-plain` block, so a
    `ChatRagKVCache` model recognises the retrieved chunks and fuses their caches. The retriever's documents
    (best first) are laid out in `chunk_order` (`QueryConfig.chunk_order`: by default the best one last, next to
    the question).
    """
    order = QueryConfig(chunk_order=chunk_order)  # refuses an unknown order
    to_messages = RunnableLambda(
        lambda inputs: [rag_message(order.in_prompt_order(inputs["documents"]), inputs["question"])]
    )
    return (RunnableParallel(documents=retriever, question=RunnablePassthrough()) | to_messages | model).with_config(
        run_name="kv_rag_chain"
    )
