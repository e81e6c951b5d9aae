"""The one configuration object, passed explicitly everywhere (no globals, no environment), made of its settings
by lifetime: what an index records (`IndexSettings`, in `index`), how a question is answered unless its request
says otherwise (`QueryConfig` with `FusionConfig` and `GenerationConfig`, in `query`), and where a process runs
(`RuntimeConfig` with `StorageConfig`, in `runtime`); `Config` (in `config`) holds one of each.

Each setting a user may choose carries its help text in its field's metadata (`setting`, in `defaults`); the CLI
builds its options, defaults and help from these fields, so a default changed here changes the CLI. Every name
below is imported from `rag_kvcache.config`; a setting out of its range raises `ConfigError` (`at_least`, `one_of`).
"""

from ..errors import ConfigError
from .config import Config
from .defaults import (
    BUILTIN_METHODS,
    CHUNK_ORDERS,
    CHUNK_PREFILLS,
    CODEC_NAMES,
    DEFAULT_EMBEDDER,
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MODEL,
    DEFAULT_SYSTEM_PROMPT,
    DTYPE_NAMES,
    EMBEDDER_DTYPES,
    EPIC_SHARE,
    FLOAT32_TINY,
    GREEDY_BELOW,
    ChunkOrder,
    ChunkPrefill,
    CodecName,
    Deviation,
    DType,
    EmbedderDType,
    Eviction,
    at_least,
    one_of,
    setting,
)
from .index import IndexSettings
from .query import FusionConfig, GenerationConfig, QueryConfig
from .runtime import RuntimeConfig, StorageConfig

__all__ = [
    "BUILTIN_METHODS",
    "CHUNK_ORDERS",
    "CHUNK_PREFILLS",
    "CODEC_NAMES",
    "DEFAULT_EMBEDDER",
    "DEFAULT_MAX_DOCUMENTS",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MODEL",
    "DEFAULT_SYSTEM_PROMPT",
    "DTYPE_NAMES",
    "EMBEDDER_DTYPES",
    "EPIC_SHARE",
    "FLOAT32_TINY",
    "GREEDY_BELOW",
    "ChunkOrder",
    "ChunkPrefill",
    "CodecName",
    "Config",
    "ConfigError",
    "DType",
    "Deviation",
    "EmbedderDType",
    "Eviction",
    "FusionConfig",
    "GenerationConfig",
    "IndexSettings",
    "QueryConfig",
    "RuntimeConfig",
    "StorageConfig",
    "at_least",
    "one_of",
    "setting",
]
