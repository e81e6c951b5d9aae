"""`RagKVCacheRetriever`: the chunks of a rag-kvcache index most similar to a query."""

from __future__ import annotations

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from typing_extensions import Self

from rag_kvcache import Engine, EngineHandle, Hit

from .chat_models import CHUNK_ID_KEY


class RagKVCacheRetriever(BaseRetriever):
    """Retrieves indexed chunks as `Document`s: `id` and `metadata["chunk_id"]` are the chunk id,
    `metadata` also has its `source` file, `ordinal` in that file, and cosine `score`."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    engine: Engine | None = Field(default=None, exclude=True, description="An opened `Engine`, shared with a model.")
    index: str | None = Field(default=None, description="Or the folder of a rag-kvcache index (opened on first use).")
    k: int = Field(default=4, ge=1, description="How many chunks to return.")
    device: str | None = Field(default=None, description="Torch device of the model (None: the index's, cpu).")
    dtype: str | None = Field(default=None, description="Model dtype (None: the one the index was built with).")

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="after")
    def _open_handle(self) -> Self:
        self._handle = EngineHandle(self.engine, self.index, self.device, self.dtype)
        return self

    def close(self) -> None:
        """Close the engine this retriever opened for `index`."""
        self._handle.close()

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        hits = self._handle.get().search(query, self.k if k is None else k)
        return [_document(hit) for hit in hits]


def _document(hit: Hit) -> Document:
    chunk = hit.chunk
    metadata = {CHUNK_ID_KEY: chunk.id, "source": chunk.source, "ordinal": chunk.ordinal, "score": hit.score}
    return Document(page_content=chunk.text, id=chunk.id, metadata=metadata)
