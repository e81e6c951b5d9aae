"""The read side of an open chunk index (`IndexReader`; `ChunkIndex` extends it with creating, opening,
writing and repair): its metadata and rows, each chunk's stored vector, its embedder, search and prompt matching.

A chunk longer than the embedder reads is searched as its windows (`embedder.chunk_embeddings`): a query's hits
are windows, a chunk scores as its best window, and `search` returns distinct chunks, best first; a chunk's own
stored embedding (its windows' normalised mean) is its vector for chunk-to-chunk similarity (`vectors`,
`nearest`). Rows are read in batches under SQLite's bound-parameter limit. A reader opened before another
process's sync keeps its FAISS snapshot and skips, with a warning, the hits whose chunks that sync removed. An
index opened without its embedder finds chunks by their tokens alone (`match`) and refuses to embed.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from sentence_transformers import SentenceTransformer

from ..errors import RagKVCacheError
from . import database as db
from .embedder import ChunkEmbeddings, chunk_embeddings, unit_vectors
from .matching import MAX_CANDIDATES, MIN_SPAN, Span, find_spans, prompt_ngrams
from .records import ChunkRecord, Hit, TextDocument
from .vectors import EMBEDDING_DTYPE

if TYPE_CHECKING:
    import faiss

logger = logging.getLogger(__name__)

_RECORD_COLUMNS = "id, source, ordinal, token_ids, char_start, char_end, text"


class EmptyIndexError(RagKVCacheError, ValueError):
    """A question with no chunks to answer from: the index holds none (empty, or every document failed
    to index), or every hit was removed by another process meanwhile."""


class IndexReader:
    """The read side of an open chunk index: what it holds, search and prompt matching, and its embedder. Every
    `ChunkIndex` is one (`ChunkIndex.open`, `ChunkIndex.create`)."""

    def __init__(
        self,
        index_dir: Path,
        conn: sqlite3.Connection,
        vectors: faiss.Index,
        embedder: SentenceTransformer | None,
        meta: dict[str, str],
        vectors_sha256: str | None,
        writing: bool,
    ) -> None:
        self._dir = index_dir
        self._conn = conn
        self._writing = writing  # whether `conn` was opened for writing
        self._vectors = vectors
        self._vectors_sha256 = vectors_sha256
        self._embedder = embedder
        self._meta = meta
        self._dim = int(meta["embedding_dim"])
        self._chunk_count, self._most_windows = db.window_shape(conn)

    @property
    def index_dir(self) -> Path:
        return self._dir

    @property
    def meta(self) -> dict[str, str]:
        """All stored metadata: the caller's keys plus format, embedder, embedding_dim, index_type."""
        return dict(self._meta)

    def __len__(self) -> int:
        """How many chunks the index holds."""
        return self._chunk_count

    def close(self) -> None:
        self._conn.close()

    def documents(self) -> dict[str, str]:
        """The documents the index holds (files and texts): sha256 of each, by source."""
        return dict(self._conn.execute("SELECT source, sha256 FROM documents"))

    def texts(self, sources: Sequence[str]) -> dict[str, TextDocument]:
        """The documents among `sources` that were added as text (`add_texts`), by source."""
        if not sources or not self._conn.execute(f"SELECT 1 FROM sqlite_master WHERE name = '{db.TEXTS}'").fetchone():
            return {}
        keys = list(dict.fromkeys(sources))
        rows = self._conn.execute(
            f"SELECT source, text, metadata FROM {db.TEXTS} WHERE source IN ({', '.join('?' * len(keys))})", keys
        )
        return {source: TextDocument(source, text, json.loads(metadata)) for source, text, metadata in rows}

    def search(self, query: str, k: int) -> list[Hit]:
        """The `k` distinct chunks most similar to `query`, each scored by its best window, best first (all
        chunks, with a warning, if fewer)."""
        if not query.strip():
            raise ValueError(f"query must not be empty, got {query!r}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")
        if k > len(self):
            logger.warning("k=%d exceeds the %d chunks in %s; returning all of them", k, len(self), self._dir)
            k = len(self)
        if k == 0:
            return []
        return self._hits(self.embed([query], batch_size=1, progress=False), k)[0]

    def nearest(self, chunks: Sequence[ChunkRecord], k: int) -> list[list[ChunkRecord]]:
        """For each of `chunks` (indexed ones), the at most `k` other chunks most similar to it (its own vector,
        `vectors`, against their windows), best first, each text once: a chunk with the same tokens as the chunk
        or as one taken before it (the same passage in another document) is skipped. One search for all of
        them, nothing embedded again."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")
        if not chunks:
            return []
        queries = self.vectors(chunks)  # [C, E]
        hits = self._hits(queries, min(2 * k + 1, len(self)))  # room for copies
        return [_distinct(chunk, [h.chunk for h in found], k) for chunk, found in zip(chunks, hits, strict=True)]

    def vectors(self, chunks: Sequence[ChunkRecord]) -> np.ndarray:
        """The stored vectors of `chunks` (indexed ones) [C, E], unit rows, nothing embedded again: each chunk's
        own vector, its windows' normalised mean (a chunk of one window: that window's). Raises
        `RagKVCacheError` naming a chunk the index does not hold."""
        if not chunks:
            return self._none()
        ids = list(dict.fromkeys(c.id for c in chunks))
        blobs: dict[str, bytes] = {}
        for start in range(0, len(ids), db.LOOKUP_BATCH):
            batch = ids[start : start + db.LOOKUP_BATCH]
            rows = self._conn.execute(
                f"SELECT id, embedding FROM chunks WHERE id IN ({', '.join('?' * len(batch))})", batch
            )
            blobs.update(rows)
        if missing := [c.id for c in chunks if c.id not in blobs]:
            raise RagKVCacheError(f"chunks {missing!r} are not in {self._dir}: only indexed chunks have stored vectors")
        return np.stack([np.frombuffer(blobs[c.id], dtype=EMBEDDING_DTYPE) for c in chunks])  # [C, E]

    def _hits(self, queries: np.ndarray, k: int) -> list[list[Hit]]:
        """The `k` distinct chunks most similar to each of `queries` [Q, E] (unit vectors), best first, each scored
        by its best window. Searches the (k - 1) * m + 1 best windows (m: the most windows a chunk has), which
        hold the k best chunks' best windows (exactly so in a flat index)."""
        if k < 1:
            return [[] for _ in queries]
        n_windows = min((k - 1) * self._most_windows + 1, self._vectors.ntotal)
        scores, faiss_ids = self._vectors.search(queries, n_windows)  # [Q, n_windows] x 2
        found = [
            [(int(i), float(s)) for i, s in zip(row_ids, row, strict=True) if i != -1]
            for row_ids, row in zip(faiss_ids, scores, strict=True)
        ]
        ids = [i for row in found for i, _ in row]
        records = self._fetch_windows(list(set(ids)))
        removed = sum(i not in records for i in ids)
        if removed:  # another process synced since this index was opened
            logger.warning(
                "%d of the %d hits were removed from %s by another process since it was opened; reopen the "
                "index to search its current contents",
                removed,
                len(ids),
                self._dir,
            )
        return [_best_windows(((records[i], score) for i, score in row if i in records), k) for row in found]

    def match(self, ids: Sequence[int], min_span: int = MIN_SPAN) -> list[tuple[Span, ChunkRecord]]:
        """Every run of at least `min_span` tokens of `ids` (a prompt's token ids) that equals a run of an
        indexed chunk's ids, in prompt order, without overlaps, with its chunk (`matching.find_spans`)."""
        hashes = sorted(set(prompt_ngrams(ids)))
        candidates: dict[int, list[tuple[int, int]]] = {}
        for start in range(0, len(hashes), db.LOOKUP_BATCH):
            batch = hashes[start : start + db.LOOKUP_BATCH]
            rows = self._conn.execute(
                f"SELECT hash, faiss_id, offset FROM ngrams WHERE hash IN ({', '.join('?' * len(batch))})", batch
            )
            for h, faiss_id, offset in rows:
                if len(entries := candidates.setdefault(h, [])) < MAX_CANDIDATES:
                    entries.append((faiss_id, offset))
        if not candidates:
            return []
        records = self._fetch("faiss_id", list({fid for entries in candidates.values() for fid, _ in entries}))
        candidates = {h: [e for e in entries if e[0] in records] for h, entries in candidates.items()}
        spans = find_spans(ids, candidates, {fid: r.token_ids for fid, r in records.items()}, min_span=min_span)
        return [(span, records[span.chunk]) for span in spans]

    def get(self, ids: Sequence[str]) -> list[ChunkRecord]:
        """The chunks with these ids, in the given order."""
        records = self._fetch("id", list(dict.fromkeys(ids)))
        if missing := [chunk for chunk in ids if chunk not in records]:
            raise KeyError(f"chunk ids not in index {self._dir}: {missing!r}")
        return [records[chunk] for chunk in ids]

    def vector_batches(self, size: int) -> Iterator[tuple[list[str], np.ndarray]]:
        """Every chunk's stored vector (as `vectors` gives it), `size` chunks at a time, by source then ordinal:
        (their ids, [B, E] unit rows)."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        rows = self._conn.execute("SELECT id, embedding FROM chunks ORDER BY source, ordinal")
        while batch := rows.fetchmany(size):
            yield [chunk for chunk, _ in batch], np.stack([np.frombuffer(b, dtype=EMBEDDING_DTYPE) for _, b in batch])

    def centrality(self, batch: int) -> tuple[list[str], np.ndarray]:
        """Every chunk's id (by source, then ordinal) and its stored vector's cosine to the mean of all of them [C]:
        two passes over the vectors, `batch` at a time (`vector_batches`)."""
        total: np.ndarray | None = None
        n = 0
        for _, vectors in self.vector_batches(batch):  # [B, E], unit rows
            part = vectors.sum(axis=0, dtype=np.float64)  # [E]
            total = part if total is None else total + part
            n += len(vectors)
        if total is None:
            return [], np.zeros(0)
        centre = total / n  # [E]
        ids: list[str] = []
        scores: list[np.ndarray] = []
        for chunks, vectors in self.vector_batches(batch):
            ids.extend(chunks)
            scores.append(vectors @ centre)  # [B]
        return ids, np.concatenate(scores)  # [C]

    def all_chunks(self) -> Iterator[ChunkRecord]:
        """Every chunk, by source then ordinal."""
        rows = self._conn.execute(f"SELECT {_RECORD_COLUMNS} FROM chunks ORDER BY source, ordinal")
        return (_record(row) for row in rows)

    def token_ids(self) -> Iterator[tuple[int, ...]]:
        """Every chunk's token ids, in no particular order."""
        rows = self._conn.execute("SELECT token_ids FROM chunks")
        return (tuple(np.frombuffer(blob, dtype=db.TOKEN_DTYPE).tolist()) for (blob,) in rows)

    def embed(self, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        """L2-normalised float32 embeddings [T, E] of `texts`, as queries are embedded: each text read up to
        the embedder's limit (`unit_vectors`; a tqdm bar over batches if `progress`). A text under the limit
        gets the vector `embed_chunks` gives it."""
        if not texts:
            return self._none()
        return unit_vectors(self._own_embedder(len(texts)), texts, batch_size, progress)  # [T, E]

    def embed_chunks(self, texts: list[str], batch_size: int = 64, progress: bool = False) -> ChunkEmbeddings:
        """Chunk `texts` embedded as the index stores them: each text whole, its windows under the embedder's
        limit and its own vector (`embedder.chunk_embeddings`; a tqdm bar over the windows' batches if
        `progress`). Indexing and the repair of a damaged embedding (`reembed`) both embed this way, so a
        repaired embedding is the one indexing stored."""
        if not texts:
            return ChunkEmbeddings.empty(self._dim)
        embedder = self._own_embedder(len(texts))
        return chunk_embeddings(embedder, texts, batch_size, progress, self._meta["embedder"])

    def _none(self) -> np.ndarray:
        """No embeddings [0, E]."""
        return np.empty((0, self._dim), dtype=np.float32)

    def _own_embedder(self, asked: int) -> SentenceTransformer:
        """The embedder this index was opened with; raises when it was opened without one (`asked` texts)."""
        if self._embedder is None:
            raise RagKVCacheError(
                f"index {self._dir} was opened without its embedder {self._meta['embedder']!r}: it finds chunks by "
                f"their tokens, and embeds nothing ({asked} texts asked)"
            )
        return self._embedder

    def _fetch_windows(self, window_ids: Sequence[int]) -> dict[int, ChunkRecord]:
        """The chunks of the windows with these FAISS ids, keyed by window id (in batches under SQLite's
        bound-parameter limit); a window whose chunk the index no longer holds is left out."""
        records: dict[int, ChunkRecord] = {}
        columns = ", ".join(f"c.{name.strip()}" for name in _RECORD_COLUMNS.split(","))
        windows = db.window_rows(self._conn)
        for start in range(0, len(window_ids), db.LOOKUP_BATCH):
            batch = list(window_ids[start : start + db.LOOKUP_BATCH])
            rows = self._conn.execute(
                f"SELECT w.faiss_id, {columns} FROM {windows} AS w JOIN chunks c ON c.id = w.chunk"
                f" WHERE w.faiss_id IN ({', '.join('?' * len(batch))})",
                batch,
            )
            records.update((row[0], _record(row[1:])) for row in rows)
        return records

    def _fetch(self, column: Literal["id", "faiss_id"], keys: Sequence[str | int]) -> dict[str | int, ChunkRecord]:
        """Chunks whose `column` is in `keys`, keyed by it (in batches under SQLite's bound-parameter limit)."""
        records: dict[str | int, ChunkRecord] = {}
        for start in range(0, len(keys), db.LOOKUP_BATCH):
            batch = list(keys[start : start + db.LOOKUP_BATCH])
            rows = self._conn.execute(
                f"SELECT {column}, {_RECORD_COLUMNS} FROM chunks WHERE {column} IN ({', '.join('?' * len(batch))})",
                batch,
            )
            records.update((row[0], _record(row[1:])) for row in rows)
        return records


def _best_windows(hits: Iterable[tuple[ChunkRecord, float]], k: int) -> list[Hit]:
    """The first `k` distinct chunks of window `hits` (each window's chunk and score, best first), each scored by
    its first (best) window."""
    best: dict[str, Hit] = {}
    for record, score in hits:
        if record.id not in best:
            best[record.id] = Hit(record, score)
            if len(best) == k:
                break
    return list(best.values())


def _distinct(chunk: ChunkRecord, found: Sequence[ChunkRecord], k: int) -> list[ChunkRecord]:
    """The first `k` of `found` whose tokens are neither `chunk`'s nor those of one taken before."""
    seen = {chunk.token_ids}
    taken: list[ChunkRecord] = []
    for other in found:
        if len(taken) == k:
            break
        if other.token_ids not in seen:
            seen.add(other.token_ids)
            taken.append(other)
    return taken


def _record(row: Sequence) -> ChunkRecord:
    """A `ChunkRecord` from a row of `_RECORD_COLUMNS`."""
    chunk, source, ordinal, token_blob, char_start, char_end, text = row
    token_ids = tuple(np.frombuffer(token_blob, dtype=db.TOKEN_DTYPE).tolist())
    return ChunkRecord(source, ordinal, token_ids, char_start, char_end, text, id=chunk)
