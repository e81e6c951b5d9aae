"""The storage backend interface: what a tier below the memory tier is, and the entry format every
such tier stores, so that each one verifies its entries the same way.

A backend holds content-addressed entries: `write` (all-or-nothing, once per key), `blob` (the
stored bytes, read by ranges), `__contains__`, `remove`. Everything else is shared here: `put`
encodes a `ChunkKV` (`encode_entry`), `open` returns an `Entry` whose header is verified at once and
whose layers are read and verified one at a time. A new backend is one module implementing those four
methods (`tiers.DiskTier`: files; `redis_tier.RedisTier`: a Redis or Valkey server).

The format is a safetensors file: one tensor per layer, K/V and codec part (`k.3`, `v.3.scale`), side
by side, so a layer is one byte range, read in one request; its metadata carries an xxh3 checksum of
every tensor, verified when its layer is read, and a checksum of the header itself, verified before
any of its fields is used.
A failure raises `CorruptEntryError`, after the backend has dropped the entry, so the caller can
recompute it; a miss is `None`, never a wrong hit.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import numpy as np
import torch
import xxhash

from ..engine.cache import ChunkKV
from ..engine.interface import KVLayout
from ..errors import RagKVCacheError
from .codecs import Codec, cache_nbytes, entry_codecs, get_codec

log = logging.getLogger(__name__)

FORMAT = "rag-kvcache-kv-v2"  # v2: the header carries a checksum of itself
_HEADER_CHECKSUM = "header_xxh3"
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}
_DTYPE_NAMES = {str(d).removeprefix("torch."): name for name, d in _SAFETENSORS_DTYPES.items()}


class KVStoreError(RagKVCacheError):
    """A problem with a stored cache entry."""


class CorruptEntryError(KVStoreError):
    """An entry could not be read whole and intact (it failed its integrity check, or its backend lost it
    mid-read): recompute it. A corrupt entry has been removed."""


class UnreachableEntryError(CorruptEntryError):
    """The backend holding an entry stopped answering while it was read (nothing was removed)."""


@dataclass
class TierStats:
    """Counters of one tier (since the counters were last persisted, or in total)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0  # requests to a remote tier that failed (server down, refused, timed out)
    refused: int = 0  # writes the disk tier's budget did not admit (`store.ledger`)

    def __add__(self, other: TierStats) -> TierStats:
        return TierStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Counted:
    """A tier's counters, changed and read under their own lock: the fusion's background reader
    counts too."""

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats = TierStats()

    def count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    @property
    def stats(self) -> TierStats:
        """A snapshot of this process's counters."""
        with self._stats_lock:
            return TierStats(**self._stats.as_dict())

    def take_stats(self) -> TierStats:
        """The counters, reset to zero in the same step."""
        with self._stats_lock:
            stats, self._stats = self._stats, TierStats()
        return stats


class Blob(Protocol):
    """The stored bytes of one entry, read by byte ranges."""

    size: int

    def read(self, offset: int, n: int) -> bytes:
        """Up to `n` bytes from `offset` (fewer if the blob is shorter)."""
        ...

    def read_into(self, ranges: list[tuple[np.ndarray, int]]) -> list[int]:
        """Fill each uint8 buffer with the bytes from its offset (one request where the backend can);
        returns how many bytes each got."""
        ...


