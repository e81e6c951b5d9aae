"""LlamaIndex vector store backed by a rag-kvcache index: nodes added to it are chunk-cached."""

from .base import RagKVCacheVectorStore

__all__ = ["RagKVCacheVectorStore"]
