"""The chunk index's database: the SQLite file that is its source of truth (schema, connections, one write
transaction at a time, typed errors for a full disk) and the protocol that keeps `vectors.faiss` the file
SQLite records (`commit`: staged before the transaction commits, published after; `rebuild_vectors`
when it is not).

FAISS holds one vector a window (`WINDOWS`: a chunk's windows under the embedder's limit, keyed by chunk id and
ordinal, each with the FAISS id `window_faiss_id` gives it), written in the transactions that write their chunks.
A chunk's window 0 has the chunk's own FAISS id, so an index made before the table existed reads as one window a
chunk, its stored embedding (`window_rows`), and its `vectors.faiss` stays valid; its first write adds the table
(`ensure_windows`).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from ..errors import RagKVCacheError, StorageFullError
from . import vectors as faiss_file
from .matching import chunk_ngrams
from .vectors import EMBEDDING_DTYPE, IndexType

if TYPE_CHECKING:
    import faiss

logger = logging.getLogger(__name__)

FORMAT = "rag-kvcache-index-v1"
DB_FILE = "index.sqlite"
VECTORS_SHA256 = "vectors_sha256"  # meta key: the checksum of the vectors.faiss SQLite's chunks belong to
NGRAM_SCHEMA = (
    "CREATE TABLE ngrams (hash INTEGER NOT NULL, faiss_id INTEGER NOT NULL, offset INTEGER NOT NULL,"
    " PRIMARY KEY (hash, faiss_id, offset)) WITHOUT ROWID",
    "CREATE INDEX ngrams_by_chunk ON ngrams (faiss_id)",
)
WINDOWS = "windows"  # a chunk's window vectors: the units FAISS searches
WINDOWS_SCHEMA = (  # a rowid table: WITHOUT ROWID left two thirds of each page empty under 1.5 KB rows
    f"CREATE TABLE {WINDOWS} (chunk TEXT NOT NULL, ordinal INTEGER NOT NULL, faiss_id INTEGER NOT NULL UNIQUE,"
    " embedding BLOB NOT NULL, PRIMARY KEY (chunk, ordinal))"
)
SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE documents (source TEXT PRIMARY KEY, sha256 TEXT NOT NULL, n_chunks INTEGER NOT NULL)",
    "CREATE TABLE chunks (id TEXT PRIMARY KEY, faiss_id INTEGER NOT NULL UNIQUE, source TEXT NOT NULL,"
    " ordinal INTEGER NOT NULL, token_ids BLOB NOT NULL, char_start INTEGER NOT NULL,"
    " char_end INTEGER NOT NULL, text TEXT NOT NULL, embedding BLOB NOT NULL)",
    "CREATE INDEX chunks_by_source ON chunks (source)",
    *NGRAM_SCHEMA,
    WINDOWS_SCHEMA,
)
TEXTS = "texts"  # documents added as text (a vector store's): their whole text and metadata
TEXTS_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TEXTS} (source TEXT PRIMARY KEY, text TEXT NOT NULL, metadata TEXT NOT NULL)"
)
TOKEN_DTYPE = np.dtype("<i4")  # the `chunks.token_ids` blob: int32 little-endian
LOOKUP_BATCH = 500  # hashes or chunk keys per SELECT (under SQLite's bound-parameter limit)


class ForeignIndexError(RagKVCacheError, ValueError):
    """A directory that is not a rag-kvcache index (or an index of another format version)."""


def exists(index_dir: Path) -> bool:
    """Whether `index_dir` holds an index: an `index.sqlite` with tables (a creation killed before its
    schema committed leaves one without, which `ChunkIndex.create` replaces)."""
    db_path = Path(index_dir) / DB_FILE
    if not db_path.is_file():
        return False
    if db_path.stat().st_size == 0:
        return False
    conn = connect(db_path, mode="ro")
    try:
        return conn.execute("SELECT 1 FROM sqlite_master").fetchone() is not None
    except sqlite3.DatabaseError:
        return True  # there, but unreadable (a full disk, not a database): opening it says why
    finally:
        conn.close()


def connect_existing(index_dir: Path, write: bool = False) -> sqlite3.Connection:
    """A connection to the SQLite file of an existing index directory (never creates one): for writing,
    or read-only. A reader that cannot open it the ordinary way (WAL needs its shared-memory file,
    which a full disk or a read-only folder cannot hold) opens it immutable, provided its write-ahead
    log holds no commits the file lacks; a writer gets `StorageFullError` (or the `OSError`)."""
    if not index_dir.is_dir():
        raise FileNotFoundError(
            f"index folder not found: {index_dir}; make one with `rag-kvcache index DOCS --index {index_dir}`"
        )
    db_path = index_dir / DB_FILE
    if not exists(index_dir):
        raise ForeignIndexError(
            f"{index_dir} is not a rag-kvcache index (no {DB_FILE})"
            if not db_path.exists()
            else f"{index_dir} holds an {DB_FILE} without tables (its creation was interrupted): run `rag-kvcache "
            "index` into it again to create it"
        )
    conn = connect(db_path, mode="rw" if write else "ro")
    try:
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()  # opens the WAL's shared memory
        return conn
    except sqlite3.OperationalError as exc:
        conn.close()
        wal = db_path.with_name(f"{DB_FILE}-wal")
        if write or (wal.exists() and wal.stat().st_size > 0):
            raise io_error(exc, index_dir, "opening the index" + (" for writing" if write else "")) from exc
        logger.warning("%s cannot be opened the ordinary way (%s); reading it as an immutable file", db_path, exc)
        return connect(db_path, mode="ro", immutable=True)
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise ForeignIndexError(f"{index_dir} is not a rag-kvcache index ({exc})") from exc


def writable(index_dir: Path) -> bool:
    """Whether this process may write the index in `index_dir` (permissions, a read-only mount)."""
    return os.access(index_dir / DB_FILE, os.W_OK) and os.access(index_dir, os.W_OK)


def checked_meta(conn: sqlite3.Connection, index_dir: Path) -> dict[str, str]:
    """The meta table, after checking that it marks a rag-kvcache index of this format."""
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key != ?", (VECTORS_SHA256,)))
    except sqlite3.DatabaseError as exc:
        raise ForeignIndexError(f"{index_dir} is not a rag-kvcache index ({exc})") from exc
    if (found := meta.get("format")) != FORMAT:
        raise ForeignIndexError(f"{index_dir} is not a rag-kvcache index: format {found!r}, expected {FORMAT!r}")
    return meta


def recorded_vectors_sha256(conn: sqlite3.Connection) -> str | None:
    """The checksum of the `vectors.faiss` that SQLite's chunks belong to (None in indexes made before
    it was recorded)."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (VECTORS_SHA256,)).fetchone()
    return row[0] if row else None


