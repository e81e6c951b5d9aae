"""Documents staged for the chunk index: read, diffed against what it holds, chunked and embedded, with
nothing written (`stage_sync` for a folder, `stage_texts` for documents given as text). Indexing then
computes the new chunks' KV caches and only after them commits the staged rows (`commit`), so a
committed chunk always has its cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import DEFAULT_MAX_DOCUMENTS, DEFAULT_MAX_FILE_BYTES
from ..retrieval.chunk_index import ChunkIndex
from ..retrieval.chunking import Chunk
from ..retrieval.documents import Skipped, SourceFile, read_documents
from ..retrieval.embedder import ChunkEmbeddings
from ..retrieval.records import ChunkRecord, TextDocument

logger = logging.getLogger(__name__)

Chunker = Callable[[str, str], list[Chunk]]  # (text, source) -> the document's chunks


@dataclass(frozen=True)
class SyncReport:
    """What a staged sync or addition of documents does (`commit` returns it), by document source."""

    added: list[str]
    changed: list[str]
    removed: list[str]
    unchanged: list[str]
    skipped: list[Skipped]
    new_chunks: list[ChunkRecord]


@dataclass(frozen=True)
class Staged:
    """Documents read, chunked and embedded, not yet written (`commit`): what indexing computes the new
    chunks' caches from before the index holds them."""

    report: SyncReport
    stale: list[str]  # the sources whose rows go: removed and changed
    documents: list[tuple[str, str, int]]  # the document rows to add: (source, sha256, number of chunks)
    embedded: ChunkEmbeddings  # one chunk per `report.new_chunks`: its windows and its own vector
    texts: list[tuple[str, str, str]] = field(default_factory=list)  # given as text: (source, text, metadata JSON)

    @property
    def embeddings(self) -> np.ndarray:
        """The new chunks' own vectors [C, E], one per `report.new_chunks` (their windows' normalised mean)."""
        return self.embedded.chunks


def stage_sync(
    index: ChunkIndex,
    docs_dir: Path,
    chunker: Chunker,
    batch_size: int = 64,
    progress: bool = True,
    prune: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_documents: int = DEFAULT_MAX_DOCUMENTS,
) -> Staged:
    """`docs_dir`'s new and changed files read, chunked and embedded, for `commit`; nothing is written.
    Documents the index holds that are not in `docs_dir` (another folder's, a store's, or deleted files)
    are kept, unless `prune` drops them (reported as `removed`). Sources are paths relative to
    `docs_dir`, so a file at the same relative path as an indexed document replaces it (`changed`).

    `chunker(text, source)` splits one document; unchanged files (same sha256) are not re-chunked.
    `max_file_bytes` and `max_documents` are `read_documents`' limits; the index folder itself is never
    read as a document.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    files, skipped = read_documents(
        docs_dir, max_file_bytes=max_file_bytes, max_documents=max_documents, exclude=(index.index_dir,)
    )
    indexed = index.documents()
    to_index = [f for f in files if indexed.get(f.source) != f.sha256]
    added = [f.source for f in to_index if f.source not in indexed]
    changed = [f.source for f in to_index if f.source in indexed]
    unchanged = [f.source for f in files if indexed.get(f.source) == f.sha256]
    removed = sorted(indexed.keys() - {f.source for f in files}) if prune else []

    new_chunks, embeddings, documents = _chunked(index, to_index, chunker, batch_size, progress)
    report = SyncReport(added, changed, removed, unchanged, skipped, new_chunks)
    return Staged(report, removed + changed, documents, embeddings)


def stage_texts(
    index: ChunkIndex,
    documents: Sequence[TextDocument],
    chunker: Chunker,
    batch_size: int = 64,
    progress: bool = True,
) -> Staged:
    """Documents given as text chunked and embedded, for `commit`, as `stage_sync` stages files: a document
    whose source the index holds replaces it (`changed`); nothing else is removed. Their texts and
    metadata are kept (`texts`)."""
    sources = [d.source for d in documents]
    if duplicates := sorted({s for s in sources if sources.count(s) > 1}):
        raise ValueError(f"documents added together must have distinct sources, got {duplicates!r} twice")
    if empty := [d.source for d in documents if not d.text.strip()]:
        raise ValueError(f"documents without text cannot be indexed: {empty!r}")
    files = [SourceFile(d.source, d.text, hashlib.sha256(d.text.encode()).hexdigest()) for d in documents]
    indexed = index.documents()
    new_chunks, embeddings, rows = _chunked(index, files, chunker, batch_size, progress)
    stored = [(d.source, d.text, json.dumps(dict(d.metadata))) for d in documents]  # TypeError if not JSON-able
    changed = [s for s in sources if s in indexed]
    report = SyncReport([s for s in sources if s not in indexed], changed, [], [], [], new_chunks)
    return Staged(report, changed, rows, embeddings, stored)


def commit(index: ChunkIndex, staged: Staged) -> SyncReport:
    """Write what `stage_sync` or `stage_texts` staged into `index` (`ChunkIndex.write`: one SQLite
    transaction and a swap of `vectors.faiss`); returns its report."""
    if staged.documents or staged.stale:
        index.write(staged.stale, staged.documents, staged.report.new_chunks, staged.embedded, staged.texts)
    r = staged.report
    logger.info(
        "committed into %s: %d added, %d changed, %d removed, %d unchanged, %d skipped, %d new chunks",
        index.index_dir,
        len(r.added),
        len(r.changed),
        len(r.removed),
        len(r.unchanged),
        len(r.skipped),
        len(r.new_chunks),
    )
    return r


def _chunked(
    index: ChunkIndex, files: Sequence[SourceFile], chunker: Chunker, batch_size: int, progress: bool
) -> tuple[list[ChunkRecord], ChunkEmbeddings, list[tuple[str, str, int]]]:
    """`files` chunked and embedded by `index`'s embedder: their chunks in order, the chunks' embeddings
    (`ChunkIndex.embed_chunks`), and a document row (source, sha256, number of chunks) for each file."""
    chunks_by_source = {f.source: _chunk(f, chunker) for f in files}
    new_chunks = [record for records in chunks_by_source.values() for record in records]
    embeddings = index.embed_chunks([record.text for record in new_chunks], batch_size, progress)
    return new_chunks, embeddings, [(f.source, f.sha256, len(chunks_by_source[f.source])) for f in files]


def _chunk(file: SourceFile, chunker: Chunker) -> list[ChunkRecord]:
    """Chunk one file, checking that the chunker kept its source."""
    records = [ChunkRecord.from_chunk(chunk) for chunk in chunker(file.text, file.source)]
    if wrong := sorted({r.source for r in records} - {file.source}):
        raise ValueError(f"chunker returned chunks of sources {wrong} for document {file.source!r}")
    return records
