"""Content-addressed, tiered store of per-chunk KV caches: a memory tier over a disk tier, over a
remote tier shared by every process and machine (`StorageConfig.remote`: Redis or Valkey) if set.

An entry's key hashes everything that decides its contents: the model fingerprint, how chunks are
prefilled (the cache namespace), the tokens before the chunk when it was computed (its context),
and the chunk's own token ids. A different model or setting is therefore a miss, never a wrong
hit. `put` encodes an entry once and writes it to disk and to the remote tier (`write` takes one
encoded already); `open` returns a `LayerSource` whose layers are read one at a time (from memory,
or from the first backend holding it, verified); an entry read whole from a backend is promoted to
the memory tier.

Counters (hits, misses, bytes read and written, evictions, corrupt entries) are kept per tier in
process and added to `stats.json` in the store folder by `flush_stats` (under a file lock, so
concurrent processes lose no counts); `stats()` reports the persisted totals plus this process's.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterable

import torch
from filelock import FileLock

from ..config import StorageConfig
from ..engine.cache import ChunkKV, LayerSource
from .backend import Backend, CorruptEntryError, TierStats, encode_entry
from .codecs import get_codec
from .tiers import DiskTier, MemoryTier

log = logging.getLogger(__name__)

__all__ = ["ChunkKV", "KVStore"]

_STATS_FILE = "stats.json"


class KVStore:
    """Chunk caches under `root`: `<key[:2]>/<key>.safetensors`, with a memory tier in front (in host
    memory, or on the model's device) and a remote tier behind."""

    def __init__(
        self, root: Path, codec: str, config: StorageConfig = StorageConfig(), device: torch.device | str = "cpu"
    ) -> None:
        """Entries encoded by `codec` (a name in `store.codecs.CODECS`: the index's `IndexSettings.codec`);
        `device` is the model's: where the memory tier keeps its caches when `config.memory_on_device`; else in
        host memory, pinned when the model is on a GPU."""
        self.root = Path(root)
        self.config = config
        self.codec = get_codec(codec)
        gpu = torch.device(device).type == "cuda"
        self.memory = MemoryTier(
            config.memory_bytes,
            config.eviction,
            device if config.memory_on_device else "cpu",
            pinned=gpu and not config.memory_on_device,
        )
        promote = self.memory.put if config.memory_bytes > 0 else None
        self.disk = DiskTier(self.root, self.codec, config.disk_bytes, on_loaded=promote)
        self.ledger = self.disk.ledger  # the disk tier's budget and popularity, shared by every process
        self.remote = _remote_tier(config, codec, promote) if config.remote is not None else None
        self.backends: list[Backend] = [self.disk] + ([self.remote] if self.remote is not None else [])

    @property
    def budget(self) -> int | None:
        """The disk tier's byte budget, the index's (`store.ledger`); None: unbounded."""
        return None if self.ledger is None else self.ledger.budget

    def path(self, key: str) -> Path:
        return self.disk.path(key)

    def __contains__(self, key: str) -> bool:
        return any(key in backend for backend in self.backends)

    def missing(self, keys: Iterable[str]) -> set[str]:
        """Those of `keys` that indexing must compute: none of the backends vouches for them (`Backend.trusted`:
        this index's disk for what it holds; the remote tier only for entries it read and verified with the
        cluster's secret, never for a bare key there). Each backend is asked once, for what those before it lack."""
        todo = set(keys)
        for backend in self.backends:
            if todo:
                todo -= backend.trusted(todo)
        return todo

    def trust(self) -> str:
        """What this store takes for computed and where it writes, in a sentence (`index` and `serve` log it)."""
        own = f"KV caches: trusting the index's own disk {self.root}"
        if self.config.remote is None:
            return own
        where = self.config.remote_address
        if self.config.remote_secret is not None:
            return f"{own}, and entries of the shared tier {where} that verify with the cluster's secret (HMAC); writing both"
        access = (
            "written too (--kv-remote-writable: its writers are trusted)"
            if self.config.remote_writable
            else "read-only (--kv-remote-writable to write it)"
        )
        return (
            f"{own}; the shared tier {where} has no secret (RAG_KVCACHE_KV_REMOTE_SECRET): its entries never count "
            f"as computed, are read with their shape checked, and the tier is {access}"
        )

    def put(self, key: str, kv: ChunkKV) -> bool:
        """Write `kv` to every backend, atomically in each (the remote tier keeps an entry another process
        stored first, and skips the write when its server does not answer); the disk tier only if its budget
        admits it (`store.ledger`). True when the disk holds it now. Raises `StorageFullError`.
        The memory tier is a read cache: entries enter it when read whole, so indexing does not churn it."""
        return self.write(key, encode_entry(kv, self.codec), kv.n_tokens)

    def write(self, key: str, data: bytearray, cost: float | None = None) -> bool:
        """Write an entry `encode_entry` made with this store's codec to every backend, as `put` does; `cost`
        is what recomputing it costs, in tokens (its priority for the disk budget)."""
        stored = self.disk.write(key, data, cost) > 0
        for backend in self.backends[1:]:
            backend.write(key, data)
        return stored

    def open(self, key: str, promote: bool = True) -> LayerSource | None:
        """The entry, layers read on demand, or None when missing or corrupt in every tier (a corrupt
        entry is removed). Read whole from a backend, it enters the memory tier unless `promote` is False."""
        kv = self.memory.get(key)
        if kv is not None:
            return kv
        for backend in self.backends:
            if (entry := backend.open(key)) is not None:
                if not promote:
                    entry.on_loaded = None
                return entry
        return None

    def get(self, key: str, device: torch.device | str = "cpu") -> ChunkKV | None:
        """The whole entry, or None when missing or corrupt (then it is removed)."""
        source = self.open(key)
        if source is None:
            return None
        try:
            layers = [source.layer(i) for i in range(source.n_layers)]
        except CorruptEntryError:
            return None
        return ChunkKV([k.to(device) for k, _ in layers], [v.to(device) for _, v in layers], source.position)

    def load(self, key: str) -> bool:
        """Read the entry whole into the memory tier from the first backend holding it, unless it is there
        already or there is no memory tier; True when it was read now. A missing or corrupt entry is left as
        it is (its reader recomputes it)."""
        return self.config.memory_bytes > 0 and key not in self.memory and self.get(key) is not None

    def discard(self, key: str) -> None:
        """Forget an entry in every tier."""
        self.memory.remove(key)
        for backend in self.backends:
            backend.remove(key)

    # ---- counters -----------------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        """Per tier: the persisted counters plus those of this process not yet flushed (a tier this
        store does not open now, such as a remote tier other runs used, with its persisted counters)."""
        saved, tiers = self._read_stats(), self._tiers()
        return {
            name: saved.get(name, TierStats()) + tiers[name].stats if name in tiers else saved[name]
            for name in {**tiers, **saved}
        }

    def flush_stats(self) -> None:
        """Add this process's counters to `stats.json` and reset them."""
        with FileLock(self.root / f".{_STATS_FILE}.lock"):
            saved = self._read_stats()
            totals = saved | {
                name: saved.get(name, TierStats()) + tier.take_stats() for name, tier in self._tiers().items()
            }
            tmp = self.root / f".{_STATS_FILE}.{os.getpid()}"
            try:
                tmp.write_text(json.dumps({name: s.as_dict() for name, s in totals.items()}, indent=1))
                os.replace(tmp, self.root / _STATS_FILE)
            finally:  # a failed write (a full disk) leaves no partial file behind
                tmp.unlink(missing_ok=True)

    def _tiers(self) -> dict[str, MemoryTier | Backend]:
        return {"memory": self.memory, "disk": self.disk} | ({"remote": self.remote} if self.remote is not None else {})

    def _read_stats(self) -> dict[str, TierStats]:
        path = self.root / _STATS_FILE
        if not path.is_file():
            return {}
        try:
            return {name: TierStats(**counts) for name, counts in json.loads(path.read_text()).items()}
        except (ValueError, TypeError) as err:
            log.warning("ignoring unreadable store counters %s: %s", path, err)
            return {}


def _remote_tier(config: StorageConfig, codec: str, on_loaded: Callable[[str, ChunkKV], None] | None) -> Backend:
    """The remote tier `config.remote` names (redis-py is an optional dependency)."""
    try:
        from .redis_tier import RedisTier
    except ImportError as err:
        raise ValueError(
            f"a remote KV tier (StorageConfig.remote) needs redis-py: pip install 'rag-kvcache[redis]' ({err})"
        ) from err
    return RedisTier(config, codec, on_loaded)
