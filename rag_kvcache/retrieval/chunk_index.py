"""The chunk index: embeddings in FAISS, chunk metadata and token ids in SQLite.

An index directory holds `index.sqlite` (the source of truth: documents, chunks with their token ids
and embeddings, each chunk's window embeddings, and free-form metadata; plus the table of chunk n-grams that
`match` finds chunks in any prompt with, written in the same transactions as the chunks) and `vectors.faiss`
(derived from it: one vector a window). A chunk longer than the embedder reads is searched as its windows
(`embedder.chunk_embeddings`): a query's hits are windows, a chunk scores as its best window, and `search`
returns distinct chunks; a chunk's own stored embedding (its windows' normalised mean) is its vector for
chunk-to-chunk similarity (`vectors`, `nearest`). Documents are staged outside it (`indexing.staging`: read, diffed, chunked, embedded; nothing
written: the caller computes the new chunks' KV caches then), then written (`write`). A write
and fsyncs the new FAISS file under a temporary name, commits SQLite in one
transaction (with that file's sha256), then renames the file into place; a failure before the
commit (a full disk: `StorageFullError`, naming the file and what was being written) leaves both as
they were. A FAISS file whose bytes do not match the checksum or that does not hold exactly the
chunks in SQLite (a kill between commit and rename, a deleted, damaged or edited file) is rebuilt
from SQLite's embeddings on open: in memory for a reader, which writes nothing (SQLite opened
read-only; immutable when even that is impossible, e.g. on a full disk), and rewritten by a writer. A writer whose FAISS snapshot is not the one SQLite records
(another process synced since it opened) rebuilds from SQLite instead of extending its snapshot.
SQLite runs in WAL mode, so readers see the last committed sync and never wait for one; a reader
opened before a sync keeps its FAISS snapshot and skips hits whose chunks that sync removed.
Writers are serialised by the caller (the pipeline holds a lock file for a whole sync).

The SQLite file, its transactions and the commit protocol of the FAISS file are `database`'s, the checks
of its rows `integrity`'s; this module is the index over them: writing chunks into it, search, prompt
matching, and repair.
"""

from __future__ import annotations

import errno
import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from sentence_transformers import SentenceTransformer

from ..errors import RagKVCacheError
from . import database as db
from . import integrity
from . import vectors as faiss_file
from .chunking import Chunk
from .database import chunk_id
from .embedder import ChunkEmbeddings, chunk_embeddings, unit_vectors
from .integrity import Verified
from .matching import MAX_CANDIDATES, MIN_SPAN, Span, find_spans, prompt_ngrams
from .vectors import EMBEDDING_DTYPE, IndexType

if TYPE_CHECKING:
    import faiss

logger = logging.getLogger(__name__)

_RECORD_COLUMNS = "id, source, ordinal, token_ids, char_start, char_end, text"


class EmptyIndexError(RagKVCacheError, ValueError):
    """A question with no chunks to answer from: the index holds none (empty, or every document failed
    to index), or every hit was removed by another process meanwhile."""


@dataclass(frozen=True)
class ChunkRecord(Chunk):
    """An indexed chunk: a `Chunk` with its content-derived id."""

    id: str

    @classmethod
    def from_chunk(cls, chunk: Chunk) -> ChunkRecord:
        """The record of `chunk`, with its id derived from its source, ordinal and token ids."""
        return cls(
            chunk.source,
            chunk.ordinal,
            chunk.token_ids,
            chunk.char_start,
            chunk.char_end,
            chunk.text,
            id=chunk_id(chunk.source, chunk.ordinal, chunk.token_ids),
        )


@dataclass(frozen=True)
class Hit:
    """A search result: the chunk and its cosine similarity to the query (that of its best window)."""

    chunk: ChunkRecord
    score: float  # in [-1, 1], higher is closer


@dataclass(frozen=True)
class TextDocument:
    """A document given as text rather than as a file (a vector store's), with its JSON-able metadata;
    its `source` is its id in the index."""

    source: str
    text: str = field(repr=False)
    metadata: Mapping[str, object] = field(default_factory=dict)


