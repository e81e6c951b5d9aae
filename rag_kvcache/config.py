"""The one configuration object, passed explicitly everywhere (no globals, no environment), made of
its settings by lifetime: what an index records (`IndexSettings`), how a question is answered unless its
request says otherwise (`QueryConfig`), and where a process runs (`RuntimeConfig`).

Each setting a user may choose carries its help text in its field's metadata (`setting`); the CLI
builds its options, defaults and help from these fields, so a default changed here changes the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args
from urllib.parse import urlsplit

from .errors import ConfigError

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


T = TypeVar("T")


def setting(default: Any, help: str) -> Any:
    """A dataclass field with a default and the help text the CLI shows for it."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class FusionConfig:
    """How retrieved chunk caches are fused into one prompt cache.

    `ratio`, `check_layer`, `deviation` are CacheBlend's knobs (paper defaults: 15%, layer 1, K);
    `filter_steps` > 1 enables the paper's gradual filtering (§4.3): the kept fraction shrinks
    linearly from `min(1, 2 * ratio)` at the check layer to `ratio` over that many layers.
    `epic_k` is EPIC LegoLink's number of recomputed leading tokens per chunk (paper default 16); unset, an
    `EPIC_SHARE`-th of the index's chunk size (`for_chunks`, before fusing): 16 at 128-token chunks, 64 at 512.
    `ratio="auto"` asks the loading controller; `store.controller.resolve_ratio` turns it into a
    number before fusing.
    """

    method: str = setting(
        "epic_match", f"Fusion method: a name registered in rag_kvcache.METHODS (built in: {BUILTIN_METHODS})."
    )
    ratio: float | Literal["auto"] = setting(
        0.15,
        "CacheBlend recompute ratio in [0, 1], or 'auto': the loading controller's choice "
        "(needs `rag-kvcache calibrate`).",
    )
    check_layer: int = setting(1, "CacheBlend check layer.")
    filter_steps: int = setting(
        1, "CacheBlend gradual filtering: narrow the selection to the ratio over this many layers."
    )
    deviation: Deviation = setting("k", "CacheBlend: select the tokens whose K (or V) deviates most from the cache.")
    epic_k: int | None = setting(
        None,
        "EPIC: recomputed leading tokens per chunk; unset: an eighth of the index's chunk size (16 at 128-token "
        "chunks, 64 at 512), the same share of every chunk at any chunk size.",
    )
    match_words: int = setting(
        3, "epic_match: a sentence echoes the question when it shares this many distinct words with it."
    )
    repick_layers: tuple[int, ...] = setting(
        (4, 10),
        "cacheblend_repick: layers after the check layer where the HKVD tokens are picked again, fewer each time.",
    )
    repick_decay: float = setting(
        0.5, "cacheblend_repick: each re-pick keeps this fraction of the tokens kept before it."
    )
    template_text: bool = setting(
        False,
        "Read a prompt template's recurring text after the chunks (learned from the prompts) from a cache, as an "
        "inexact chunk's: faster, at a measured fidelity cost (CacheBlend TF KL +15% in LlamaIndex's layout); off: it "
        "is computed.",
    )

    def __post_init__(self) -> None:
        if self.ratio != "auto" and (isinstance(self.ratio, str) or not 0.0 <= self.ratio <= 1.0):
            raise ConfigError(f"ratio must be in [0, 1] or 'auto', got {self.ratio!r}")
        if self.check_layer < 0:
            raise ConfigError(f"check_layer must be >= 0, got {self.check_layer!r}")
        if self.filter_steps < 1:
            raise ConfigError(f"filter_steps must be >= 1, got {self.filter_steps!r}")
        if self.deviation not in ("k", "v"):
            raise ConfigError(f"deviation must be 'k' or 'v', got {self.deviation!r}")
        if self.epic_k is not None and self.epic_k < 0:
            raise ConfigError(f"epic_k must be >= 0, got {self.epic_k!r}")
        if self.match_words < 1:
            raise ConfigError(f"match_words must be >= 1, got {self.match_words!r}")
        if not 0.0 < self.repick_decay <= 1.0:
            raise ConfigError(f"repick_decay must be in (0, 1], got {self.repick_decay!r}")

    def check_model(self, n_layers: int, chunk_tokens: int) -> FusionConfig:
        """This config, if its parameters fit a model of `n_layers` layers and an index of `chunk_tokens`-token
        chunks (`check_layer` and the layers `filter_steps` reach below `n_layers`, `epic_k` at most a chunk);
        else a ConfigError naming the parameter and its value (they were once accepted silently)."""
        if self.check_layer >= n_layers:
            raise ConfigError(
                f"check_layer must be below the model's {n_layers} layers (0..{n_layers - 1}), got {self.check_layer!r}"
            )
        if self.check_layer + self.filter_steps > n_layers:
            raise ConfigError(
                f"filter_steps must be at most {n_layers - self.check_layer} (the model's {n_layers} layers from "
                f"check_layer {self.check_layer} on), got {self.filter_steps!r}"
            )
        if self.epic_k is not None and self.epic_k > chunk_tokens:
            raise ConfigError(
                f"epic_k must be at most the index's chunk size ({chunk_tokens} tokens), got {self.epic_k!r}"
            )
        return self

    def for_chunks(self, chunk_tokens: int) -> FusionConfig:
        """This config with `epic_k` set for an index of `chunk_tokens`-token chunks: as given, else an
        `EPIC_SHARE`-th of the chunk size (EPIC's 16 heads are that share of a 128-token chunk)."""
        return self if self.epic_k is not None else replace(self, epic_k=max(1, chunk_tokens // EPIC_SHARE))


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding after the fused prefill: sampled at a `temperature` of `GREEDY_BELOW` or more, greedy below
    (logits divided by a smaller one overflow float32; vLLM draws the same line)."""

    max_new_tokens: int = setting(64, "Most tokens to generate.")
    temperature: float = setting(0.0, "Sampling temperature; 0 (or below 1e-5) decodes greedily, above samples.")
    top_p: float = setting(0.9, "Nucleus sampling: sample from the smallest set of tokens holding this probability.")
    seed: int | None = setting(None, "Seed for sampling (none: a fresh random seed).")
    stop: tuple[str, ...] = setting((), "Stop string: generation ends before it (repeatable).")
    json_schema: str | None = setting(
        None,
        "A JSON Schema (as JSON text): the answer is decoded constrained to JSON that matches it "
        "(needs rag-kvcache[structured]).",
    )
    draft_tokens: int = setting(
        2,
        "Prompt lookup (speculative decoding): a step decoding one answer alone also feeds up to this many tokens "
        "that followed the answer's last tokens where they occur earlier in the prompt or answer, and keeps those "
        "the model would have decoded itself, so an answer that quotes its documents takes fewer steps. Greedy, "
        "unconstrained decoding only (else ignored): the answer is the one decoding a token a step gives. 0: off.",
    )

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.draft_tokens < 0:
            raise ConfigError(f"draft_tokens must be >= 0 (0: no drafting), got {self.draft_tokens!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < FLOAT32_TINY:
            raise ConfigError(
                f"top_p must be at least {FLOAT32_TINY:.3g} (probabilities are float32; a smaller one rounds to 0), "
                f"got {self.top_p!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def with_options(
        self,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        json_schema: str | None = None,
    ) -> GenerationConfig:
        """These settings with a caller's per-request options (a framework's `max_tokens`, `temperature`,
        ...) put over them; None keeps the setting."""
        given = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": None if stop is None else tuple(stop),
            "json_schema": json_schema,
        }
        return replace(self, **{name: value for name, value in given.items() if value is not None})


@dataclass(frozen=True)
class StorageConfig:
    """Where chunk caches live and how they are read at query time.

    A memory tier (`memory_bytes`, 0 disables it; in host memory, or on the model's device with
    `memory_on_device`; evicting by `eviction`, least recently or least frequently used) sits over the disk
    tier, whose byte budget `disk_bytes` is the index's (`store.ledger`: recorded, shared by every process,
    popularity- and cost-aware; None keeps the recorded one).
    How entries are encoded is the index's (`IndexSettings.codec`). `prefetch_layers` is how many layers the
    background reader may run ahead of the fusion (0: each layer is read when the fusion needs it, no overlap;
    on a CPU, a prompt whose caches are all in the memory tier is assembled at once, without a reader).
    `quality_floor` is the smallest recompute ratio the loading controller will pick.
    `remote` adds a tier shared by every process and machine that opens the index, below memory and
    disk: a Redis or Valkey server (`store.redis_tier`). A request to it that takes longer than
    `remote_timeout` seconds, or fails, counts as a miss; after a failure the tier is skipped for
    `remote_retry` seconds. With `remote_secret` (a key every process of the cluster shares: the CLI reads
    it from `RAG_KVCACHE_KV_REMOTE_SECRET`, never from its arguments) each remote entry carries an
    HMAC-SHA256 over its key and bytes, and an entry that does not verify (forged by another writer,
    moved from another key, or written without the secret) is dropped and recomputed. Without one, an entry
    there proves only that someone who can write to the server stored it: indexing computes every cache not
    on its own disk, and the tier is read-only (this process writes and deletes nothing there) unless
    `remote_writable`. `conversation_bytes` bounds the conversation cache of the engines that
    serve chats (`serving.engine.ServingEngine`: the server and the integrations), which keeps answered
    prompts' K/V for the turns that continue them (`store.conversations`).
    """

    memory_bytes: int = setting(
        256 << 20,
        "Memory for the chunk caches read most recently, decoded: a prompt whose caches are all there reads no "
        "disk (0: none kept).",
    )
    memory_on_device: bool = setting(
        False,
        "Keep the memory tier's caches on the model's device (a GPU's memory; memory_bytes is then spent there): "
        "a query reads them in place, with no host-to-device copy per layer. Else in host memory, pinned when the "
        "model is on a GPU (read by DMA). On a CPU it changes nothing.",
    )
    disk_bytes: int | None = setting(
        None,
        "Byte budget of the chunk caches on disk (e.g. 20GB, 512MiB), recorded by the index: every process that "
        "opens it keeps to it, popular and costly caches kept first (GDSF), indexing stops at it, a chunk without "
        "a cache is computed when a question needs it. Not given: the index's recorded budget (none: unbounded).",
    )
    eviction: Eviction = "lru"
    prefetch_layers: int = 2
    quality_floor: float = 0.15
    remote: str | None = setting(
        None,
        "Shared KV tier on a Redis or Valkey server, redis://[user:password@]host:port/db (rediss:// for "
        "TLS, unix:///path.sock): every process that opens the index reads the same entries there, and writes them "
        "with a shared secret (RAG_KVCACHE_KV_REMOTE_SECRET) or --kv-remote-writable.",
    )
    remote_timeout: float = 5.0
    remote_retry: float = 30.0
    remote_secret: bytes | None = field(default=None, repr=False)  # authenticates the remote tier's entries (HMAC)
    remote_writable: bool = setting(
        False,
        "Without a shared secret (RAG_KVCACHE_KV_REMOTE_SECRET), write and delete entries in the shared KV tier "
        "(--kv-remote) all the same, trusting whoever else can write to the server (its ACLs and TLS are then the "
        "whole boundary). Unset, a tier without a secret is only read. With a secret the tier is always written.",
    )
    request_bytes: int = setting(
        256 << 20,
        "Memory per API key for the caches of request text (a prompt head: a pipeline's instructions "
        "before its first chunk, and the chunk behind it), least recently used evicted first; never written to disk.",
    )
    conversation_bytes: int = setting(
        512 << 20,
        "Memory per API key for the K/V of fused prompts and their answers, so that a chat's next turn computes "
        "only its new tokens (a radix tree by token ids per API key; a key's least recently used evicted first, "
        "never another key's; 0: keep none).",
    )

    @property
    def remote_address(self) -> str | None:
        """`remote` without its user and password (for messages and for what an index records)."""
        if self.remote is None:
            return None
        url = urlsplit(self.remote)
        return f"{url.scheme}://{url.hostname or ''}{f':{url.port}' if url.port else ''}{url.path}"

    @property
    def remote_writes(self) -> bool:
        """Whether this process writes and deletes entries in the remote tier: with `remote_secret` (its entries
        are authenticated), or when `remote_writable` says so."""
        return self.remote_secret is not None or self.remote_writable

    def __post_init__(self) -> None:
        if self.memory_bytes < 0:
            raise ConfigError(f"memory_bytes must be >= 0, got {self.memory_bytes!r}")
        if self.disk_bytes is not None and self.disk_bytes < 1:
            raise ConfigError(f"disk_bytes must be >= 1 or None, got {self.disk_bytes!r}")
        if self.eviction not in ("lru", "lfu"):
            raise ConfigError(f"eviction must be 'lru' or 'lfu', got {self.eviction!r}")
        if self.prefetch_layers < 0:
            raise ConfigError(f"prefetch_layers must be >= 0, got {self.prefetch_layers!r}")
        if not 0.0 <= self.quality_floor <= 1.0:
            raise ConfigError(f"quality_floor must be in [0, 1], got {self.quality_floor!r}")
        if self.remote is not None and urlsplit(self.remote).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"remote must be a redis://, rediss:// or unix:// URL, got {self.remote!r}")
        if self.remote_secret is not None and len(self.remote_secret) < 16:
            raise ConfigError(f"remote_secret must be at least 16 bytes, got {len(self.remote_secret)}")
        if self.request_bytes < 0:
            raise ConfigError(f"request_bytes must be >= 0 (0: keep none), got {self.request_bytes!r}")
        if self.conversation_bytes < 0:
            raise ConfigError(f"conversation_bytes must be >= 0 (0: keep none), got {self.conversation_bytes!r}")
        if self.remote_timeout <= 0 or self.remote_retry < 0:
            raise ConfigError(
                f"remote_timeout must be > 0 and remote_retry >= 0, got {self.remote_timeout!r} and {self.remote_retry!r}"
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
        if self.chunk_tokens < 16:
            raise ConfigError(f"chunk_tokens must be >= 16, got {self.chunk_tokens!r}")
        if self.index_type not in ("flat", "hnsw"):
            raise ConfigError(f"index_type must be 'flat' or 'hnsw', got {self.index_type!r}")
        if self.chunk_prefill not in CHUNK_PREFILLS:
            raise ConfigError(f"chunk_prefill must be one of {', '.join(CHUNK_PREFILLS)}, got {self.chunk_prefill!r}")
        if self.context_chunks < 1:
            raise ConfigError(f"context_chunks must be >= 1, got {self.context_chunks!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.codec not in CODEC_NAMES:
            raise ConfigError(f"codec must be one of {', '.join(CODEC_NAMES)}, got {self.codec!r}")

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


@dataclass(frozen=True)
class QueryConfig:
    """How a question is answered unless its request says otherwise: never recorded by an index."""

    top_k: int = setting(6, "Chunks retrieved per question.")
    chunk_order: ChunkOrder = setting(
        "best_last",
        "Where the retrieved chunks go in the prompt: best_last ends with the best-ranked one, next to the question "
        "(the fused prompt keeps more of a full prefill's answers there: docs/methods.md), best_first in retrieval's "
        "order. Chunks a request names keep the order it names them in.",
    )
    fusion: FusionConfig = field(default_factory=FusionConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k!r}")
        if self.chunk_order not in CHUNK_ORDERS:
            raise ConfigError(f"chunk_order must be one of {', '.join(CHUNK_ORDERS)}, got {self.chunk_order!r}")

    def in_prompt_order(self, ranked: Sequence[T]) -> list[T]:
        """Retrieved chunks, best first, in the order the prompt lays them out (`chunk_order`)."""
        return list(reversed(ranked)) if self.chunk_order == "best_last" else list(ranked)


@dataclass(frozen=True)
class RuntimeConfig:
    """Where this process runs and what it may spend: never recorded by an index (two processes may open
    one index with different ones)."""

    device: str = setting("cpu", "Torch device of the model and the embedder: cpu, cuda, cuda:1, mps.")
    embedder_dtype: EmbedderDType = setting(
        "auto",
        "The dtype the embedder runs in; auto: bfloat16 on a CPU that computes it natively (AMX or AVX512-BF16: about "
        "2.7x faster, the same answer recall on MuSiQue; its vectors differ from float32's, and with the batch a text "
        "is embedded in, by up to ~4e-4 of cosine, which can swap near ties among the retrieved chunks), float32 on "
        "other CPUs (where bfloat16 is slower) and devices.",
    )
    cuda_graphs: int = setting(
        16,
        "On CUDA, the fused prefill's layers with a fixed active set (CacheBlend's: every layer, its selection "
        "at a count known beforehand) run as one captured CUDA graph per bucket of sizes; this many are kept (least recently used dropped; 0: every layer op by op). Each holds "
        "its layers' K/V for its largest prompt in GPU memory (300 MB for an 8B model's 2,300-token prompt).",
    )
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "rag-kvcache")
    ray: str | None = setting(
        None,
        "Compute the KV caches on a Ray cluster (needs rag-kvcache[ray]): its address (auto, ray://host:10001), "
        "or local to start one on this machine.",
    )
    ray_workers: int = setting(0, "Ray actors computing KV caches, each with a loaded model (0: one per free CPU).")
    max_file_bytes: int = setting(
        DEFAULT_MAX_FILE_BYTES, "Largest document file indexed, in bytes; larger files are skipped with a warning."
    )
    max_documents: int = setting(
        DEFAULT_MAX_DOCUMENTS, "Most files one index run reads; a folder with more is refused before any is read."
    )
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        if self.max_file_bytes < 1:
            raise ConfigError(f"max_file_bytes must be >= 1, got {self.max_file_bytes!r}")
        if self.max_documents < 1:
            raise ConfigError(f"max_documents must be >= 1, got {self.max_documents!r}")
        if self.embedder_dtype not in EMBEDDER_DTYPES:
            raise ConfigError(
                f"embedder_dtype must be one of {', '.join(EMBEDDER_DTYPES)}, got {self.embedder_dtype!r}"
            )
        if self.cuda_graphs < 0:
            raise ConfigError(f"cuda_graphs must be >= 0 (0: none), got {self.cuda_graphs!r}")
        if self.ray_workers < 0:
            raise ConfigError(f"ray_workers must be >= 0 (0: one per free CPU), got {self.ray_workers!r}")


@dataclass(frozen=True)
class Config:
    """Everything that decides what is indexed, cached and generated, by lifetime: what an index records
    (`index`), how questions are answered by default (`query`), where this process runs (`runtime`)."""

    index: IndexSettings = field(default_factory=IndexSettings)
    query: QueryConfig = field(default_factory=QueryConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def with_index(self, **changes: object) -> Config:
        return replace(self, index=replace(self.index, **changes))

    def with_query(self, **changes: object) -> Config:
        return replace(self, query=replace(self.query, **changes))

    def with_runtime(self, **changes: object) -> Config:
        return replace(self, runtime=replace(self.runtime, **changes))

    def with_fusion(self, **changes: object) -> Config:
        return self.with_query(fusion=replace(self.query.fusion, **changes))

    def with_generation(self, **changes: object) -> Config:
        return self.with_query(generation=replace(self.query.generation, **changes))

    def with_storage(self, **changes: object) -> Config:
        return self.with_runtime(storage=replace(self.runtime.storage, **changes))

    def placed(self, device: str | None, dtype: str | None) -> Config:
        """This config with the model on `device` in `dtype`, each kept as it is when None (an index is read
        in the dtype it records unless told otherwise)."""
        config = self if device is None else self.with_runtime(device=device)
        return config if dtype is None else config.with_index(dtype=dtype)
