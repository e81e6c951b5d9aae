"""`RagKVCacheRetriever`: the chunks of a rag-kvcache index most similar to a query."""

from __future__ import annotations

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import Field

from rag_kvcache import Hit

from .chat_models import CHUNK_ID_KEY
from .engines import EngineBacked


class RagKVCacheRetriever(BaseRetriever, EngineBacked):
    """Retrieves indexed chunks as `Document`s: `id` and `metadata["chunk_id"]` are the chunk id,
    `metadata` also has its `source` file, `ordinal` in that file, and cosine `score`."""

    k: int = Field(default=4, ge=1, description="How many chunks to return.")

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        hits = self._handle.get().search(query, self.k if k is None else k)
        return [_document(hit) for hit in hits]


def _document(hit: Hit) -> Document:
    chunk = hit.chunk
    metadata = {CHUNK_ID_KEY: chunk.id, "source": chunk.source, "ordinal": chunk.ordinal, "score": hit.score}
    return Document(page_content=chunk.text, id=chunk.id, metadata=metadata)
