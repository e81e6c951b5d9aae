"""`KVIndex`: an index you build and open: chunks, vectors, and every chunk's KV cache.

An index directory holds the chunk/document metadata and vectors (`index.sqlite`, `vectors.faiss`)
and the per-chunk KV caches (`kv/`). Chunks are prefilled *behind the system prefix* by default: a
chunk's cache is computed at the positions it would have right after the prefix, so the first
retrieved chunk is exact and no chunk grows an attention sink of its own (the prefix's first
token is the sink). `chunk_prefill="isolated"` computes each chunk alone from position 0 instead.
`chunk_prefill="neighbours"` (FusionRAG-style) also computes each chunk behind the prefix and its
most similar chunks of the corpus (its likely retrieval neighbours, laid out as in a prompt, the most
similar last), so its cache already carries cross-attention of the kind a prompt needs: one cache behind
each number j = 1..`context_chunks` of them, and a chunk with r chunks before it in a prompt reads the
one behind min(r, `context_chunks`), a context as long as the one it meets (the second chunk of a prompt
reads its cache behind its single most similar chunk: exact where that chunk is the first). Unless the
prompt's tokens before it are exactly that context, the chunk reads the mean of that cache and its
behind-prefix one (`BlendKV`): the deviations particular to each context partly cancel (measured in
`benchmarks/fusion-quality/RESULTS.md`, "Session 8"). The chosen neighbours are recorded in
`neighbours.json`. The first chunk, or one without recorded neighbours (indexed by a run killed before it
recorded them), uses its behind-prefix cache, which every index stores.
`chunk_prefill="cached_neighbours"` stores the same caches (same contexts, same neighbours, read the same
way), each computed behind the neighbours' *cached* K/V instead of their recomputed text: the prefix's
cache, then each neighbour's behind-prefix cache re-rotated to the position it takes in the context,
with the separator between two of them read from the separator's own cache behind the prefix, and the
separator just before the chunk computed with the chunk (`compute_behind_cached`). Only the chunk's own
tokens are computed for each context, so a context costs about a plain forward over the chunk (the
recomputed text costs the context's tokens too); the K/V differ from the recomputed ones (a neighbour's
cached tokens have not seen the neighbours before it), so they live under their own keys (the namespace
holds `chunk_prefill`). With one neighbour the context is exact (the neighbour's cache is its own,
right after the prefix), and so is the chunk's cache behind it.

Consistency. Indexers are serialised by a lock file (`.writer.lock`): a second indexer waits, then
finds the work done. A sync stores the new chunks' caches *before* it commits them, so every chunk
the index holds has its cache; a `kill -9` mid-way leaves the index as it was plus some complete
cache entries (writes are atomic renames; temporary files of dead writers are removed by the next
indexer), and re-running the command resumes, reusing what was stored. A full disk fails the
update with `StorageFullError` and the same guarantee. Readers need no lock. At query time a
missing or corrupt cache (detected when opened or, per layer, when read) is recomputed, rewritten
and logged, and the fusion continues with the recomputed cache, so the answer is unchanged.

Which caches a prompt reads is `store.addressing` (`KVIndex.addressing`, `address`); `open_caches` opens
them and, where needed, repairs them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, fields, replace
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import xxhash
from filelock import FileLock, Timeout
from rich.filesize import decimal
from tqdm.auto import tqdm

from .config import Config
from .engine.cache import BlendKV, ChunkKV, LayerSource, SliceKV
from .engine.model import ModelAdapter
from .engine.prompt import PromptFormat, Segment
from .errors import StorageFullError
from .indexing.precompute import WriteBehind, compute_behind_cached, compute_caches, pack_tokens
from .retrieval import vectors as faiss_file
from .retrieval.chunk_index import ChunkIndex, ChunkRecord, Hit, SyncReport, TextDocument
from .retrieval.chunking import chunk_document
from .retrieval.database import exists
from .retrieval.embedder import load_embedder
from .store.addressing import CacheAddressing, address
from .store.backend import CorruptEntryError
from .store.kvstore import KVStore
from .store.tiers import MemoryTier

if TYPE_CHECKING:
    from .indexing.cluster import RayWorkers

log = logging.getLogger(__name__)

_INDEX_CONFIG_KEYS = (
    "model",
    "embedder",
    "chunk_tokens",
    "index_type",
    "system_prompt",
    "chunk_prefill",
    "context_chunks",
    "dtype",
)


class KVIndex:
    """Chunks, vectors and per-chunk KV caches of a document folder, for one model."""

    def __init__(self, path: Path, config: Config, chunks: ChunkIndex, adapter: ModelAdapter) -> None:
        self.path = path
        if (codec := chunks.meta.get("kv_codec", "none")) != config.storage.codec:  # what the index records wins
            log.info(
                "index %s stores KV caches as %r: reading and writing them so, not as %r",
                path,
                codec,
                config.storage.codec,
            )
            config = replace(config, storage=replace(config.storage, codec=codec))
        self.config = config
        self.chunks = chunks
        self.adapter = adapter
        self.store = KVStore(path / "kv", config.storage, adapter.device)
        self.request_tiers: dict[str, MemoryTier] = {}  # per API key: caches of request text (`request_tier`)
        self.format = PromptFormat.build(adapter.tokenizer, config.system_prompt)
        self.namespace = xxhash.xxh3_128_hexdigest(f"{adapter.fingerprint}|{config.chunk_prefill}".encode())
        built_with = chunks.meta.get("model_fingerprint")
        self.foreign = built_with != adapter.fingerprint  # then caches computed at query time stay in memory
        if self.foreign:
            log.warning(
                "index %s was built with model %s (fingerprint %s); %s (fingerprint %s) will miss every cached "
                "chunk and prefill it at query time, keeping it in this process's memory, not in the index",
                path,
                chunks.meta.get("model"),
                built_with,
                config.model,
                adapter.fingerprint,
            )
        if (remote := chunks.meta.get("kv_remote")) and config.storage.remote is None:
            log.warning(
                "index %s was built with its KV caches also in the shared tier %s; opened without it "
                "(--kv-remote), the caches missing from this machine's disk are recomputed",
                path,
                remote,
            )
        if chunks.meta.get("tokenizer") != _tokenizer_id(adapter.tokenizer):
            raise ValueError(
                f"index {path} was chunked with the tokenizer of {chunks.meta.get('model')!r}; {config.model!r} "
                "tokenizes differently, so its stored token ids mean nothing to it: re-index with this model"
            )

    # ---- building -------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, config: Config = Config(), adapter: ModelAdapter | None = None) -> KVIndex:
        """An index at `path` for `config`: a new empty one, or the one already there."""
        path = Path(path)
        adapter = adapter or ModelAdapter.load(config)
        embedder = load_embedder(config.embedder, device=config.device)
        path.mkdir(parents=True, exist_ok=True)
        with _writer_lock(path):
            if exists(path):
                return cls(path, config, ChunkIndex.open(path, embedder), adapter)
            meta = {k: str(getattr(config, k)) for k in _INDEX_CONFIG_KEYS}
            meta |= {
                "model_fingerprint": adapter.fingerprint,
                "tokenizer": _tokenizer_id(adapter.tokenizer),
                "kv_codec": config.storage.codec,
            } | ({"kv_remote": config.storage.remote_address} if config.storage.remote else {})
            chunks = ChunkIndex.create(path, embedder, config.embedder, meta, config.index_type)
        return cls(path, config, chunks, adapter)

    @classmethod
    def build(
        cls,
        docs_dir: Path,
        path: Path,
        config: Config = Config(),
        adapter: ModelAdapter | None = None,
        progress: bool = True,
    ) -> KVIndex:
        """Index `docs_dir` into `path`, creating the index or bringing it up to date."""
        index = cls.create(path, config, adapter)
        index.update(docs_dir, progress=progress)
        return index

    @staticmethod
    def config_of(path: Path, base: Config = Config()) -> Config:
        """The settings an index was built with (fields it does not record come from `base`)."""
        meta = ChunkIndex.read_meta(Path(path))
        types = {f.name: f.type for f in fields(Config)}
        values = {k: int(meta[k]) if types[k] == "int" else meta[k] for k in _INDEX_CONFIG_KEYS if k in meta}
        return replace(base, **values, storage=replace(base.storage, codec=meta.get("kv_codec", "none")))

    @classmethod
    def open(
        cls, path: Path, config: Config | None = None, adapter: ModelAdapter | None = None, rewrite: bool = True
    ) -> KVIndex:
        """Open an existing index; `config` defaults to the settings it was built with. A damaged
        `vectors.faiss` is rewritten from SQLite where this process may (`ChunkIndex.open`), unless
        `rewrite` is False (`rag-kvcache check` sees the index as it is)."""
        path = Path(path)
        config = config or cls.config_of(path)
        adapter = adapter or ModelAdapter.load(config)
        return cls(path, config, ChunkIndex.open(path, load_embedder(config.embedder, config.device), rewrite), adapter)

    def update(
        self, docs_dir: Path, progress: bool = True, prune: bool = False, workers: RayWorkers | None = None
    ) -> SyncReport:
        """Add `docs_dir`: index its new and changed files, storing the new chunks' KV caches before the
        index commits them; other documents stay unless `prune` drops those not in `docs_dir`. With
        `workers` (`ray_workers()`) the caches are computed on a Ray cluster.
        Raises `StorageFullError` (index unchanged) when the disk fills."""
        tok, n = self.adapter.tokenizer, self.config.chunk_tokens
        with _writer_lock(self.path):
            used = self.live_keys()
            staged = self.chunks.stage_sync(
                Path(docs_dir),
                lambda text, src: chunk_document(text, src, tok, n),
                progress=progress,
                prune=prune,
                max_file_bytes=self.config.max_file_bytes,
                max_documents=self.config.max_documents,
            )
            self.precompute([c.token_ids for c in staged.report.new_chunks], progress=progress, workers=workers)
            report = self.chunks.commit(staged)  # a committed chunk always has its cache
            self._pending_path.unlink(missing_ok=True)  # committed: the run's caches are the index's now
            if self.with_neighbours:
                self.precompute_neighbours(self.unrecorded_chunks(), progress)
            self.collect(used)
        self.flush_stats()
        return report

    def add_texts(self, documents: Sequence[TextDocument], progress: bool = True) -> SyncReport:
        """Add documents given as text (a vector store's: `source` is the document's id): chunked,
        embedded, and the new chunks' KV caches stored before the index commits them, as `update` does;
        a document with the source of an indexed one replaces it, nothing else is removed."""
        tok, n = self.adapter.tokenizer, self.config.chunk_tokens
        with _writer_lock(self.path):
            used = self.live_keys()
            staged = self.chunks.stage_texts(
                documents, lambda text, src: chunk_document(text, src, tok, n), progress=progress
            )
            self.precompute([c.token_ids for c in staged.report.new_chunks], progress=progress)
            report = self.chunks.commit(staged)
            self._pending_path.unlink(missing_ok=True)  # committed: the run's caches are the index's now
            if self.with_neighbours:
                self.precompute_neighbours(self.unrecorded_chunks(), progress)
            self.collect(used)
        self.flush_stats()
        return report

    def delete(self, sources: Sequence[str]) -> list[str]:
        """Remove the documents (files or texts) with these sources; returns those the index held."""
        with _writer_lock(self.path):
            used = self.live_keys()
            removed = self.chunks.delete(sources)
            self.collect(used)
        return removed

    def ray_workers(self) -> RayWorkers:
        """A pool of Ray actors computing this index's chunk caches into its store (`config.ray`,
        `config.ray_workers`), for `update(workers=...)`; a context manager that stops them."""
        from .indexing.cluster import RayWorkers

        return RayWorkers(self.config, self.store.root, self.namespace, self.adapter.fingerprint)

    def live_keys(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Every cache the index uses, as store key -> (token ids, context): the prefix's, each chunk's
        behind its context and, with `chunk_prefill="neighbours"` (or "cached_neighbours"), behind each number of
        its recorded neighbours."""
        prefix = self.format.prefix_ids
        live = {self.addressing.key(prefix, ()): (prefix, ())}
        if self.config.chunk_prefill == "cached_neighbours" and self.format.separator_ids:
            live[self.addressing.key(self.format.separator_ids, prefix)] = (self.format.separator_ids, prefix)
        for ids in self.chunks.token_ids():
            live[self.addressing.key(ids)] = (ids, self.addressing.chunk_context)
            for context in self.addressing.neighbour_contexts(self.addressing.near(ids)):
                live[self.addressing.key(ids, context)] = (ids, context)
        return live

    def orphans(self, candidates: Iterable[str] | None = None) -> list[Path]:
        """The disk caches no indexed chunk uses (not in `live_keys`) and no interrupted run will resume with
        (not `pending`): all of them, or those among the keys `candidates`."""
        live = self.live_keys() | self.pending()
        if candidates is None:
            return [path for path in self.store.disk.files() if path.stem not in live]
        return [self.store.disk.path(key) for key in candidates if key not in live and key in self.store.disk]

    def writer_lock(self) -> AbstractContextManager[None]:
        """The lock `update` holds while it changes the index, for other writers (`maintenance`)."""
        return _writer_lock(self.path)

    def collect(self, used: Iterable[str] | None = None) -> Collected:
        """Garbage collection (the caller holds the writer lock): delete the disk caches no indexed chunk
        uses and the temporary files of killed writers (`kv/??/.tmp-*` of dead processes,
        `.vectors.faiss.*`). `update`, `add_texts` and `delete` pass the keys the index `used` before
        they changed it, so only the caches of the chunks they removed go (of edited or deleted
        documents); without `used` (`rag-kvcache gc`), every cache that is not an indexed chunk's goes
        too (another model's, a prompt head cached at query time: recomputed when next needed).
        Files of names this package does not make are left alone. Opened with a model the index was
        not built with (`foreign`), it collects temporary files only: that model addresses none of the
        index's caches, so all of them would look orphaned."""
        orphans = [] if self.foreign else self.orphans(used)
        freed = 0
        for path in orphans:
            freed += path.stat().st_size
            self.store.memory.remove(path.stem)
            self.store.disk.remove(path.stem)
        temp = self.store.disk.remove_stale_temp_files() + len(faiss_file.remove_temp_files(self.path))
        if orphans or temp:
            log.info(
                "collected %d orphan KV caches (%.1f MiB) and %d temporary files in %s",
                len(orphans),
                freed / 2**20,
                temp,
                self.path,
            )
        return Collected(len(orphans), freed, temp)

    def flush_stats(self) -> None:
        """Add the store's counters to its `stats.json`; a failure (a full disk, a read-only index) is
        logged, never raised: no answer or index run is lost for its counters."""
        try:
            self.store.flush_stats()
        except OSError as err:
            log.warning("could not write the KV store counters of %s: %s", self.path, err)

    def precompute(
        self,
        chunks: Sequence[tuple[int, ...]],
        progress: bool = True,
        workers: RayWorkers | None = None,
    ) -> int:
        """Compute and store the caches of the prefix and of `chunks` not yet stored; returns how many.
        The writes run behind the compute (`WriteBehind`); with `workers`, the chunks' caches are computed
        on a Ray cluster, and each is checked to be in this index's store before this returns."""
        prefix = self.format.prefix_ids
        # Present means on this index's own disk: an entry in the shared tier proves only that some writer
        # stored something under the key (one planted there before indexing was once never computed here).
        held = self.store.disk if workers is None else self.store
        if self.addressing.key(prefix, ()) not in held:
            self.store.put(self.addressing.key(prefix, ()), next(self.compute([prefix], ()))[1])
        todo = list({ids for ids in chunks if self.addressing.key(ids) not in held})
        self._record_pending(
            self.pending() | {self.addressing.key(ids): (ids, self.addressing.chunk_context) for ids in todo}
        )
        if workers is not None:
            workers.store(todo, self.addressing.chunk_context, progress)
            if lost := [ids for ids in todo if self.addressing.key(ids) not in self.store]:
                raise RuntimeError(
                    f"{len(lost)} of the {len(todo)} chunk caches the Ray workers computed are not in the store "
                    f"{self.store.root}: workers on other machines need a shared tier (--kv-remote)"
                )
            return len(todo)
        if todo:
            log.info(
                "computing the KV caches of %d chunks (%d tokens): about %s on disk (codec %s)",
                len(todo),
                sum(map(len, todo)),
                decimal(self.kv_bytes(map(len, todo))),
                self.store.codec.name,
            )
        bar = tqdm(total=sum(map(len, todo)), unit="tok", desc="KV precompute", disable=not progress)
        with WriteBehind(self.store) as writer:
            for i, kv in self.compute(todo, self.addressing.chunk_context):
                writer.put(self.addressing.key(todo[i]), kv)
                bar.update(len(todo[i]))
        bar.close()
        return len(todo)

    def pending(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """The caches an `index` run computed for chunks it had not committed when it was interrupted (Ctrl-C,
        a crash), as store key -> (token ids, context): kept (not orphans), and read again by the next run."""
        if not self._pending_path.is_file():
            return {}
        table = json.loads(self._pending_path.read_text(encoding="utf-8"))
        return {key: (tuple(ids), tuple(ctx)) for key, (ids, ctx) in table.items()}

    @property
    def _pending_path(self) -> Path:
        return self.path / "pending.json"

    def _record_pending(self, pending: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """Record a run's caches before it computes them: until it commits they are resumable work, not garbage."""
        _write_json(self._pending_path, {key: [list(ids), list(ctx)] for key, (ids, ctx) in pending.items()})

    def unrecorded_chunks(self) -> list[ChunkRecord]:
        """`chunk_prefill="neighbours"` or "cached_neighbours": the indexed chunks without recorded neighbours:
        this run's new ones, and those of a run killed after it committed its chunks but before it recorded theirs."""
        table = self._neighbours
        return [c for c in self.chunks.all_chunks() if self.addressing.neighbour_key(c.token_ids) not in table]

    def precompute_neighbours(self, chunks: Sequence[ChunkRecord], progress: bool = True) -> int:
        """`chunk_prefill="neighbours"` or "cached_neighbours": for each of `chunks` (already in the index),
        find its `context_chunks` most similar other chunks, store its caches computed behind the prefix and
        its j most similar of them for each j (`CacheAddressing.neighbour_contexts`, made by `_behind_neighbours`), and
        record them in `neighbours.json`; returns how many caches were computed. A run killed midway leaves
        whole cache entries and the old table: the next run finds the same neighbours and skips the
        caches already stored."""
        table = self._neighbours
        sep, prefix = self.format.separator_ids, self.format.prefix_ids
        if (
            chunks
            and self.config.chunk_prefill == "cached_neighbours"
            and sep
            and self.addressing.key(sep, prefix) not in self.store
        ):
            self.store.put(
                self.addressing.key(sep, prefix), next(self.compute([sep], prefix))[1]
            )  # read between neighbours
        bar = tqdm(total=len(chunks), unit="chunk", desc="KV precompute behind neighbours", disable=not progress)
        done = 0
        for chunk in chunks:
            hits = self.chunks.search(chunk.text, self.config.context_chunks + 1)
            near = [h.chunk.token_ids for h in hits if h.chunk.token_ids != chunk.token_ids][
                : self.config.context_chunks
            ]
            table[self.addressing.neighbour_key(chunk.token_ids)] = [list(ids) for ids in near]
            for j, ctx in enumerate(self.addressing.neighbour_contexts(near), 1):
                if self.addressing.key(chunk.token_ids, ctx) not in self.store:
                    self.store.put(
                        self.addressing.key(chunk.token_ids, ctx), self._behind_neighbours(chunk.token_ids, near[:j])
                    )
                    done += 1
            bar.update(1)
        bar.close()
        _write_json(self._neighbours_path, table)  # atomic: readers see the old table or the new one
        return done

    def _behind_neighbours(self, ids: tuple[int, ...], near: Sequence[Sequence[int]]) -> ChunkKV:
        """The cache of chunk `ids` behind `addressing.neighbour_context(near)`: with `chunk_prefill="cached_neighbours"`
        computed behind the cached K/V of that context (the prefix's cache, each neighbour's behind-prefix
        cache, the separator's behind-prefix cache between them; the last separator computed with the
        chunk), else behind the context's recomputed text."""
        if self.config.chunk_prefill != "cached_neighbours":
            return next(self.compute([ids], self.addressing.neighbour_context(near)))[1]
        prefix, sep = self.format.prefix_ids, self.format.separator_ids
        between = [self._cached(sep, prefix)] if sep else []
        sources = [self._cached(prefix, ())]
        for i, n in enumerate(reversed(near)):
            sources += [*(between if i else []), self._cached(tuple(n), prefix)]
        return compute_behind_cached(self.adapter, ids, sources, sep)

    def _cached(self, ids: tuple[int, ...], context: tuple[int, ...]) -> LayerSource:
        """The stored cache of `ids` behind `context`, to build a cached context from: a missing one is
        recomputed and stored (logged), one that fails a layer's check when read is recomputed then."""
        key = self.addressing.key(ids, context)
        entry = self.store.open(key)
        if entry is None:
            return self._repair(key, ids, context)
        return entry if isinstance(entry, ChunkKV) else _Repairing(entry, partial(self._repair, key, ids, context))

    def _compute_one(self, ids: tuple[int, ...], context: tuple[int, ...]) -> ChunkKV:
        """The cache of `ids` behind `context`, made as the index makes it: behind one of the chunk's recorded
        neighbour contexts, as `_behind_neighbours` makes it; else a prefill behind the context's tokens."""
        near = self.addressing.near(ids)
        j = next((j for j in range(1, len(near) + 1) if self.addressing.neighbour_context(near[:j]) == context), None)
        return next(self.compute([ids], context))[1] if j is None else self._behind_neighbours(ids, near[:j])

    def compute(self, chunks: Sequence[tuple[int, ...]], context: tuple[int, ...]) -> Iterator[tuple[int, ChunkKV]]:
        """Prefill each chunk behind `context` (`compute_caches`: packed forwards); yields (index in
        `chunks`, cache)."""
        return compute_caches(self.adapter, chunks, context, pack_tokens(self.config))

    # ---- cache addressing and opening --------------------------------------------------------------
    @property
    def with_neighbours(self) -> bool:
        """Whether chunks also have caches behind their most similar chunks (recomputed or cached context)."""
        return self.config.chunk_prefill in ("neighbours", "cached_neighbours")

    @property
    def _neighbours_path(self) -> Path:
        return self.path / "neighbours.json"

    @cached_property
    def _neighbours(self) -> dict[str, list[list[int]]]:
        """`chunk_prefill="neighbours"` or "cached_neighbours": chunk (by `neighbour_key`) -> its recorded
        neighbours' token ids."""
        if not self.with_neighbours or not self._neighbours_path.exists():
            return {}
        return json.loads(self._neighbours_path.read_text(encoding="utf-8"))

    @cached_property
    def addressing(self) -> CacheAddressing:
        """What names this index's caches (the neighbour table it reads is the one `precompute_neighbours` fills)."""
        chunk_context = () if self.config.chunk_prefill == "isolated" else self.format.prefix_ids
        return CacheAddressing(
            self.namespace, chunk_context, self.format.prefix_ids, self.format.separator_ids, self._neighbours
        )

    def open_caches(self, segments: Sequence[Segment], salt: str = "") -> PromptCaches:
        """The caches of a prompt's cacheable segments (None for the others), each with the context it
        was computed behind: those `address` names (the mean of several where it names several, `BlendKV`;
        a run of a stored sequence reads its slice, `SliceKV`); a sequence several segments read is opened
        once. A missing entry is recomputed and stored now; one that fails a layer's check while the fusion
        reads it is recomputed then. Either way the fusion gets intact caches.

        Caches of request text (a prompt head other than the system prefix, and the first chunk behind it)
        are kept in memory only (`request_tier`, per API key, within `StorageConfig.request_bytes`), never
        on disk or in the shared tier, and with a `salt` (the server's tenant) under keys of that salt alone,
        so that no other tenant can hit them (a hit is measurably faster: a guessed secret in a shared head
        would be confirmed by the time to the first token).
        """
        addresses = address(self.addressing, segments, salt)
        sources: list[LayerSource | None] = []
        opened: dict[str, LayerSource] = {}
        recomputed: set[str] = set()
        missing = computed = 0
        for seg, at in zip(segments, addresses):
            if not at.keys:
                sources.append(None)
                continue
            for key, context in zip(at.keys, at.contexts):
                if key not in opened:
                    entry = self.request_tier(salt).get(key) if at.request_text else self.store.open(key)
                    if entry is None:
                        opened[key] = self._repair(key, at.whole, context, salt if at.request_text else None)
                        recomputed.add(key)
                    else:
                        opened[key] = (
                            entry
                            if isinstance(entry, ChunkKV)
                            else _Repairing(entry, partial(self._repair, key, at.whole, context))
                        )
                missing += at.counted and key in recomputed  # per segment
            computed += len(seg.ids) if any(k in recomputed for k in at.keys) else 0
            source = (
                opened[at.keys[0]]
                if len(at.keys) == 1
                else BlendKV(  # turns made where stored caches live
                    tuple(opened[k] for k in at.keys), self.adapter.inv_freq.cpu()
                )
            )
            sources.append(
                SliceKV(source, seg.offset, seg.offset + len(seg.ids)) if len(seg.ids) < len(at.whole) else source
            )
        return PromptCaches(sources, [at.context for at in addresses], missing, list(opened.values()), computed)

    def request_tier(self, salt: str) -> MemoryTier:
        """The memory that holds the caches of request text (prompt heads, a chunk behind one) of the API key
        that `salt` names (the part before its first ':'; a request's `cache_salt` splits keys within it),
        within `StorageConfig.request_bytes`, least recently used first out. Request text is never written
        to disk or to the shared tier: no client can fill them, and no tenant's prompts are kept there."""
        tenant = salt.partition(":")[0]
        if tenant not in self.request_tiers:
            self.request_tiers[tenant] = MemoryTier(self.config.storage.request_bytes, "lru")
        return self.request_tiers[tenant]

    def _repair(self, key: str, ids: tuple[int, ...], context: tuple[int, ...], salt: str | None = None) -> ChunkKV:
        """Recompute a missing or corrupt cache and store it again (a failed write is logged, not raised:
        the recomputed cache serves the query that found the fault); with `salt`, a cache of request text
        made on first use (a new prompt head, or a chunk behind it), kept in that tenant's `request_tier`."""
        kv = self._compute_one(ids, context)
        if salt is not None:
            self.request_tier(salt).put(key, kv)
            return kv
        if self.foreign:  # another model's cache is not the index's: kept in this process's memory only
            self.store.memory.put(key, kv)
            return kv
        try:
            self.store.put(key, kv)
        except OSError as err:
            log.warning("computed the KV cache %s but could not store it: %s", key, err)
        else:
            log.warning("recomputed and rewrote the missing or corrupt KV cache %s (%d tokens)", key, len(ids))
        return kv

    def close(self) -> None:
        """Close the chunk index's database connection (on the thread that opened it)."""
        self.chunks.close()

    def search(self, query: str, k: int) -> list[Hit]:
        return self.chunks.search(query, k)

    def embed(self, texts: list[str]) -> np.ndarray:
        """The index's embedder's L2-normalised embeddings of `texts` [T, E], as it embeds chunks and queries."""
        return self.chunks.embed(texts)

    def kv_bytes(self, lengths: Iterable[int]) -> int:
        """Bytes the caches of chunks of these token counts take on disk, as the index's codec stores them
        (payload and scales; the few hundred bytes of each file's header aside)."""
        layout, codec = self.adapter.layout, self.store.codec
        per_tensor = partial(codec.nbytes, layout.n_kv_heads, d=layout.head_dim, dtype=layout.dtype)
        return sum(2 * layout.n_layers * per_tensor(t=n) for n in lengths)  # K and V of every layer

    @property
    def kv_bytes_per_token(self) -> float:
        """Disk bytes a token of a full-size chunk takes (`kv_bytes`)."""
        return self.kv_bytes([self.config.chunk_tokens]) / self.config.chunk_tokens


def _write_json(path: Path, data: object) -> None:
    """Write `data` as JSON at `path` atomically (a temporary file renamed over it); a full disk raises
    `StorageFullError` and leaves the old file as it was."""
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(
                err.errno, f"no space left on the device of {path.parent} while writing {path.name}: free space"
            ) from err
        raise


@contextmanager
def _writer_lock(path: Path) -> Iterator[None]:
    """Exclusive right to change the index at `path` (across processes); waits for the holder."""
    lock = FileLock(path / ".writer.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is updating %s; waiting for it to finish", path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@dataclass(frozen=True)
class Collected:
    """What `KVIndex.collect` deleted."""

    orphans: int  # cache entries no indexed chunk uses
    orphan_bytes: int
    temp_files: int  # of killed writers


@dataclass(frozen=True)
class PromptCaches:
    """The opened caches of a prompt's segments (`KVIndex.open_caches`)."""

    sources: list[LayerSource | None]  # per segment; None: computed at query time
    contexts: list[tuple[int, ...]]  # per segment: the tokens its cache was computed behind
    missing: int  # chunk caches that were missing when opened (recomputed and stored)
    opened: list[LayerSource]  # each stored cache opened, once (segments may read slices of one)
    computed_tokens: int  # prompt tokens of the segments whose cache was computed now (first use or repair)

    @property
    def repaired(self) -> int:
        """Chunk caches recomputed so far: missing when opened, or corrupt when a layer was read."""
        return self.missing + sum(isinstance(s, _Repairing) and s.repaired for s in self.opened)


class _Repairing:
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


def _tokenizer_id(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return xxhash.xxh3_64_hexdigest(json.dumps(vocab).encode())