def record_vectors(conn: sqlite3.Connection, vectors: faiss.Index) -> bytes:
    """Record the checksum of `vectors`' file in the meta table (inside the caller's transaction) and
    return the file's bytes, for the caller to write once the transaction commits."""
    data = faiss_file.serialize(vectors)
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (VECTORS_SHA256, faiss_file.checksum(data)))
    return data


def insert_ngrams(conn: sqlite3.Connection, chunks: Iterable[tuple[int, Sequence[int]]]) -> None:
    """Add the n-gram entries of chunks given as (faiss id, token ids) (inside the caller's transaction)."""
    conn.executemany(
        "INSERT OR IGNORE INTO ngrams (hash, faiss_id, offset) VALUES (?, ?, ?)",
        ((h, fid, offset) for fid, ids in chunks for h, offset in chunk_ngrams(ids)),
    )


def ensure_ngrams(conn: sqlite3.Connection, index_dir: Path) -> None:
    """Build the n-gram table from the chunks when the index has none (it is derived from them, like
    the FAISS file; indexes made before it existed get it on first open, through a connection of its
    own when `conn` is a reader's)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ngrams'").fetchone():
        return
    if not writable(index_dir):
        logger.warning("%s has no chunk n-gram table and is read-only: prompts are matched against no chunk", index_dir)
        return
    writer = connect_existing(index_dir, write=True)
    try:
        with transaction(writer, index_dir, "building the chunk n-gram table"):
            if writer.execute("SELECT 1 FROM sqlite_master WHERE name = 'ngrams'").fetchone():
                return  # another process built it meanwhile
            for statement in NGRAM_SCHEMA:
                writer.execute(statement)
            rows = writer.execute("SELECT faiss_id, token_ids FROM chunks").fetchall()
            insert_ngrams(writer, ((fid, np.frombuffer(blob, dtype=TOKEN_DTYPE).tolist()) for fid, blob in rows))
    finally:
        writer.close()
    logger.info("built the chunk n-gram table of %s (%d chunks)", index_dir, len(rows))


def rebuild_vectors(
    conn: sqlite3.Connection, index_dir: Path, dim: int, index_type: IndexType, rewrite: bool
) -> tuple[faiss.Index, str | None]:
    """The vectors rebuilt from SQLite's embeddings, and `vectors.faiss` rewritten with them (through a
    connection of its own) when asked to and the index is writable; where it is not (permissions, a
    read-only mount, a full disk), they serve from memory and the file is left as it is (checksum None)."""
    if not rewrite:
        logger.warning("%s left as it is: searching vectors rebuilt in memory", index_dir / faiss_file.VECTORS_FILE)
    elif writable(index_dir):
        try:
            writer = connect_existing(index_dir, write=True)
            try:
                return commit(
                    writer, index_dir, "rewriting vectors.faiss", lambda: vectors_from_db(writer, dim, index_type)
                )
            finally:
                writer.close()
        except OSError as exc:  # a full disk: serve all the same
            logger.warning(
                "could not rewrite %s (%s): searching vectors rebuilt in memory",
                index_dir / faiss_file.VECTORS_FILE,
                exc,
            )
    else:
        logger.warning("%s is read-only for this process: searching vectors rebuilt in memory", index_dir)
    return vectors_from_db(conn, dim, index_type), None


def vectors_from_db(conn: sqlite3.Connection, dim: int, index_type: IndexType) -> faiss.Index:
    """The FAISS index of every window vector of every chunk in SQLite (`window_rows`), keyed by window."""
    rows = conn.execute(f"SELECT w.faiss_id, w.embedding FROM {window_rows(conn)} AS w JOIN chunks c ON c.id = w.chunk")
    pairs = rows.fetchall()
    ids = np.array([fid for fid, _ in pairs], dtype=np.int64)  # [W]
    embeddings = np.frombuffer(b"".join(blob for _, blob in pairs), dtype=EMBEDDING_DTYPE)  # [W * E]
    return faiss_file.build(ids, embeddings, dim, index_type)


def has_windows(conn: sqlite3.Connection) -> bool:
    """Whether the index has its window table (indexes made before it existed have none until written)."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (WINDOWS,)).fetchone() is not None


