"""Where a process runs and what it may spend, never recorded by an index (two processes may open one index
with different ones): `RuntimeConfig` (device, cache folder, Ray, limits on what is read) with its `StorageConfig`
(the memory, disk and shared remote tiers the chunk caches live in, and how they are read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import ConfigError
from .defaults import (
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_FILE_BYTES,
    EMBEDDER_DTYPES,
    EmbedderDType,
    Eviction,
    at_least,
    one_of,
    setting,
)


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
        at_least(self, memory_bytes=0, disk_bytes=1, prefetch_layers=0, request_bytes=0, conversation_bytes=0)
        one_of(self, eviction=("lru", "lfu"))
        if not 0.0 <= self.quality_floor <= 1.0:
            raise ConfigError(f"quality_floor must be in [0, 1], got {self.quality_floor!r}")
        if self.remote is not None and urlsplit(self.remote).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"remote must be a redis://, rediss:// or unix:// URL, got {self.remote!r}")
        if self.remote_secret is not None and len(self.remote_secret) < 16:
            raise ConfigError(f"remote_secret must be at least 16 bytes, got {len(self.remote_secret)}")
        if self.remote_timeout <= 0 or self.remote_retry < 0:
            raise ConfigError(
                f"remote_timeout must be > 0 and remote_retry >= 0, got {self.remote_timeout!r} and {self.remote_retry!r}"
            )


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
        "at a count known beforehand) run as one captured CUDA graph per bucket of sizes; this many are kept "
        "(least recently used dropped; 0: every layer op by op). Each holds its layers' K/V for its largest prompt "
        "in GPU memory (300 MB for an 8B model's 2,300-token prompt).",
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
        at_least(self, max_file_bytes=1, max_documents=1, cuda_graphs=0, ray_workers=0)
        one_of(self, embedder_dtype=EMBEDDER_DTYPES)
