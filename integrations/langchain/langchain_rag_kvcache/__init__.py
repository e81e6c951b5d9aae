"""LangChain integration of rag-kvcache: a chat model that fuses retrieved chunks' KV caches, a
retriever over the index, the RAG chain that joins them without losing chunk identity, a relevance grader
that reads the chunks' caches (an agentic RAG graph's "grade documents" step), a vector store backed by the
index, and the agentic RAG graph itself (`langchain_rag_kvcache.graph`, with the `graph` extra: LangGraph)."""

from .chains import create_kv_rag_chain, rag_message
from .chat_models import CHUNK_ID_KEY, ChatRagKVCache, chunk_block
from .graders import RELEVANCE_KEY, ChatModelGrader, RagKVCacheGrader
from .retrievers import RagKVCacheRetriever
from .vectorstores import RagKVCacheVectorStore

__all__ = [
    "CHUNK_ID_KEY",
    "RELEVANCE_KEY",
    "ChatModelGrader",
    "ChatRagKVCache",
    "RagKVCacheGrader",
    "RagKVCacheRetriever",
    "RagKVCacheVectorStore",
    "chunk_block",
    "create_kv_rag_chain",
    "rag_message",
]
