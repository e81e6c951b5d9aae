"""LlamaIndex LLM of rag-kvcache, which fuses retrieved chunks' KV caches, and the response synthesizer /
query engine that hands it the retrieved chunks by id. The retriever and the vector store live in
`llama_index.retrievers.rag_kvcache` and `llama_index.vector_stores.rag_kvcache` (same distribution)."""

from .base import RagKVCacheLLM
from .synthesizers import KVCacheSynthesizer, create_kv_query_engine

__all__ = ["KVCacheSynthesizer", "RagKVCacheLLM", "create_kv_query_engine"]
