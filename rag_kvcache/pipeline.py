"""The two nouns users meet: a `KVIndex` you build and open, and a `FusedGenerator` you ask.

An index directory holds the chunk/document metadata and vectors (`index.sqlite`, `vectors.faiss`)
and the per-chunk KV caches (`kv/`). Chunks are prefilled *behind the system prefix* by default: a
chunk's cache is computed at the positions it would have right after the prefix, so the first
retrieved chunk is exact and no chunk grows an attention sink of its own (the prefix's first
token is the sink). `chunk_prefill="isolated"` computes each chunk alone from position 0 instead.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import xxhash
from tqdm.auto import tqdm

from .chunking import chunk_document
from .config import Config, FusionConfig, GenerationConfig
from .fusion import FusionInput, FusionResult, get_method
from .generation import Decoder, sample_token
from .index import ChunkIndex, Hit, SyncReport, load_embedder
from .kvstore import ChunkKV, KVStore, cache_key
from .model import ModelAdapter
from .profiling import StageClock
from .prompt import PromptFormat, Segment

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
        self.store = KVStore(path / "kv")
        self.format = PromptFormat.build(adapter.tokenizer, config.system_prompt)
        self.namespace = xxhash.xxh3_128_hexdigest(f"{adapter.fingerprint}|{config.chunk_prefill}".encode())
        built_with = chunks.meta.get("model_fingerprint")
        if built_with != adapter.fingerprint:
            log.warning(
                "index %s was built with model %s (fingerprint %s); %s (fingerprint %s) will miss every cached "
                "chunk and prefill it at query time", path, chunks.meta.get("model"), built_with, config.model,
                adapter.fingerprint,
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
        if (path / "index.sqlite").exists():
            return cls(path, config, ChunkIndex.open(path, embedder), adapter)
        meta = {k: str(getattr(config, k)) for k in _INDEX_CONFIG_KEYS}
        meta |= {"model_fingerprint": adapter.fingerprint, "tokenizer": _tokenizer_id(adapter.tokenizer)}
        return cls(path, config, ChunkIndex.create(path, embedder, config.embedder, meta, config.index_type), adapter)

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
        return replace(base, **values)

    @classmethod
    def open(cls, path: Path, config: Config | None = None, adapter: ModelAdapter | None = None) -> KVIndex:
        """Open an existing index; `config` defaults to the settings it was built with."""
        path = Path(path)
        config = config or cls.config_of(path)
        adapter = adapter or ModelAdapter.load(config)
        return cls(path, config, ChunkIndex.open(path, load_embedder(config.embedder, config.device)), adapter)

    def update(self, docs_dir: Path, progress: bool = True) -> SyncReport:
        """Re-index changed/new files, drop deleted ones, and precompute the new chunks' KV caches."""
        tok, n = self.adapter.tokenizer, self.config.chunk_tokens
        report = self.chunks.sync(Path(docs_dir), lambda text, src: chunk_document(text, src, tok, n), progress=progress)
        self.precompute([c.token_ids for c in report.new_chunks], progress=progress)
        return report

    def precompute(self, chunks: Sequence[tuple[int, ...]], batch_size: int = 4, progress: bool = True) -> int:
        """Compute and store the caches of the prefix and of `chunks` not yet stored; returns how many."""
        context = self.chunk_context
        todo = {self.key(ids): ids for ids in chunks if self.key(ids) not in self.store}
        prefix_key = cache_key(self.namespace, (), self.format.prefix_ids)
        if prefix_key not in self.store:
            keys, values, _ = self.adapter.prefill(torch.tensor([self.format.prefix_ids]))
            self.store.put(prefix_key, ChunkKV([k[0] for k in keys], [v[0] for v in values], 0))
        if not todo:
            return 0
        past = self.adapter.prefill(torch.tensor([context]))[:2] if context else None
        by_length: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        for key, ids in todo.items():
            by_length.setdefault(len(ids), []).append((key, ids))
        bar = tqdm(total=sum(len(ids) for ids in todo.values()), unit="tok", desc="KV precompute", disable=not progress)
        for group in by_length.values():
            for i in range(0, len(group), batch_size):
                batch = group[i : i + batch_size]
                ids = torch.tensor([b[1] for b in batch])  # [B, T]
                batch_past = None if past is None else tuple([t.expand(len(batch), -1, -1, -1) for t in p] for p in past)
                keys, values, _ = self.adapter.prefill(ids, batch_past)
                for j, (key, _) in enumerate(batch):
                    self.store.put(key, ChunkKV([k[j] for k in keys], [v[j] for v in values], len(context)))
                bar.update(ids.numel())
        bar.close()
        return len(todo)

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
        if misses:
            log.warning("%d prompt segment(s) had no usable cache; recomputing and storing them", len(misses))
            self.index.precompute(misses, progress=False)
        yield Answer(
            answer="", method=fusion.method, ttft_s=ttft, retrieval_s=0.0, prompt_tokens=n_prompt,
            recomputed_tokens=result.recomputed_tokens, compute_fraction=result.compute_fraction,
            generation_s=generation_s, generated_tokens=n_generated, cache_misses=len(misses),
            stages=result.stages, first_token_logits=result.logits,
        )

    def prefill(
        self, segments: Sequence[Segment], fusion: FusionConfig
    ) -> tuple[FusionResult, int, list[tuple[int, ...]]]:
        """Load the cacheable segments' caches (none for `full`), fuse, and return the prompt cache,
        the prompt length, and the chunks whose cache was missing or corrupt.

        A cacheable segment at position 0 is the system prefix (cached with no context); any other
        was cached behind the index's chunk context.
        """
        index = self.index
        clock = StageClock(self.adapter.device)
        caches: list[ChunkKV | None] = []
        contexts: list[tuple[int, ...]] = []
        misses = []
        start = 0
        with clock.stage("kv_load"):
            for seg in segments:
                ctx = () if start == 0 else index.chunk_context
                kv = None
                if seg.cacheable and fusion.method != "full":
                    kv = index.store.get(cache_key(index.namespace, ctx, seg.ids), device=self.adapter.device)
                    if kv is None and start > 0:
                        misses.append(seg.ids)
                caches.append(kv)
                contexts.append(ctx)
                start += len(seg.ids)
            inp = FusionInput.build(list(segments), caches, contexts, device=self.adapter.device)
        result = get_method(fusion.method)(self.adapter, inp, fusion)
        result.stages = {**clock.seconds, **result.stages}
        return result, inp.n_tokens, misses