def window_rows(conn: sqlite3.Connection) -> str:
    """SQL naming the window rows (chunk, ordinal, faiss_id, embedding): the window table, or in an index without
    one each chunk as its one window (ordinal 0, its FAISS id and stored embedding)."""
    if has_windows(conn):
        return WINDOWS
    return "(SELECT id AS chunk, 0 AS ordinal, faiss_id, embedding FROM chunks)"


def ensure_windows(conn: sqlite3.Connection) -> None:
    """Inside the caller's write transaction: add the window table to an index without one, each chunk its one
    window (what `window_rows` read it as), so that the write can add chunks of several windows; move the rows of
    a table made `WITHOUT ROWID` (which held 1.5 KB rows at a third of each page) into one of `WINDOWS_SCHEMA`.
    The pages that frees are reused by later writes (the file shrinks only if it is vacuumed)."""
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (WINDOWS,)).fetchone() or (None,)
    if sql is None:
        conn.execute(WINDOWS_SCHEMA)
        conn.execute(
            f"INSERT INTO {WINDOWS} (chunk, ordinal, faiss_id, embedding) SELECT id, 0, faiss_id, embedding FROM chunks"
        )
    elif "WITHOUT ROWID" in sql.upper():
        conn.execute(f"ALTER TABLE {WINDOWS} RENAME TO {WINDOWS}_without_rowid")
        conn.execute(WINDOWS_SCHEMA)
        conn.execute(
            f"INSERT INTO {WINDOWS} (chunk, ordinal, faiss_id, embedding)"
            f" SELECT chunk, ordinal, faiss_id, embedding FROM {WINDOWS}_without_rowid"
        )
        conn.execute(f"DROP TABLE {WINDOWS}_without_rowid")


def window_ids(conn: sqlite3.Connection) -> np.ndarray:
    """The FAISS ids of every indexed chunk's windows [W]: what `vectors.faiss` must hold."""
    rows = conn.execute(f"SELECT w.faiss_id FROM {window_rows(conn)} AS w JOIN chunks c ON c.id = w.chunk")
    return np.fromiter((fid for (fid,) in rows), dtype=np.int64)


def window_shape(conn: sqlite3.Connection) -> tuple[int, int]:
    """How many chunks the index holds, and the most windows any one of them has (1 for none)."""
    (chunks,) = conn.execute("SELECT COUNT(*) FROM chunks").fetchone()
    (most,) = conn.execute(f"SELECT MAX(ordinal) + 1 FROM {window_rows(conn)}").fetchone()
    return int(chunks), max(1, int(most or 1))


