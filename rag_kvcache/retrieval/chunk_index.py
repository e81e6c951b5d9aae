"""The chunk index: embeddings in FAISS, chunk metadata and token ids in SQLite.

An index directory holds `index.sqlite` (the source of truth: documents, chunks with their token ids
and embeddings, each chunk's window embeddings, and free-form metadata; plus the table of chunk n-grams that
`match` finds chunks in any prompt with, written in the same transactions as the chunks) and `vectors.faiss`
(derived from it: one vector a window). Documents are staged outside it (`indexing.staging`: read, diffed,
chunked, embedded; nothing written: the caller computes the new chunks' KV caches then), then written
(`write`). A write writes and fsyncs the new FAISS file under a temporary name, commits SQLite in one
transaction (with that file's sha256), then renames the file into place; a failure before the
commit (a full disk: `StorageFullError`, naming the file and what was being written) leaves both as
they were. A FAISS file whose bytes do not match the checksum or that does not hold exactly the
chunks in SQLite (a kill between commit and rename, a deleted, damaged or edited file) is rebuilt
from SQLite's embeddings on open: in memory for a reader, which writes nothing (SQLite opened
read-only; immutable when even that is impossible, e.g. on a full disk), and rewritten by a writer. A writer
whose FAISS snapshot is not the one SQLite records (another process synced since it opened) rebuilds from
SQLite instead of extending its snapshot. SQLite runs in WAL mode, so readers see the last committed sync and
never wait for one; a reader opened before a sync keeps its FAISS snapshot and skips hits whose chunks that
sync removed. Writers are serialised by the caller (the pipeline holds a lock file for a whole sync).

The SQLite file, its transactions and the commit protocol of the FAISS file are `database`'s, the checks
of its rows `integrity`'s, what it hands out `records`', and its reading (rows, search, prompt matching)
`reader`'s; this module is the index over them: creating and opening it, writing chunks into it, and repair.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from sentence_transformers import SentenceTransformer

from . import database as db
from . import integrity
from . import vectors as faiss_file
from .embedder import ChunkEmbeddings
from .integrity import Verified
from .reader import IndexReader
from .records import ChunkRecord
from .vectors import EMBEDDING_DTYPE, IndexType

if TYPE_CHECKING:
    import faiss

logger = logging.getLogger(__name__)


class ChunkIndex(IndexReader):
    """A persistent, folder-synced index of chunk embeddings, token ids and texts.

    Build one with `ChunkIndex.create` or `ChunkIndex.open`; close it (or use it as a context manager).
    """

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

    def __enter__(self) -> ChunkIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def delete(self, sources: Sequence[str]) -> list[str]:
        """Remove the documents (files or texts) with these sources; returns those the index held."""
        indexed = self.documents()
        removed = [s for s in dict.fromkeys(sources) if s in indexed]
        if removed:
            self.write(removed, [], [], ChunkEmbeddings.empty(self._dim))
        logger.info("deleted %d documents from %s", len(removed), self._dir)
        return removed

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
