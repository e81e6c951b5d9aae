"""`RagKVCacheVectorStore`: a LangChain `VectorStore` backed by a rag-kvcache index.

Documents added from any loader and splitter are chunked with the index's tokenizer, embedded with
the index's embedder, and every new chunk's KV cache is computed and stored before the add returns,
so a chain that puts the retrieved texts into a prompt for `ChatRagKVCache` reads them from cache.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from rag_kvcache import EngineHandle, Hit, KVIndex, ServingEngine, TextDocument


class RagKVCacheVectorStore(VectorStore):
    """A vector store over a rag-kvcache index (the index's own embedder; no `Embeddings` object).

    ```python
    from langchain_rag_kvcache import RagKVCacheVectorStore

    store = RagKVCacheVectorStore.from_documents(docs, index="demo-index")  # or engine=ServingEngine("demo-index")
    retriever = store.as_retriever(search_kwargs={"k": 4})
    ```

    A document's id (given, or a new UUID) is its source in the index; adding a document with an id
    the index holds replaces it. A document longer than one chunk is split into the index's chunks:
    a search returns the matching chunks, each as a `Document` with its document's id and metadata.
    Documents of a folder indexed with `rag-kvcache index` are found too, with metadata `{"source":
    path}`. Scores are cosine similarities.
    """

    def __init__(
        self,
        index: str | Path | None = None,
        *,
        engine: ServingEngine | None = None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        """Serve from `engine` (shared with a chat model) or open one for `index` on first use, loading its
        model on `device` in `dtype` (None: the index's settings)."""
        self._handle = EngineHandle(engine, index, device, dtype)  # fails here for a folder that is no index

    def close(self) -> None:
        """Close the engine this store opened for `index` (a given `engine` is its owner's to close)."""
        self._handle.close()

    @property
    def embeddings(self) -> Embeddings | None:
        return None

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict] | None = None,
        *,
        ids: list[str | None] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        if kwargs:
            raise TypeError(f"{type(self).__name__}.add_texts got unexpected arguments {sorted(kwargs)!r}")
        texts = list(texts)
        metadatas = [{} for _ in texts] if metadatas is None else metadatas
        ids = [None for _ in texts] if ids is None else ids
        if not len(texts) == len(metadatas) == len(ids):
            raise ValueError(
                f"{len(texts)} texts, {len(metadatas)} metadatas and {len(ids)} ids: give one of each per text"
            )
        ids = [str(uuid.uuid4()) if i is None else i for i in ids]
        documents = [TextDocument(i, t, m) for i, t, m in zip(ids, texts, metadatas, strict=True)]
        if documents:
            engine = self._handle.get()
            engine.run(_add, engine.index, documents)
        return ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Remove the documents with these ids (ids the index does not hold are ignored)."""
        if kwargs:
            raise TypeError(f"{type(self).__name__}.delete got unexpected arguments {sorted(kwargs)!r}")
        if ids is None:
            raise ValueError("delete needs the ids of the documents to remove, got None")
        engine = self._handle.get()
        engine.run(engine.index.delete, list(ids))
        return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The documents added with these ids, whole (ids the store did not add are left out)."""
        engine = self._handle.get()
        found = engine.run(engine.index.chunks.texts, list(ids))
        return [Document(page_content=found[i].text, metadata=dict(found[i].metadata), id=i) for i in ids if i in found]

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
        if kwargs:
            raise TypeError(f"{type(self).__name__}.similarity_search got unexpected arguments {sorted(kwargs)!r}")
        engine = self._handle.get()
        return engine.run(_search, engine.index, query, k)

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return lambda similarity: (1.0 + similarity) / 2.0  # cosine similarity in [-1, 1] -> [0, 1]

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings | None = None,
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        index: str | Path | None = None,
        engine: ServingEngine | None = None,
        device: str | None = None,
        dtype: str | None = None,
        **kwargs: Any,
    ) -> RagKVCacheVectorStore:
        """A store over `index` (or `engine`) with `texts` added; the index embeds with its own embedder,
        so `embedding` must be None."""
        if embedding is not None:
            raise ValueError(
                f"{cls.__name__} embeds with its index's embedder; got embedding={type(embedding).__name__}: pass None"
            )
        store = cls(index, engine=engine, device=device, dtype=dtype)
        store.add_texts(texts, metadatas, ids=ids, **kwargs)
        return store

    @classmethod
    def from_documents(
        cls, documents: list[Document], embedding: Embeddings | None = None, **kwargs: Any
    ) -> RagKVCacheVectorStore:
        return super().from_documents(documents, embedding, **kwargs)


def _add(index: KVIndex, documents: list[TextDocument]) -> None:
    index.add_texts(documents, progress=False)


def _search(index: KVIndex, query: str, k: int) -> list[tuple[Document, float]]:
    hits = index.search(query, k)
    texts = index.chunks.texts([hit.chunk.source for hit in hits])
    return [(_document(hit, texts.get(hit.chunk.source)), hit.score) for hit in hits]


def _document(hit: Hit, added: TextDocument | None) -> Document:
    metadata = {"source": hit.chunk.source} if added is None else dict(added.metadata)
    return Document(page_content=hit.chunk.text, metadata=metadata, id=hit.chunk.source)
