"""The two nouns users meet: a `KVIndex` you build and open, and a `FusedGenerator` you ask.

An index directory holds the chunk/document metadata and vectors (`index.sqlite`, `vectors.faiss`)
and the per-chunk KV caches (`kv/`). Chunks are prefilled *behind the system prefix* by default: a
chunk's cache is computed at the positions it would have right after the prefix, so the first
retrieved chunk is exact and no chunk grows an attention sink of its own (the prefix's first
token is the sink). `chunk_prefill="isolated"` computes each chunk alone from position 0 instead.

Consistency. Indexers are serialised by a lock file (`.writer.lock`): a second indexer waits, then
finds the work done. A sync stores the new chunks' caches *before* it commits them, so every chunk
the index holds has its cache; a `kill -9` mid-way leaves the index as it was plus some complete
cache entries (writes are atomic renames; temporary files of dead writers are removed by the next
indexer), and re-running the command resumes, reusing what was stored. A full disk fails the
update with `StorageFullError` and the same guarantee. Readers need no lock. At query time a
missing or corrupt cache (detected when opened or, per layer, when read) is recomputed, rewritten
and logged, and the fusion continues with the recomputed cache, so the answer is unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import xxhash
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from .chunking import chunk_document
from .config import Config, FusionConfig, GenerationConfig, StorageConfig
from .fusion import FusionInput, FusionResult, get_method
from .generation import Decoder, sample_token
from .index import ChunkIndex, Hit, SyncReport, load_embedder
from .kvstore import ChunkKV, KVStore, cache_key
from .model import ModelAdapter
from .profiling import StageClock
from .prompt import PromptFormat, Segment
from .storage import CorruptEntryError, LayerSource

log = logging.getLogger(__name__)

_INDEX_CONFIG_KEYS = ("model", "embedder", "chunk_tokens", "index_type", "system_prompt", "chunk_prefill", "dtype")


@dataclass(frozen=True)
class RetrievedChunk:
    id: str
    source: str
    score: float


@dataclass(frozen=True)
class Answer:
    answer: str
    method: str
    ttft_s: float  # question in -> first token out: cache loading, fusion and first sampling included
    retrieval_s: float
    prompt_tokens: int
    recomputed_tokens: int
    compute_fraction: float
    generation_s: float
    generated_tokens: int
    cache_misses: int
    chunks: list[RetrievedChunk] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage of the prefill
    first_token_logits: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("first_token_logits")
        return out


class KVIndex:
    """Chunks, vectors and per-chunk KV caches of a document folder, for one model."""

    def __init__(self, path: Path, config: Config, chunks: ChunkIndex, adapter: ModelAdapter) -> None:
        self.path = path
        self.config = config
        self.chunks = chunks
        self.adapter = adapter
        self.store = KVStore(path / "kv", config.storage)
        self.format = PromptFormat.build(adapter.tokenizer, config.system_prompt)
        self.namespace = xxhash.xxh3_128_hexdigest(f"{adapter.fingerprint}|{config.chunk_prefill}".encode())
        built_with = chunks.meta.get("model_fingerprint")
        if built_with != adapter.fingerprint:
            log.warning(
                "index %s was built with model %s (fingerprint %s); %s (fingerprint %s) will miss every cached "
                "chunk and prefill it at query time", path, chunks.meta.get("model"), built_with, config.model,
                adapter.fingerprint,
            )
        if (codec := chunks.meta.get("kv_codec", "none")) != config.storage.codec:
            raise ValueError(
                f"index {path} stores KV caches with codec {codec!r}, not {config.storage.codec!r}: open it with "
                f"StorageConfig(codec={codec!r}) (KVIndex.config_of does), or build another index"
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
            if (path / "index.sqlite").exists():
                return cls(path, config, ChunkIndex.open(path, embedder), adapter)
            meta = {k: str(getattr(config, k)) for k in _INDEX_CONFIG_KEYS}
            meta |= {
                "model_fingerprint": adapter.fingerprint, "tokenizer": _tokenizer_id(adapter.tokenizer),
                "kv_codec": config.storage.codec,
            }
            chunks = ChunkIndex.create(path, embedder, config.embedder, meta, config.index_type)
        return cls(path, config, chunks, adapter)

    @classmethod
    def build(
        cls, docs_dir: Path, path: Path, config: Config = Config(), adapter: ModelAdapter | None = None,
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
    def open(cls, path: Path, config: Config | None = None, adapter: ModelAdapter | None = None) -> KVIndex:
        """Open an existing index; `config` defaults to the settings it was built with."""
        path = Path(path)
        config = config or cls.config_of(path)
        adapter = adapter or ModelAdapter.load(config)
        return cls(path, config, ChunkIndex.open(path, load_embedder(config.embedder, config.device)), adapter)

    def update(self, docs_dir: Path, progress: bool = True) -> SyncReport:
        """Re-index changed/new files and drop deleted ones, storing the new chunks' KV caches before
        the index commits them. Raises `StorageFullError` (index unchanged) when the disk fills."""
        tok, n = self.adapter.tokenizer, self.config.chunk_tokens
        with _writer_lock(self.path):
            self.store.disk.remove_stale_temp_files()
            report = self.chunks.sync(
                Path(docs_dir), lambda text, src: chunk_document(text, src, tok, n), progress=progress,
                before_commit=lambda new: self.precompute([c.token_ids for c in new], progress=progress),
            )
        self.store.flush_stats()
        return report

    def precompute(self, chunks: Sequence[tuple[int, ...]], batch_size: int = 4, progress: bool = True) -> int:
        """Compute and store the caches of the prefix and of `chunks` not yet stored; returns how many."""
        prefix_key = cache_key(self.namespace, (), self.format.prefix_ids)
        if prefix_key not in self.store:
            self.store.put(prefix_key, next(self.compute([self.format.prefix_ids], ()))[1])
        todo = list({ids for ids in chunks if self.key(ids) not in self.store})
        bar = tqdm(total=sum(map(len, todo)), unit="tok", desc="KV precompute", disable=not progress)
        for i, kv in self.compute(todo, self.chunk_context, batch_size):
            self.store.put(self.key(todo[i]), kv)
            bar.update(len(todo[i]))
        bar.close()
        return len(todo)

    def compute(
        self, chunks: Sequence[tuple[int, ...]], context: tuple[int, ...], batch_size: int = 4
    ) -> Iterator[tuple[int, ChunkKV]]:
        """Prefill each chunk behind `context` (batched by length); yields (index in `chunks`, cache)."""
        if not chunks:
            return
        past = self.adapter.prefill(torch.tensor([context]))[:2] if context else None
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(chunks):
            by_length.setdefault(len(ids), []).append(i)
        for group in by_length.values():
            for start in range(0, len(group), batch_size):
                batch = group[start : start + batch_size]
                ids = torch.tensor([chunks[i] for i in batch])  # [B, T]
                batch_past = None if past is None else tuple([t.expand(len(batch), -1, -1, -1) for t in p] for p in past)
                keys, values, _ = self.adapter.prefill(ids, batch_past)  # L x [B, H_kv, T, D]
                for j, i in enumerate(batch):
                    yield i, ChunkKV([k[j] for k in keys], [v[j] for v in values], len(context))

    def repair(self, ids: tuple[int, ...], context: tuple[int, ...]) -> ChunkKV:
        """Recompute a missing or corrupt cache and store it again (a failed write is logged, not raised:
        the recomputed cache serves the query that found the fault)."""
        kv = next(self.compute([ids], context))[1]
        key = cache_key(self.namespace, context, ids)
        try:
            self.store.put(key, kv)
        except OSError as err:
            log.warning("recomputed the KV cache %s but could not store it: %s", key, err)
        else:
            log.warning("recomputed and rewrote the missing or corrupt KV cache %s (%d tokens)", key, len(ids))
        return kv

    # ---- cache addressing -----------------------------------------------------------------------
    @property
    def chunk_context(self) -> tuple[int, ...]:
        """Tokens a chunk's cache is computed behind."""
        return self.format.prefix_ids if self.config.chunk_prefill == "behind_prefix" else ()

    def key(self, ids: Sequence[int]) -> str:
        return cache_key(self.namespace, self.chunk_context, ids)

    def search(self, query: str, k: int) -> list[Hit]:
        return self.chunks.search(query, k)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.adapter.layout.bytes_per_token


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


