"""`RagKVCacheRetriever`: the chunks of a rag-kvcache index most similar to a query, as nodes."""

from __future__ import annotations

from pathlib import Path

from llama_index.core.callbacks import CallbackManager
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from rag_kvcache import EngineHandle, ServingEngine


class RagKVCacheRetriever(BaseRetriever):
    """Retrieves indexed chunks as `NodeWithScore`s: each node's id is the chunk id, its metadata
    the chunk's `source` file and `ordinal` in it, and its score the cosine similarity."""

    def __init__(
        self,
        index: str | Path | None = None,
        similarity_top_k: int = 4,
        *,
        engine: ServingEngine | None = None,
        device: str | None = None,
        dtype: str | None = None,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        """Serve from `engine` (shared, e.g. an LLM's `serving_engine`) or open one for `index` on first use,
        loading its model on `device` in `dtype` (None: the index's settings)."""
        if similarity_top_k < 1:
            raise ValueError(f"similarity_top_k must be >= 1, got {similarity_top_k!r}")
        self._handle = EngineHandle(engine, index, device, dtype)  # fails here for a folder that is no index
        self.similarity_top_k = similarity_top_k
        super().__init__(callback_manager=callback_manager)

    def close(self) -> None:
        """Close the engine this retriever opened for `index`."""
        self._handle.close()

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self._handle.get().search(query_bundle.query_str, self.similarity_top_k)
        return [
            NodeWithScore(
                node=TextNode(
                    id_=hit.chunk.id,
                    text=hit.chunk.text,
                    metadata={"source": hit.chunk.source, "ordinal": hit.chunk.ordinal},
                ),
                score=hit.score,
            )
            for hit in hits
        ]
