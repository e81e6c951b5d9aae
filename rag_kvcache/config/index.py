"""`IndexSettings`: what an index is built with and records, as JSON: the model, the embedder, the chunk
size, what each chunk's cache is computed behind, the dtype and the codec. A process that opens an index reads it
with these, whatever its own defaults; another value of any of them is another index."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Literal

from ..errors import ConfigError
from .defaults import (
    CHUNK_PREFILLS,
    CODEC_NAMES,
    DEFAULT_EMBEDDER,
    DEFAULT_MODEL,
    DEFAULT_SYSTEM_PROMPT,
    DTYPE_NAMES,
    ChunkPrefill,
    CodecName,
    DType,
    at_least,
    one_of,
    setting,
)


@dataclass(frozen=True)
class IndexSettings:
    """What an index is built with and records (as JSON, `to_json`): chunks, vectors and caches are made
    with these, so a process that opens the index reads it with them, whatever its own defaults
    (`KVIndex.config_of`). Another value of any of them is another index."""

    model: str = setting(
        DEFAULT_MODEL, "The LLM: SmolLM2-135M-Instruct, a Hugging Face id, a local directory or a .gguf file."
    )
    embedder: str = setting(
        DEFAULT_EMBEDDER,
        "sentence-transformers model that embeds the chunks and questions. It reads at most its max_seq_length "
        "tokens of a text (all-MiniLM-L6-v2, the default: 256 word pieces, about half a 512-token chunk): a longer "
        "chunk is embedded whole, as overlapping windows under that limit, and scores as its best window; a longer "
        "question is cut at it. Indexing logs the limit of another embedder whose chunks exceed it.",
    )
    chunk_tokens: int = setting(512, "Chunk size in LLM tokens (typically 128 or 512).")
    index_type: Literal["flat", "hnsw"] = "flat"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    chunk_prefill: ChunkPrefill = setting(
        "cached_neighbours",
        "What each chunk's cache is computed behind: the system prefix (behind_prefix), nothing (isolated), or also "
        "the chunks most similar to it. cached_neighbours, the default: two caches a chunk, one behind the prefix "
        "and one behind its context_chunks most similar chunks' cached K/V (stored averaged with the first), made "
        "by a second pass over the chunks' own tokens: about 2.3x grouped's indexing time and twice its disk, for "
        "the most facts kept (README, Methods). grouped: similar chunks prefilled together as one sequence of "
        "1 + context_chunks, each chunk's one cache behind those before it in its group, about one forward over the "
        "corpus. neighbours: 1 + context_chunks caches a chunk behind the neighbours' recomputed text (~9x the "
        "indexing work).",
    )
    context_chunks: int = setting(
        3,
        "chunk_prefill=neighbours: a chunk's caches are computed behind its 1, 2, ... this many most similar "
        "chunks; a chunk with r chunks before it in a prompt reads the one behind min(r, this). "
        "chunk_prefill=cached_neighbours: its one neighbour cache is behind this many. "
        "chunk_prefill=grouped: a group holds a chunk and up to this many of its most similar chunks.",
    )
    dtype: DType = setting(
        "float32",
        "Dtype of the model and its KV caches. An index records the one it was built with and is read "
        "with it unless told otherwise; another dtype misses every cached chunk.",
    )
    codec: CodecName = setting(
        "int8k-int4v",
        "How KV caches are stored on disk: int8 keys with 4-bit values (int8k-int4v, the default: 0.20-0.21x "
        "the bytes of float32; the values of a cache at a sequence's start stay at 8 bits), int8 with "
        "per-channel scales (int8-channel: 0.26x; its caches' answers match float32 caches' within noise), "
        "int8 with per-token scales, fp8, or as computed (none: the only lossless one, with which `prefix` "
        "and the first chunk are bit-exact). docs/indexing-and-storage.md (Codecs) gives what each costs.",
    )

    def __post_init__(self) -> None:
        at_least(self, chunk_tokens=16, context_chunks=1)
        one_of(self, index_type=("flat", "hnsw"), chunk_prefill=CHUNK_PREFILLS, dtype=DTYPE_NAMES, codec=CODEC_NAMES)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> IndexSettings:
        """Settings `to_json` wrote (a field a later release added takes its default); raises ConfigError
        naming a key this release does not know, or for a value that is not a JSON object."""
        values = json.loads(text)
        if not isinstance(values, dict):
            raise ConfigError(f"index settings must be a JSON object, got {text[:60]!r}")
        if unknown := values.keys() - {f.name for f in fields(cls)}:
            raise ConfigError(f"index settings hold keys this release does not know: {sorted(unknown)!r}")
        return cls(**values)