def insert_windows(conn: sqlite3.Connection, chunks: Sequence[str], windows: Sequence[np.ndarray]) -> np.ndarray:
    """Add the window vectors of `chunks` (ids; `windows[i]` [n_i, E] chunk i's, in order) to the window table
    (inside the caller's transaction, after `ensure_windows`); returns their FAISS ids [sum n_i], in that order."""
    rows = [
        (chunk, j, window_faiss_id(chunk, j), vector.astype(EMBEDDING_DTYPE).tobytes())
        for chunk, vectors in zip(chunks, windows, strict=True)
        for j, vector in enumerate(vectors)
    ]
    conn.executemany(f"INSERT INTO {WINDOWS} (chunk, ordinal, faiss_id, embedding) VALUES (?, ?, ?, ?)", rows)
    return np.array([fid for _, _, fid, _ in rows], dtype=np.int64)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the `chunks.token_ids` blob)."""
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()


def connect(db_path: Path, mode: Literal["ro", "rw", "rwc"], immutable: bool = False) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit, see `transaction`)."""
    uri = f"{db_path.resolve().as_uri()}?mode={mode}" + ("&immutable=1" if immutable else "")
    return sqlite3.connect(uri, uri=True, isolation_level=None)


def db_files(db_path: Path) -> tuple[Path, ...]:
    """The SQLite file and its write-ahead log and shared-memory files."""
    return db_path, db_path.with_name(f"{db_path.name}-wal"), db_path.with_name(f"{db_path.name}-shm")


def io_error(exc: sqlite3.Error, index_dir: Path, what: str) -> OSError:
    """The typed error for SQLite failing to write (or open) the index in `index_dir` while `what`:
    `StorageFullError` when the disk is full, else an `OSError` with SQLite's reason."""
    db_path = str(index_dir / DB_FILE)
    stats = os.statvfs(index_dir)
    if exc.sqlite_errorcode == sqlite3.SQLITE_FULL or stats.f_bavail * stats.f_frsize < 1 << 20:
        return StorageFullError(
            errno.ENOSPC,
            f"no space left on the device of {index_dir} while {what} ({exc}); the index is "
            "unchanged: free space and run the command again",
            db_path,
        )
    return OSError(errno.EIO, f"{exc} ({exc.sqlite_errorname}) while {what}", db_path)


def commit(
    conn: sqlite3.Connection, index_dir: Path, what: str, change: Callable[[], faiss.Index]
) -> tuple[faiss.Index, str]:
    """Run `change` (SQLite writes that return the FAISS index they leave) in one transaction that also
    records that index's checksum, and write its `vectors.faiss`: staged (written, fsynced) before the
    commit, renamed into place after it. A failure before the commit, a full disk included, leaves
    SQLite and the file as they were; a kill between commit and rename leaves a file that does not
    match the recorded checksum, rebuilt on open. Returns the index and the checksum."""
    staged: Path | None = None
    try:
        with transaction(conn, index_dir, what):
            vectors = change()
            data = record_vectors(conn, vectors)
            staged = faiss_file.stage(index_dir, data)
    except BaseException:
        if staged is not None:
            staged.unlink(missing_ok=True)
        raise
    faiss_file.publish(staged, index_dir)
    return vectors, faiss_file.checksum(data)


@contextmanager
def transaction(conn: sqlite3.Connection, index_dir: Path, what: str) -> Iterator[None]:
    """One write transaction: committed if the block succeeds, rolled back if it or the commit fails.
    SQLite failing to write (a full disk) is `io_error`'s typed error naming `what`."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    except sqlite3.DatabaseError as exc:
        if exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN):
            raise io_error(exc, index_dir, what) from exc
        raise


def chunk_id(source: str, ordinal: int, token_ids: Sequence[int]) -> str:
    """A short stable id that changes whenever the chunk's source, position or tokens change."""
    digest = hashlib.sha256(f"{source}\0{ordinal}\0".encode())
    digest.update(pack_tokens(token_ids))
    return digest.hexdigest()[:16]


def faiss_id(chunk: str) -> int:
    """The FAISS id of a chunk: 63 bits of its content-derived id, so a non-negative int64.

    Being content-derived, a FAISS file holding the same ids as SQLite holds the same vectors.
    """
    return int(chunk, 16) >> 1


def window_faiss_id(chunk: str, ordinal: int) -> int:
    """The FAISS id of window `ordinal` of a chunk: the chunk's own (`faiss_id`) for window 0, so an index of one
    window a chunk holds the ids it held before windows existed; 63 bits of a hash of the chunk id and the
    ordinal for the others."""
    if ordinal == 0:
        return faiss_id(chunk)
    return int(hashlib.sha256(f"{chunk}\0{ordinal}".encode()).hexdigest()[:16], 16) >> 1
