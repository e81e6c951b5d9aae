"""The chunk index's integrity checks: every row of `index.sqlite` against what it was derived from (a chunk's
window rows with it), and `vectors.faiss` against the recorded checksum and SQLite's window ids
(`ChunkIndex.verify`, `rag-kvcache check`)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import database as db
from . import vectors as faiss_file
from .database import EMBEDDING_DTYPE, chunk_id, faiss_id, window_faiss_id
from .embedder import pool


@dataclass(frozen=True)
class BadRow:
    """A chunk or document row of `index.sqlite` that is not what it was derived from (`ChunkIndex.verify`)."""

    source: str
    chunk: str | None  # None: the document's row
    reason: str
    embedding_only: bool  # the row is intact but its embedding or windows: re-embedding its text repairs it


@dataclass(frozen=True)
class Verified:
    """What `ChunkIndex.verify` found wrong (nothing: every list empty and `vectors` None)."""

    integrity: list[str]  # SQLite's integrity_check messages
    bad_rows: list[BadRow]
    vectors: str | None  # what is wrong with vectors.faiss
    orphan_windows: int = 0  # window rows of chunks the index does not hold (`ChunkIndex.rewrite_vectors` drops them)


def verify(conn: sqlite3.Connection, index_dir: Path, dim: int) -> Verified:
    """SQLite's own `integrity_check`, every chunk row against what it was derived from (its id from its
    source, ordinal and token ids; its FAISS id from its id; its embedding a finite unit vector of `dim`
    floats; its windows `windows_problem`'s; its document row and chunk count), and `vectors.faiss` against
    the recorded checksum and SQLite's window ids."""
    integrity = [msg for (msg,) in conn.execute("PRAGMA integrity_check")]
    bad_rows: list[BadRow] = []
    counts: dict[str, int] = {}
    windows: dict[str, list[tuple[int, int, bytes]]] = {}
    for chunk, ordinal, fid, blob in conn.execute(
        f"SELECT chunk, ordinal, faiss_id, embedding FROM {db.window_rows(conn)} ORDER BY chunk, ordinal"
    ):
        windows.setdefault(chunk, []).append((ordinal, fid, blob))
    rows = conn.execute("SELECT id, faiss_id, source, ordinal, token_ids, char_start, char_end, embedding FROM chunks")
    for chunk, fid, source, ordinal, token_blob, char_start, char_end, blob in rows:
        counts[source] = counts.get(source, 0) + 1
        if reason := row_problem(chunk, fid, source, ordinal, token_blob, char_start, char_end):
            bad_rows.append(BadRow(source, chunk, reason, embedding_only=False))
        elif reason := embedding_problem(blob, dim) or windows_problem(chunk, blob, windows.get(chunk, []), dim):
            bad_rows.append(BadRow(source, chunk, reason, embedding_only=True))
        windows.pop(chunk, None)
    for source, n_chunks in conn.execute("SELECT source, n_chunks FROM documents"):
        if counts.pop(source, 0) != n_chunks:
            bad_rows.append(BadRow(source, None, f"document row records {n_chunks} chunks", embedding_only=False))
    bad_rows += [BadRow(s, None, "chunks of a document the index does not list", False) for s in counts]
    expected = db.window_ids(conn)  # [W]
    _, vectors_problem = faiss_file.check(index_dir, expected, dim, db.recorded_vectors_sha256(conn))
    orphans = sum(len(rows) for rows in windows.values())
    return Verified([] if integrity == ["ok"] else integrity, bad_rows, vectors_problem, orphans)


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


def windows_problem(chunk: str, chunk_blob: bytes, windows: list[tuple[int, int, bytes]], dim: int) -> str | None:
    """What is wrong with a chunk's window rows (ordinal, FAISS id, embedding), in ordinal order, or None: there
    must be at least one, numbered 0, 1, ..., each with the FAISS id `window_faiss_id` gives it and a finite unit
    embedding of `dim` floats, and the chunk's own (valid) embedding `chunk_blob` must be their `pool`."""
    if not windows:
        return "no window embeddings"
    if [ordinal for ordinal, _, _ in windows] != list(range(len(windows))):
        return f"window ordinals {[ordinal for ordinal, _, _ in windows]}, not 0..{len(windows) - 1}"
    for ordinal, fid, blob in windows:
        if fid != (expected := window_faiss_id(chunk, ordinal)):
            return f"window {ordinal}: its FAISS id {fid} is not the one its chunk and ordinal give ({expected})"
        if reason := embedding_problem(blob, dim):
            return f"window {ordinal}: {reason}"
    vectors = np.stack([np.frombuffer(blob, dtype=EMBEDDING_DTYPE) for _, _, blob in windows])  # [n, E]
    pooled = pool(vectors, np.array([len(windows)]))[0]  # [E]
    if not np.allclose(pooled, np.frombuffer(chunk_blob, dtype=EMBEDDING_DTYPE), atol=1e-5):
        return f"embedding is not the mean of its {len(windows)} window embeddings"
    return None
