"""`RagKVCacheVectorStore`: documents added through it are chunk-cached and keep their ids and metadata;
LangChain's tutorial chain over it reads the retrieved chunks from cache; langchain-tests' standard suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_rag_kvcache import ChatRagKVCache, RagKVCacheVectorStore
from langchain_rag_kvcache.chat_models import _prompt
from langchain_tests.integration_tests import VectorStoreIntegrationTests

from rag_kvcache import Options, ServingEngine

from ...testing import QUESTION, demo_files, empty_engine

pytestmark = pytest.mark.smollm2  # every test runs on an index built with SmolLM2-135M


@pytest.fixture(scope="module")
def demo_documents() -> list[Document]:
    return [
        Document(page_content=f.read_text(), id=f"demo/{f.name}", metadata={"file": f.name, "kind": "demo"})
        for f in demo_files()
    ]


@pytest.fixture(scope="module")
def store(store_engine: ServingEngine, demo_documents: list[Document]) -> RagKVCacheVectorStore:
    return RagKVCacheVectorStore.from_documents(demo_documents, engine=store_engine)


def test_documents_keep_their_ids_and_metadata(store: RagKVCacheVectorStore, demo_documents: list[Document]) -> None:
    found = store.similarity_search(QUESTION, k=3)
    assert found[0].id == "demo/observatory.md"
    by_id = {d.id: d for d in demo_documents}
    for doc in found:
        assert doc.metadata == by_id[doc.id].metadata
        assert doc.page_content in by_id[doc.id].page_content
    assert store.get_by_ids(["demo/observatory.md", "missing"]) == [by_id["demo/observatory.md"]]


def test_added_documents_are_chunk_cached(store: RagKVCacheVectorStore, store_engine: ServingEngine) -> None:
    chunks = store_engine.run(lambda: list(store_engine.index.chunks.all_chunks()))
    assert chunks and all(c.source.startswith("demo/") for c in chunks)
    index = store_engine.index
    assert all(index.addressing.own_key(c.token_ids) in index.store for c in chunks)


def test_tutorial_chain_over_the_store_reads_the_chunks_from_cache(
    store: RagKVCacheVectorStore, store_engine: ServingEngine
) -> None:
    """LangChain's RAG tutorial chain with the store's retriever: `format_docs` into a prompt template."""
    model = ChatRagKVCache(engine=store_engine, max_tokens=24)
    prompt = ChatPromptTemplate.from_messages(
        [
            (
                "system",
                (
                    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                    "context to answer the question. Keep the answer concise.\n\n{context}"
                ),
            ),
            ("human", "{question}"),
        ]
    )
    retriever = store.as_retriever(search_kwargs={"k": 3})

    def format_docs(docs):
        return "\n\n".join(d.page_content for d in docs)

    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | model
    answer = chain.invoke(QUESTION)
    assert "Harrow" in answer.text
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0
    messages = prompt.invoke({"context": format_docs(retriever.invoke(QUESTION)), "question": QUESTION}).to_messages()
    segments = store_engine.run(_prompt, store_engine.generator, messages, Options(fusion=model.fusion)).segments
    matched = sum(len(s.ids) for s in segments if s.cacheable and s.label.startswith("chunk:"))
    chunk_tokens = sum(len(h.chunk.token_ids) for h in store_engine.search(QUESTION, 3))
    assert matched >= 0.9 * chunk_tokens


def test_replace_and_delete(demo_engine: ServingEngine, tmp_path: Path) -> None:
    with empty_engine(tmp_path / "index", demo_engine) as engine:
        store = RagKVCacheVectorStore(engine=engine)
        store.add_texts(["The Harrow telescope has a 2.4 m mirror."], [{"v": 1}], ids=["t"])
        store.add_texts(["The Harrow telescope was rebuilt in 1990."], [{"v": 2}], ids=["t"])
        (doc,) = store.similarity_search("Harrow telescope", k=1)
        assert doc == Document(id="t", page_content="The Harrow telescope was rebuilt in 1990.", metadata={"v": 2})
        store.delete(["t", "never-added"])
        assert store.similarity_search("Harrow telescope", k=1) == []
        with pytest.raises(ValueError, match="embedder"):
            RagKVCacheVectorStore.from_texts(["x"], DeterministicFakeEmbedding(size=6), engine=engine)
        with pytest.raises(ValueError, match="2 texts, 1 metadatas"):
            store.add_texts(["a", "b"], [{}])
        with pytest.raises(ValueError, match="distinct sources"):
            store.add_texts(["a", "b"], ids=["x", "x"])


class TestRagKVCacheVectorStoreStandard(VectorStoreIntegrationTests):
    """langchain-tests' suite on an empty index (emptied after each test); the index embeds with its own
    embedder, so the suite's fake embeddings are not used."""

    @pytest.fixture
    def vectorstore(self, store_engine_empty: ServingEngine) -> Iterator[RagKVCacheVectorStore]:  # type: ignore[override]
        store = RagKVCacheVectorStore(engine=store_engine_empty)
        try:
            yield store
        finally:
            sources = store_engine_empty.run(lambda: [c.source for c in store_engine_empty.index.chunks.all_chunks()])
            store.delete(sources)

    @pytest.fixture(scope="class")
    def store_engine_empty(
        self, tmp_path_factory: pytest.TempPathFactory, demo_engine: ServingEngine
    ) -> Iterator[ServingEngine]:
        with empty_engine(tmp_path_factory.mktemp("standard") / "index", demo_engine) as engine:
            yield engine
