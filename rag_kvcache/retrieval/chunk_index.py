"""The chunk index: embeddings in FAISS, chunk metadata and token ids in SQLite, synced with a folder.

An index directory holds `index.sqlite` (the source of truth: documents, chunks with their token ids
and embeddings, and free-form metadata; plus the table of chunk n-grams that `match` finds chunks
in any prompt with, written in the same transactions as the chunks) and `vectors.faiss` (derived
from it). A sync commits SQLite
in one transaction (with the sha256 of the FAISS file it is about to write), then replaces
`vectors.faiss` atomically; a FAISS file whose bytes do not match that checksum or that does not hold
exactly the chunks in SQLite (a crash between the two, a deleted, damaged or edited file) is rebuilt
from SQLite's embeddings on open. A writer whose FAISS snapshot is not the one SQLite records
(another process synced since it opened) rebuilds from SQLite instead of extending its snapshot.
SQLite runs in WAL mode, so readers see the last committed sync and never wait for one; a reader
opened before a sync keeps its FAISS snapshot and skips hits whose chunks that sync removed.
Writers are serialised by the caller (the pipeline holds a lock file for a whole sync).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import faiss
import numpy as np
from sentence_transformers import SentenceTransformer

from . import vectors as faiss_file
from .chunking import Chunk
from .matching import MAX_CANDIDATES, MIN_SPAN, Span, chunk_ngrams, find_spans, prompt_ngrams
from .documents import DEFAULT_MAX_DOCUMENTS, DEFAULT_MAX_FILE_BYTES, Skipped, SourceFile, read_documents
from .vectors import EMBEDDING_DTYPE, IndexType

logger = logging.getLogger(__name__)

FORMAT = "rag-kvcache-index-v1"
_DB_FILE = "index.sqlite"
_VECTORS_SHA256 = "vectors_sha256"  # meta key: the checksum of the vectors.faiss SQLite's chunks belong to
_NGRAM_SCHEMA = (
    "CREATE TABLE ngrams (hash INTEGER NOT NULL, faiss_id INTEGER NOT NULL, offset INTEGER NOT NULL,"
    " PRIMARY KEY (hash, faiss_id, offset)) WITHOUT ROWID",
    "CREATE INDEX ngrams_by_chunk ON ngrams (faiss_id)",
)
_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE documents (source TEXT PRIMARY KEY, sha256 TEXT NOT NULL, n_chunks INTEGER NOT NULL)",
    "CREATE TABLE chunks (id TEXT PRIMARY KEY, faiss_id INTEGER NOT NULL UNIQUE, source TEXT NOT NULL,"
    " ordinal INTEGER NOT NULL, token_ids BLOB NOT NULL, char_start INTEGER NOT NULL,"
    " char_end INTEGER NOT NULL, text TEXT NOT NULL, embedding BLOB NOT NULL)",
    "CREATE INDEX chunks_by_source ON chunks (source)",
    *_NGRAM_SCHEMA,
)
_TEXTS = "texts"  # documents added as text (a vector store's): their whole text and metadata
_TEXTS_SCHEMA = f"CREATE TABLE IF NOT EXISTS {_TEXTS} (source TEXT PRIMARY KEY, text TEXT NOT NULL, metadata TEXT NOT NULL)"
_LOOKUP_BATCH = 500  # hashes or chunk keys per SELECT (under SQLite's bound-parameter limit)
_RECORD_COLUMNS = "id, source, ordinal, token_ids, char_start, char_end, text"
_TOKEN_DTYPE = np.dtype("<i4")


class ForeignIndexError(ValueError):
    """A directory that is not a rag-kvcache index (or an index of another format version)."""


class EmptyIndexError(ValueError):
    """A question with no chunks to answer from: the index holds none (empty, or every document failed
    to index), or every hit was removed by another process meanwhile."""


@dataclass(frozen=True)
class ChunkRecord:
    """An indexed chunk: a `Chunk` with its content-derived id."""

    id: str
    source: str
    ordinal: int
    token_ids: tuple[int, ...]
    char_start: int
    char_end: int
    text: str

    @classmethod
    def from_chunk(cls, chunk: Chunk) -> ChunkRecord:
        """The record of `chunk`, with its id derived from its source, ordinal and token ids."""
        return cls(
            id=chunk_id(chunk.source, chunk.ordinal, chunk.token_ids),
            source=chunk.source,
            ordinal=chunk.ordinal,
            token_ids=chunk.token_ids,
            char_start=chunk.char_start,
            char_end=chunk.char_end,
            text=chunk.text,
        )


@dataclass(frozen=True)
class Hit:
    """A search result: the chunk and its cosine similarity to the query."""

    chunk: ChunkRecord
    score: float


@dataclass(frozen=True)
class SyncReport:
    """What a `ChunkIndex.sync` did, by document source."""

    added: list[str]
    changed: list[str]
    removed: list[str]
    unchanged: list[str]
    skipped: list[Skipped]
    new_chunks: list[ChunkRecord]


@dataclass(frozen=True)
class TextDocument:
    """A document given as text rather than as a file (a vector store's), with its JSON-able metadata;
    its `source` is its id in the index."""

    source: str
    text: str = field(repr=False)
    metadata: Mapping[str, object] = field(default_factory=dict)


def chunk_id(source: str, ordinal: int, token_ids: Sequence[int]) -> str:
    """A short stable id that changes whenever the chunk's source, position or tokens change."""
    digest = hashlib.sha256(f"{source}\0{ordinal}\0".encode())
    digest.update(_pack_tokens(token_ids))
    return digest.hexdigest()[:16]


class ChunkIndex:
    """A persistent, folder-synced index of chunk embeddings, token ids and texts.

    Build one with `ChunkIndex.create` or `ChunkIndex.open`; close it (or use it as a context manager).
    """

    def __init__(
        self,
        index_dir: Path,
        conn: sqlite3.Connection,
        vectors: faiss.Index,
        embedder: SentenceTransformer,
        meta: dict[str, str],
        vectors_sha256: str,
    ) -> None:
        self._dir = index_dir
        self._conn = conn
        self._vectors = vectors
        self._vectors_sha256 = vectors_sha256
        self._embedder = embedder
        self._meta = meta
        self._dim = int(meta["embedding_dim"])

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
            "format": FORMAT,
            "embedder": embedder_name,
            "embedding_dim": str(dim),
            "index_type": index_type,
        }
        if clash := {key: meta[key] for key in own_meta.keys() & meta.keys() if meta[key] != own_meta[key]}:
            raise ValueError(f"meta {clash!r} contradicts what the index records itself: {own_meta!r}")
        db_path = index_dir / _DB_FILE
        if db_path.exists():
            raise FileExistsError(f"an index already exists at {index_dir}; open it instead")

        index_dir.mkdir(parents=True, exist_ok=True)
        full_meta = {**meta, **own_meta}
        conn = _connect(db_path, mode="rwc")
        try:
            conn.execute("PRAGMA journal_mode=WAL")  # readers never wait for a sync's commit
            with _transaction(conn):
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", full_meta.items())
                vectors = _vectors_from_db(conn, dim, index_type)
                data = _record_vectors(conn, vectors)
            faiss_file.write(index_dir, data)
        except BaseException:
            conn.close()
            raise
        logger.info("created %s index at %s (embedder %s, dim %d)", index_type, index_dir, embedder_name, dim)
        return cls(index_dir, conn, vectors, embedder, full_meta, faiss_file.checksum(data))

    @classmethod
    def open(cls, index_dir: Path, embedder: SentenceTransformer) -> ChunkIndex:
        """Open an existing index; `embedder` must produce vectors of the index's dimension."""
        index_dir = Path(index_dir)
        conn = _connect_existing(index_dir)
        try:
            meta = _checked_meta(conn, index_dir)
            _ensure_ngrams(conn, index_dir)
            dim = embedder.get_embedding_dimension()
            if str(dim) != meta["embedding_dim"]:
                raise ValueError(
                    f"index {index_dir} holds {meta['embedding_dim']}-d vectors of {meta['embedder']!r}, "
                    f"but the given embedder produces {dim}-d vectors"
                )
            conn.execute("BEGIN")  # the checksum and the chunk ids of one snapshot
            try:
                recorded = _recorded_vectors_sha256(conn)
                expected = np.fromiter((fid for (fid,) in conn.execute("SELECT faiss_id FROM chunks")), dtype=np.int64)
            finally:
                conn.execute("COMMIT")
            vectors = faiss_file.load(index_dir, expected, dim, recorded)
            if vectors is None and not _writable(index_dir):
                logger.warning("%s is read-only: searching vectors rebuilt in memory, the file left as it is", index_dir)
                vectors = _vectors_from_db(conn, dim, meta["index_type"])
                recorded = None
            elif vectors is None:
                with _transaction(conn):
                    vectors = _vectors_from_db(conn, dim, meta["index_type"])
                    data = _record_vectors(conn, vectors)
                faiss_file.write(index_dir, data)
                recorded = faiss_file.checksum(data)
            return cls(index_dir, conn, vectors, embedder, meta, recorded)
        except BaseException:
            conn.close()
            raise

    @staticmethod
    def read_meta(index_dir: Path) -> dict[str, str]:
        """An index's metadata without opening it (e.g. to learn which embedder it was built with)."""
        index_dir = Path(index_dir)
        conn = _connect_existing(index_dir)
        try:
            return _checked_meta(conn, index_dir)
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
        return self._vectors.ntotal

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ChunkIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def sync(
        self,
        docs_dir: Path,
        chunker: Callable[[str, str], list[Chunk]],
        batch_size: int = 64,
        progress: bool = True,
        before_commit: Callable[[list[ChunkRecord]], None] | None = None,
        prune: bool = False,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_documents: int = DEFAULT_MAX_DOCUMENTS,
    ) -> SyncReport:
        """Add `docs_dir` to the index: index its new and changed files. Documents the index holds that
        are not in `docs_dir` (another folder's, a store's, or deleted files) are kept, unless `prune`
        drops them (reported as `removed`). Sources are paths relative to `docs_dir`, so a file at the
        same relative path as an indexed document replaces it (`changed`).

        `chunker(text, source)` splits one document; unchanged files (same sha256) are not re-chunked.
        `before_commit(new_chunks)` runs before anything is committed (the pipeline stores the new
        chunks' KV caches there, so a committed chunk always has its cache); if it raises, the index
        is left as it was. `max_file_bytes` and `max_documents` are `read_documents`' limits; the index
        folder itself is never read as a document.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        files, skipped = read_documents(
            docs_dir, max_file_bytes=max_file_bytes, max_documents=max_documents, exclude=(self._dir,)
        )
        indexed = dict(self._conn.execute("SELECT source, sha256 FROM documents"))
        to_index = [f for f in files if indexed.get(f.source) != f.sha256]
        added = [f.source for f in to_index if f.source not in indexed]
        changed = [f.source for f in to_index if f.source in indexed]
        unchanged = [f.source for f in files if indexed.get(f.source) == f.sha256]
        removed = sorted(indexed.keys() - {f.source for f in files}) if prune else []

        chunks_by_source = {f.source: _chunk(f, chunker) for f in to_index}
        new_chunks = [record for records in chunks_by_source.values() for record in records]
        embeddings = self._embed([record.text for record in new_chunks], batch_size, progress)
        if before_commit is not None:
            before_commit(new_chunks)
        if to_index or removed:
            documents = [(f.source, f.sha256, len(chunks_by_source[f.source])) for f in to_index]
            self._apply(removed + changed, documents, new_chunks, embeddings)

        logger.info(
            "synced %s into %s: %d added, %d changed, %d removed, %d unchanged, %d skipped, %d new chunks",
            docs_dir,
            self._dir,
            len(added),
            len(changed),
            len(removed),
            len(unchanged),
            len(skipped),
            len(new_chunks),
        )
        return SyncReport(added, changed, removed, unchanged, skipped, new_chunks)

    def add_texts(
        self,
        documents: Sequence[TextDocument],
        chunker: Callable[[str, str], list[Chunk]],
        batch_size: int = 64,
        progress: bool = True,
        before_commit: Callable[[list[ChunkRecord]], None] | None = None,
    ) -> SyncReport:
        """Add documents given as text, as `sync` adds files (`chunker`, `before_commit` alike): a document
        whose source the index holds replaces it (`changed`); nothing else is removed. Their texts and
        metadata are kept (`texts`)."""
        sources = [d.source for d in documents]
        if duplicates := sorted({s for s in sources if sources.count(s) > 1}):
            raise ValueError(f"documents added together must have distinct sources, got {duplicates!r} twice")
        if empty := [d.source for d in documents if not d.text.strip()]:
            raise ValueError(f"documents without text cannot be indexed: {empty!r}")
        files = [SourceFile(d.source, d.text, hashlib.sha256(d.text.encode()).hexdigest()) for d in documents]
        indexed = {source for (source,) in self._conn.execute("SELECT source FROM documents")}
        chunks_by_source = {f.source: _chunk(f, chunker) for f in files}
        new_chunks = [record for records in chunks_by_source.values() for record in records]
        embeddings = self._embed([record.text for record in new_chunks], batch_size, progress)
        stored = [(d.source, d.text, json.dumps(dict(d.metadata))) for d in documents]  # TypeError if not JSON-able
        if before_commit is not None:
            before_commit(new_chunks)
        changed = [s for s in sources if s in indexed]
        documents_rows = [(f.source, f.sha256, len(chunks_by_source[f.source])) for f in files]
        self._apply(changed, documents_rows, new_chunks, embeddings, stored)
        return SyncReport([s for s in sources if s not in indexed], changed, [], [], [], new_chunks)

    def delete(self, sources: Sequence[str]) -> list[str]:
        """Remove the documents (files or texts) with these sources; returns those the index held."""
        indexed = {source for (source,) in self._conn.execute("SELECT source FROM documents")}
        removed = [s for s in dict.fromkeys(sources) if s in indexed]
        if removed:
            self._apply(removed, [], [], np.zeros((0, self._dim), dtype=np.float32))
        logger.info("deleted %d documents from %s", len(removed), self._dir)
        return removed

    def texts(self, sources: Sequence[str]) -> dict[str, TextDocument]:
        """The documents among `sources` that were added as text (`add_texts`), by source."""
        if not sources or not self._conn.execute(f"SELECT 1 FROM sqlite_master WHERE name = '{_TEXTS}'").fetchone():
            return {}
        keys = list(dict.fromkeys(sources))
        rows = self._conn.execute(
            f"SELECT source, text, metadata FROM {_TEXTS} WHERE source IN ({', '.join('?' * len(keys))})", keys
        )
        return {source: TextDocument(source, text, json.loads(metadata)) for source, text, metadata in rows}

    def search(self, query: str, k: int) -> list[Hit]:
        """The `k` chunks most similar to `query`, best first (all chunks, with a warning, if fewer)."""
        if not query.strip():
            raise ValueError(f"query must not be empty, got {query!r}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")
        if k > len(self):
            logger.warning("k=%d exceeds the %d chunks in %s; returning all of them", k, len(self), self._dir)
            k = len(self)
        if k == 0:
            return []
        scores, faiss_ids = self._vectors.search(self._embed([query], batch_size=1, progress=False), k)
        found = [(int(i), float(s)) for i, s in zip(faiss_ids[0], scores[0], strict=True) if i != -1]
        records = self._fetch("faiss_id", [i for i, _ in found])
        if len(records) < len(found):  # another process synced since this index was opened
            logger.warning(
                "%d of the %d hits were removed from %s by another process since it was opened; reopen the "
                "index to search its current contents", len(found) - len(records), len(found), self._dir,
            )
        return [Hit(records[i], score) for i, score in found if i in records]

    def match(self, ids: Sequence[int], min_span: int = MIN_SPAN) -> list[tuple[Span, ChunkRecord]]:
        """Every run of at least `min_span` tokens of `ids` (a prompt's token ids) that equals a run of an
        indexed chunk's ids, in prompt order, without overlaps, with its chunk (`matching.find_spans`)."""
        hashes = sorted(set(prompt_ngrams(ids)))
        candidates: dict[int, list[tuple[int, int]]] = {}
        for start in range(0, len(hashes), _LOOKUP_BATCH):
            batch = hashes[start : start + _LOOKUP_BATCH]
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

    def _embed(self, texts: list[str], batch_size: int, progress: bool) -> np.ndarray:
        """L2-normalised float32 embeddings, one row per text (a tqdm bar over batches if `progress`)."""
        if not texts:
            return np.empty((0, self._dim), dtype=np.float32)
        embeddings = self._embedder.encode(
            texts,
            batch_size=batch_size,
            show_progress_bar=progress,
            convert_to_numpy=True,
            normalize_embeddings=True,
        )
        return np.ascontiguousarray(embeddings, dtype=np.float32)

    def _apply(
        self,
        stale_sources: list[str],
        documents: list[tuple[str, str, int]],
        new_chunks: list[ChunkRecord],
        embeddings: np.ndarray,
        texts: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        """Drop the stale sources, add `documents` (source, sha256, n_chunks) and their `new_chunks`, and
        `texts` (source, text, metadata JSON) of documents added as text.

        SQLite changes in one transaction; FAISS is updated on a copy, swapped in and written after.
        """
        new_faiss_ids = np.array([_faiss_id(record.id) for record in new_chunks], dtype=np.int64)
        with _transaction(self._conn):
            old_faiss_ids = np.array(
                [
                    faiss_id
                    for source in stale_sources
                    for (faiss_id,) in self._conn.execute(
                        "SELECT faiss_id FROM chunks WHERE source = ?", (source,)
                    )
                ],
                dtype=np.int64,
            )
            self._conn.executemany("DELETE FROM ngrams WHERE faiss_id = ?", ((int(f),) for f in old_faiss_ids))
            self._conn.executemany("DELETE FROM chunks WHERE source = ?", ((s,) for s in stale_sources))
            self._conn.executemany("DELETE FROM documents WHERE source = ?", ((s,) for s in stale_sources))
            self._conn.execute(_TEXTS_SCHEMA)
            self._conn.executemany(f"DELETE FROM {_TEXTS} WHERE source = ?", ((s,) for s in stale_sources))
            self._conn.executemany(f"INSERT INTO {_TEXTS} (source, text, metadata) VALUES (?, ?, ?)", texts)
            self._conn.executemany(
                "INSERT INTO documents (source, sha256, n_chunks) VALUES (?, ?, ?)", documents
            )
            self._conn.executemany(
                "INSERT INTO chunks (id, faiss_id, source, ordinal, token_ids, char_start, char_end, text,"
                " embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (
                        r.id,
                        int(fid),
                        r.source,
                        r.ordinal,
                        _pack_tokens(r.token_ids),
                        r.char_start,
                        r.char_end,
                        r.text,
                        emb.astype(EMBEDDING_DTYPE).tobytes(),
                    )
                    for r, fid, emb in zip(new_chunks, new_faiss_ids, embeddings, strict=True)
                ),
            )
            _insert_ngrams(self._conn, zip(new_faiss_ids.tolist(), (r.token_ids for r in new_chunks)))
            if (recorded := _recorded_vectors_sha256(self._conn)) != self._vectors_sha256:
                logger.warning(
                    "%s was synced by another process since it was opened (vectors sha256 %s, this process has "
                    "%s); rebuilding the vectors from the stored embeddings", self._dir, recorded, self._vectors_sha256,
                )
                vectors = _vectors_from_db(self._conn, self._dim, self._meta["index_type"])
            elif len(old_faiss_ids) and self._meta["index_type"] == "hnsw":
                # HNSW graphs cannot drop vectors: rebuild from the rows this transaction leaves.
                vectors = _vectors_from_db(self._conn, self._dim, self._meta["index_type"])
            else:
                vectors = faiss.clone_index(self._vectors)
                if len(old_faiss_ids):
                    vectors.remove_ids(old_faiss_ids)
                vectors.add_with_ids(embeddings, new_faiss_ids)
            data = _record_vectors(self._conn, vectors)
        self._vectors, self._vectors_sha256 = vectors, faiss_file.checksum(data)
        faiss_file.write(self._dir, data)

    def _fetch(
        self, column: Literal["id", "faiss_id"], keys: Sequence[str | int]
    ) -> dict[str | int, ChunkRecord]:
        """Chunks whose `column` is in `keys`, keyed by it (in batches under SQLite's bound-parameter limit)."""
        records: dict[str | int, ChunkRecord] = {}
        for start in range(0, len(keys), _LOOKUP_BATCH):
            batch = list(keys[start : start + _LOOKUP_BATCH])
            rows = self._conn.execute(
                f"SELECT {column}, {_RECORD_COLUMNS} FROM chunks WHERE {column} IN ({', '.join('?' * len(batch))})",
                batch,
            )
            records.update((row[0], _record(row[1:])) for row in rows)
        return records


