"""Content-addressed store of per-chunk KV caches on disk (safetensors, one tensor per layer).

An entry's key hashes everything that decides its contents: the model fingerprint, how chunks are
prefilled (the cache namespace), the tokens before the chunk when it was computed (its context),
and the chunk's own token ids. A different model or setting is therefore a miss, never a wrong
hit. Writes are atomic (temp file + rename); every tensor carries an xxh3 checksum that is
verified on read, and a corrupt or unreadable entry is dropped, reported and treated as a miss.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

FORMAT = "rag-kvcache-kv-v1"


@dataclass(frozen=True)
class ChunkKV:
    """One chunk's cache: per-layer keys/values [H_kv, T, D], computed at positions position..position+T-1."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    position: int

    @property
    def n_tokens(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


def cache_key(namespace: str, context_ids: Sequence[int], ids: Sequence[int]) -> str:
    """Content address of a chunk cache: namespace + the tokens before it + its own tokens."""
    h = xxhash.xxh3_128()
    h.update(namespace.encode())
    h.update(np.asarray(context_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def _checksum(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())


class KVStore:
    """A directory of `<key[:2]>/<key>.safetensors` files."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, kv: ChunkKV) -> None:
        tensors = {}
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            tensors[f"k.{layer}"] = k.detach().to("cpu").contiguous()
            tensors[f"v.{layer}"] = v.detach().to("cpu").contiguous()
        meta = {name: _checksum(t) for name, t in tensors.items()}
        meta |= {"format": FORMAT, "position": str(kv.position), "layers": str(len(kv.keys))}
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get(self, key: str, device: torch.device | str = "cpu") -> ChunkKV | None:
        """The entry, or None when it is missing or fails its integrity check (then it is removed)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return self._read(path, device)
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            log.warning("dropping corrupt KV cache entry %s: %s", path, err)
            path.unlink(missing_ok=True)
            return None

    def _read(self, path: Path, device: torch.device | str) -> ChunkKV:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format marker {meta.get('format')!r}, expected {FORMAT!r}")
            n_layers = int(meta["layers"])
            keys, values = [], []
            for layer in range(n_layers):
                for name, out in ((f"k.{layer}", keys), (f"v.{layer}", values)):
                    t = f.get_tensor(name)  # [H_kv, T, D]
                    if _checksum(t) != meta[name]:
                        raise ValueError(f"checksum mismatch in tensor {name}")
                    out.append(t.to(device))
        return ChunkKV(keys, values, int(meta["position"]))
