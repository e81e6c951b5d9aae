"""The FAISS side of the chunk index: inner-product search over normalised embeddings, keyed by chunk.

`vectors.faiss` is derived from SQLite (the source of truth): every write records the file's sha256
in SQLite's meta table (in the transaction that commits the chunks it holds), and a file whose bytes
do not match that checksum, or that does not hold exactly the indexed chunks, is rebuilt from the
stored embeddings. It is replaced atomically.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Literal

import faiss
import numpy as np

logger = logging.getLogger(__name__)

IndexType = Literal["flat", "hnsw"]

VECTORS_FILE = "vectors.faiss"
EMBEDDING_DTYPE = np.dtype("<f4")
_HNSW_NEIGHBOURS = 32


def serialize(vectors: faiss.Index) -> bytes:
    """The bytes of `vectors.faiss` for `vectors`."""
    return faiss.serialize_index(vectors).tobytes()


def checksum(data: bytes) -> str:
    """The checksum recorded for a `vectors.faiss` of these bytes."""
    return hashlib.sha256(data).hexdigest()


def load(index_dir: Path, expected_ids: np.ndarray, dim: int, recorded: str | None) -> faiss.Index | None:
    """Read `vectors.faiss`, or None (with the reason logged) when it must be rebuilt: it is missing,
    its bytes do not match the `recorded` checksum (None: none recorded), it is unreadable, or it does
    not hold exactly `expected_ids`."""
    path = index_dir / VECTORS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        logger.warning("%s is missing; rebuilding it from the stored embeddings", path)
        return None
    if (found := checksum(data)) != recorded:
        logger.warning(
            "%s does not match the checksum recorded in the index (sha256 %s, recorded %s); rebuilding it "
            "from the stored embeddings", path, found, recorded,
        )
        return None
    try:
        vectors = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError as exc:
        logger.warning("%s is unreadable (%s); rebuilding it from the stored embeddings", path, exc)
        return None
    if (
        isinstance(vectors, faiss.IndexIDMap2)
        and vectors.d == dim
        and np.array_equal(np.sort(faiss.vector_to_array(vectors.id_map)), np.sort(expected_ids))
    ):
        return vectors
    logger.warning(
        "%s is stale (%d vectors for %d chunks); rebuilding it from the stored embeddings",
        path, vectors.ntotal, len(expected_ids),
    )
    return None


def build(ids: np.ndarray, embeddings: np.ndarray, dim: int, index_type: IndexType) -> faiss.Index:
    """A FAISS index (inner product over normalised vectors) of `embeddings` [n, dim] keyed by `ids` [n]."""
    if index_type == "hnsw":
        base = faiss.IndexHNSWFlat(dim, _HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
    else:
        base = faiss.IndexFlatIP(dim)
    vectors = faiss.IndexIDMap2(base)
    if len(ids):
        vectors.add_with_ids(embeddings.reshape(len(ids), dim), ids)
    return vectors


def write(index_dir: Path, data: bytes) -> None:
    """Durably replace `vectors.faiss` by `data` (`serialize`): write and fsync a temporary file, then
    rename it over."""
    with tempfile.NamedTemporaryFile(dir=index_dir, prefix=f".{VECTORS_FILE}.", delete=False) as tmp:
        try:
            tmp.write(data)
            os.fchmod(tmp.fileno(), 0o644)  # readers of the index need not be its writer
            tmp.flush()
            os.fsync(tmp.fileno())
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, index_dir / VECTORS_FILE)