def _connect_existing(index_dir: Path) -> sqlite3.Connection:
    """A connection to the SQLite file of an existing index directory (never creates one); read-only
    when this process may not write the index (`_writable`)."""
    if not index_dir.is_dir():
        raise FileNotFoundError(f"index folder not found: {index_dir}")
    db_path = index_dir / _DB_FILE
    if not db_path.is_file():
        raise ForeignIndexError(f"{index_dir} is not a rag-kvcache index (no {_DB_FILE})")
    return _connect(db_path, mode="rw" if _writable(index_dir) else "ro")


def _writable(index_dir: Path) -> bool:
    """Whether this process may write the index in `index_dir` (permissions, a read-only mount)."""
    return os.access(index_dir / _DB_FILE, os.W_OK) and os.access(index_dir, os.W_OK)


def _checked_meta(conn: sqlite3.Connection, index_dir: Path) -> dict[str, str]:
    """The meta table, after checking that it marks a rag-kvcache index of this format."""
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key != ?", (_VECTORS_SHA256,)))
    except sqlite3.DatabaseError as exc:
        raise ForeignIndexError(f"{index_dir} is not a rag-kvcache index ({exc})") from exc
    if (found := meta.get("format")) != FORMAT:
        raise ForeignIndexError(
            f"{index_dir} is not a rag-kvcache index: format {found!r}, expected {FORMAT!r}"
        )
    return meta


