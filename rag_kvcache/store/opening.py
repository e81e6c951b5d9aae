"""Opening the caches a prompt reads: each segment's cache as `address` names it, from the store (or, for
request text, from its tenant's memory), made when missing and remade when a layer fails its check.

`CacheOpener.open` hands the fusion intact caches whatever it finds: a missing entry is made and stored
now, and one that fails a layer's check while the fusion reads it (`Repairing`) is made again then, so
the answer is unchanged. Making a cache is the index's job (`indexing.maker.CacheMaker`, the `Maker`
here): this module only opens and repairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from ..engine.cache import BlendKV, ChunkKV, LayerSource, SliceKV
from ..engine.prompt import Segment
from ..errors import RagKVCacheError
from .addressing import CacheAddressing, Context, address
from .backend import CorruptEntryError
from .kvstore import KVStore
from .tiers import MemoryTier


class Maker(Protocol):
    """What makes an index's caches (`indexing.maker.CacheMaker`)."""

    @property
    def addressing(self) -> CacheAddressing: ...

    def make(self, ids: tuple[int, ...], contexts: Sequence[Context]) -> ChunkKV: ...

    def repair(self, key: str, ids: tuple[int, ...], contexts: Sequence[Context]) -> ChunkKV: ...


@dataclass(frozen=True)
class PromptCaches:
    """The opened caches of a prompt's segments (`CacheOpener.open`)."""

    sources: list[LayerSource | None]  # per segment; None: computed at query time
    contexts: list[Context | None]  # per segment: the tokens its cache was computed behind (None: a mean of several)
    missing: int  # chunk caches that were missing when opened (recomputed and stored)
    opened: list[LayerSource]  # each stored cache opened, once (segments may read slices of one)
    computed_tokens: int  # prompt tokens of the segments whose cache was computed now (first use or repair)

    @property
    def repaired(self) -> int:
        """Chunk caches recomputed so far: missing when opened, or corrupt when a layer was read."""
        return self.missing + sum(isinstance(s, Repairing) and s.repaired for s in self.opened)


@dataclass(frozen=True)
class Unmade:
    """A cache not in the store, opened without making it (`CacheOpener.open(make=False)`): its length and
    position (a cache made behind a context starts right after it) for laying the prompt out; no layers."""

    n_tokens: int
    position: int
    n_layers: int

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise RagKVCacheError(f"an unmade cache of {self.n_tokens} tokens has no layers: open it with make=True")


class Repairing:
    """A store entry that, should a layer fail its check mid-read, is recomputed and served from the
    recomputation from then on (earlier layers passed their checks, so they were right)."""

    def __init__(self, source: LayerSource, recompute: Callable[[], ChunkKV]) -> None:
        self.source = source
        self.position = source.position
        self.repaired = False
        self._recompute = recompute

    @property
    def n_tokens(self) -> int:
        return self.source.n_tokens

    @property
    def n_layers(self) -> int:
        return self.source.n_layers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.source.layer(i)
        except CorruptEntryError:
            self.source, self.repaired = self._recompute(), True
            return self.source.layer(i)


def open_repairing(store: KVStore, key: str, repair: Callable[[], ChunkKV], promote: bool = True) -> LayerSource | None:
    """The store's entry under `key`, remade by `repair` should a layer fail its check while it is read
    (`Repairing`); None when missing. `promote`: as `KVStore.open`."""
    entry = store.open(key, promote)
    return entry if entry is None or isinstance(entry, ChunkKV) else Repairing(entry, repair)


