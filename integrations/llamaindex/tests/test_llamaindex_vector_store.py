"""`RagKVCacheVectorStore` under LlamaIndex's own `VectorStoreIndex` and default query engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.vector_stores.types import VectorStoreQuery
from llama_index.llms.rag_kvcache import RagKVCacheLLM
from llama_index.vector_stores.rag_kvcache import RagKVCacheVectorStore

from rag_kvcache import ServingEngine
from rag_kvcache.retrieval.embedder import embedder_dtype, load_embedder, unit_vectors

from ...testing import demo_files, empty_engine
from .support import QUESTION, Prompts, matched_tokens

pytestmark = pytest.mark.smollm2  # every test runs on an index built with SmolLM2-135M


@pytest.fixture(scope="module")
def vector_index(store_engine: ServingEngine) -> VectorStoreIndex:
    documents = [Document(text=f.read_text(), id_=f"demo/{f.name}", metadata={"file": f.name}) for f in demo_files()]
    store = RagKVCacheVectorStore(engine=store_engine)
    return VectorStoreIndex.from_documents(
        documents,
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=MockEmbedding(embed_dim=1),  # the store embeds with the index's embedder
    )


def test_vector_store_index_default_query_engine_reads_the_chunks_from_cache(
    vector_index: VectorStoreIndex, store_engine: ServingEngine, prompts: Prompts
) -> None:
    llm = RagKVCacheLLM(engine=store_engine, max_tokens=24)
    response = vector_index.as_query_engine(llm=llm, similarity_top_k=3).query(QUESTION)
    assert "Harrow" in response.response
    (first, *_) = response.source_nodes
    assert first.node.ref_doc_id == "demo/observatory.md"
    assert first.node.metadata == {"file": "observatory.md"}
    (turns,) = prompts.turns
    chunk_tokens = sum(len(h.chunk.token_ids) for h in store_engine.search(QUESTION, 3))
    assert matched_tokens(llm, turns) >= 0.9 * chunk_tokens


def test_queries_rank_by_the_real_embedder(vector_index: VectorStoreIndex, store_engine: ServingEngine) -> None:
    """Retrieval is all-MiniLM-L6-v2's, the index's own embedder: the `MockEmbedding` LlamaIndex is given
    above only fills its `embed_model` slot (the store embeds texts and queries itself). The ranking
    equals cosine similarity computed here with the real model over every stored chunk."""
    chunks = store_engine.run(lambda: list(store_engine.index.chunks.all_chunks()))
    runtime = store_engine.index.config.runtime
    dtype = embedder_dtype(runtime.embedder_dtype, runtime.device)
    embedder = load_embedder(dtype=dtype)  # in the dtype the index runs it
    vectors = unit_vectors(embedder, [QUESTION, *(c.text for c in chunks)])  # [1 + C, E], as the index's
    similarities = vectors[1:] @ vectors[0]
    top = sorted(range(len(chunks)), key=lambda i: -similarities[i])[:3]
    store = vector_index.vector_store
    result = store.query(VectorStoreQuery(query_str=QUESTION, similarity_top_k=3))
    assert [n.get_content() for n in result.nodes] == [chunks[i].text for i in top]
    # a vector embedded in bfloat16 moves with the batch it is embedded in (the question here: 4e-4 of cosine)
    tolerance = 1e-4 if dtype == "float32" else 2e-3
    assert result.similarities == pytest.approx([float(similarities[i]) for i in top], abs=tolerance)


def test_added_nodes_are_chunk_cached(vector_index: VectorStoreIndex, store_engine: ServingEngine) -> None:
    index = store_engine.index
    chunks = store_engine.run(lambda: list(index.chunks.all_chunks()))
    assert len({c.source for c in chunks}) >= 5
    assert all(index.addressing.own_key(c.token_ids) in index.store for c in chunks)


def test_delete_by_document_and_by_node(demo_engine: ServingEngine, tmp_path: Path) -> None:
    with empty_engine(tmp_path / "index", demo_engine) as engine:
        store = RagKVCacheVectorStore(engine=engine)
        index = VectorStoreIndex.from_documents(
            [
                Document(text="The Harrow telescope has a 2.4 m mirror.", id_="a"),
                Document(text="Saltmere is a fishing town.", id_="b"),
            ],
            storage_context=StorageContext.from_defaults(vector_store=store),
            embed_model=MockEmbedding(embed_dim=1),
        )
        result = store.query(VectorStoreQuery(query_str="Harrow telescope", similarity_top_k=2))
        assert [n.ref_doc_id for n in result.nodes] == ["a", "b"]
        index.delete_ref_doc("a")
        result = store.query(VectorStoreQuery(query_str="Harrow telescope", similarity_top_k=2))
        assert [n.ref_doc_id for n in result.nodes] == ["b"]
        store.delete_nodes([result.ids[0], "never-added"])
        assert store.query(VectorStoreQuery(query_str="Harrow", similarity_top_k=1)).nodes == []
        with pytest.raises(ValueError, match="query_embedding"):
            store.query(VectorStoreQuery(query_str="x", query_embedding=[0.1]))
