"""Cache addressing: which stored caches a prompt's segments read, a pure function of the segments and of
what names an index's caches.

A cache is addressed by its content (`cache_key`): the index's namespace (its model and `chunk_prefill`),
the tokens it was computed behind (its context) and its own tokens. `CacheAddressing` holds the contexts an
index computes caches behind: the system prefix (or nothing, `chunk_prefill="isolated"`), and with
neighbour caches each chunk's recorded most similar chunks (with grouped caches, the chunks before it in its
group: its one context). `address` lays a prompt's segments over them:
for each segment the caches it reads (averaged when several) and what each was computed behind (a cache
stored as the mean of a chunk's caches behind several contexts: all of them), and whether they hold request
text (a tenant's, kept in memory only). `KVIndex.caches.open` opens what it names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from ..engine.prompt import Segment

Context = tuple[int, ...]  # the tokens a cache was computed behind
# a store key, and the contexts its cache was computed behind (several: it holds their mean)
Read = tuple[str, tuple[Context, ...]]


def cache_key(namespace: str, context_ids: Sequence[int], ids: Sequence[int]) -> str:
    """Content address of a cache: namespace + the tokens before it + its own tokens."""
    h = xxhash.xxh3_128()
    h.update(namespace.encode())
    h.update(np.asarray(context_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class CacheAddressing:
    """What names an index's caches: its `namespace`, the `chunk_context` a chunk's cache is computed behind,
    the prompt format's `prefix_ids` and `separator_ids`, and (`chunk_prefill="neighbours"` or
    "cached_neighbours") each chunk's recorded `neighbours`, by `neighbour_key`, most similar first: with
    `by_depth` (`neighbours`) a chunk has a cache behind its j most similar for each j, else
    (`cached_neighbours`) one behind all of them; with `stored_means` (a `cached_neighbours` index that records
    them) that cache is stored as its mean with the chunk's behind-prefix cache (`mean_key`), read as
    one, instead of the two being read and averaged per query. With `grouped` (`chunk_prefill="grouped"`) a
    chunk's recorded neighbours are the chunks before it in its group, nearest first, and its one cache is
    behind them."""

    namespace: str
    chunk_context: tuple[int, ...]
    prefix_ids: tuple[int, ...]
    separator_ids: tuple[int, ...]
    neighbours: Mapping[str, Sequence[Sequence[int]]]
    grouped: bool = False
    by_depth: bool = True
    stored_means: bool = False

    def key(self, ids: Sequence[int], context: Sequence[int] | None = None, salt: str = "") -> str:
        """The store key of the cache of `ids` computed behind `context` (default: a chunk's); a `salt`
        (a tenant's) gives a cache of request text a key no other salt addresses."""
        namespace = f"{self.namespace}|{salt}" if salt else self.namespace
        return cache_key(namespace, self.chunk_context if context is None else context, ids)

    def mean_key(self, ids: Sequence[int], contexts: Sequence[Context]) -> str:
        """The store key of the mean of the caches of `ids` behind each of `contexts` (two or more), at the first's
        positions: under a namespace of its own, so no cache behind one context is read as it."""
        joined = tuple(t for c in contexts for t in (*c, -1))  # -1: no token id, so the contexts stay apart
        return cache_key(f"{self.namespace}|mean", joined, ids)

    def reads(self, ids: Sequence[int], contexts: Sequence[Context], salt: str = "") -> tuple[Read, ...]:
        """What a chunk `ids` that reads its caches behind `contexts` (averaged when several) reads from the
        store: with `stored_means`, their mean under one key; else each under its own."""
        if self.stored_means and len(contexts) > 1:
            return ((self.mean_key(ids, contexts), tuple(contexts)),)
        return tuple((self.key(ids, c, salt), (c,)) for c in contexts)

    def neighbour_reads(self, ids: Sequence[int]) -> tuple[Read, ...]:
        """The stored caches chunk `ids` has behind its recorded neighbours (`neighbour_sets`; with
        `stored_means`, each averaged with its behind-prefix cache)."""
        return tuple(
            read
            for context in self.neighbour_contexts(self.near(ids))
            for read in self.reads(ids, (context, self.chunk_context) if self.stored_means else (context,))
        )

    def neighbour_key(self, ids: Sequence[int]) -> str:
        return cache_key(self.namespace, (), ids)

    def near(self, ids: Sequence[int]) -> Sequence[Sequence[int]]:
        """Chunk `ids`'s recorded neighbours, most similar first (none outside the neighbour modes)."""
        return self.neighbours.get(self.neighbour_key(ids), [])

    def neighbour_context(self, near: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """The prefix, then the neighbours as a prompt lays chunks out (separator after each), most similar last."""
        return self.prefix_ids + tuple(t for ids in reversed(near) for t in (*ids, *self.separator_ids))

    def neighbour_sets(self, near: Sequence[Sequence[int]]) -> list[Sequence[Sequence[int]]]:
        """The sets of neighbours a chunk with neighbours `near` (most similar first) has caches behind: with
        `by_depth` its j most similar, for j = 1..len(near); else all of them, once."""
        if not self.by_depth:
            return [near] if near else []
        return [near[:j] for j in range(1, len(near) + 1)]

    def neighbour_contexts(self, near: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The contexts of the caches a chunk with neighbours `near` has behind them (`neighbour_sets`)."""
        return [self.neighbour_context(s) for s in self.neighbour_sets(near)]

    def prefilled(self, ids: Sequence[int], context: Context) -> bool:
        """Whether chunk `ids`'s cache behind `context` is what a prefill behind the context's tokens gives, so
        exact where a prompt's tokens before the chunk are that context: every cache but a `cached_neighbours`
        chunk's behind its neighbours (computed behind their cached K/V, each of which has not seen the others)."""
        near = self.near(ids)
        return self.by_depth or not near or context != self.neighbour_context(near)

    def own_context(self, ids: Sequence[int]) -> tuple[int, ...]:
        """What chunk `ids`'s own cache (the one indexing makes first) is computed behind: `chunk_context`, or
        with `grouped` the prefix and the chunks before it in its group."""
        near = self.neighbours.get(self.neighbour_key(ids)) if self.grouped else None
        return self.neighbour_context(near) if near else self.chunk_context

    def own_key(self, ids: Sequence[int]) -> str:
        """The store key of chunk `ids`'s own cache (behind `own_context`)."""
        return self.key(ids, self.own_context(ids))

    def contexts_at(self, depth: int, ids: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The contexts of the caches read, averaged, for chunk `ids` with `depth` chunks before it in a
        prompt: with recorded neighbours, behind them (`by_depth`: its min(depth, recorded) most similar, a
        context of as many chunks as it meets) and behind `chunk_context`, except for the first chunk (depth 0),
        whose behind-prefix cache is exact right after the prefix; otherwise `chunk_context` alone. `grouped`:
        the chunk's one cache, behind the chunks before it in its group, at every depth. `address` reads one
        alone where the prompt reproduces it."""
        if self.grouped:
            return (self.own_context(ids),)
        near = self.neighbours.get(self.neighbour_key(ids)) if self.neighbours else None
        if not near or depth == 0:
            return (self.chunk_context,)
        return self.neighbour_context(near[:depth] if self.by_depth else near), self.chunk_context


@dataclass(frozen=True)
class SegmentAddress:
    """The caches one prompt segment reads."""

    reads: tuple[Read, ...]  # the store keys read, averaged when several; none for a segment computed at query time
    whole: tuple[int, ...]  # the stored sequence they hold: the segment's tokens, or a sequence it is a run of
    context: Context | None  # what the segment's cache was computed behind, as laid out in this prompt; None: a mean
    request_text: bool  # a cache of request text: the tenant's, in memory only, made by the first prompt to need it
    counted: bool  # recomputing it counts as a missing cache (not the prompt's head, nor a chunk behind a new head)
    prefilled: bool = False  # it reads one cache, a prefill behind exactly the prompt's tokens before the segment

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.reads)

    @property
    def contexts(self) -> tuple[Context, ...]:
        """Every context the caches read were computed behind, in order."""
        return tuple(c for _, contexts in self.reads for c in contexts)


def address(addressing: CacheAddressing, segments: Sequence[Segment], salt: str = "") -> list[SegmentAddress]:
    """Each segment's caches: the system prefix (a cacheable segment at position 0) behind nothing; a chunk
    behind the contexts `contexts_at` names for the number of other stored sequences read before it (its
    depth): the one the prompt's tokens before it reproduce, where its cache is a prefill's behind them
    (`CacheAddressing.prefilled`: exact), else all of them (averaged: read as `CacheAddressing.reads` names,
    their stored mean or each; exact behind no prompt, so with no context). A segment that is a run of a stored sequence (`Segment.whole`) reads that sequence's caches, the sequence's tokens
    before the run added to its context.

    A prompt whose cached head is not the system prefix (a pipeline's own instructions) reads its head and
    the first chunk after it (behind exactly the prompt's tokens before it: exact, as prefix caching is) as
    request text, under keys of `salt` (the tenant) alone."""
    out: list[SegmentAddress] = []
    head = bool(segments) and segments[0].cacheable and segments[0].ids != addressing.prefix_ids
    in_head = head  # still in a head and the computed text after it, before its first chunk
    read: set[tuple[int, ...]] = set()  # the stored sequences of the cached segments after position 0 so far
    prompt: tuple[int, ...] = ()  # the prompt's tokens before the segment
    contexts: tuple[tuple[int, ...], ...]
    for seg in segments:
        behind_head = in_head and bool(prompt) and seg.cacheable
        exact: tuple[Context, ...] = ()
        if behind_head:
            contexts, whole = (prompt,), seg.ids
        else:
            whole = seg.stored
            contexts = ((),) if not prompt else addressing.contexts_at(len(read - {whole}), whole)
            exact = tuple(c for c in contexts if c + whole[: seg.offset] == prompt and addressing.prefilled(whole, c))
            contexts = exact or contexts  # exact: it alone
        request_text = seg.cacheable and (behind_head or (head and not prompt))
        reads = addressing.reads(whole, contexts, salt if request_text else "") if seg.cacheable else ()
        run_of = seg.cacheable and len(seg.ids) < len(whole)
        context = (contexts[0] + whole[: seg.offset] if run_of else contexts[0]) if len(contexts) == 1 else None
        counted = bool(prompt) and not behind_head
        out.append(SegmentAddress(reads, whole, context, request_text, counted, seg.cacheable and bool(exact)))
        if seg.cacheable and prompt:
            read.add(whole)
        prompt += seg.ids
        in_head = in_head and not behind_head
    return out


def reads_neighbours(addressing: CacheAddressing, at: SegmentAddress) -> bool:
    """Whether segment `at` reads a chunk's cache behind its recorded neighbours (not request text, a grouped
    chunk, the prefix, or a chunk read behind `chunk_context`)."""
    return (
        not at.request_text
        and not addressing.grouped
        and any(len(c) > len(addressing.chunk_context) for c in at.contexts)
    )
