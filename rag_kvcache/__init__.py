"""rag-kvcache: retrieval-augmented generation that never prefills the same chunk twice."""

from .config import Config, FusionConfig, GenerationConfig
from .fusion import METHODS, FusionInput, FusionResult, register
from .kvstore import ChunkKV, KVStore
from .model import ModelAdapter, UnsupportedModelError
from .pipeline import Answer, FusedGenerator, KVIndex

__all__ = [
    "Answer", "ChunkKV", "Config", "FusedGenerator", "FusionConfig", "FusionInput", "FusionResult",
    "GenerationConfig", "KVIndex", "KVStore", "METHODS", "ModelAdapter", "UnsupportedModelError", "register",
]
