"""Opening the caches a prompt reads: each segment's cache as `address` names it, from the store (or, for
request text, from its tenant's memory), made when missing and remade when a layer fails its check.

`CacheOpener.open` hands the fusion intact caches whatever it finds: a missing entry is made and stored
now, and one that fails a layer's check while the fusion reads it (`Repairing`) is made again then, so
the answer is unchanged. An entry that is not the shape of the cache its key names (another token count,
layer count or position, as a shared tier's writer may store; or a layer of other heads or head size) is
corrupt like one that fails its checksum: dropped, counted, logged, and made again. Making a cache is the
index's job (`indexing.maker.CacheMaker`, the `Maker` here): this module only opens and repairs.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Protocol

import torch

from ..engine.cache import BlendKV, ChunkKV, LayerSource, SliceKV
from ..engine.prompt import Segment
from ..engine.spec import ModelSpec, Pause
from ..errors import RagKVCacheError
from .addressing import CacheAddressing, Context, SegmentAddress, address, reads_neighbours
from .backend import CorruptEntryError, Entry
from .kvstore import KVStore
from .ledger import Ledger
from .tiers import MemoryTier

log = logging.getLogger(__name__)

MAX_WANTED = 4096  # chunk caches remembered for `CacheOpener.backfill`; more forget the least recently wanted
MAX_READY = 8  # wanted caches held computed (`CacheOpener.harvest`); more are made again when still wanted
MADE_AT_USES = 2  # under a budget, `backfill` makes a neighbour cache once prompts have read it this often


class Maker(Protocol):
    """What makes an index's caches (`indexing.maker.CacheMaker`)."""

    @property
    def addressing(self) -> CacheAddressing: ...

    @property
    def adapter(self) -> ModelSpec: ...

    def make(self, ids: tuple[int, ...], contexts: Sequence[Context], pause: Pause | None = None) -> ChunkKV: ...

    def repair(self, key: str, ids: tuple[int, ...], contexts: Sequence[Context]) -> ChunkKV: ...

    def cache_bytes(self, n_tokens: int) -> int: ...


@dataclass(frozen=True)
class InPlace:
    """A chunk without a cache that a prompt computes where it stands (`CacheOpener.open(in_place=True)`), behind
    the very tokens its missing cache under `key` is a prefill behind (the first chunk after the system prefix):
    the prompt's K/V over its span, `start` on, are that cache (`CacheOpener.harvest`), computed behind those
    tokens as the prompt read them (the prefix from its stored cache, rounded by a lossy codec)."""

    start: int  # its first token's position in the prompt
    key: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class PromptCaches:
    """The opened caches of a prompt's segments (`CacheOpener.open`)."""

    sources: list[LayerSource | None]  # per segment; None: computed at query time
    contexts: list[Context | None]  # per segment: the tokens its cache was computed behind (None: a mean of several)
    missing: int  # chunk caches that were missing when opened (recomputed and stored)
    opened: list[LayerSource]  # each stored cache opened, once (segments may read slices of one)
    computed_tokens: int  # prompt tokens of the segments whose cache was computed now (first use or repair)
    # `in_place`: the missing chunk caches the prefill computes exactly, where each segment stands (`harvest`)
    exact_in_place: tuple[InPlace, ...] = ()

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


@dataclass(frozen=True)
class Expected:
    """The shape of the cache a key names: `n_tokens` tokens computed from `position` on, `n_layers` layers of
    keys and values [`n_kv_heads`, `n_tokens`, `head_dim`]."""

    n_tokens: int
    position: int
    n_layers: int
    n_kv_heads: int
    head_dim: int

    def misfit(self, source: LayerSource) -> str | None:
        """Why `source` (as its header says) is not such a cache, or None."""
        got = (source.n_tokens, source.position, source.n_layers)
        want = (self.n_tokens, self.position, self.n_layers)
        if got == want:
            return None
        return (
            f"it holds {got[0]} tokens from position {got[1]} in {got[2]} layers, where its key names "
            f"{want[0]} tokens from position {want[1]} in {want[2]} layers"
        )

    def layer_misfit(self, i: int, k: torch.Tensor, v: torch.Tensor) -> str | None:
        """Why layer `i`'s keys `k` and values `v` are not [`n_kv_heads`, `n_tokens`, `head_dim`] each, or None."""
        want = (self.n_kv_heads, self.n_tokens, self.head_dim)
        if tuple(k.shape) == tuple(v.shape) == want:
            return None
        return f"layer {i} has keys {tuple(k.shape)} and values {tuple(v.shape)}, where its key names {want} each"