class CacheOpener:
    """Opens the caches of prompts over `store`, whose caches `maker` names and makes. Caches of request
    text (a prompt head other than the system prefix, and the first chunk behind it) are kept in memory
    only (`request_tier`, per API key, within `request_bytes`), never on disk or in the shared tier.
    `inv_freq` [D/2] turns the caches a `BlendKV` averages."""

    def __init__(self, store: KVStore, maker: Maker, request_bytes: int, inv_freq: torch.Tensor, n_layers: int) -> None:
        self.store, self.maker, self.request_bytes, self.inv_freq = store, maker, request_bytes, inv_freq
        self.n_layers = n_layers
        self.request_tiers: dict[str, MemoryTier] = {}  # per API key: caches of request text

    def open(self, segments: Sequence[Segment], salt: str = "", make: bool = True) -> PromptCaches:
        """The caches of a prompt's cacheable segments (None for the others), each with the context it
        was computed behind: those `address` names (the mean of several where it names several, `BlendKV`;
        a run of a stored sequence reads its slice, `SliceKV`); a sequence several segments read is opened
        once. A missing entry is recomputed and stored now; one that fails a layer's check while the fusion
        reads it is recomputed then. Either way the fusion gets intact caches.

        With a `salt` (the server's tenant), caches of request text are under keys of that salt alone, so
        that no other tenant can hit them (a hit is measurably faster: a guessed secret in a shared head
        would be confirmed by the time to the first token).

        With `make` False nothing is made or stored: a missing entry is `Unmade`, which lays the prompt out
        as the made cache would (the vLLM connector's scheduler plans a load that its worker makes).
        """
        addresses = address(self.maker.addressing, segments, salt)
        sources: list[LayerSource | None] = []
        opened: dict[str, LayerSource] = {}
        recomputed: set[str] = set()
        missing = computed = 0
        for seg, at in zip(segments, addresses):
            if not at.keys:
                sources.append(None)
                continue
            for key, contexts in at.reads:
                if key not in opened:
                    entry = self._open(key, at.whole, contexts, salt if at.request_text else None)
                    if entry is None and not make:
                        entry = Unmade(len(at.whole), len(contexts[0]), self.n_layers)
                    elif entry is None:
                        entry = (
                            self._first_use(key, at.whole, contexts, salt)
                            if at.request_text
                            else self.maker.repair(key, at.whole, contexts)
                        )
                        recomputed.add(key)
                    opened[key] = entry
                missing += at.counted and key in recomputed  # per segment
            computed += len(seg.ids) if any(k in recomputed for k in at.keys) else 0
            keys = at.keys
            source = opened[keys[0]] if len(keys) == 1 else BlendKV(tuple(opened[k] for k in keys), self.inv_freq)
            sources.append(
                SliceKV(source, seg.offset, seg.offset + len(seg.ids)) if len(seg.ids) < len(at.whole) else source
            )
        return PromptCaches(sources, [at.context for at in addresses], missing, list(opened.values()), computed)

    def load(self, segments: Sequence[Segment], salt: str = "") -> int:
        """Read the stored chunk caches the prompt's segments will read into the store's memory tier ahead of
        `open` (`KVStore.load`: a missing or corrupt entry is left to `open` to make); returns how many were
        read now. Caches of request text live in their tenant's memory already. Touches no SQLite connection,
        so it may run beside the thread that owns the index."""
        addresses = address(self.maker.addressing, segments, salt)
        keys = dict.fromkeys(key for at in addresses if not at.request_text for key in at.keys)  # in prompt order, once
        return sum(map(self.store.load, keys))

    def request_tier(self, salt: str) -> MemoryTier:
        """The memory that holds the caches of request text (prompt heads, a chunk behind one) of the API key
        that `salt` names (the part before its first ':'; a request's `cache_salt` splits keys within it),
        within `request_bytes`, least recently used first out. Request text is never written to disk or to
        the shared tier: no client can fill them, and no tenant's prompts are kept there."""
        tenant = salt.partition(":")[0]
        if tenant not in self.request_tiers:
            self.request_tiers[tenant] = MemoryTier(self.request_bytes, "lru")
        return self.request_tiers[tenant]

    def _open(
        self, key: str, ids: tuple[int, ...], contexts: Sequence[Context], salt: str | None
    ) -> LayerSource | None:
        """The entry under `key` (request text: from the tenant's memory), repaired if a layer fails its
        check; None when missing."""
        if salt is not None:
            return self.request_tier(salt).get(key)
        return open_repairing(self.store, key, partial(self.maker.repair, key, ids, contexts))

    def _first_use(self, key: str, ids: tuple[int, ...], contexts: Sequence[Context], salt: str) -> ChunkKV:
        """A cache of request text made on first use (a new prompt head, or a chunk behind it), kept in the
        tenant's `request_tier`."""
        kv = self.maker.make(ids, contexts)
        self.request_tier(salt).put(key, kv)
        return kv
