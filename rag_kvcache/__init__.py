"""rag-kvcache: retrieval-augmented generation that never prefills the same chunk twice.

The names below are imported on first use, so that `import rag_kvcache` (and the CLI's `--help`)
does not load torch, transformers or FAISS.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__ as __version__

_EXPORTS = {  # name -> module it is imported from on first use
    "Answer": ".query.answers",
    "ChunkKV": ".engine.cache",
    "Config": ".config",
    "FusedGenerator": ".query.generator",
    "FusionConfig": ".config",
    "FusionInput": ".engine.fusion",
    "FusionResult": ".engine.fusion",
    "GenerationConfig": ".config",
    "IndexSettings": ".config",
    "QueryConfig": ".config",
    "RuntimeConfig": ".config",
    "StorageConfig": ".config",
    "KVIndex": ".index",
    "KVStore": ".store.kvstore",
    "METHODS": ".engine.methods",
    "ModelAdapter": ".engine.model",
    "UnsupportedModelError": ".engine.spec",
    "register": ".engine.methods",
    "Segment": ".engine.prompt",
    "ChatTurn": ".engine.prompt",
    "ChunkPart": ".engine.prompt",
    "chat_segments": ".engine.prompt",
    "Hit": ".retrieval.records",
    "ServingEngine": ".serving.engine",
    "EngineHandle": ".serving.engine",
    "RagKVCacheError": ".errors",
    "ConfigError": ".errors",
    "ConversationCache": ".store.conversations",
    "RelevanceCheck": ".query.relevance",
    "Verdict": ".query.relevance",
    "RequestError": ".query.request",
    "ChunkOrder": ".config",
    "ChunkRecord": ".retrieval.records",
    "TextDocument": ".retrieval.records",
    "Options": ".query.request",
    "Prompt": ".query.request",
    "chat_prompt": ".query.request",
    "completion_prompt": ".query.request",
    "generation_of": ".query.request",
    "SharedPrompt": ".query.agent",
    "RELEVANCE_CHECK": ".query.relevance",
    "MAX_CHECK_PROMPT_TOKENS": ".query.relevance",
}
__all__ = [
    "Answer",
    "ChatTurn",
    "ChunkKV",
    "ChunkOrder",
    "ChunkPart",
    "ChunkRecord",
    "Config",
    "ConfigError",
    "ConversationCache",
    "EngineHandle",
    "FusedGenerator",
    "FusionConfig",
    "FusionInput",
    "FusionResult",
    "GenerationConfig",
    "Hit",
    "IndexSettings",
    "KVIndex",
    "KVStore",
    "MAX_CHECK_PROMPT_TOKENS",
    "METHODS",
    "ModelAdapter",
    "Options",
    "Prompt",
    "QueryConfig",
    "RELEVANCE_CHECK",
    "RagKVCacheError",
    "RelevanceCheck",
    "RequestError",
    "RuntimeConfig",
    "Segment",
    "ServingEngine",
    "SharedPrompt",
    "StorageConfig",
    "TextDocument",
    "UnsupportedModelError",
    "Verdict",
    "chat_prompt",
    "chat_segments",
    "completion_prompt",
    "generation_of",
    "register",
]

if TYPE_CHECKING:
    from .config import (
        ChunkOrder,
        Config,
        FusionConfig,
        GenerationConfig,
        IndexSettings,
        QueryConfig,
        RuntimeConfig,
        StorageConfig,
    )
    from .engine.cache import ChunkKV
    from .engine.fusion import FusionInput, FusionResult
    from .engine.methods import METHODS, register
    from .engine.model import ModelAdapter
    from .engine.prompt import ChatTurn, ChunkPart, Segment, chat_segments
    from .engine.spec import UnsupportedModelError
    from .errors import ConfigError, RagKVCacheError
    from .index import KVIndex
    from .query.agent import SharedPrompt
    from .query.answers import Answer
    from .query.generator import FusedGenerator
    from .query.relevance import MAX_CHECK_PROMPT_TOKENS, RELEVANCE_CHECK, RelevanceCheck, Verdict
    from .query.request import Options, Prompt, RequestError, chat_prompt, completion_prompt, generation_of
    from .retrieval.records import ChunkRecord, Hit, TextDocument
    from .serving.engine import EngineHandle, ServingEngine
    from .store.conversations import ConversationCache
    from .store.kvstore import KVStore


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