class MisfitEntryError(CorruptEntryError):
    """An entry intact by its checksums that is not the shape of the cache its key names (dropped)."""


class Repairing:
    """A store entry that, should a layer fail its check mid-read (or be of another shape than `expected`,
    then dropped), is recomputed and served from the recomputation from then on (earlier layers passed their
    checks, so they were right)."""

    def __init__(self, source: LayerSource, recompute: Callable[[], ChunkKV], expected: Expected | None = None) -> None:
        self.source = source
        self.position = source.position
        self.repaired = False
        self._recompute = recompute
        self._expected = expected

    @property
    def n_tokens(self) -> int:
        return self.source.n_tokens

    @property
    def n_layers(self) -> int:
        return self.source.n_layers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._checked(i)
        except CorruptEntryError:
            self.source, self.repaired = self._recompute(), True
            return self.source.layer(i)

    def _checked(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i` of the entry, `MisfitEntryError` (the entry dropped) when not of the expected shape."""
        k, v = self.source.layer(i)
        if self._expected is not None and (why := self._expected.layer_misfit(i, k, v)):
            reject(self.source, why)
            raise MisfitEntryError(why)
        return k, v


def reject(source: LayerSource, why: str) -> None:
    """Drop a stored entry that is not the cache its key names from the tier it was read from (logged, counted
    corrupt); one of the memory tier is left to the caller."""
    if isinstance(source, Entry):
        source.reject(f"not the cache its key names: {why}")


def open_repairing(
    store: KVStore, key: str, repair: Callable[[], ChunkKV], promote: bool = True, expected: Expected | None = None
) -> LayerSource | None:
    """The store's entry under `key`, remade by `repair` should a layer fail its check while it is read
    (`Repairing`); None when missing. `promote`: as `KVStore.open`. With `expected`, an entry of another shape
    is dropped from every tier (logged and counted as corrupt) and is None, missing: its reader makes it."""
    entry = store.open(key, promote)
    if entry is not None and expected is not None and (why := _misfit(entry, expected)):
        reject(entry, why)
        if isinstance(entry, ChunkKV):
            log.warning("dropping the KV cache %s from memory: not the cache its key names: %s", key, why)
        store.memory.remove(key)
        return None
    return entry if entry is None or isinstance(entry, ChunkKV) else Repairing(entry, repair, expected)


def _misfit(entry: LayerSource, expected: Expected) -> str | None:
    """Why `entry` is not the cache `expected` describes: its header, and for a decoded cache its first layer."""
    if why := expected.misfit(entry):
        return why
    return expected.layer_misfit(0, *entry.layer(0)) if isinstance(entry, ChunkKV) else None


class CacheOpener:
    """Opens the caches of prompts over `store`, whose caches `maker` names and makes. Caches of request
    text (a prompt head other than the system prefix, and the first chunk behind it) are kept in memory
    only (`request_tier`, per API key, within `request_bytes`), never on disk or in the shared tier.
    `inv_freq` [D/2] turns the caches a `BlendKV` averages."""

    def __init__(self, store: KVStore, maker: Maker, request_bytes: int, inv_freq: torch.Tensor, n_layers: int) -> None:
        self.store, self.maker, self.request_bytes, self.inv_freq = store, maker, request_bytes, inv_freq
        self.n_layers = n_layers
        self.request_tiers: dict[str, MemoryTier] = {}  # per API key: caches of request text
        # chunk caches prompts wanted and did not find: key -> (token ids, contexts), made by `backfill`
        self.wanted: OrderedDict[str, tuple[tuple[int, ...], tuple[Context, ...]]] = OrderedDict()
        self.ready: OrderedDict[str, ChunkKV] = OrderedDict()  # wanted caches a prompt computed exactly (`harvest`)
        self._wanted_lock = threading.Lock()

    def open(
        self, segments: Sequence[Segment], salt: str = "", make: bool = True, in_place: bool = False
    ) -> PromptCaches:
        """The caches of a prompt's cacheable segments (None for the others), each with the context it
        was computed behind: those `address` names (the mean of several where it names several, `BlendKV`;
        a run of a stored sequence reads its slice, `SliceKV`); a sequence several segments read is opened
        once. A missing entry is recomputed and stored now; one that fails a layer's check while the fusion
        reads it is recomputed then. Either way the fusion gets intact caches.

        With a `salt` (the server's tenant), caches of request text are under keys of that salt alone, so
        that no other tenant can hit them (a hit is measurably faster: a guessed secret in a shared head
        would be confirmed by the time to the first token).

        With `make` False nothing is made or stored: a missing entry is `Unmade`, which lays the prompt out
        as the made cache would (the vLLM connector's scheduler plans a load that its worker makes); a missing
        neighbour cache (below) has no source there either, so that the scheduler plans what the worker does.

        A chunk read behind its recorded neighbours whose neighbour cache is not stored (not made yet, or evicted
        by the store's budget) is not made now either (a forward behind the neighbours' caches, which a prompt
        would wait for): its segment has no source, so the prompt's prefill computes it where it stands, as
        `full` computes it, and the cache is made later, off the request path (`wanted`, `backfill`). Its cache
        behind the prefix alone is not read in its place: that reading loses facts the default keeps.
        With `in_place` (the query path under a disk budget, where a chunk outside the hot set has no cache by
        design) any missing chunk cache is so; the budget decides at `backfill` whether it is stored. A missing
        cache of request text is made now.
        """
        addressing = self.maker.addressing
        addresses = address(addressing, segments, salt)
        self._count_uses(addresses)
        sources: list[LayerSource | None] = []
        opened: dict[str, LayerSource] = {}
        recomputed: set[str] = set()
        left: set[str] = set()  # missing chunk caches not made now: their segments computed in the prompt
        exact: list[InPlace] = []  # of those, the ones whose span of the prompt's K/V is their missing cache
        missing = computed = 0
        starts = accumulate((len(seg.ids) for seg in segments), initial=0)  # each segment's first position
        for seg, at, start in zip(segments, addresses, starts):
            if not at.keys:
                sources.append(None)
                continue
            for key, contexts in at.reads:
                if key not in opened and key not in left:
                    entry = self._open(key, at.whole, contexts, salt if at.request_text else None)
                    if entry is None and ((in_place and not at.request_text) or reads_neighbours(addressing, at)):
                        self._want(key, at.whole, contexts)
                        left.add(key)
                        if at.prefilled and seg.ids == at.whole:  # the whole chunk, computed as its cache is
                            exact.append(InPlace(start, key, at.whole))
                    elif entry is None and not make:
                        entry = Unmade(len(at.whole), len(contexts[0]), self.n_layers)
                    elif entry is None:
                        entry = (
                            self._first_use(key, at.whole, contexts, salt)
                            if at.request_text
                            else self.maker.repair(key, at.whole, contexts)
                        )
                        recomputed.add(key)
                    if entry is not None:
                        opened[key] = entry
                missing += at.counted and (key in recomputed or key in left)  # per segment
            computed += len(seg.ids) if any(k in recomputed for k in at.keys) else 0  # `left`: the prefill's
            if any(k in left for k in at.keys):
                sources.append(None)  # computed in place by the prefill
                continue
            keys = at.keys
            source = opened[keys[0]] if len(keys) == 1 else BlendKV(tuple(opened[k] for k in keys), self.inv_freq)
            sources.append(
                SliceKV(source, seg.offset, seg.offset + len(seg.ids)) if len(seg.ids) < len(at.whole) else source
            )
        laid_behind = [at.context for at in addresses]
        return PromptCaches(sources, laid_behind, missing, list(opened.values()), computed, tuple(exact))

    def harvest(self, made: Sequence[tuple[InPlace, ChunkKV]]) -> None:
        """The caches a prompt's prefill computed exactly where their chunks stood (`PromptCaches.exact_in_place`),
        handed to `backfill` to store as they are, if the budget admits them, instead of computing them again.
        At most `MAX_READY` wait so (the K/V of a whole chunk each); older ones are made again if still wanted."""
        with self._wanted_lock:
            for spot, kv in made:
                if spot.key in self.wanted:
                    self.ready[spot.key] = kv
                    self.ready.move_to_end(spot.key)
            while len(self.ready) > MAX_READY:
                self.ready.popitem(last=False)

    def _want(self, key: str, ids: tuple[int, ...], contexts: tuple[Context, ...]) -> None:
        """Ask `backfill` for the cache under `key` (the most recently wanted is made first)."""
        with self._wanted_lock:
            self.wanted[key] = (ids, contexts)
            self.wanted.move_to_end(key)
            while len(self.wanted) > MAX_WANTED:
                self.ready.pop(self.wanted.popitem(last=False)[0], None)

    def _count_uses(self, addresses: Sequence[SegmentAddress]) -> None:
        """Count every chunk cache the prompt reads (those computed in place too) with the store's ledger: the
        popularity its budget keeps the hot set by."""
        if self.store.ledger is None:
            return
        reads = {
            key: self.maker.cache_bytes(len(at.whole)) for at in addresses if not at.request_text for key in at.keys
        }
        self.store.ledger.used(reads)

    def backfill(self, limit: int = 1, pause: Pause | None = None) -> int:
        """Make up to `limit` of the chunk caches prompts wanted and did not find (most recently wanted first),
        each only if the store's budget would keep it; returns how many were stored. For idle moments: the
        server runs it when no request waits. `pause` is called before each layer of a forward: a caller running
        it in the background stops it there while requests run.

        Under a budget, a chunk's neighbour cache (`CacheAddressing.neighbour_reads`) is made only once
        prompts have read it `MADE_AT_USES` times (the ledger counts them): it takes a forward behind the
        neighbours' caches, and theirs where the store holds none, which the next request of an unbroken stream
        waits for, and a chunk read once would never read it. Until then prompts compute the chunk where it stands."""
        made = 0
        while made < limit:
            with self._wanted_lock:
                if not self.wanted:
                    return made
                key, (ids, contexts) = self.wanted.popitem()
                kv = self.ready.pop(key, None)
            ledger = self.store.ledger
            if key in self.store or (
                ledger is not None
                and (
                    (kv is None and self._read_too_seldom(key, ids, ledger))
                    or not ledger.admits(key, self.maker.cache_bytes(len(ids)), len(ids))
                )
            ):
                continue
            made += self.store.put(key, kv if kv is not None else self.maker.make(ids, contexts, pause))
        return made

    def _read_too_seldom(self, key: str, ids: tuple[int, ...], ledger: Ledger) -> bool:
        """Whether `key`, to be made with a forward, is a neighbour cache of chunk `ids` that prompts have read fewer
        than `MADE_AT_USES` times, under a budget (`backfill`)."""
        return (
            ledger.budget is not None
            and key in {k for k, _ in self.maker.addressing.neighbour_reads(ids)}
            and ledger.uses(key) < MADE_AT_USES
        )

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
        layout = self.maker.adapter.layout
        expected = Expected(len(ids), len(contexts[0]), self.n_layers, layout.n_kv_heads, layout.head_dim)
        return open_repairing(self.store, key, partial(self.maker.repair, key, ids, contexts), expected=expected)

    def _first_use(self, key: str, ids: tuple[int, ...], contexts: Sequence[Context], salt: str) -> ChunkKV:
        """A cache of request text made on first use (a new prompt head, or a chunk behind it), kept in the
        tenant's `request_tier`."""
        kv = self.maker.make(ids, contexts)
        self.request_tier(salt).put(key, kv)
        return kv