class Backend(Counted, ABC):
    """A tier of entries in the store's format. `on_loaded(key, kv)` is called when every layer of an
    entry has been read (the store promotes it to the memory tier)."""

    def __init__(self, codec: Codec, on_loaded: Callable[[str, ChunkKV], None] | None = None) -> None:
        super().__init__()
        self.codec = codec
        self.on_loaded = on_loaded

    # ---- what a backend implements ------------------------------------------------------------
    @abstractmethod
    def write(self, key: str, data: bytes) -> int:
        """Store `data` (an encoded entry) under `key`, all or nothing; returns the bytes written."""

    @abstractmethod
    def blob(self, key: str) -> Blob | None:
        """The stored bytes of `key`, or None when it is not stored."""

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...

    @abstractmethod
    def remove(self, key: str) -> None:
        """Delete the entry (nothing if it is not there)."""

    @abstractmethod
    def where(self, key: str) -> str:
        """Where the entry lives, for messages."""

    def opened(self, key: str) -> None:
        """Called when an entry is opened intact (a tier that tracks use refreshes it)."""

    def held(self, keys: Collection[str]) -> set[str]:
        """Those of `keys` stored here (a remote tier asks in one request)."""
        return {key for key in keys if key in self}

    def trusted(self, keys: Collection[str]) -> set[str]:
        """Those of `keys` stored here that may count as computed, so that indexing skips them: a tier only its
        own index writes (the disk) vouches for what it holds; a tier others write (`RedisTier`) only for the
        entries it read and authenticated."""
        return self.held(keys)

    # ---- shared ---------------------------------------------------------------------------------
    def put(self, key: str, kv: ChunkKV) -> int:
        """Encode `kv` with this tier's codec and store it under `key`; returns the bytes written."""
        return self.write(key, encode_entry(kv, self.codec))

    def open(self, key: str) -> Entry | None:
        """The entry with its header checked, or None when missing or corrupt (then it is removed)."""
        try:
            blob = self.blob(key)
            if blob is None:
                self.count(misses=1)
                return None
            entry = Entry(self, key, blob)
        except (OSError, ValueError, KeyError) as err:
            self.drop(key, err)
            self.count(misses=1)
            return None
        self.count(hits=1)
        self.opened(key)
        return entry

    def drop(self, key: str, reason: Exception | str) -> None:
        log.warning("dropping corrupt KV cache entry %s: %s", self.where(key), reason)
        self.count(corrupt=1)
        try:
            self.remove(key)
        except OSError as err:  # e.g. a read-only index: the entry stays, and is a miss again next time
            log.warning("could not remove the corrupt KV cache entry %s: %s", self.where(key), err)


def header_nbytes(codec: Codec, layout: KVLayout, n_tokens: int, position: int) -> int:
    """Bytes an entry of `n_tokens` tokens at `position` takes beyond its payload (`codecs.cache_nbytes`): its
    header, every layer's tensors named, shaped and checksummed (about half a KiB a layer); measured by encoding
    an entry of that size, so it costs one encode."""
    ones = torch.ones(layout.n_kv_heads, n_tokens, layout.head_dim, dtype=layout.dtype)  # [H_kv, T, D]
    entry = encode_entry(ChunkKV([ones] * layout.n_layers, [ones] * layout.n_layers, position), codec)
    return len(entry) - cache_nbytes(codec, layout, [n_tokens], position)


