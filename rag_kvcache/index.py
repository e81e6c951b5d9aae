"""`KVIndex`: an index you build and open: chunks, vectors, and every chunk's KV cache.

An index directory holds the chunk/document metadata and vectors (`index.sqlite`, `vectors.faiss`)
and the per-chunk KV caches (`kv/`). How the caches are computed, named and stored (behind the system
prefix by default; isolated; behind each chunk's nearest neighbours) is `indexing.maker.CacheMaker`
(`KVIndex.maker`); how a prompt opens them, `store.opening.CacheOpener` (`KVIndex.caches`).

Consistency. Indexers are serialised by a lock file (`.writer.lock`, `indexing.lock`): a second indexer waits, then
finds the work done. A sync stores the new chunks' caches *before* it commits them, so every chunk
the index holds has its cache; a `kill -9` mid-way leaves the index as it was plus some complete
cache entries (writes are atomic renames; temporary files of dead writers are removed by the next
indexer), and re-running the command resumes, reusing what was stored. A full disk fails the
update with `StorageFullError` and the same guarantee. Readers need no lock. At query time a
missing or corrupt cache (detected when opened or, per layer, when read) is recomputed, rewritten
and logged, and the fusion continues with the recomputed cache, so the answer is unchanged.

Which caches a prompt reads is `store.addressing` (`KVIndex.addressing`, `address`); `CacheOpener.open`
opens them and, where needed, repairs them. What the index records of how it was built (its settings and
their checksum, its tokenizer), and how the settings are read back and checked, is `indexing.provenance`.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Sequence

import numpy as np
import xxhash
from rich.filesize import decimal

from .config import Config, IndexSettings
from .engine.model import ModelAdapter
from .engine.prompt import PromptFormat
from .engine.spec import ModelSpec
from .errors import RagKVCacheError
from .indexing import lock, staging
from .indexing.maker import CacheMaker
from .indexing.provenance import (
    SETTINGS_CHECKSUM_KEY,
    SETTINGS_KEY,
    STORED_MEANS_KEY,
    ForeignModelError,
    recorded_settings,
    settings_checksum,
    tokenizer_id,
)
from .indexing.staging import Chunker, SyncReport
from .retrieval import vectors as faiss_file
from .retrieval.chunk_index import ChunkIndex
from .retrieval.chunking import chunk_document
from .retrieval.database import exists
from .retrieval.embedder import load_embedder
from .retrieval.records import ChunkRecord, Hit, TextDocument
from .store.kvstore import KVStore
from .store.opening import CacheOpener

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from .indexing.cluster import RayWorkers

log = logging.getLogger(__name__)


class KVIndex:
    """Chunks, vectors and per-chunk KV caches of a document folder, for one model."""

    def __init__(self, path: Path, config: Config, chunks: ChunkIndex, model: ModelSpec) -> None:
        """`config` with the settings the index records (`IndexSettings`: how its chunks and caches were made),
        but for `model` and `dtype`, which a caller may read it with otherwise (another model's caches are then
        foreign). `model`: the index's model, a `ModelAdapter` (transformers' weights) for the embedded engine; the vLLM
        connector's worker passes vLLM's (`VllmAdapter`), its scheduler a bare `ModelSpec` (no weights: it
        opens caches without making any, `CacheOpener.open(make=False)`)."""
        self.path = path
        self.recorded = recorded_settings(chunks.meta, path)  # what the index was built with
        if differs := {  # what the index records wins, but for the model and dtype a caller reads it with
            f.name: getattr(self.recorded, f.name)
            for f in fields(IndexSettings)
            if f.name not in ("model", "dtype") and getattr(self.recorded, f.name) != getattr(config.index, f.name)
        }:
            log.info(
                "index %s was built with %s: reading and writing it so, not with %s",
                path,
                differs,
                {name: getattr(config.index, name) for name in differs},
            )
            config = config.with_index(**differs)
        self.config = config
        self.chunks = chunks
        self.model = adapter = model
        self.store = KVStore(path / "kv", config.index.codec, config.runtime.storage, adapter.device)
        self.format = PromptFormat.build(adapter.tokenizer, config.index.system_prompt)
        self.namespace = xxhash.xxh3_128_hexdigest(f"{adapter.fingerprint}|{config.index.chunk_prefill}".encode())
        self.built_with = chunks.meta.get("model_fingerprint")  # the fingerprint of the index's model
        if self.foreign:
            log.warning(
                "index %s was built with model %s (fingerprint %s); %s (fingerprint %s) will miss every cached "
                "chunk and prefill it at query time, keeping it in this process's memory, not in the index",
                path,
                self.recorded.model,
                self.built_with,
                config.index.model,
                adapter.fingerprint,
            )
        if (remote := chunks.meta.get("kv_remote")) and config.runtime.storage.remote is None:
            log.warning(
                "index %s was built with its KV caches also in the shared tier %s; opened without it "
                "(--kv-remote), the caches missing from this machine's disk are recomputed",
                path,
                remote,
            )
        if chunks.meta.get("tokenizer") != tokenizer_id(adapter.tokenizer):
            raise ValueError(
                f"index {path} was chunked with the tokenizer of {self.recorded.model!r}; {config.index.model!r} "
                "tokenizes differently, so its stored token ids mean nothing to it: re-index with this model"
            )
        self.maker = CacheMaker(
            path,
            config,
            adapter,
            self.store,
            chunks,
            self.format,
            self.namespace,
            self.foreign,
            stored_means=config.index.chunk_prefill == "cached_neighbours" and STORED_MEANS_KEY in chunks.meta,
        )
        self.addressing = self.maker.addressing  # what names the index's caches (`store.addressing`)
        self.caches = CacheOpener(
            self.store,
            self.maker,
            config.runtime.storage.request_bytes,
            adapter.inv_freq.cpu(),
            adapter.layout.n_layers,
        )

    @property
    def foreign(self) -> bool:
        """The model is not the one the index was built with: caches computed at query time stay in memory."""
        return self.built_with != self.model.fingerprint

    @property
    def adapter(self) -> ModelAdapter:
        """The index's model as transformers' weights: what the embedded engine answers and decodes with."""
        if not isinstance(self.model, ModelAdapter):
            raise RagKVCacheError(
                f"index {self.path} is open over {type(self.model).__name__} {self.model.name!r}, not transformers' "
                "weights: it lays prompts out and fuses caches, the embedded engine's answering needs a ModelAdapter"
            )
        return self.model

    # ---- building -------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, config: Config = Config(), adapter: ModelSpec | None = None) -> KVIndex:
        """An index at `path` for `config`: a new empty one, or the one already there."""
        path = Path(path)
        adapter = adapter or ModelAdapter.load(config)
        embedder = _embedder(config)
        path.mkdir(parents=True, exist_ok=True)
        with lock.writer_lock(path):
            if exists(path):
                return cls(path, config, ChunkIndex.open(path, embedder), adapter)
            meta = {
                SETTINGS_KEY: config.index.to_json(),
                SETTINGS_CHECKSUM_KEY: settings_checksum(config.index.to_json()),
                "model_fingerprint": adapter.fingerprint,
                "tokenizer": tokenizer_id(adapter.tokenizer),
                STORED_MEANS_KEY: "1",
            } | ({"kv_remote": config.runtime.storage.remote_address} if config.runtime.storage.remote else {})
            chunks = ChunkIndex.create(path, embedder, config.index.embedder, meta, config.index.index_type)
        return cls(path, config, chunks, adapter)

    @classmethod
    def build(
        cls,
        docs_dir: Path,
        path: Path,
        config: Config = Config(),
        adapter: ModelSpec | None = None,
        progress: bool = True,
    ) -> KVIndex:
        """Index `docs_dir` into `path`, creating the index or bringing it up to date."""
        index = cls.create(path, config, adapter)
        index.update(docs_dir, progress=progress)
        return index

    @staticmethod
    def config_of(path: Path, base: Config = Config()) -> Config:
        """`base` with the settings the index at `path` records (`IndexSettings`)."""
        return replace(base, index=recorded_settings(ChunkIndex.read_meta(Path(path)), Path(path)))

    @classmethod
    def open(
        cls,
        path: Path,
        config: Config | None = None,
        adapter: ModelSpec | None = None,
        rewrite: bool = True,
        embeds: bool = True,
    ) -> KVIndex:
        """Open an existing index; `config` defaults to the settings it was built with. A damaged
        `vectors.faiss` is rewritten from SQLite where this process may (`ChunkIndex.open`), unless
        `rewrite` is False (`rag-kvcache check` sees the index as it is). `embeds` False: without loading its
        embedder, for a process that finds chunks in prompts by their tokens alone (the vLLM connector's)."""
        path = Path(path)
        config = config or cls.config_of(path)
        adapter = adapter or ModelAdapter.load(config)
        embedder = _embedder(config) if embeds else None
        return cls(path, config, ChunkIndex.open(path, embedder, rewrite), adapter)

    def update(
        self,
        docs_dir: Path,
        progress: bool = True,
        prune: bool = False,
        workers: RayWorkers | None = None,
        on_searchable: Callable[[], None] | None = None,
    ) -> SyncReport:
        """Add `docs_dir`: index its new and changed files (the chunks committed first, searchable from then on,
        then their KV caches made in passes, as `_index` says); other documents stay unless `prune` drops those
        not in `docs_dir`. With `workers` (`ray_workers()`) the caches are computed on a Ray cluster.
        `on_searchable` is called once the chunks are committed, before the cache passes (the CLI lowers its CPU
        priority there, so questions asked meanwhile come first). Raises `StorageFullError` when the disk fills
        (the chunks and caches committed before it are kept)."""
        return self._index(
            lambda chunker: staging.stage_sync(
                self.chunks,
                Path(docs_dir),
                chunker,
                progress=progress,
                prune=prune,
                max_file_bytes=self.config.runtime.max_file_bytes,
                max_documents=self.config.runtime.max_documents,
            ),
            progress,
            workers,
            on_searchable,
        )

    def add_texts(self, documents: Sequence[TextDocument], progress: bool = True) -> SyncReport:
        """Add documents given as text (a vector store's: `source` is the document's id): chunked,
        embedded, and the new chunks' KV caches stored before the index commits them, as `update` does;
        a document with the source of an indexed one replaces it, nothing else is removed."""
        return self._index(
            lambda chunker: staging.stage_texts(self.chunks, documents, chunker, progress=progress), progress
        )

    def _index(
        self,
        stage: Callable[[Chunker], staging.Staged],
        progress: bool,
        workers: RayWorkers | None = None,
        on_searchable: Callable[[], None] | None = None,
    ) -> SyncReport:
        """The indexing pipeline after what `stage` reads, diffs, chunks (with the chunker it is given) and
        embeds, in passes, all under the writer lock: the chunks committed (searchable from then on: a chunk
        without a cache is computed when a prompt needs it), then the caches of the chunks most likely to be
        retrieved, behind the prefix (`CacheMaker.hot_set`, within the store's budget), then their neighbour
        caches (every chunk's neighbours recorded: a chunk outside the hot set gets its neighbour cache from
        `CacheOpener.backfill` once prompts read it after another chunk), then what no chunk reads any more
        collected. `grouped` caches are named by their group, so they are made before their chunks are committed.
        Each pass resumes where a killed run stopped."""
        if self.foreign:
            raise ForeignModelError(
                f"index {self.path} was built with model fingerprint {self.built_with}, "
                f"and {self.config.index.model} has fingerprint {self.model.fingerprint}: the caches it computes "
                "would not be the index's. Index with the model the index was built with, or build a new index"
            )
        tok, n = self.model.tokenizer, self.config.index.chunk_tokens
        maker = self.maker
        with lock.writer_lock(self.path):
            used = maker.live_keys()
            staged = stage(lambda text, src: chunk_document(text, src, tok, n))
            if maker.grouped:
                maker.precompute_grouped(staged.report.new_chunks, staged.embeddings, progress, workers)
            report = staging.commit(self.chunks, staged)
            if on_searchable is not None:
                on_searchable()
            if not maker.grouped:
                hot = maker.hot_set()
                self._announce(hot)
                maker.precompute([c.token_ids for c in hot], progress=progress, workers=workers)
                if maker.with_neighbours:
                    cached = [c for c in hot if maker.addressing.own_key(c.token_ids) in self.store.disk]
                    named = {c.id for c in cached}  # `precompute_neighbours` records theirs
                    lacking = maker.record_lacking(named)  # the others' (under a budget): `backfill` makes theirs
                    maker.precompute_neighbours([c for c in cached if c.id in lacking], progress)
            maker.committed()
            self.collect(used)
        self.flush_stats()
        return report

    def _announce(self, hot: Sequence[ChunkRecord]) -> None:
        """Log that the index answers now, and the cache passes to come: how many chunks and tokens each
        computes and the bytes they take (within the budget, if any)."""
        tokens = sum(len(c.token_ids) for c in hot)
        budget = self.store.budget
        log.info(
            "%s: %d chunks searchable; questions are answered from now on (a chunk without a cache is computed "
            "when a question needs it)",
            self.path,
            len(self.chunks),
        )
        passes = ["behind the system prefix"] + (
            ["behind each chunk's nearest neighbours"] if self.maker.with_neighbours else []
        )
        log.info(
            "KV cache passes: %s, for the %d of %d chunks most likely to be retrieved (%d tokens a pass, at most %s "
            "on disk%s)",
            " then ".join(passes),
            len(hot),
            len(self.chunks),
            tokens,
            decimal(self.kv_bytes(len(c.token_ids) for c in hot)),
            "" if budget is None else f"; budget {decimal(budget)}",
        )

    def delete(self, sources: Sequence[str]) -> list[str]:
        """Remove the documents (files or texts) with these sources; returns those the index held."""
        with lock.writer_lock(self.path):
            used = self.maker.live_keys()
            removed = self.chunks.delete(sources)
            self.collect(used)
        return removed

    def ray_workers(self) -> RayWorkers:
        """A pool of Ray actors computing this index's chunk caches into its store (`config.runtime.ray`,
        `config.runtime.ray_workers`), for `update(workers=...)`; a context manager that stops them."""
        from .indexing.cluster import RayWorkers

        return RayWorkers(self.config, self.store.root, self.namespace, self.model.fingerprint)

    def orphans(self, candidates: Iterable[str] | None = None, kept: Collection[str] | None = None) -> list[Path]:
        """The disk caches the index does not keep (not in `CacheMaker.kept`: no indexed chunk uses them and no
        interrupted run will resume with them): all of them, or those among the keys `candidates`. `kept`:
        `CacheMaker.kept()`, when the caller has it."""
        live = self.maker.kept() if kept is None else kept
        if candidates is None:
            return [path for path in self.store.disk.files() if path.stem not in live]
        return [self.store.disk.path(key) for key in candidates if key not in live and key in self.store.disk]

    def writer_lock(self) -> AbstractContextManager[None]:
        """The lock `update` holds while it changes the index, for other writers (`maintenance`)."""
        return lock.writer_lock(self.path)

    def collect(self, used: Iterable[str] | None = None) -> Collected:
        """Garbage collection (the caller holds the writer lock): delete the disk caches no indexed chunk
        uses and the temporary files of killed writers (`kv/??/.tmp-*` of dead processes,
        `.vectors.faiss.*`). `update`, `add_texts` and `delete` pass the keys the index `used` before
        they changed it, so only the caches of the chunks they removed go (of edited or deleted
        documents); without `used` (`rag-kvcache gc`), every cache that is not an indexed chunk's goes
        too (another model's, a prompt head cached at query time: recomputed when next needed).
        The neighbour table forgets the texts no chunk holds (`CacheMaker.forget_unindexed`).
        Files of names this package does not make are left alone. Opened with a model the index was
        not built with (`foreign`), it collects temporary files only: that model addresses none of the
        index's caches, so all of them would look orphaned."""
        orphans: list[Path] = []
        forgotten = 0
        if not self.foreign:
            orphans, forgotten = self.orphans(used, self.maker.kept()), self.maker.forget_unindexed()
        freed = 0
        for path in orphans:
            freed += path.stat().st_size
            self.store.memory.remove(path.stem)
            self.store.disk.remove(path.stem)
        temp = self.store.disk.remove_stale_temp_files() + len(faiss_file.remove_temp_files(self.path))
        collected = Collected(len(orphans), freed, temp, forgotten)
        if collected:
            log.info("%s: %s", self.path, collected)
        return collected

    def flush_stats(self) -> None:
        """Add the store's counters to its `stats.json`; a failure (a full disk, a read-only index) is
        logged, never raised: no answer or index run is lost for its counters."""
        try:
            self.store.flush_stats()
        except OSError as err:
            log.warning("could not write the KV store counters of %s: %s", self.path, err)

    def close(self) -> None:
        """Close the chunk index's and the neighbour table's database connections (on the thread that opened the
        chunk index)."""
        self.chunks.close()
        self.maker.neighbours.close()

    def search(self, query: str, k: int) -> list[Hit]:
        return self.chunks.search(query, k)

    def embed(self, texts: list[str]) -> np.ndarray:
        """The index's embedder's L2-normalised embeddings of `texts` [T, E], as it embeds chunks and queries."""
        return self.chunks.embed(texts)

    def kv_bytes(self, lengths: Iterable[int]) -> int:
        """Bytes the caches of chunks of these token counts take on disk (`CacheMaker.disk_bytes`)."""
        return self.maker.disk_bytes(lengths)

    @property
    def kv_bytes_per_token(self) -> float:
        """Disk bytes a token of a full-size chunk takes (`kv_bytes`)."""
        return self.kv_bytes([self.config.index.chunk_tokens]) / self.config.index.chunk_tokens


def _embedder(config: Config) -> SentenceTransformer:
    """The index's embedder, on the runtime's device in the runtime's dtype."""
    return load_embedder(config.index.embedder, config.runtime.device, config.runtime.embedder_dtype)


@dataclass(frozen=True)
class Collected:
    """What `KVIndex.collect` deleted."""

    orphans: int  # cache entries no indexed chunk uses
    orphan_bytes: int
    temp_files: int  # of killed writers
    neighbour_records: int  # texts no chunk holds any more, forgotten by the neighbour table

    def __bool__(self) -> bool:
        return bool(self.orphans or self.temp_files or self.neighbour_records)

    def __str__(self) -> str:
        return (
            f"deleted {self.orphans} orphan KV caches ({self.orphan_bytes / 2**20:.1f} MiB), {self.temp_files} "
            f"temporary files and {self.neighbour_records} neighbour records"
        )