def _recorded_vectors_sha256(conn: sqlite3.Connection) -> str | None:
    """The checksum of the `vectors.faiss` that SQLite's chunks belong to (None in indexes made before
    it was recorded)."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (_VECTORS_SHA256,)).fetchone()
    return row[0] if row else None


def _record_vectors(conn: sqlite3.Connection, vectors: faiss.Index) -> bytes:
    """Record the checksum of `vectors`' file in the meta table (inside the caller's transaction) and
    return the file's bytes, for the caller to write once the transaction commits."""
    data = faiss_file.serialize(vectors)
    conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (_VECTORS_SHA256, faiss_file.checksum(data))
    )
    return data


def _insert_ngrams(conn: sqlite3.Connection, chunks: Iterable[tuple[int, Sequence[int]]]) -> None:
    """Add the n-gram entries of chunks given as (faiss id, token ids) (inside the caller's transaction)."""
    conn.executemany(
        "INSERT OR IGNORE INTO ngrams (hash, faiss_id, offset) VALUES (?, ?, ?)",
        ((h, fid, offset) for fid, ids in chunks for h, offset in chunk_ngrams(ids)),
    )


def _ensure_ngrams(conn: sqlite3.Connection, index_dir: Path) -> None:
    """Build the n-gram table from the chunks when the index has none (it is derived from them, like
    the FAISS file; indexes made before it existed get it on first open)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ngrams'").fetchone():
        return
    with _transaction(conn):
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ngrams'").fetchone():
            return  # another process built it meanwhile
        for statement in _NGRAM_SCHEMA:
            conn.execute(statement)
        rows = conn.execute("SELECT faiss_id, token_ids FROM chunks").fetchall()
        _insert_ngrams(conn, ((fid, np.frombuffer(blob, dtype=_TOKEN_DTYPE).tolist()) for fid, blob in rows))
    logger.info("built the chunk n-gram table of %s (%d chunks)", index_dir, len(rows))


def _vectors_from_db(conn: sqlite3.Connection, dim: int, index_type: IndexType) -> faiss.Index:
    """The FAISS index of every chunk embedding in SQLite."""
    rows = conn.execute("SELECT faiss_id, embedding FROM chunks").fetchall()
    ids = np.array([fid for fid, _ in rows], dtype=np.int64)
    embeddings = np.frombuffer(b"".join(blob for _, blob in rows), dtype=EMBEDDING_DTYPE)
    return faiss_file.build(ids, embeddings, dim, index_type)


def _chunk(file: SourceFile, chunker: Callable[[str, str], list[Chunk]]) -> list[ChunkRecord]:
    """Chunk one file, checking that the chunker kept its source."""
    records = [ChunkRecord.from_chunk(chunk) for chunk in chunker(file.text, file.source)]
    if wrong := sorted({r.source for r in records} - {file.source}):
        raise ValueError(f"chunker returned chunks of sources {wrong} for document {file.source!r}")
    return records


def _record(row: Sequence) -> ChunkRecord:
    """A `ChunkRecord` from a row of `_RECORD_COLUMNS`."""
    chunk, source, ordinal, token_blob, char_start, char_end, text = row
    token_ids = tuple(np.frombuffer(token_blob, dtype=_TOKEN_DTYPE).tolist())
    return ChunkRecord(chunk, source, ordinal, token_ids, char_start, char_end, text)


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the `chunks.token_ids` blob)."""
    return np.asarray(token_ids, dtype=_TOKEN_DTYPE).tobytes()


def _faiss_id(chunk: str) -> int:
    """The FAISS id of a chunk: 63 bits of its content-derived id, so a non-negative int64.

    Being content-derived, a FAISS file holding the same ids as SQLite holds the same vectors.
    """
    return int(chunk, 16) >> 1


def _connect(db_path: Path, mode: Literal["ro", "rw", "rwc"]) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit, see `_transaction`)."""
    return sqlite3.connect(f"{db_path.resolve().as_uri()}?mode={mode}", uri=True, isolation_level=None)


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: committed if the block succeeds, rolled back if it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
