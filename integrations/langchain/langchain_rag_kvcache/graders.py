"""An agentic RAG graph's "grade documents" step. `RagKVCacheGrader`: each document judged by the model while
reading its chunk's cache (`rag_kvcache.RelevanceCheck`): only the check question is computed, for all documents
in one batched forward (`exact=True`: a chunk whose cache was computed in another context is computed too).
`ChatModelGrader`: the same question put to any chat model, one full prompt per document (how the step runs
without the caches)."""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import Field

from rag_kvcache import RagKVCacheError
from rag_kvcache.relevance import CHECK, RelevanceCheck, Verdict

from .chains import rag_message
from .chat_models import CHUNK_ID_KEY
from .engines import EngineBacked

RELEVANCE_KEY = "relevance"  # metadata a graded document gets: the model's probability that it is relevant


class RagKVCacheGrader(RunnableSerializable[dict, list[Document]], EngineBacked):
    """Takes `{"question": str, "documents": [Document, ...]}` (documents from `RagKVCacheRetriever`, which carry
    their chunk id) and returns the documents judged relevant, in order, each with `metadata["relevance"]` (the
    probability of "yes"). A document without a chunk id of this index is refused: it has no cache to read."""

    template: str = Field(default=CHECK, description="The check question; `{question}` is replaced by the question.")
    threshold: float = Field(
        default=0.5, ge=0.0, le=1.0, description="Least probability of 'yes' that keeps a document."
    )
    exact: bool = Field(
        default=False,
        description="Compute the chunks whose caches are not what a full prefill of the check prompt computes "
        "(on grouped caches, those not first in their group), so that every verdict is a full prefill's.",
    )

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._grade, input, config, run_type="parser", **kwargs)

    def _grade(self, input: dict) -> list[Document]:
        documents = _documents(input, type(self).__name__)
        missing = [d.page_content[:60] for d in documents if d.metadata.get(CHUNK_ID_KEY) is None]
        if missing:
            raise RagKVCacheError(f"documents without a chunk id (not from RagKVCacheRetriever): {missing}")
        engine = self._handle.get()

        def check(question: str, ids: list[str]) -> list[Verdict]:  # on the engine's thread, which owns the index
            return RelevanceCheck(engine.generator, self.template, self.threshold, self.exact)(
                question, engine.index.chunks.get(ids)
            )

        verdicts = engine.run(check, input["question"], [d.metadata[CHUNK_ID_KEY] for d in documents])
        return [
            d.model_copy(update={"metadata": {**d.metadata, RELEVANCE_KEY: v.p_yes}})
            for d, v in zip(documents, verdicts)
            if v.relevant
        ]


class ChatModelGrader(RunnableSerializable[dict, list[Document]]):
    """Takes `{"question": str, "documents": [Document, ...]}` and returns the documents a chat model judges
    relevant, in order: for each, the model is asked `template` over that document alone (`rag_message`) for one
    token, and a document is kept when the answer begins with "yes". Any chat model; no cache is read."""

    model: BaseChatModel
    template: str = Field(default=CHECK, description="The check question; `{question}` is replaced by the question.")

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._grade, input, config, run_type="parser", **kwargs)

    def _grade(self, input: dict) -> list[Document]:
        documents = _documents(input, type(self).__name__)
        check, model = self.template.format(question=input["question"].strip()), self.model.bind(max_tokens=1)
        return [d for d in documents if model.invoke([rag_message([d], check)]).text.strip().lower().startswith("yes")]


def _documents(input: Any, grader: str) -> list[Document]:
    if not isinstance(input, dict) or not isinstance(input.get("question"), str) or "documents" not in input:
        raise TypeError(f"{grader} takes {{'question': str, 'documents': [Document]}}, got {input!r:.200}")
    return list(input["documents"])
