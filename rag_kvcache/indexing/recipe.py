"""`CacheRecipe`: how an index makes one cache of a chunk (or the prefix, or a separator) behind one context or
several, as its `chunk_prefill` makes it, and recomputes one found missing or corrupt.

- Behind a context's tokens: a prefill of the chunk behind them (`compute`: packed forwards).
- Behind one of the chunk's recorded neighbour contexts (`CacheAddressing.neighbour_context`): with
  `cached_neighbours`, the chunk computed behind the context's *cached* K/V (the prefix's cache, each
  neighbour's behind-prefix cache, the separator's between them, each re-rotated into place), a stored cache
  that is missing or corrupt recomputed and stored on the way (a missing one, under a disk budget, kept in
  memory instead); otherwise a prefill behind the context's text.
- Behind several (`CacheAddressing.stored_means`): the mean, at the first's positions, of those caches
  (`BlendKV`), as a query averaging them would read it.

A repaired cache is stored again, except with `foreign` (the model is not the one the index was built with):
then it is kept in this process's memory tier only. A failed write of a repaired cache is logged, not raised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from functools import partial

from ..config import Config
from ..engine.cache import BlendKV, ChunkKV, LayerSource, all_layers
from ..engine.prompt import PromptFormat
from ..engine.spec import ModelSpec, Pause
from ..store.addressing import CacheAddressing, Context
from ..store.kvstore import KVStore
from ..store.opening import open_repairing
from .precompute import compute_behind_cached, compute_caches, pack_tokens

log = logging.getLogger(__name__)


class CacheRecipe:
    """Makes the caches that `addressing` names for an index of `config` on model `adapter`, with prompts laid
    out by `format`, reading and repairing the caches it is built from in `store`. `foreign`: the model is not
    the one the index was built with, so a cache it repairs stays in this process's memory."""

    def __init__(
        self,
        config: Config,
        adapter: ModelSpec,
        store: KVStore,
        format: PromptFormat,
        addressing: CacheAddressing,
        foreign: bool,
    ) -> None:
        self.config, self.adapter, self.store, self.format = config, adapter, store, format
        self.addressing, self.foreign = addressing, foreign

    def compute(
        self, chunks: Sequence[tuple[int, ...]], context: tuple[int, ...], pause: Pause | None = None
    ) -> Iterator[tuple[int, ChunkKV]]:
        """Prefill each chunk behind `context` (`compute_caches`: packed forwards); yields (index in
        `chunks`, cache)."""
        return compute_caches(self.adapter, chunks, context, pack_tokens(self.config), pause)

    def make(self, ids: tuple[int, ...], contexts: Sequence[Context], pause: Pause | None = None) -> ChunkKV:
        """The cache of `ids` behind `contexts`, made as the index makes it. Behind one: behind one of the chunk's
        recorded neighbour contexts, as `behind_neighbours` makes it; else a prefill behind the context's tokens.
        Behind several (`CacheAddressing.stored_means`): the mean, at the first's positions, of the chunk's
        neighbour cache, made now, and its stored caches behind the others (`BlendKV`, as a query averaging
        them would read it). `pause`: called before each layer of every forward (`ModelSpec.prefill_packed`)."""
        if len(contexts) > 1:
            sets = [self._neighbour_set(ids, c) for c in contexts]
            parts = [
                self.cached(ids, c, pause) if s is None else self.behind_neighbours(ids, s, pause)
                for c, s in zip(contexts, sets)
            ]
            mean = BlendKV(tuple(parts), self.adapter.inv_freq)
            return ChunkKV.viewing(all_layers(mean), mean.position)  # [L, 2, H_kv, T, D]
        (context,) = contexts
        nearest = self._neighbour_set(ids, context)
        if nearest is None:
            return next(self.compute([ids], context, pause))[1]
        return self.behind_neighbours(ids, nearest, pause)

    def _neighbour_set(self, ids: tuple[int, ...], context: Context) -> Sequence[Sequence[int]] | None:
        """The recorded neighbours of chunk `ids` that `context` lays out, or None: not a neighbour context."""
        sets = self.addressing.neighbour_sets(self.addressing.near(ids))
        return next((s for s in sets if self.addressing.neighbour_context(s) == context), None)

    def behind_neighbours(
        self, ids: tuple[int, ...], near: Sequence[Sequence[int]], pause: Pause | None = None
    ) -> ChunkKV:
        """The cache of chunk `ids` behind `addressing.neighbour_context(near)`: with `chunk_prefill="cached_neighbours"`
        computed behind the cached K/V of that context (the prefix's cache, each neighbour's behind-prefix
        cache, the separator's behind-prefix cache between them; the last separator computed with the
        chunk), else behind the context's recomputed text."""
        if self.config.index.chunk_prefill != "cached_neighbours":
            return next(self.compute([ids], self.addressing.neighbour_context(near), pause))[1]
        prefix, sep = self.format.prefix_ids, self.format.separator_ids
        between = [self.cached(sep, prefix, pause)] if sep else []
        sources = [self.cached(prefix, (), pause)]
        for i, n in enumerate(reversed(near)):
            sources += [*(between if i else []), self.cached(tuple(n), prefix, pause)]
        return compute_behind_cached(self.adapter, ids, sources, sep, pause)

    def cached(self, ids: tuple[int, ...], context: tuple[int, ...], pause: Pause | None = None) -> LayerSource:
        """The stored cache of `ids` behind `context`, to build a cached context from: one that fails a layer's
        check when read is recomputed then; a missing one is recomputed and stored (logged), except under a
        disk budget, where it is kept in this process's memory tier: a neighbour outside the hot set is made to
        build its neighbour's cache, and storing it would spend the room the budget planned for the hot set's
        caches (a prompt that reads it stores it, if the budget admits it then). Read without entering the
        memory tier, so indexing does not churn the caches queries read from it."""
        key = self.addressing.key(ids, context)
        entry = open_repairing(self.store, key, partial(self.repair, key, ids, (context,)), promote=False)
        if entry is not None:
            return entry
        if self.store.budget is not None:
            kv = self.make(ids, (context,), pause)
            self.store.memory.put(key, kv)
            return kv
        return self.repair(key, ids, (context,), pause)

    def repair(
        self, key: str, ids: tuple[int, ...], contexts: Sequence[Context], pause: Pause | None = None
    ) -> ChunkKV:
        """Recompute a missing or corrupt cache (`make`) and store it again (a failed write is logged, not
        raised: the recomputed cache serves the query that found the fault)."""
        kv = self.make(ids, contexts, pause)
        if self.foreign:  # another model's cache is not the index's: kept in this process's memory only
            self.store.memory.put(key, kv)
            return kv
        try:
            self.store.put(key, kv)
        except OSError as err:
            log.warning("computed the KV cache %s but could not store it: %s", key, err)
        else:
            # not a fault in itself: a cache not made yet (a folder searchable before its caches) is made so too; a
            # corrupt entry was logged when the store dropped it
            log.info("made and stored the KV cache %s (%d tokens), which the store did not hold", key, len(ids))
        return kv
