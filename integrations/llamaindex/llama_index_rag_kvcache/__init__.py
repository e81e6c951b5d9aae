"""LlamaIndex integration of rag-kvcache: an LLM that fuses retrieved chunks' KV caches, a retriever
whose node ids are chunk ids, the response synthesizer / query engine that joins them, and a vector store
backed by the index."""

from .llms import RagKVCacheLLM
from .retrievers import RagKVCacheRetriever
from .synthesizers import KVCacheSynthesizer, create_kv_query_engine
from .vector_stores import RagKVCacheVectorStore

__all__ = [
    "KVCacheSynthesizer", "RagKVCacheLLM", "RagKVCacheRetriever", "RagKVCacheVectorStore", "create_kv_query_engine",
]
