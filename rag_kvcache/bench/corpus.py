"""A benchmark's corpus and index: a QA set's passages written as documents, indexed and timed against the
model's plain forward throughput; the evidence placed among the retrieved chunks.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ChunkPrefill, Config, IndexSettings
from ..engine.model import ModelAdapter
from ..engine.prompt import Segment
from ..index import KVIndex
from ..retrieval.records import Hit
from ..store.controller import time_prefill
from .datasets import QAExample
from .metrics import contains_answer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexingStats:
    passages: int
    chunks: int
    tokens: int  # chunk tokens prefilled by this run (0 when the index was already complete)
    seconds: float  # chunking + embedding + KV precompute
    forward_before: float  # tok/s of the model's plain forward over one 512-token input, before indexing
    forward_after: float  # the same, after: the two bracket the machine's drift during indexing

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens else None

    @property
    def forward_tokens_per_s(self) -> float:
        return (self.forward_before + self.forward_after) / 2

    def to_dict(self) -> dict[str, Any]:
        rate = self.tokens_per_s
        return {
            "passages": self.passages,
            "chunks": self.chunks,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": rate,
            "forward_tokens_per_s": self.forward_tokens_per_s,
            "forward_tokens_per_s_before_after": [self.forward_before, self.forward_after],
            "fraction_of_forward": None if rate is None else rate / self.forward_tokens_per_s,
        }


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:48] or "untitled"


def write_corpus(examples: Sequence[QAExample], docs_dir: Path) -> int:
    """Write every distinct passage of `examples` as `<i>-<slug>.txt` ("title\\ntext"); returns how many."""
    passages = dict.fromkeys(doc for ex in examples for doc in ex.documents)
    docs_dir.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(passages):
        text = f"{doc.title}\n{doc.text}" if doc.title else doc.text
        (docs_dir / f"{i:05d}-{_slug(doc.title)}.txt").write_text(text, encoding="utf-8")
    return len(passages)


def write_question_passages(examples: Sequence[QAExample], docs_dir: Path) -> None:
    """Write each example's passages, repeats kept, as `<question>-<passage>.txt` ("title\\ntext"): the layout
    the profiling and measurement scripts index (every question's contexts, as the dataset lists them)."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    for qi, example in enumerate(examples):
        for pi, doc in enumerate(example.documents):
            (docs_dir / f"{qi:03d}-{pi:02d}.txt").write_text(f"{doc.title}\n{doc.text}", encoding="utf-8")


def question_index(
    examples: Sequence[QAExample], work_dir: Path, chunk_tokens: int, chunk_prefill: ChunkPrefill | None = None
) -> KVIndex:
    """The index of `examples`' passages (`write_question_passages` under `work_dir / "docs"`) at `work_dir /
    "index"` with the default settings at `chunk_tokens` (and `chunk_prefill`, None: the default): opened when
    already built there, else built."""
    docs, index_dir = work_dir / "docs", work_dir / "index"
    write_question_passages(examples, docs)
    if (index_dir / "index.sqlite").is_file():
        return KVIndex.open(index_dir)
    settings = IndexSettings(chunk_tokens=chunk_tokens)
    if chunk_prefill is not None:
        settings = replace(settings, chunk_prefill=chunk_prefill)
    return KVIndex.build(docs, index_dir, Config(index=settings))


def forward_throughput(adapter: ModelAdapter, n_tokens: int = 512, repeats: int = 3) -> float:
    """Tokens/s of a plain forward over `n_tokens` ids: median of `repeats` after a warm-up."""
    ids = torch.randint(0, adapter.model.config.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    adapter.prefill(ids)
    return n_tokens / float(np.median([time_prefill(adapter, ids) for _ in range(repeats)]))


def build_index(
    examples: Sequence[QAExample],
    work_dir: Path,
    config: Config,
    adapter: ModelAdapter,
    progress: bool,
    name: str = "index",
) -> tuple[KVIndex, IndexingStats]:
    """Index every passage of `examples` into `work_dir / name` (incremental if already there) and time it."""
    n_passages = write_corpus(examples, work_dir / "docs")
    index = KVIndex.create(work_dir / name, config, adapter)
    forward_before = forward_throughput(adapter)
    t0 = time.perf_counter()
    report = index.update(work_dir / "docs", progress=progress)
    seconds = time.perf_counter() - t0
    if report.removed or report.changed:
        raise ValueError(
            f"{work_dir / name} holds another corpus ({len(report.removed)} files removed, "
            f"{len(report.changed)} changed): use a new --out"
        )
    stats = IndexingStats(
        passages=n_passages,
        chunks=len(index.chunks),
        tokens=sum(len(c.token_ids) for c in report.new_chunks),
        seconds=seconds,
        forward_before=forward_before,
        forward_after=forward_throughput(adapter),
    )
    if not stats.tokens:
        log.info("index %s was already complete: indexing throughput not measured", work_dir / "index")
    return index, stats


def place_evidence(hits: Sequence[Hit], example: QAExample, move: bool = True) -> tuple[list[Hit], int | None]:
    """For a planted fact (`example.evidence_rank` set): `hits` (in the prompt's order) with the first chunk
    holding the answer moved to that place (`move=False`: left where it is), and where it was in `hits` (None,
    order kept, when it was not retrieved)."""
    if example.evidence_rank is None:
        return list(hits), None
    if move and example.evidence_rank >= len(hits):
        raise ValueError(
            f"{example.id!r}: evidence_rank {example.evidence_rank} is beyond the {len(hits)} retrieved "
            "chunks: plant the facts for this top-k"
        )
    found = next((i for i, h in enumerate(hits) if contains_answer(h.chunk.text, example.answers)), None)
    if found is None:
        log.warning("%s: the chunk holding %r was not retrieved", example.id, example.answers[0])
        return list(hits), None
    if not move:
        return list(hits), found
    rest = [h for i, h in enumerate(hits) if i != found]
    return [*rest[: example.evidence_rank], hits[found], *rest[example.evidence_rank :]], found


def distractors_in(hits: Sequence[Hit], example: QAExample, facts: frozenset[str]) -> list[str]:
    """The exact answers of other questions (`facts`) that a retrieved chunk holds: facts a fused answer
    may give instead of `example`'s own."""
    others = facts - set(example.answers)
    return sorted(a for a in others if any(contains_answer(h.chunk.text, [a]) for h in hits))


def chunk_tokens_matched(segments: Sequence[Segment], hits: Sequence[Hit]) -> float:
    """The fraction of the retrieved chunks' tokens that the prompt's segments read from a chunk cache
    (1.0 in the native layout; less where a prompt's text around a chunk re-tokenises its edges). A head
    or a template's text read from cache is not chunk text."""
    matched = sum(len(s.ids) for s in segments if s.cacheable and s.label.startswith("chunk"))
    return matched / sum(len(h.chunk.token_ids) for h in hits)


# ---- summary ------------------------------------------------------------------------------------------
