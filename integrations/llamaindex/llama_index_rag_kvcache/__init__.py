"""LlamaIndex integration of rag-kvcache: an LLM that fuses retrieved chunks' KV caches, a retriever
whose node ids are chunk ids, and the response synthesizer / query engine that joins them."""

from .llms import RagKVCacheLLM
from .retrievers import RagKVCacheRetriever
from .synthesizers import KVCacheSynthesizer, create_kv_query_engine

__all__ = ["KVCacheSynthesizer", "RagKVCacheLLM", "RagKVCacheRetriever", "create_kv_query_engine"]
