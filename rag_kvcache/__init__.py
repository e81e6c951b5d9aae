"""rag-kvcache: retrieval-augmented generation that never prefills the same chunk twice."""

from .config import Config, FusionConfig, GenerationConfig
from .engine.cache import ChunkKV
from .engine.fusion import FusionInput, FusionResult
from .engine.methods import METHODS, register
from .engine.model import ModelAdapter, UnsupportedModelError
from .generator import Answer, FusedGenerator
from .index import KVIndex
from .store.kvstore import KVStore

__all__ = [
    "Answer", "ChunkKV", "Config", "FusedGenerator", "FusionConfig", "FusionInput", "FusionResult",
    "GenerationConfig", "KVIndex", "KVStore", "METHODS", "ModelAdapter", "UnsupportedModelError", "register",
]
