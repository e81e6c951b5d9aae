"""The defaults of the configuration and the names each choice may take (`CHUNK_PREFILLS`, `DTYPE_NAMES`,
`CODEC_NAMES`, ...), `setting`, the field that carries a setting's default with the help text the CLI shows, and
the range checks every config's `__post_init__` makes (`at_least`, `one_of`).

Nothing here imports the rest of the package but its error root."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any, Literal, get_args

from ..errors import ConfigError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number (a top_p below it rounds to 0)
DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents in the user's message. "
    "Answer briefly, with a short phrase."
)

Deviation = Literal["k", "v"]
ChunkPrefill = Literal["behind_prefix", "isolated", "neighbours", "cached_neighbours", "grouped"]
CHUNK_PREFILLS: tuple[str, ...] = get_args(ChunkPrefill)
ChunkOrder = Literal["best_last", "best_first"]
CHUNK_ORDERS: tuple[str, ...] = get_args(ChunkOrder)
Eviction = Literal["lru", "lfu"]
DType = Literal["float32", "float16", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = get_args(DType)
EmbedderDType = Literal["auto", "float32", "float16", "bfloat16"]  # auto: retrieval.embedder.embedder_dtype
EMBEDDER_DTYPES: tuple[str, ...] = get_args(EmbedderDType)
CodecName = Literal["none", "int8-channel", "int8-token", "fp8", "int8k-int4v"]  # implemented by store.codecs.CODECS
CODEC_NAMES: tuple[str, ...] = get_args(CodecName)
DEFAULT_MAX_FILE_BYTES = 8 << 20
DEFAULT_MAX_DOCUMENTS = 100_000
EPIC_SHARE = 8  # an unset epic_k recomputes this share (1/EPIC_SHARE) of a chunk's size: 16 of 128 tokens, 64 of 512
BUILTIN_METHODS = "full, prefix, reuse, cacheblend, epic, epic_match, cacheblend_repick"  # for help texts; the registry is engine.methods.METHODS


def setting(default: Any, help: str, secret: bool = False) -> Any:
    """A dataclass field with a default and the help text the CLI shows for it (`secret`: left out of the config's
    repr, as keys are)."""
    return field(default=default, repr=not secret, metadata={"help": help})


def at_least(config: Any, **lows: float) -> None:
    """`ConfigError` naming the first of `config`'s fields below its bound in `lows` (an unset one, None, passes)."""
    for name, low in lows.items():
        if (value := getattr(config, name)) is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value!r}")


def one_of(config: Any, **choices: Sequence[str]) -> None:
    """`ConfigError` naming the first of `config`'s fields whose value is not among its `choices`."""
    for name, allowed in choices.items():
        if (value := getattr(config, name)) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
