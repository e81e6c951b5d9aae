"""`CacheMaker`: how one index makes, names and stores its KV caches, at indexing time and on repair.

What each `chunk_prefill` stores for a chunk:
- `behind_prefix`: one cache, computed at the positions right after the system prefix, so the first retrieved
  chunk is exact and no chunk grows an attention sink of its own (the prefix's first token is the sink).
- `isolated`: one cache, the chunk alone from position 0.
- `neighbours`: the behind-prefix cache and one behind each number j = 1..`context_chunks` of the chunk's most
  similar chunks (its likely retrieval neighbours, laid out as a prompt lays chunks out, most similar last),
  recomputed from their text. A chunk with r chunks before it in a prompt reads the one behind
  min(r, `context_chunks`), averaged with its behind-prefix cache (`BlendKV`) unless the prompt's tokens
  before it are exactly that context.
- `cached_neighbours` (the default): the behind-prefix cache and one behind all `context_chunks` neighbours,
  computed behind their *cached* K/V (`compute_behind_cached`: the prefix's cache, each neighbour's
  behind-prefix cache re-rotated into place, the separators' caches between them), so only the chunk's own
  tokens are computed. A chunk after the first in a prompt reads that cache's mean with its behind-prefix one,
  stored as one cache (`stored_means`); an index made before means were stored keeps the neighbour cache itself.
- `grouped`: one cache, cut from its group of similar chunks (`grouping.similar_groups`, at most
  1 + `context_chunks`) prefilled behind the prefix as one sequence; a prompt that lays a group out as it was
  indexed reads exact caches, elsewhere a chunk reads its cache re-rotated to where it sits.
The chosen neighbours (or groups) are recorded in the neighbour table (`neighbours.sqlite`,
`indexing.neighbours.NeighbourTable`) before their caches are computed, every chunk's under a budget too
(`record_neighbours`): a chunk outside the hot set gets its neighbour cache from `CacheOpener.backfill` once prompts
have read it after another chunk twice. A chunk whose neighbour cache is not stored reads its behind-prefix cache
meanwhile.

Which chunks get caches, and in what order, is `hot_set`: the most central chunks first, within the store's
budget (`store.ledger`). A run records the caches it is about to compute in `pending.json`, so that an
interrupted run's caches are resumable work, not garbage (`pending`). Each cache is made by the maker's
`recipe` (`indexing.recipe.CacheRecipe`); its neighbour table is `neighbours`, its pending caches `records`
(`indexing.records.IndexRecords`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.filesize import decimal
from tqdm.auto import tqdm

from ..config import Config
from ..engine.cache import ChunkKV
from ..engine.prompt import PromptFormat
from ..engine.spec import ModelSpec, Pause
from ..retrieval.chunk_index import ChunkIndex
from ..retrieval.records import ChunkRecord
from ..store.addressing import CacheAddressing, Context
from ..store.backend import header_nbytes
from ..store.codecs import cache_nbytes
from ..store.kvstore import KVStore
from .grouping import similar_groups
from .neighbours import NeighbourTable
from .precompute import WriteBehind, compute_grouped, pack_tokens
from .recipe import CacheRecipe
from .records import IndexRecords, Pending

if TYPE_CHECKING:
    from .cluster import RayWorkers

log = logging.getLogger(__name__)

BATCH = 4096  # chunks a pass over the corpus holds at a time (their records, vectors or neighbour searches)
HOT_BATCH = 256  # chunks `hot_set` reads at a time, in order, until the budget is spent

LiveCache = tuple[str, tuple[int, ...], tuple[Context, ...]]  # store key, token ids, contexts (several: their mean)


class CacheMaker:
    """Computes the caches of one index's chunks (and prefix) into its `store`, names them (`addressing`),
    and recomputes one found missing or corrupt (`repair`), each made by its `recipe`. `foreign`: the model is
    not the one the index was built with, so a cache it computes at query time stays in this process's memory.
    `stored_means`: a `cached_neighbours` chunk's neighbour cache is stored averaged with its behind-prefix one
    (`CacheAddressing.stored_means`). Its neighbour table is `neighbours` (an index whose table is still
    `neighbours.json` has it moved into SQLite here, when this process may write the folder), its pending caches
    `records`."""

    def __init__(
        self,
        path: Path,
        config: Config,
        adapter: ModelSpec,
        store: KVStore,
        chunks: ChunkIndex,
        format: PromptFormat,
        namespace: str,
        foreign: bool,
        stored_means: bool,
    ) -> None:
        self.path, self.config, self.adapter, self.store = path, config, adapter, store
        self.chunks, self.format, self.foreign = chunks, format, foreign
        self.made = 0  # caches this object computed and stored while indexing (kept if the run is interrupted)
        self.records = IndexRecords(path)  # its pending caches
        self.neighbours = NeighbourTable(path)  # chunk (by `neighbour_key`) -> its neighbours' token ids
        self.neighbours.import_json()  # an index made when the table was `neighbours.json`
        bool(self.neighbours)  # a table that is not one fails the opening (`IndexFileError`), as `check` reports it
        chunk_context = () if config.index.chunk_prefill == "isolated" else format.prefix_ids
        # what names this index's caches (its neighbour table: `precompute_neighbours` or `precompute_grouped` fill it)
        self.addressing = CacheAddressing(
            namespace,
            chunk_context,
            format.prefix_ids,
            format.separator_ids,
            self.neighbours,
            self.grouped,
            by_depth=config.index.chunk_prefill != "cached_neighbours",
            stored_means=stored_means,
        )
        self.recipe = CacheRecipe(config, adapter, store, format, self.addressing, foreign)

    # ---- names ----------------------------------------------------------------------------------------
    @property
    def with_neighbours(self) -> bool:
        """Whether chunks also have caches behind their most similar chunks (recomputed or cached context)."""
        return self.config.index.chunk_prefill in ("neighbours", "cached_neighbours")

    @property
    def grouped(self) -> bool:
        """Whether each chunk's one cache is computed behind the chunks before it in its group of similar chunks."""
        return self.config.index.chunk_prefill == "grouped"

    @property
    def caches_per_chunk(self) -> int:
        """How many caches a chunk gets: its own (behind the prefix, its group, or nothing) and, with neighbours,
        one behind each number of them (`neighbours`) or one behind all (`cached_neighbours`)."""
        if not self.with_neighbours:
            return 1
        return 1 + (self.config.index.context_chunks if self.addressing.by_depth else 1)

    def disk_bytes(self, lengths: Iterable[int]) -> int:
        """Bytes on disk of all the caches (`caches_per_chunk`) of chunks of these token counts, as the store's
        codec stores them, their files' headers included."""
        lengths = list(lengths)
        position = len(self.addressing.chunk_context)  # 0 for `isolated`: computed behind nothing
        payload = cache_nbytes(self.store.codec, self.adapter.layout, lengths, position)
        return (payload + self._header_bytes * len(lengths)) * self.caches_per_chunk

    @cached_property
    def _header_bytes(self) -> int:
        """A cache file's header (`backend.header_nbytes`), as a whole chunk's takes it: shorter ones' are a few
        bytes less."""
        position = len(self.addressing.chunk_context)
        return header_nbytes(self.store.codec, self.adapter.layout, self.config.index.chunk_tokens, position)

    def _fixed(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """The caches every prompt or neighbour cache reads, as (key, token ids, context): the system prefix's,
        behind nothing, and with `cached_neighbours` the separator's, behind the prefix."""
        prefix, sep = self.format.prefix_ids, self.format.separator_ids
        fixed: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = [(self.addressing.key(prefix, ()), prefix, ())]
        if self.config.index.chunk_prefill == "cached_neighbours" and sep:
            fixed.append((self.addressing.key(sep, prefix), sep, prefix))
        return fixed

    def _fixed_bytes_lacking(self) -> int:
        """Bytes of the `_fixed` caches the disk does not hold yet."""
        codec, layout = self.store.codec, self.adapter.layout
        return sum(
            cache_nbytes(codec, layout, [len(ids)], len(context)) + self._header_bytes
            for key, ids, context in self._fixed()
            if key not in self.store.disk
        )

    def cache_bytes(self, n_tokens: int) -> int:
        """Bytes on disk of one cache of a chunk of `n_tokens` tokens."""
        return self.disk_bytes([n_tokens]) // self.caches_per_chunk

    def live(self) -> Iterator[LiveCache]:
        """Every cache the index uses, as (store key, token ids, contexts), one chunk's at a time (a chunk's contexts
        hold its neighbours' tokens: held together for a corpus, they would take tens of bytes a token): the
        prefix's, each chunk's behind its context (with `grouped`, the chunks before it in its group) and, with
        `chunk_prefill="neighbours"` (or "cached_neighbours"), behind each number of its recorded neighbours
        (`CacheAddressing.neighbour_reads`). Chunks of the same text give the same caches, each time."""
        for key, ids, context in self._fixed():
            yield key, ids, (context,)
        for ids in self.chunks.token_ids():
            own = self.addressing.own_context(ids)
            yield self.addressing.key(ids, own), ids, (own,)
            for key, contexts in self.addressing.neighbour_reads(ids) if self.with_neighbours else ():
                yield key, ids, contexts

    def live_keys(self) -> set[str]:
        """The store keys of every cache the index uses (`live`)."""
        return {key for key, _, _ in self.live()}

    # ---- what indexing makes, in what order -----------------------------------------------------------
    def hot_set(self) -> list[ChunkRecord]:
        """The indexed chunks whose caches indexing makes, most likely to be retrieved first, within the store's
        budget (`store.ledger`): by how central each chunk is among the corpus' embeddings (cosine to their mean:
        the chunks many questions land near), each taking the bytes of the caches it lacks (`caches_per_chunk`),
        until the budget's free room is spent. Without a budget, every chunk. It holds each chunk's id and score,
        and reads the chunks it returns and at most `HOT_BATCH` more."""
        ids, scores = self.chunks.centrality(BATCH)  # [C] cosines to the corpus' mean vector
        order = np.argsort(-scores, kind="stable")  # [C], most central first
        room = None if self.store.ledger is None else self.store.ledger.room()
        if room is None:
            return self.chunks.get([ids[i] for i in order])
        room -= self._fixed_bytes_lacking()
        hot: list[ChunkRecord] = []
        for start in range(0, len(order), HOT_BATCH):
            for chunk in self.chunks.get([ids[i] for i in order[start : start + HOT_BATCH]]):
                held = sum(key in self.store.disk for key in self.chunk_keys(chunk.token_ids))
                need = (self.caches_per_chunk - held) * self.cache_bytes(len(chunk.token_ids))
                if need > room:
                    return hot
                room -= need
                hot.append(chunk)
        return hot

    def chunk_keys(self, ids: tuple[int, ...]) -> list[str]:
        """The store keys of chunk `ids`'s caches: its own and, once its neighbours are recorded, theirs."""
        return [self.addressing.own_key(ids), *(k for k, _ in self.addressing.neighbour_reads(ids))][
            : self.caches_per_chunk
        ]

    # ---- indexing -------------------------------------------------------------------------------------
    def precompute(
        self,
        chunks: Sequence[tuple[int, ...]],
        progress: bool = True,
        workers: RayWorkers | None = None,
    ) -> int:
        """Compute and store the caches of the prefix and of `chunks` not yet stored; returns how many.
        The writes run behind the compute (`WriteBehind`); with `workers`, the chunks' caches are computed
        on a Ray cluster, and each is checked to be in this index's store before this returns."""
        prefix, key = self.format.prefix_ids, self.addressing.key
        # Present means on this index's own disk: an entry in the shared tier proves only that some writer
        # stored something under the key (one planted there before indexing was once never computed here).
        held = self.store.disk if workers is None else self.store
        if key(prefix, ()) not in held:
            self.store.put(key(prefix, ()), next(self.recipe.compute([prefix], ()))[1])
        todo = list(dict.fromkeys(ids for ids in chunks if key(ids) not in held))  # in the caller's order
        self.records.record_pending(self.pending() | {key(ids): (ids, self.addressing.chunk_context) for ids in todo})
        if workers is not None:
            workers.store(todo, self.addressing.chunk_context, progress)
            self._check_stored({ids: key(ids) for ids in todo})
            return len(todo)
        if todo:
            self._announce(todo)
        bar = tqdm(total=sum(map(len, todo)), unit="tok", desc="KV precompute", disable=not progress)
        with WriteBehind(self.store) as writer:
            for i, kv in self.recipe.compute(todo, self.addressing.chunk_context):
                writer.put(key(todo[i]), kv)
                self.made += 1
                bar.update(len(todo[i]))
        bar.close()
        return len(todo)

    def precompute_grouped(
        self,
        chunks: Sequence[ChunkRecord],
        embeddings: np.ndarray,
        progress: bool = True,
        workers: RayWorkers | None = None,
    ) -> int:
        """`chunk_prefill="grouped"`: compute and store the caches of `chunks` (embedded as `embeddings` [C, E])
        that have none yet, in groups of similar chunks, each group one sequence behind the prefix (packed
        several to a forward); record each chunk's group before it in the neighbour table. Returns how many
        caches were computed. A chunk already recorded with its cache stored (an unchanged chunk of an edited
        document, or one a killed run computed) is not computed again; a recorded one whose cache is missing
        is grouped again. With Ray `workers`, the groups are computed on the cluster, in the packs this process
        would prefill, and each cache is checked to be in this index's store before this returns."""
        prefix, sep = self.format.prefix_ids, self.format.separator_ids
        key, own_key = self.addressing.key, self.addressing.own_key
        todo, rows, seen = [], [], set()
        for row, chunk in enumerate(chunks):
            ids = chunk.token_ids
            if ids in seen or own_key(ids) in self.store.disk:
                continue
            seen.add(ids)
            todo.append(ids)
            rows.append(row)
        stored = key(prefix, ()) in self.store.disk
        if stored and not todo:
            return 0
        past = self.adapter.prefill_packed([prefix])[0]  # L x [H_kv, P, D] each: what every group is behind
        if not stored:
            self.store.put(key(prefix, ()), ChunkKV(*past, 0))
        if not todo:
            return 0
        groups = [[todo[i] for i in g] for g in similar_groups(embeddings[rows], 1 + self.config.index.context_chunks)]
        self.neighbours.record(
            (self.addressing.neighbour_key(ids), group[:k][::-1])  # nearest first
            for group in groups
            for k, ids in enumerate(group)
        )  # one transaction: readers see the old table or the new one
        contexts = {ids: self.addressing.own_context(ids) for ids in todo}  # behind its group, now recorded
        keys = {ids: key(ids, context) for ids, context in contexts.items()}
        self.records.record_pending(self.pending() | {keys[ids]: (ids, context) for ids, context in contexts.items()})
        if workers is not None:
            workers.store_groups(groups, prefix, sep, keys, progress)
            self._check_stored(keys)
            return len(todo)
        self._announce(todo, f" in {len(groups)} groups of similar chunks")
        bar = tqdm(total=sum(map(len, todo)), unit="tok", desc="KV precompute, grouped", disable=not progress)
        with WriteBehind(self.store) as writer:
            for ids, kv in compute_grouped(self.adapter, groups, past, sep, pack_tokens(self.config)):
                writer.put(keys[ids], kv)
                self.made += 1
                bar.update(len(ids))
        bar.close()
        return len(todo)

    def _check_stored(self, keys: Mapping[tuple[int, ...], str]) -> None:
        """Every chunk cache the Ray workers were given (chunk ids -> store key) is in this index's store, or
        `RuntimeError`."""
        if lost := [ids for ids, k in keys.items() if k not in self.store]:
            raise RuntimeError(
                f"{len(lost)} of the {len(keys)} chunk caches the Ray workers computed are not in the store "
                f"{self.store.root}: workers on other machines need a shared tier (--kv-remote)"
            )

    def _announce(self, todo: Sequence[tuple[int, ...]], how: str = "") -> None:
        """Log, before computing them, how many chunk caches indexing computes (`how`) and about how many bytes
        they and the chunks' other caches (`caches_per_chunk`) take on disk."""
        per_chunk = self.caches_per_chunk
        log.info(
            "computing the KV caches of %d chunks%s (%d tokens): about %s on disk (codec %s%s)",
            len(todo),
            how,
            sum(map(len, todo)),
            decimal(self.disk_bytes(map(len, todo))),
            self.store.codec.name,
            f", {per_chunk} caches a chunk" if per_chunk > 1 else "",
        )

    def pending(self) -> Pending:
        """The caches an `index` run computed for chunks it had not committed when it was interrupted (Ctrl-C,
        a crash): kept (not orphans), and read again by the next run."""
        return self.records.pending()  # IndexFileError naming pending.json when it does not parse

    def kept(self) -> set[str]:
        """The store keys of every cache the index keeps: its chunks' (`live_keys`) and an interrupted run's
        (`pending`)."""
        return self.live_keys() | self.pending().keys()

    def committed(self) -> None:
        """The run's chunks are committed: its caches are the index's now, no longer pending."""
        self.records.clear_pending()

    def lacking_neighbour_caches(self) -> Iterator[ChunkRecord]:
        """The indexed chunks without recorded neighbours or without every cache those give them, read a batch at
        a time (one request to a remote tier a batch): this run's new ones, those of a run killed after it
        committed its chunks but before it recorded theirs, and a dropped document's indexed again (the table
        keeps a text's neighbours after its caches are collected)."""
        chunks = self.chunks.all_chunks()
        while batch := list(itertools.islice(chunks, BATCH)):
            reads = [[key for key, _ in self.addressing.neighbour_reads(c.token_ids)] for c in batch]
            missing = self.store.missing(key for keys in reads for key in keys)
            for c, keys in zip(batch, reads, strict=True):
                if self.addressing.neighbour_key(c.token_ids) not in self.neighbours or not missing.isdisjoint(keys):
                    yield c

    def record_lacking(self, named: Set[str]) -> set[str]:
        """Record the neighbours of the chunks lacking neighbour caches (`lacking_neighbour_caches`) that have none
        recorded, but for those in `named` (chunk ids: the hot set's, which `precompute_neighbours` records);
        returns the ids of every chunk lacking them. Under a budget, `CacheOpener.backfill` makes the caches of
        those recorded here."""
        lacking: set[str] = set()

        def unrecorded() -> Iterator[ChunkRecord]:
            for chunk in self.lacking_neighbour_caches():
                lacking.add(chunk.id)
                if chunk.id not in named and not self.addressing.near(chunk.token_ids):
                    yield chunk

        self.record_neighbours(unrecorded())
        return lacking

    def precompute_neighbours(self, chunks: Sequence[ChunkRecord], progress: bool = True) -> int:
        """`chunk_prefill="neighbours"` or "cached_neighbours": for each of `chunks` (already in the index, in the
        order given), find its `context_chunks` most similar other chunks, store its caches computed behind the
        prefix and them (`CacheAddressing.neighbour_sets`: `neighbours`, its j most similar for each j;
        `cached_neighbours`, all of them; with `stored_means`, each averaged with its behind-prefix cache), made
        by `make`; returns how many caches were computed. The neighbours are recorded in the neighbour table before
        any of their caches is computed, so a run killed midway leaves caches the index names (kept, not
        garbage), and the next run skips those stored; a chunk whose neighbour cache is not stored reads its
        behind-prefix one meanwhile (`store.opening`). Stops at the first cache the store's budget does not
        admit."""
        key = self.addressing.key
        sep, prefix = self.format.separator_ids, self.format.prefix_ids
        if (
            chunks
            and self.config.index.chunk_prefill == "cached_neighbours"
            and sep
            and self.store.missing([key(sep, prefix)])
        ):
            self.store.put(key(sep, prefix), next(self.recipe.compute([sep], prefix))[1])  # read between neighbours
        self.record_neighbours(chunks)
        reads = [self.addressing.neighbour_reads(chunk.token_ids) for chunk in chunks]
        todo = self.store.missing(at for chunk_reads in reads for at, _ in chunk_reads)  # one request to a remote tier
        made = 0
        bar = tqdm(total=len(chunks), unit="chunk", desc="KV caches behind neighbours", disable=not progress)
        with WriteBehind(self.store) as writer:
            for chunk, chunk_reads in zip(chunks, reads, strict=True):
                lacking = [(at, contexts) for at, contexts in chunk_reads if at in todo]
                if lacking and not self._room_for(len(lacking) * self.cache_bytes(len(chunk.token_ids))):
                    log.info(
                        "the KV store's budget is spent: %d chunks left without neighbour caches", len(chunks) - bar.n
                    )
                    break
                for at, contexts in lacking:
                    writer.put(at, self.make(chunk.token_ids, contexts))
                    todo.discard(at)
                    made += 1
                    self.made += 1
                bar.update(1)
        bar.close()
        return made

    def record_neighbours(self, chunks: Iterable[ChunkRecord]) -> None:
        """Record each of `chunks`' `context_chunks` most similar other chunks in the neighbour table (a search and
        a transaction each `BATCH` chunks, so what is held meanwhile is bounded), which name its neighbour
        cache: made by `precompute_neighbours` for the hot set, and for a chunk outside it by
        `CacheOpener.backfill` once prompts have read the chunk after another one twice."""
        chunks = iter(chunks)
        while batch := list(itertools.islice(chunks, BATCH)):
            nearest = self.chunks.nearest(batch, self.config.index.context_chunks)
            self.neighbours.record(
                (self.addressing.neighbour_key(chunk.token_ids), [n.token_ids for n in near])
                for chunk, near in zip(batch, nearest, strict=True)
            )

    def _room_for(self, nbytes: int) -> bool:
        """Whether the store's budget has `nbytes` free (always, without a budget)."""
        room = None if self.store.ledger is None else self.store.ledger.room()
        return room is None or nbytes <= room

    def forget_unindexed(self) -> int:
        """Drop the neighbour table's entries of texts neither an indexed chunk nor an interrupted run's pending
        cache (`pending`) holds any more (deleted or edited documents'): their caches are collected with them, and
        a text indexed again gets neighbours afresh; an interrupted run's chunks keep theirs, since its grouped
        caches are addressed by them and the next run resumes with both. Returns how many entries went."""
        if not self.neighbours:  # an index without a table (`behind_prefix`, `isolated`) or with none yet
            return 0
        texts = itertools.chain(self.chunks.token_ids(), (ids for ids, _ in self.pending().values()))
        return self.neighbours.forget({self.addressing.neighbour_key(ids) for ids in texts})

    # ---- making one cache -----------------------------------------------------------------------------
    def make(self, ids: tuple[int, ...], contexts: Sequence[Context], pause: Pause | None = None) -> ChunkKV:
        """The cache of `ids` behind `contexts`, made as the index makes it (`CacheRecipe.make`); `pause` is called
        before each layer of its forwards."""
        return self.recipe.make(ids, contexts, pause)

    def repair(self, key: str, ids: tuple[int, ...], contexts: Sequence[Context]) -> ChunkKV:
        """Recompute a missing or corrupt cache and store it again (`CacheRecipe.repair`)."""
        return self.recipe.repair(key, ids, contexts)
