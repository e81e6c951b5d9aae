"""The FAISS side of the chunk index: inner-product search over normalised embeddings, keyed by chunk.

`vectors.faiss` is derived from SQLite (the source of truth): it is rebuilt from the stored
embeddings whenever it does not hold exactly the indexed chunks, and replaced atomically.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import faiss
import numpy as np

logger = logging.getLogger(__name__)

IndexType = Literal["flat", "hnsw"]

VECTORS_FILE = "vectors.faiss"
EMBEDDING_DTYPE = np.dtype("<f4")
_HNSW_NEIGHBOURS = 32


def load(index_dir: Path, expected_ids: np.ndarray, dim: int, rebuild: Callable[[], faiss.Index]) -> faiss.Index:
    """Read `vectors.faiss`; when it is missing, unreadable or does not hold exactly `expected_ids`,
    write and return `rebuild()` instead."""
    path = index_dir / VECTORS_FILE
    expected = np.sort(expected_ids)
    if not path.is_file():
        logger.warning("%s is missing; rebuilding it from the stored embeddings", path)
    else:
        try:
            vectors = faiss.read_index(str(path))
        except RuntimeError as exc:
            logger.warning("%s is unreadable (%s); rebuilding it from the stored embeddings", path, exc)
        else:
            if (
                isinstance(vectors, faiss.IndexIDMap2)
                and vectors.d == dim
                and np.array_equal(np.sort(faiss.vector_to_array(vectors.id_map)), expected)
            ):
                return vectors
            logger.warning(
                "%s is stale (%d vectors for %d chunks); rebuilding it from the stored embeddings",
                path, vectors.ntotal, len(expected),
            )
    vectors = rebuild()
    write(index_dir, vectors)
    return vectors


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


def write(index_dir: Path, vectors: faiss.Index) -> None:
    """Durably replace `vectors.faiss`: write and fsync a temporary file, then rename it over."""
    with tempfile.NamedTemporaryFile(dir=index_dir, prefix=f".{VECTORS_FILE}.", delete=False) as tmp:
        try:
            tmp.write(faiss.serialize_index(vectors))
            tmp.flush()
            os.fsync(tmp.fileno())
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, index_dir / VECTORS_FILE)
