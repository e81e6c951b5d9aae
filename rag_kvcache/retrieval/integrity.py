"""The chunk index's integrity checks: every row of `index.sqlite` against what it was derived from, and
`vectors.faiss` against the recorded checksum and SQLite's chunk ids (`ChunkIndex.verify`, `rag-kvcache check`)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import database as db
from . import vectors as faiss_file
from .database import EMBEDDING_DTYPE, chunk_id, faiss_id


@dataclass(frozen=True)
class BadRow:
    """A chunk or document row of `index.sqlite` that is not what it was derived from (`ChunkIndex.verify`)."""

    source: str
    chunk: str | None  # None: the document's row
    reason: str
    embedding_only: bool  # the row is intact but its embedding: re-embedding its text repairs it


@dataclass(frozen=True)
class Verified:
    """What `ChunkIndex.verify` found wrong (nothing: every list empty and `vectors` None)."""

    integrity: list[str]  # SQLite's integrity_check messages
    bad_rows: list[BadRow]
    vectors: str | None  # what is wrong with vectors.faiss


def verify(conn: sqlite3.Connection, index_dir: Path, dim: int) -> Verified:
    """SQLite's own `integrity_check`, every chunk row against what it was derived from (its id from its
    source, ordinal and token ids; its FAISS id from its id; its embedding a finite unit vector of `dim`
    floats; its document row and chunk count), and `vectors.faiss` against the recorded checksum and
    SQLite's chunk ids."""
    integrity = [msg for (msg,) in conn.execute("PRAGMA integrity_check")]
    bad_rows: list[BadRow] = []
    counts: dict[str, int] = {}
    rows = conn.execute("SELECT id, faiss_id, source, ordinal, token_ids, char_start, char_end, embedding FROM chunks")
    for chunk, fid, source, ordinal, token_blob, char_start, char_end, blob in rows:
        counts[source] = counts.get(source, 0) + 1
        if reason := row_problem(chunk, fid, source, ordinal, token_blob, char_start, char_end):
            bad_rows.append(BadRow(source, chunk, reason, embedding_only=False))
        elif reason := embedding_problem(blob, dim):
            bad_rows.append(BadRow(source, chunk, reason, embedding_only=True))
    for source, n_chunks in conn.execute("SELECT source, n_chunks FROM documents"):
        if counts.pop(source, 0) != n_chunks:
            bad_rows.append(BadRow(source, None, f"document row records {n_chunks} chunks", embedding_only=False))
    bad_rows += [BadRow(s, None, "chunks of a document the index does not list", False) for s in counts]
    expected = np.fromiter((fid for (fid,) in conn.execute("SELECT faiss_id FROM chunks")), dtype=np.int64)
    _, vectors_problem = faiss_file.check(index_dir, expected, dim, db.recorded_vectors_sha256(conn))
    return Verified([] if integrity == ["ok"] else integrity, bad_rows, vectors_problem)


def row_problem(
    chunk: str, fid: int, source: str, ordinal: int, token_blob: bytes, char_start: int, char_end: int
) -> str | None:
    """What is wrong with a chunk row's derived columns, or None."""
    if not isinstance(token_blob, bytes) or len(token_blob) % db.TOKEN_DTYPE.itemsize or not token_blob:
        return (
            f"token ids are not a non-empty int32 array ({type(token_blob).__name__} of {len(token_blob or b'')} bytes)"
        )
    if chunk != chunk_id(source, ordinal, np.frombuffer(token_blob, dtype=db.TOKEN_DTYPE).tolist()):
        return "its id does not match its source, ordinal and token ids"
    if fid != faiss_id(chunk):
        return f"its FAISS id {fid} is not the one its id gives ({faiss_id(chunk)})"
    if not 0 <= char_start <= char_end:
        return f"character range {char_start}..{char_end}"
    return None


def embedding_problem(blob: bytes, dim: int) -> str | None:
    """What is wrong with a stored embedding (it must be a finite unit vector of `dim` floats), or None."""
    if not isinstance(blob, bytes) or len(blob) != dim * EMBEDDING_DTYPE.itemsize:
        return f"embedding of {len(blob or b'')} bytes, not {dim} float32"
    vector = np.frombuffer(blob, dtype=EMBEDDING_DTYPE)
    if not np.isfinite(vector).all() or abs(float(np.linalg.norm(vector)) - 1.0) > 1e-3:
        return "embedding is not a finite unit vector"
    return None