class FusedGenerator:
    """Answers questions over a `KVIndex` by fusing the retrieved chunks' caches."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.adapter = index.adapter

    def ask(
        self, question: str, top_k: int | None = None, fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None, on_text: Callable[[str], None] | None = None,
    ) -> Answer:
        """Retrieve the top-k chunks for `question` and answer it with fused KV."""
        if not question.strip():
            raise ValueError("the question is empty")
        t0 = time.perf_counter()
        hits = self.index.search(question, top_k or self.index.config.top_k)
        retrieval_s = time.perf_counter() - t0
        return self.generate(question, hits, fusion, generation, on_text, retrieval_s)

    def generate(
        self, question: str, hits: Sequence[Hit], fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None, on_text: Callable[[str], None] | None = None,
        retrieval_s: float = 0.0,
    ) -> Answer:
        """Answer `question` over the given retrieved chunks (in order)."""
        fmt = self.index.format
        segments = fmt.segments([h.chunk.token_ids for h in hits], fmt.question_ids(self.adapter.tokenizer, question))
        answer = self.complete(segments, fusion, generation, on_text)
        chunks = [RetrievedChunk(h.chunk.id, h.chunk.source, float(h.score)) for h in hits]
        return replace(answer, retrieval_s=retrieval_s, chunks=chunks)

    def complete(
        self, segments: Sequence[Segment], fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None, on_text: Callable[[str], None] | None = None,
    ) -> Answer:
        """Generate after a prompt given as segments; `on_text` receives the text as it streams."""
        pieces = []
        for step in self.stream(segments, fusion, generation):
            if isinstance(step, Answer):
                return replace(step, answer="".join(pieces).strip())
            pieces.append(step)
            if on_text is not None and step:
                on_text(step)
        raise AssertionError("stream() always ends with an Answer")

    def stream(
        self, segments: Sequence[Segment], fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None,
    ) -> Iterator[str | Answer]:
        """Yield the answer's text pieces as they are generated, then the `Answer` with its numbers
        (its `answer` field empty: the text is what was streamed)."""
        fusion = fusion or self.index.config.fusion
        generation = generation or self.index.config.generation
        t0 = time.perf_counter()
        result, n_prompt, misses = self.prefill(segments, fusion)
        decoder = Decoder(self.adapter, generation)
        first = sample_token(result.logits, generation, decoder.rng)
        ttft = time.perf_counter() - t0
        n_generated = 0
        for step in decoder.steps(result.keys, result.values, result.logits, first):
            n_generated += step.token_id is not None
            yield step.text
        generation_s = time.perf_counter() - t0 - ttft
        self.index.store.flush_stats()
        yield Answer(
            answer="", method=fusion.method, ttft_s=ttft, retrieval_s=0.0, prompt_tokens=n_prompt,
            recomputed_tokens=result.recomputed_tokens, compute_fraction=result.compute_fraction,
            generation_s=generation_s, generated_tokens=n_generated, cache_misses=misses,
            stages=result.stages, first_token_logits=result.logits,
        )

    def prefill(
        self, segments: Sequence[Segment], fusion: FusionConfig, storage: StorageConfig | None = None,
    ) -> tuple[FusionResult, int, int]:
        """Open the cacheable segments' caches (none for `full`), fuse, and return the prompt cache,
        the prompt length, and how many caches were missing or corrupt (those were recomputed and
        stored again before use, so the answer is what intact caches give; the prefix is not counted).

        Cached layers are read by a background reader `storage.prefetch_layers` ahead of the fusion
        (default: the index's storage settings). A cacheable segment at position 0 is the system
        prefix (cached with no context); any other was cached behind the index's chunk context.
        Stages: `kv_load` (opening entries, and recomputing missing ones), `kv_wait` (the fusion
        waiting for cached layers: what the recompute did not hide; not counted in `assemble_kv`).
        """
        index = self.index
        storage = storage or index.config.storage
        clock = StageClock(self.adapter.device)
        caches: list[LayerSource | None] = []
        contexts: list[tuple[int, ...]] = []
        misses = 0
        repaired: dict[str, ChunkKV] = {}
        start = 0
        with clock.stage("kv_load"):
            for seg in segments:
                ctx = () if start == 0 else index.chunk_context
                key = cache_key(index.namespace, ctx, seg.ids)
                source: LayerSource | None = None
                if seg.cacheable and fusion.method != "full":
                    source = repaired.get(key) or index.store.open(key)
                    if source is None:
                        source = repaired[key] = index.repair(seg.ids, ctx)
                    elif not isinstance(source, ChunkKV):
                        source = _Repairing(source, lambda ids=seg.ids, ctx=ctx: index.repair(ids, ctx))
                    misses += start > 0 and key in repaired  # the prefix is not a retrieved chunk
                caches.append(source)
                contexts.append(ctx)
                start += len(seg.ids)
            inp = FusionInput.build(
                list(segments), caches, contexts, device=self.adapter.device, prefetch=storage.prefetch_layers
            )
        try:
            result = get_method(fusion.method)(self.adapter, inp, fusion)
        finally:
            inp.close()
        misses += sum(isinstance(c, _Repairing) and c.repaired for c in caches)
        stages = {**clock.seconds, **result.stages}
        if "assemble_kv" in stages:
            stages["kv_wait"] = inp.load_wait_s
            stages["assemble_kv"] -= inp.load_wait_s
        result.stages = stages
        return result, inp.n_tokens, misses
