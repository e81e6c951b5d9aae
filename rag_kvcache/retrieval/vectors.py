"""The FAISS side of the chunk index: inner-product search over normalised embeddings, keyed by window (a
chunk's windows under the embedder's limit, `database.window_faiss_id`).

`vectors.faiss` is derived from SQLite (the source of truth): every write records the file's sha256
in SQLite's meta table (in the transaction that commits the chunks it holds), and a file whose bytes
do not match that checksum, or that does not hold exactly the indexed chunks' windows, is rebuilt from the
stored window embeddings. It is replaced atomically in two steps, so the caller can commit SQLite in
between: `stage` writes and fsyncs a temporary file (created like any file, with the umask's mode),
`publish` renames it over. A full disk is a `StorageFullError` naming the file.

FAISS is faiss-cpu, a plain dependency; its CUDA build (faiss-gpu-cu12) installs the same module
`faiss` and may replace it (the README says how). This module is the only one that imports it. With
either, the index is searched on the CPU: the GPU build's own indexes are not used.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import StorageFullError

try:
    import faiss
except ImportError as e:
    raise ImportError(
        "rag-kvcache needs FAISS (the module `faiss`), which is missing: pip install faiss-cpu, or the CUDA "
        "build in its place (pip uninstall faiss-cpu && pip install faiss-gpu-cu12), never both"
    ) from e

logger = logging.getLogger(__name__)

IndexType = Literal["flat", "hnsw"]

VECTORS_FILE = "vectors.faiss"
EMBEDDING_DTYPE = np.dtype("<f4")
_HNSW_NEIGHBOURS = 32
_TEMP_PREFIX = f".{VECTORS_FILE}."  # temporary files of `stage`: .vectors.faiss.<pid>-<random>


def serialize(vectors: faiss.Index) -> bytes:
    """The bytes of `vectors.faiss` for `vectors`."""
    return faiss.serialize_index(vectors).tobytes()


def clone(vectors: faiss.Index) -> faiss.Index:
    """A copy of `vectors` to change while readers keep searching the original."""
    return faiss.clone_index(vectors)


def checksum(data: bytes) -> str:
    """The checksum recorded for a `vectors.faiss` of these bytes."""
    return hashlib.sha256(data).hexdigest()


def load(index_dir: Path, expected_ids: np.ndarray, dim: int, recorded: str | None) -> faiss.Index | None:
    """Read `vectors.faiss`, or None (with the reason logged) when it must be rebuilt (`check`)."""
    vectors, problem = check(index_dir, expected_ids, dim, recorded)
    if problem is not None:
        logger.warning("%s %s; rebuilding it from the stored embeddings", index_dir / VECTORS_FILE, problem)
    return vectors


def check(
    index_dir: Path, expected_ids: np.ndarray, dim: int, recorded: str | None
) -> tuple[faiss.Index | None, str | None]:
    """`vectors.faiss` read and verified: (the index, None), or (None, what is wrong with it): it is
    missing, its bytes do not match the `recorded` checksum (None: none recorded), it is unreadable,
    or it does not hold exactly `expected_ids`."""
    path = index_dir / VECTORS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "is missing"
    if (found := checksum(data)) != recorded:
        return None, f"does not match the checksum recorded in the index (sha256 {found}, recorded {recorded})"
    try:
        vectors = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError as exc:
        return None, f"is unreadable ({exc})"
    if (
        isinstance(vectors, faiss.IndexIDMap2)
        and vectors.d == dim
        and np.array_equal(np.sort(faiss.vector_to_array(vectors.id_map)), np.sort(expected_ids))
    ):
        return vectors, None
    return None, f"is stale ({vectors.ntotal} vectors for {len(expected_ids)} windows)"


def build(ids: np.ndarray, embeddings: np.ndarray, dim: int, index_type: IndexType) -> faiss.Index:
    """A FAISS index (inner product over normalised vectors) of `embeddings` [n, dim] keyed by `ids` [n]."""
    base: faiss.Index
    if index_type == "hnsw":
        base = faiss.IndexHNSWFlat(dim, _HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
    else:
        base = faiss.IndexFlatIP(dim)
    vectors = faiss.IndexIDMap2(base)
    if len(ids):
        vectors.add_with_ids(embeddings.reshape(len(ids), dim), ids)
    return vectors


def stage(index_dir: Path, data: bytes) -> Path:
    """Write `data` (`serialize`) to a new temporary file beside `vectors.faiss` and fsync it; returns
    its path, for `publish`. Raises `StorageFullError` (nothing left behind) when the disk is full."""
    tmp = index_dir / f"{_TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides, as for any file
        try:
            with os.fdopen(fd, "wb", buffering=0) as file:
                file.write(data)
                os.fsync(file.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(
                err.errno,
                f"no space left on the device of {index_dir} while writing the {len(data)}-byte "
                f"{VECTORS_FILE}; the index is unchanged: free space and run the command again",
                str(tmp),
            ) from err
        raise
    return tmp


def publish(staged: Path, index_dir: Path) -> None:
    """Rename a `stage`d file over `vectors.faiss` (atomic: readers see the old file or the new one)."""
    os.replace(staged, index_dir / VECTORS_FILE)


def remove_temp_files(index_dir: Path) -> list[Path]:
    """Delete the temporary files of writes that never reached `publish` (a killed writer's); the
    caller holds the index's writer lock, so none of them is being written. Returns those removed."""
    removed = [tmp for tmp in index_dir.glob(f"{_TEMP_PREFIX}*") if tmp.is_file()]
    for tmp in removed:
        tmp.unlink(missing_ok=True)
    return removed
