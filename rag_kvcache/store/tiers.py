"""Storage tiers for chunk caches: a memory tier (decoded tensors, LRU/LFU by bytes) over a disk tier
(one file per chunk in the store's format, `backend.encode_entry`: one tensor per layer and K/V, so a
layer is read without touching the others).

Disk files are written whole to a temporary name, fsynced and renamed over, so a reader sees an
old entry or a new one, never a torn one; a reader holding an entry keeps its inode when a writer
replaces or evicts the file. Integrity is checked by `backend.Entry` (header and per-tensor xxh3
checksums): a failure drops the entry, is logged and raises `CorruptEntryError` so the caller can
recompute it.

A tensor is read with one positional read (`preadv`) of its byte range straight into a fresh
tensor: the syscall releases the GIL, so a background reader overlaps the fusion's compute. (When this
was written, copying out of a memory mapping paid a page fault per 4 KiB, 57 MB/s against 3 GB/s for
`preadv` from the page cache; on the same 2-core VM's kernel of 2026-11-23, 24 page-cached entries read
whole and hashed ran at ~8 GB/s through a lazily faulted private mapping and 5-13 GB/s through `preadv`:
the choice no longer rests on that figure.) The files are plain safetensors: `safetensors.safe_open`
reads them too.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sqlite3
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ..config import Eviction
from ..engine.cache import ChunkKV
from ..errors import ConfigError, StorageFullError
from .backend import Backend, Counted
from .codecs import Codec
from .ledger import Ledger, alive

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(rf"^{re.escape(_TMP_PREFIX)}([0-9]+)-[0-9]+-[0-9a-f]+\.safetensors$")  # pid, thread, key


class EvictionPolicy:
    """Sizes and use of a tier's entries; names the victims when the tier is over its byte budget.

    `lru` evicts the least recently used entry first; `lfu` the least often used, the least recent
    among equals. Not thread-safe: the owning tier holds its lock.
    """

    def __init__(self, kind: Eviction) -> None:
        if kind not in ("lru", "lfu"):
            raise ValueError(f"eviction must be 'lru' or 'lfu', got {kind!r}")
        self.kind = kind
        self._entries: OrderedDict[str, list[int]] = OrderedDict()  # key -> [bytes, uses], least recent first
        self.total = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: str, size: int) -> None:
        self.remove(key)
        self._entries[key] = [size, 1]
        self.total += size

    def touch(self, key: str) -> None:
        if key in self._entries:
            self._entries[key][1] += 1
            self._entries.move_to_end(key)

    def remove(self, key: str) -> None:
        if (entry := self._entries.pop(key, None)) is not None:
            self.total -= entry[0]

    def victims(self, budget: int, keep: str | None = None) -> list[str]:
        """Entries to evict, in order, to bring the total to at most `budget` bytes (never `keep`)."""
        excess = self.total - budget
        if excess <= 0:
            return []
        order = list(self._entries)
        if self.kind == "lfu":
            order.sort(key=lambda k: self._entries[k][1])  # stable: least recent first among equals
        out = []
        for key in order:
            if excess <= 0:
                break
            if key != keep:
                out.append(key)
                excess -= self._entries[key][0]
        return out


class MemoryTier(Counted):
    """Decoded chunk caches in process memory, within `budget` bytes, held on `device` (host memory, or a
    GPU's: a cache put here is moved there once, so every later read finds it in place). `pinned`: host memory
    page-locked (`ChunkKV.pinned`), for a model on a GPU, which then reads each layer by DMA."""

    def __init__(
        self, budget: int, eviction: Eviction, device: torch.device | str = "cpu", pinned: bool = False
    ) -> None:
        self.budget = budget
        self.device = torch.device(device)
        if pinned and self.device.type != "cpu":
            raise ConfigError(f"a pinned memory tier holds host memory, not {self.device}")
        self.pinned = pinned
        super().__init__()
        self._policy = EvictionPolicy(eviction)
        self._items: dict[str, ChunkKV] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._policy.total

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._items.get(key)
            if kv is None:
                self.count(misses=1)
                return None
            self._policy.touch(key)
            self.count(hits=1)
            self.count(bytes_read=kv.nbytes)
            return kv

    def put(self, key: str, kv: ChunkKV) -> None:
        if kv.nbytes > self.budget:
            return
        kv = kv.pinned() if self.pinned else kv.to(self.device)
        with self._lock:
            self._items[key] = kv
            self._policy.add(key, kv.nbytes)
            self.count(bytes_written=kv.nbytes)
            for victim in self._policy.victims(self.budget, keep=key):
                self._policy.remove(victim)
                del self._items[victim]
                self.count(evictions=1)

    def remove(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)
            self._policy.remove(key)


class DiskTier(Backend):
    """A directory of `<key[:2]>/<key>.safetensors` files, within the store's byte budget.

    Which entries the directory keeps is its `Ledger` (`ledger.sqlite`, shared by every process that opens
    the store): a write is admitted only if it fits the budget once entries of lower GDSF priority are
    evicted, else it is not stored (`TierStats.refused`). `budget` (bytes) sets the store's budget, recorded
    in the ledger; None keeps the recorded one (none: unbounded). A store this process may not write (a
    read-only mount) has no ledger and is read as it is.
    """

    def __init__(
        self,
        root: Path,
        codec: Codec,
        budget: int | None,
        on_loaded: Callable[[str, ChunkKV], None] | None = None,
    ) -> None:
        self.root = Path(root)
        super().__init__(codec, on_loaded)
        self.ledger: Ledger | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.ledger = Ledger(self.root, self.path, budget)
        except (OSError, sqlite3.OperationalError) as err:
            if budget is not None:
                raise ConfigError(f"cannot keep the KV store {self.root} to a budget of {budget} bytes: {err}") from err
            log.debug("KV store %s is read as it is, without its ledger: %s", self.root, err)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def where(self, key: str) -> str:
        return str(self.path(key))

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def files(self) -> Iterator[Path]:
        return (p for p in self.root.glob("??/*.safetensors") if not p.name.startswith(_TMP_PREFIX))

    def write(self, key: str, data: bytes, cost: float | None = None) -> int:
        """Store `data` under `key` atomically (replacing what was there) if the ledger admits it (`cost`: what
        recomputing it costs, in tokens; default its bytes); returns the bytes written, 0 when not admitted.
        Raises `StorageFullError`."""
        if self.ledger is not None and not self.ledger.reserve(key, len(data), len(data) if cost is None else cost):
            self.count(refused=1)
            return 0
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{key}.safetensors"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if self.ledger is not None:
                self.ledger.abandon(key)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(
                    err.errno,
                    f"no space left on the device of {self.root} while writing a {len(data)}-byte KV cache "
                    "entry: free space, or give the store a disk budget (--kv-budget, StorageConfig.disk_bytes)",
                ) from err
            raise
        if self.ledger is not None:
            self.ledger.landed(key)
        self.count(bytes_written=len(data))
        return len(data)

    def blob(self, key: str) -> FileBlob | None:
        try:
            return FileBlob(self.path(key))
        except FileNotFoundError:
            return None

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
        if self.ledger is not None:
            self.ledger.forget(key)

    def remove_stale_temp_files(self) -> int:
        """Delete temporary files left by writers that died (a `kill -9` mid-write); returns how many."""
        removed = 0
        for tmp in self.root.glob(f"??/{_TMP_PREFIX}*"):
            writer = _TMP_NAME.match(tmp.name)  # a name of our own writers; anything else is not ours to touch
            if writer is not None and not alive(int(writer[1])):
                tmp.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("removed %d temporary file(s) left by interrupted writers in %s", removed, self.root)
        return removed

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget the cached pages of every entry, so the next reads hit the device."""
        for path in self.files():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class FileBlob:
    """An entry's file, open until the blob is dropped, read with positional reads."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb", buffering=0)
        weakref.finalize(self, self._file.close)
        self.size = os.fstat(self._file.fileno()).st_size

    def read(self, offset: int, n: int) -> bytes:
        return os.pread(self._file.fileno(), n, offset)

    def read_into(self, ranges: list[tuple[np.ndarray, int]]) -> list[int]:
        return [os.preadv(self._file.fileno(), [buf], offset) for buf, offset in ranges]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
