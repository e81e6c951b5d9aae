"""LangChain integration of rag-kvcache: a chat model that fuses retrieved chunks' KV caches, a
retriever over the index, and the RAG chain that joins them without losing chunk identity."""

from .chains import create_kv_rag_chain, rag_message
from .chat_models import CHUNK_ID_KEY, ChatRagKVCache, chunk_block
from .retrievers import RagKVCacheRetriever

__all__ = ["CHUNK_ID_KEY", "ChatRagKVCache", "RagKVCacheRetriever", "chunk_block", "create_kv_rag_chain", "rag_message"]