def encode_entry(kv: ChunkKV, codec: Codec) -> bytearray:
    """`kv` in the store's format: a safetensors file with checksummed tensors and a sealed header.

    The file is laid out here rather than by `safetensors.torch.save`, which copies every tensor into
    bytes, then into its output, whose header sealing copied once more: each tensor is now copied once,
    into the one buffer returned (a `bytearray`: file writes and redis-py take it as it is)."""
    tensors: dict[str, torch.Tensor] = {}
    codecs = entry_codecs(codec, kv.position)
    for layer in range(kv.n_layers):
        for kind, tensor_codec, t in zip("kv", codecs, kv.layer(layer)):
            for suffix, part in tensor_codec.encode(t.detach().to("cpu")).items():
                tensors[f"{kind}.{layer}{'.' + suffix if suffix else ''}"] = part.contiguous()
    header: dict = {
        "__metadata__": {name: _checksum(t) for name, t in tensors.items()}
        | {
            "format": FORMAT,
            "position": str(kv.position),
            "layers": str(kv.n_layers),
            "codec": codec.name,
            "dtype": str(kv.keys[0].dtype).removeprefix("torch."),
        }
    }
    starts, end = [], 0
    for name, t in tensors.items():
        header[name] = {
            "dtype": _DTYPE_NAMES[str(t.dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            "data_offsets": [end, end + t.nbytes],
        }
        starts.append(end)
        end += t.nbytes
    header["__metadata__"][_HEADER_CHECKSUM] = _header_checksum(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    out = bytearray(8 + len(raw) + end)
    out[: 8 + len(raw)] = struct.pack("<Q", len(raw)) + raw
    data = np.frombuffer(out, dtype=np.uint8, offset=8 + len(raw))  # [bytes of every tensor]
    for start, t in zip(starts, tensors.values()):
        data[start : start + t.nbytes] = t.view(-1).view(torch.uint8).numpy()
    return out


class Entry:
    """An opened entry: header checked; layers read and verified on demand. It reads through its blob
    (a disk tier's keeps the file open, so a writer replacing or evicting it does not disturb this
    reader)."""

    def __init__(self, tier: Backend, key: str, blob: Blob) -> None:
        self._tier, self.key, self._blob = tier, key, blob
        self._parse_header()
        self.on_loaded = tier.on_loaded  # where the whole entry goes once every layer is read; None: nowhere
        self._loaded: set[int] = set()  # the layers read, with a tier to hand the whole entry to (`on_loaded`)
        self._whole: torch.Tensor | None = None  # [L, 2, H_kv, T, D], those layers decoded

    def _parse_header(self) -> None:
        """Read and verify the header: its own checksum first (so no field of it, position, dtype or a
        tensor's shape, is used unverified), then its shape against the blob. Any malformation is a
        `ValueError`, which makes the entry a corrupt miss (recomputed), never a crash."""
        size = self._blob.size
        if size < 8:
            raise ValueError(f"{size}-byte entry is too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", self._blob.read(0, 8))
        if 8 + header_len > size:
            raise ValueError(f"header of {header_len} bytes in a {size}-byte entry (truncated)")
        header = _verified_header(self._blob.read(8, header_len))
        try:
            self._meta: dict[str, str] = header.pop("__metadata__")
            self._tensors: dict[str, dict] = header
            self._base = 8 + header_len
            end = max(t["data_offsets"][1] for t in header.values())
            if self._base + end != size:
                raise ValueError(f"{size}-byte entry, header describes {self._base + end} bytes (truncated)")
            self.position = int(self._meta["position"])
            self.n_layers = int(self._meta["layers"])
            self._codecs = entry_codecs(get_codec(self._meta["codec"]), self.position)  # keys', values'
            self.dtype = _SAFETENSORS_DTYPES[_DTYPE_NAMES[self._meta["dtype"]]]
            self.n_tokens = int(header["k.0"]["shape"][1])
            self._parts: list[dict[str, dict[str, str]]] = [{"k": {}, "v": {}} for _ in range(self.n_layers)]
            for name in header:  # "k.3" (a payload), "k.3.scale" (its side data): layer -> kind -> suffix -> name
                kind, layer, *suffix = name.split(".", 2)
                self._parts[int(layer)][kind][suffix[0] if suffix else ""] = name
            self._check_uniform()
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"malformed header ({type(err).__name__}: {err})") from err

    def _check_uniform(self) -> None:
        """Every layer has layer 0's parts, of the same dtypes and shapes (`ValueError` if not): a layer read
        decodes as the first did, and the whole entry fits the one tensor it is decoded into."""
        first = {
            (kind, suffix): self._tensors[name]
            for kind, names in self._parts[0].items()
            for suffix, name in names.items()
        }
        for layer, parts in enumerate(self._parts):
            for (kind, suffix), want in first.items():
                got = self._tensors[parts[kind][suffix]]
                if (got["dtype"], got["shape"]) != (want["dtype"], want["shape"]):
                    raise ValueError(
                        f"layer {layer}'s {kind} part {suffix or 'payload'!r} is {got['dtype']} {got['shape']}, "
                        f"layer 0's {want['dtype']} {want['shape']}"
                    )
            if sum(map(len, parts.values())) != len(first):
                raise ValueError(f"layer {layer} has {sum(map(len, parts.values()))} parts, layer 0 {len(first)}")

    def reject(self, reason: str) -> None:
        """Drop this entry from its tier as corrupt (logged and counted): it is not the cache its key names."""
        self._tier.drop(self.key, reason)

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors (one layer's parts, laid out side by side), read as one byte range in one
        request to the blob, each checked against its checksum and returned as a view of that read."""
        spans = [self._tensors[n]["data_offsets"] for n in names]
        lo, hi = min(start for start, _ in spans), max(end for _, end in spans)
        raw = torch.empty(hi - lo, dtype=torch.uint8)  # [bytes of the layer]
        data = raw.numpy()
        (n_read,) = self._blob.read_into([(data, self._base + lo)])
        if n_read != hi - lo:
            raise CorruptEntryError(
                f"tensors {', '.join(names)} of {self._tier.where(self.key)}: read {n_read} of {hi - lo} bytes"
            )
        self._tier.count(bytes_read=hi - lo)
        out = {}
        for name, (start, end) in zip(names, spans):
            if xxhash.xxh3_64_hexdigest(data[start - lo : end - lo]) != self._meta[name]:
                raise CorruptEntryError(f"checksum mismatch in tensor {name} of {self._tier.where(self.key)}")
            info = self._tensors[name]
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            part = raw[start - lo : end - lo]  # [bytes of the tensor]
            if (start - lo) % dtype.itemsize:
                part = part.clone()  # a typed view needs an aligned start
            out[name] = part.view(dtype).view(info["shape"])  # e.g. [H_kv, T, D]
        return out

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [H_kv, T, D] of layer `i`, decoded to the dtype they were computed in."""
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} of a {self.n_layers}-layer entry")
        parts = self._parts[i]
        try:
            read = self._read([n for names in parts.values() for n in names.values()])
        except UnreachableEntryError:
            raise
        except CorruptEntryError as err:
            self._tier.drop(self.key, err)
            raise
        if self.on_loaded is None:
            k, v = (
                codec.decode({s: read[n] for s, n in parts[kind].items()}, self.dtype)
                for kind, codec in zip("kv", self._codecs)
            )
            return k, v
        if self._whole is None:  # decoded in place, layer by layer: held whole once every layer is read
            h_kv, t, d = self._tensors["k.0"]["shape"]
            self._whole = torch.empty(self.n_layers, 2, h_kv, t, d, dtype=self.dtype)  # [L, 2, H_kv, T, D]
        for j, (kind, codec) in enumerate(zip("kv", self._codecs)):
            codec.decode({s: read[n] for s, n in parts[kind].items()}, self.dtype, out=self._whole[i, j])
        self._loaded.add(i)
        if len(self._loaded) == self.n_layers:
            self.on_loaded(self.key, ChunkKV.viewing(self._whole, self.position))
        return self._whole[i, 0], self._whole[i, 1]


def _checksum(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())


def _header_checksum(header: dict) -> str:
    """xxh3 of a header (metadata and every tensor's dtype, shape and offsets) without its own checksum."""
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != _HEADER_CHECKSUM}
    canonical = {**header, "__metadata__": meta}
    return xxhash.xxh3_128_hexdigest(json.dumps(canonical, sort_keys=True).encode())


def _verified_header(raw: bytes) -> dict:
    """The parsed header, or `ValueError` if it is not a JSON object carrying its own correct checksum."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"header is not JSON ({err})") from err
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"no {FORMAT!r} header (format marker {meta and meta.get('format')!r})")
    if meta.get(_HEADER_CHECKSUM) != _header_checksum(header):
        raise ValueError("header checksum mismatch: its metadata or tensor layout was altered")
    return header
