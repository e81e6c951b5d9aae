"""LlamaIndex retriever over a rag-kvcache index: its node ids are chunk ids, which `RagKVCacheLLM` fuses."""

from .base import RagKVCacheRetriever

__all__ = ["RagKVCacheRetriever"]
