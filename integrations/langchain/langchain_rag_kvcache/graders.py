"""An agentic RAG graph's "grade documents" step. `RagKVCacheGrader`: each document judged by the model while
reading its chunk's cache (`rag_kvcache.RelevanceCheck`): only the check question is computed, for all documents
in one batched forward (`exact=True`: a chunk whose cache was computed in another context is computed too). A
document whose text is not its chunk's (edited, or another text under a chunk id) is judged on its own text,
computed.
`ChatModelGrader`: the same question put to any chat model, one full prompt per document (how the step runs
without the caches)."""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import Field

from rag_kvcache import (
    MAX_CHECK_PROMPT_TOKENS,
    RELEVANCE_CHECK,
    ChunkRecord,
    RelevanceCheck,
    RequestError,
    ServingEngine,
    Verdict,
)

from .chains import rag_message
from .chat_models import CHUNK_ID_KEY
from .engines import EngineBacked

RELEVANCE_KEY = "relevance"  # metadata a graded document gets: the model's probability that it is relevant


class RagKVCacheGrader(RunnableSerializable[dict, list[Document]], EngineBacked):
    """Takes `{"question": str, "documents": [Document, ...]}` (documents from `RagKVCacheRetriever`, which carry
    their chunk id) and returns the documents judged relevant, in order, each with `metadata["relevance"]` (the
    probability of "yes"). What is judged is a document's `page_content`: the cache of the chunk its chunk id
    names is read only when that text is the chunk's; any other document (no chunk id, one not in the index, or
    another text under one) is computed. At most `max_documents` documents, each check prompt at most
    `max_prompt_tokens` tokens: more is a `ValueError` (`RequestError`, `PromptTooLongError`) naming the limit,
    before anything is computed."""

    template: str = Field(
        default=RELEVANCE_CHECK, description="The check question; `{question}` is replaced by the question."
    )
    threshold: float = Field(
        default=0.5, ge=0.0, le=1.0, description="Least probability of 'yes' that keeps a document."
    )
    exact: bool = Field(
        default=False,
        description="Compute the chunks whose caches are not what a full prefill of the check prompt computes "
        "(on grouped caches, those not first in their group), so that every verdict is a full prefill's.",
    )
    max_prompt_tokens: int = Field(
        default=MAX_CHECK_PROMPT_TOKENS,
        ge=1,
        description="Longest check prompt (system prefix, document and question), in tokens: longer is refused.",
    )
    max_documents: int = Field(default=64, ge=1, description="Most documents graded in one call: more is refused.")

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._grade, input, config, run_type="parser", **kwargs)

    def _grade(self, input: dict) -> list[Document]:
        documents = _documents(input, type(self).__name__)
        if len(documents) > self.max_documents:
            raise RequestError(
                f"{len(documents)} documents to grade, over the limit of {self.max_documents} (max_documents)",
                param="documents",
            )
        engine = self._handle.get()

        def check(question: str) -> list[Verdict]:  # on the engine's thread, which owns the index
            grader = RelevanceCheck(engine.generator, self.template, self.threshold, self.exact, self.max_prompt_tokens)
            return grader(question, _passages(engine, documents))

        verdicts = engine.run(check, input["question"])
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
    template: str = Field(
        default=RELEVANCE_CHECK, description="The check question; `{question}` is replaced by the question."
    )

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._grade, input, config, run_type="parser", **kwargs)

    def _grade(self, input: dict) -> list[Document]:
        documents = _documents(input, type(self).__name__)
        check, model = self.template.format(question=input["question"].strip()), self.model.bind(max_tokens=1)
        return [d for d in documents if model.invoke([rag_message([d], check)]).text.strip().lower().startswith("yes")]


def _passages(engine: ServingEngine, documents: list[Document]) -> list[ChunkRecord | str]:
    """What each document is judged as (on the engine's thread): the indexed chunk its chunk id names when the
    document's text is that chunk's (its cache is read), else its text (computed)."""
    ids = {i for d in documents if isinstance(i := d.metadata.get(CHUNK_ID_KEY), str)}
    chunks = {chunk.id: chunk for chunk in _indexed(engine, ids)}
    passages: list[ChunkRecord | str] = []
    for d in documents:
        chunk_id = d.metadata.get(CHUNK_ID_KEY)
        chunk = chunks.get(chunk_id) if isinstance(chunk_id, str) else None
        passages.append(chunk if chunk is not None and chunk.text == d.page_content else d.page_content)
    return passages


def _indexed(engine: ServingEngine, ids: set[str]) -> list[ChunkRecord]:
    """The chunks of the index among `ids` (an id it does not hold is left out)."""
    found = []
    for chunk_id in ids:
        try:
            found += engine.index.chunks.get([chunk_id])
        except KeyError:
            continue
    return found


def _documents(input: Any, grader: str) -> list[Document]:
    if not isinstance(input, dict) or not isinstance(input.get("question"), str) or "documents" not in input:
        raise TypeError(f"{grader} takes {{'question': str, 'documents': [Document]}}, got {input!r:.200}")
    return list(input["documents"])
