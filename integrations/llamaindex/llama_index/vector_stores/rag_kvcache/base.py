"""`RagKVCacheVectorStore`: a LlamaIndex vector store backed by a rag-kvcache index.

Nodes added from any reader and node parser are chunked with the index's tokenizer, embedded with the
index's embedder, and every new chunk's KV cache is computed and stored before `add` returns, so a
query engine whose `RagKVCacheLLM` gets the retrieved texts in its prompt reads them from cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, model_validator
from llama_index.core.schema import BaseNode, MetadataMode, TextNode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    VectorStoreQuery,
    VectorStoreQueryResult,
)
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict
from typing_extensions import Self

from rag_kvcache import EngineHandle, Hit, KVIndex, ServingEngine, TextDocument


class RagKVCacheVectorStore(BasePydanticVectorStore):
    """A vector store over a rag-kvcache index, which embeds texts and queries with its own embedder
    (`is_embedding_query` is False: a query is searched by its text, and the embeddings LlamaIndex
    computes for added nodes are not used).

    ```python
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.llms.rag_kvcache import RagKVCacheLLM
    from llama_index.vector_stores.rag_kvcache import RagKVCacheVectorStore

    llm = RagKVCacheLLM(index="demo-index")
    store = RagKVCacheVectorStore(engine=llm.serving_engine)
    index = VectorStoreIndex.from_documents(
        docs, storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=MockEmbedding(embed_dim=1),  # LlamaIndex's node embeddings are not used
    )
    print(index.as_query_engine(llm=llm).query("What is the telescope called?"))
    ```

    A node's id is its source in the index; adding a node with an id the index holds replaces it. A
    node longer than one chunk is split into the index's chunks: a query returns the matching chunks,
    each as a node with its node's metadata and relationships (so `ref_doc_id`), and the node's id for
    its first chunk, `'{id}#{k}'` for chunk k > 0. Similarities are cosine.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    stores_text: bool = True
    is_embedding_query: bool = False
    engine: ServingEngine | None = Field(
        default=None, exclude=True, description="An opened `ServingEngine`, shared with an LLM."
    )
    index: str | None = Field(
        default=None,
        description="Or the folder of a rag-kvcache index; the store opens its own engine on first use.",
    )
    device: str | None = Field(default=None, description="Torch device of the model (None: the index's, cpu).")
    dtype: str | None = Field(default=None, description="Model dtype (None: the one the index was built with).")

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="after")
    def _open_handle(self) -> Self:
        self._handle = EngineHandle(
            self.engine, self.index, self.device, self.dtype
        )  # fails here for a folder that is no index
        return self

    @classmethod
    def class_name(cls) -> str:
        return "RagKVCacheVectorStore"

    @property
    def client(self) -> ServingEngine:
        """The engine this store serves from."""
        return self._handle.get()

    def close(self) -> None:
        """Close the engine this store opened for `index` (a given `engine` is its owner's to close)."""
        self._handle.close()

    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        if add_kwargs:
            raise TypeError(f"{type(self).__name__}.add got unexpected arguments {sorted(add_kwargs)!r}")
        documents = [
            TextDocument(
                node.node_id,
                node.get_content(metadata_mode=MetadataMode.NONE),
                node_to_metadata_dict(node, remove_text=True, flat_metadata=False),
            )
            for node in nodes
        ]
        if documents:
            engine = self._handle.get()
            engine.run(_add, engine.index, documents)
        return [node.node_id for node in nodes]

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Remove every node added for the document `ref_doc_id`."""
        if delete_kwargs:
            raise TypeError(f"{type(self).__name__}.delete got unexpected arguments {sorted(delete_kwargs)!r}")
        engine = self._handle.get()
        engine.run(_delete_document, engine.index, ref_doc_id)

    def delete_nodes(self, node_ids: list[str] | None = None, filters: Any = None, **delete_kwargs: Any) -> None:
        """Remove the nodes with these ids (ids the index does not hold are ignored)."""
        if node_ids is None or filters is not None or delete_kwargs:
            raise ValueError(
                f"{type(self).__name__}.delete_nodes takes node_ids only, got node_ids={node_ids!r}, "
                f"filters={filters!r}, {sorted(delete_kwargs)!r}"
            )
        engine = self._handle.get()
        engine.run(engine.index.delete, list(node_ids))

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        if unsupported := {
            name: value
            for name, value in [
                ("filters", query.filters),
                ("doc_ids", query.doc_ids),
                ("node_ids", query.node_ids),
                ("query_embedding", query.query_embedding),
                *kwargs.items(),
            ]
            if value  # None or empty: unset (VectorIndexRetriever passes node_ids=[])
        }:
            raise ValueError(f"{type(self).__name__} searches by query text only; got {sorted(unsupported)!r}")
        if query.mode.value != "default":
            raise ValueError(f"{type(self).__name__} supports the default query mode only, got {query.mode.value!r}")
        if not query.query_str:
            raise ValueError(f"{type(self).__name__} needs query_str, got {query.query_str!r}")
        engine = self._handle.get()
        return engine.run(_query, engine.index, query.query_str, query.similarity_top_k)


def _add(index: KVIndex, documents: list[TextDocument]) -> None:
    index.add_texts(documents, progress=False)


def _delete_document(index: KVIndex, ref_doc_id: str) -> None:
    added = index.chunks.texts(list({chunk.source for chunk in index.chunks.all_chunks()}))
    index.delete([source for source, doc in added.items() if doc.metadata.get("ref_doc_id") == ref_doc_id])


def _query(index: KVIndex, query: str, k: int) -> VectorStoreQueryResult:
    hits = index.search(query, k)
    added = index.chunks.texts([hit.chunk.source for hit in hits])
    nodes = [_node(hit, added.get(hit.chunk.source)) for hit in hits]
    return VectorStoreQueryResult(nodes=nodes, similarities=[hit.score for hit in hits], ids=[n.node_id for n in nodes])


def _node(hit: Hit, added: TextDocument | None) -> BaseNode:
    """The chunk as a node: its node's metadata and relationships, and the node's id for its first chunk,
    `'{id}#{k}'` for chunk k > 0 (LlamaIndex drops retrieved nodes whose id it has seen)."""
    chunk = hit.chunk
    node_id = chunk.source if chunk.ordinal == 0 else f"{chunk.source}#{chunk.ordinal}"
    if added is None:
        return TextNode(id_=node_id, text=chunk.text, metadata={"source": chunk.source})
    node = metadata_dict_to_node(dict(added.metadata), text=chunk.text)
    node.id_ = node_id
    return node