class ChunkIndex:
    """A persistent, folder-synced index of chunk embeddings, token ids and texts.

    Build one with `ChunkIndex.create` or `ChunkIndex.open`; close it (or use it as a context manager).
    """

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

    @classmethod
    def create(
        cls,
        index_dir: Path,
        embedder: SentenceTransformer,
        embedder_name: str,
        meta: Mapping[str, str],
        index_type: IndexType = "flat",
    ) -> ChunkIndex:
        """Create an empty index in `index_dir` (created if missing) storing the caller's `meta`.

        The index records its own `format`, `embedder`, `embedding_dim` and `index_type` keys; `meta`
        may repeat them only with the same values.
        """
        index_dir = Path(index_dir)
        if index_type not in ("flat", "hnsw"):
            raise ValueError(f"index_type must be 'flat' or 'hnsw', got {index_type!r}")
        if bad := {key: value for key, value in meta.items() if not isinstance(value, str)}:
            raise TypeError(f"meta values must be strings, got {bad!r}")
        dim = embedder.get_embedding_dimension()
        if not dim:
            raise ValueError(f"embedder {embedder_name!r} reports no fixed embedding dimension ({dim!r})")
        own_meta = {
            "format": db.FORMAT,
            "embedder": embedder_name,
            "embedding_dim": str(dim),
            "index_type": index_type,
        }
        if clash := {key: meta[key] for key in own_meta.keys() & meta.keys() if meta[key] != own_meta[key]}:
            raise ValueError(f"meta {clash!r} contradicts what the index records itself: {own_meta!r}")
        db_path = index_dir / db.DB_FILE
        if db.exists(index_dir):
            raise FileExistsError(f"an index already exists at {index_dir}; open it instead")
        for path in db.db_files(db_path):  # a creation killed before its schema committed left an empty file
            if path.exists():
                logger.warning("removing %s, left without tables by an interrupted index creation", path)
                path.unlink()

        index_dir.mkdir(parents=True, exist_ok=True)
        full_meta = {**meta, **own_meta}
        conn = db.connect(db_path, mode="rwc")

        def schema() -> faiss.Index:
            for statement in db.SCHEMA:
                conn.execute(statement)
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", full_meta.items())
            return db.vectors_from_db(conn, dim, index_type)

        try:
            conn.execute("PRAGMA journal_mode=WAL")  # readers never wait for a sync's commit
            vectors, recorded = db.commit(conn, index_dir, "creating the index", schema)
        except BaseException:
            conn.close()
            raise
        logger.info("created %s index at %s (embedder %s, dim %d)", index_type, index_dir, embedder_name, dim)
        return cls(index_dir, conn, vectors, embedder, full_meta, recorded, writing=True)

    @classmethod
    def open(cls, index_dir: Path, embedder: SentenceTransformer | None, rewrite: bool = True) -> ChunkIndex:
        """Open an existing index; `embedder` must produce vectors of the index's dimension (None: one that
        embeds nothing, whose chunks are found by their tokens alone: the vLLM connector's).

        SQLite is opened read-only (a first write reopens it, `_writable_conn`). A `vectors.faiss` that
        fails its check is rebuilt from SQLite and, with `rewrite`, rewritten where this process may
        write the index and the disk has room; otherwise it is rebuilt in memory only and the file left
        as it is (`rewrite=False`: a check that must see the index as it is)."""
        index_dir = Path(index_dir)
        conn = db.connect_existing(index_dir)
        try:
            meta = db.checked_meta(conn, index_dir)
            db.ensure_ngrams(conn, index_dir)
            dim = int(meta["embedding_dim"]) if embedder is None else embedder.get_embedding_dimension()
            if str(dim) != meta["embedding_dim"]:
                raise ValueError(
                    f"index {index_dir} holds {meta['embedding_dim']}-d vectors of {meta['embedder']!r}, "
                    f"but the given embedder produces {dim}-d vectors"
                )
            conn.execute("BEGIN")  # the checksum and the chunk ids of one snapshot
            try:
                recorded = db.recorded_vectors_sha256(conn)
                expected = db.window_ids(conn)  # [W]
            finally:
                conn.execute("COMMIT")
            vectors = faiss_file.load(index_dir, expected, dim, recorded)
            if vectors is None:
                vectors, recorded = db.rebuild_vectors(conn, index_dir, dim, meta["index_type"], rewrite)
            return cls(index_dir, conn, vectors, embedder, meta, recorded, writing=False)
        except BaseException:
            conn.close()
            raise

    @staticmethod
    def read_meta(index_dir: Path) -> dict[str, str]:
        """An index's metadata without opening it (e.g. to learn which embedder it was built with)."""
        index_dir = Path(index_dir)
        conn = db.connect_existing(index_dir)
        try:
            return db.checked_meta(conn, index_dir)
        finally:
            conn.close()

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

    def __enter__(self) -> ChunkIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def documents(self) -> dict[str, str]:
        """The documents the index holds (files and texts): sha256 of each, by source."""
        return dict(self._conn.execute("SELECT source, sha256 FROM documents"))

    def delete(self, sources: Sequence[str]) -> list[str]:
        """Remove the documents (files or texts) with these sources; returns those the index held."""
        indexed = self.documents()
        removed = [s for s in dict.fromkeys(sources) if s in indexed]
        if removed:
            self.write(removed, [], [], ChunkEmbeddings.empty(self._dim))
        logger.info("deleted %d documents from %s", len(removed), self._dir)
        return removed

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

    def all_chunks(self) -> Iterator[ChunkRecord]:
        """Every chunk, by source then ordinal."""
        rows = self._conn.execute(f"SELECT {_RECORD_COLUMNS} FROM chunks ORDER BY source, ordinal")
        return (_record(row) for row in rows)

    def token_ids(self) -> Iterator[tuple[int, ...]]:
        """Every chunk's token ids, in no particular order."""
        rows = self._conn.execute("SELECT token_ids FROM chunks")
        return (tuple(np.frombuffer(blob, dtype=db.TOKEN_DTYPE).tolist()) for (blob,) in rows)

    def verify(self) -> Verified:
        """Check every file of the index but the KV caches (`integrity.verify`)."""
        return integrity.verify(self._conn, self._dir, self._dim)

    def reembed(self, chunk_ids: Sequence[str], batch_size: int = 64) -> int:
        """Recompute the stored embeddings of these chunks from their texts and rewrite `vectors.faiss`
        from SQLite (the repair of embeddings that `verify` found damaged); returns how many."""
        records = self._fetch("id", list(dict.fromkeys(chunk_ids)))
        embedded = self.embed_chunks([r.text for r in records.values()], batch_size, progress=False)
        conn = self._writable_conn(f"rewriting {len(records)} embeddings")

        def change() -> faiss.Index:
            db.ensure_windows(conn)
            conn.executemany(
                "UPDATE chunks SET embedding = ? WHERE id = ?",
                (
                    (e.astype(EMBEDDING_DTYPE).tobytes(), chunk)
                    for chunk, e in zip(records, embedded.chunks, strict=True)
                ),
            )
            conn.executemany(f"DELETE FROM {db.WINDOWS} WHERE chunk = ?", ((chunk,) for chunk in records))
            db.insert_windows(conn, list(records), [embedded.of_chunk(i) for i in range(len(embedded))])
            return db.vectors_from_db(conn, self._dim, self._meta["index_type"])

        self._vectors, self._vectors_sha256 = db.commit(conn, self._dir, "rewriting embeddings", change)
        self._chunk_count, self._most_windows = db.window_shape(conn)
        return len(records)

    def rewrite_vectors(self) -> None:
        """Rebuild `vectors.faiss` from SQLite's stored window embeddings (no re-embedding) and write it; window
        rows of chunks the index does not hold (`Verified.orphan_windows`) are deleted."""
        conn = self._writable_conn("rewriting vectors.faiss")

        def change() -> faiss.Index:
            if db.has_windows(conn):
                conn.execute(f"DELETE FROM {db.WINDOWS} WHERE chunk NOT IN (SELECT id FROM chunks)")
            return db.vectors_from_db(conn, self._dim, self._meta["index_type"])

        self._vectors, self._vectors_sha256 = db.commit(conn, self._dir, "rewriting vectors.faiss", change)
        self._chunk_count, self._most_windows = db.window_shape(conn)

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

    def write(
        self,
        stale_sources: list[str],
        documents: list[tuple[str, str, int]],
        new_chunks: list[ChunkRecord],
        embeddings: ChunkEmbeddings,
        texts: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        """Drop the stale sources, add `documents` (source, sha256, n_chunks) and their `new_chunks` (embedded as
        `embeddings`: their own vectors and windows), and `texts` (source, text, metadata JSON) of documents
        added as text.

        SQLite changes in one transaction; FAISS is updated on a copy, written, and swapped in after
        the commit (`db.commit`).
        """
        if len(embeddings) != len(new_chunks):
            raise ValueError(f"{len(embeddings)} chunk embeddings for {len(new_chunks)} new chunks")
        new_faiss_ids = np.array([db.faiss_id(record.id) for record in new_chunks], dtype=np.int64)  # [C]
        what = f"committing {len(new_chunks)} new chunks and dropping {len(stale_sources)} documents"
        conn = self._writable_conn(what)

        def change() -> faiss.Index:
            db.ensure_windows(conn)
            old_faiss_ids = np.array(
                [
                    faiss_id
                    for source in stale_sources
                    for (faiss_id,) in conn.execute("SELECT faiss_id FROM chunks WHERE source = ?", (source,))
                ],
                dtype=np.int64,
            )  # [C_old]
            old_window_ids = np.array(
                [
                    faiss_id
                    for source in stale_sources
                    for (faiss_id,) in conn.execute(
                        f"SELECT w.faiss_id FROM {db.WINDOWS} AS w JOIN chunks c ON c.id = w.chunk WHERE c.source = ?",
                        (source,),
                    )
                ],
                dtype=np.int64,
            )  # [W_old]
            conn.executemany("DELETE FROM ngrams WHERE faiss_id = ?", ((int(f),) for f in old_faiss_ids))
            conn.executemany(
                f"DELETE FROM {db.WINDOWS} WHERE chunk IN (SELECT id FROM chunks WHERE source = ?)",
                ((s,) for s in stale_sources),
            )
            conn.executemany("DELETE FROM chunks WHERE source = ?", ((s,) for s in stale_sources))
            conn.executemany("DELETE FROM documents WHERE source = ?", ((s,) for s in stale_sources))
            conn.execute(db.TEXTS_SCHEMA)
            conn.executemany(f"DELETE FROM {db.TEXTS} WHERE source = ?", ((s,) for s in stale_sources))
            conn.executemany(f"INSERT INTO {db.TEXTS} (source, text, metadata) VALUES (?, ?, ?)", texts)
            conn.executemany("INSERT INTO documents (source, sha256, n_chunks) VALUES (?, ?, ?)", documents)
            conn.executemany(
                "INSERT INTO chunks (id, faiss_id, source, ordinal, token_ids, char_start, char_end, text,"
                " embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (
                        r.id,
                        int(fid),
                        r.source,
                        r.ordinal,
                        db.pack_tokens(r.token_ids),
                        r.char_start,
                        r.char_end,
                        r.text,
                        emb.astype(EMBEDDING_DTYPE).tobytes(),
                    )
                    for r, fid, emb in zip(new_chunks, new_faiss_ids, embeddings.chunks, strict=True)
                ),
            )
            new_window_ids = db.insert_windows(
                conn, [r.id for r in new_chunks], [embeddings.of_chunk(i) for i in range(len(new_chunks))]
            )  # [W]
            db.insert_ngrams(conn, zip(new_faiss_ids.tolist(), (r.token_ids for r in new_chunks)))
            if (recorded := db.recorded_vectors_sha256(conn)) != self._vectors_sha256:
                logger.warning(
                    "%s was synced by another process since it was opened (vectors sha256 %s, this process has "
                    "%s); rebuilding the vectors from the stored embeddings",
                    self._dir,
                    recorded,
                    self._vectors_sha256,
                )
                return db.vectors_from_db(conn, self._dim, self._meta["index_type"])
            if len(old_window_ids) and self._meta["index_type"] == "hnsw":
                # HNSW graphs cannot drop vectors: rebuild from the rows this transaction leaves.
                return db.vectors_from_db(conn, self._dim, self._meta["index_type"])
            vectors = faiss_file.clone(self._vectors)
            if len(old_window_ids):
                vectors.remove_ids(old_window_ids)
            vectors.add_with_ids(embeddings.windows, new_window_ids)
            return vectors

        self._vectors, self._vectors_sha256 = db.commit(conn, self._dir, what, change)
        self._chunk_count, self._most_windows = db.window_shape(conn)

    def _writable_conn(self, what: str) -> sqlite3.Connection:
        """The connection, reopened for writing if it was opened read-only (a reader that now writes,
        e.g. a vector store's engine adding documents). Raises `PermissionError` naming `what` when this
        process may not write the index."""
        if not self._writing:
            if not db.writable(self._dir):
                raise PermissionError(
                    errno.EACCES,
                    f"index {self._dir} is read-only for this process: cannot go on {what}",
                    str(self._dir),
                )
            self._conn.close()
            self._conn, self._writing = db.connect_existing(self._dir, write=True), True
        return self._conn

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
