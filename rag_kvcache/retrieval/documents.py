"""Reading a documents folder: every non-hidden UTF-8 text file, with the reason for each file skipped.

Limits: a file larger than `max_file_bytes` is skipped before it is read (a 200 MB file once aborted
the tokenizer), a binary file is recognised from its first bytes without reading the rest, and a
folder with more than `max_documents` files is refused before any is read. Symbolic links that lead
out of the folder are skipped. The folders in `exclude` are index folders, never read as documents: one kept
inside the documents folder is skipped whole, and where the documents folder is an index folder (or inside one)
every entry the index writes there (`INDEX_ENTRIES`) is skipped, whatever else the folder holds.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DEFAULT_MAX_DOCUMENTS, DEFAULT_MAX_FILE_BYTES
from ..errors import RagKVCacheError

logger = logging.getLogger(__name__)

_BINARY_SNIFF_BYTES = 8192

# what an index writes in its folder (its hidden files, `.writer.lock` and `.vectors.faiss.*`, are skipped as hidden);
# `<name>.tmp` of each is a write in progress
INDEX_ENTRIES = (
    "index.sqlite",
    "index.sqlite-wal",
    "index.sqlite-shm",
    "index.sqlite-journal",
    "vectors.faiss",
    "neighbours.sqlite",
    "neighbours.sqlite-wal",
    "neighbours.sqlite-shm",
    "neighbours.json",
    "pending.json",
    "kv",
)


class DocumentLimitError(RagKVCacheError, ValueError):
    """A documents folder over a configured limit (more files than `max_documents`)."""


@dataclass(frozen=True)
class SourceFile:
    """A readable UTF-8 text file of the documents folder."""

    source: str
    text: str = field(repr=False)
    sha256: str


@dataclass(frozen=True)
class Skipped:
    """A file of the documents folder that was not indexed, and why."""

    source: str
    reason: str


def read_documents(
    docs_dir: Path,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_documents: int = DEFAULT_MAX_DOCUMENTS,
    exclude: Sequence[Path] = (),
) -> tuple[list[SourceFile], list[Skipped]]:
    """Read every non-hidden text file under `docs_dir`, recursively and in sorted order.

    Binary, non-UTF-8, unreadable, empty and over-`max_file_bytes` files, symbolic links leading out
    of `docs_dir` and the index folders in `exclude` (their own entries, `INDEX_ENTRIES`, where `docs_dir` is one
    of them or inside one) are skipped with a warning and reported. Raises
    `DocumentLimitError` when `docs_dir` holds more than `max_documents` files, before reading any.
    """
    docs_dir = Path(docs_dir)
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be >= 1, got {max_file_bytes!r}")
    if max_documents < 1:
        raise ValueError(f"max_documents must be >= 1, got {max_documents!r}")
    if not docs_dir.exists():
        raise FileNotFoundError(f"documents folder not found: {docs_dir}")
    if not docs_dir.is_dir():
        raise NotADirectoryError(f"documents path is not a folder: {docs_dir}")
    root = docs_dir.resolve()
    excluded = {Path(folder).resolve() for folder in exclude}

    skipped: list[Skipped] = []

    def skip(path: Path, reason: str) -> None:
        # a name that is not UTF-8 (undecodable bytes as surrogates) is reported with them escaped
        entry = Skipped(path.relative_to(docs_dir).as_posix().encode("utf-8", "backslashreplace").decode(), reason)
        logger.warning("skipping %s: %s", entry.source, reason)
        skipped.append(entry)

    def skip_folder(error: OSError) -> None:
        skip(Path(error.filename), f"unreadable folder ({error.strerror})")

    def index_entry(folder: Path, name: str) -> Path | None:
        """The index folder of `exclude` whose own entry `folder/name` is (`folder` holding the documents folder)."""
        path = folder.resolve() / name
        for index_dir in excluded:
            if path.is_relative_to(index_dir) and path != index_dir:
                first = path.relative_to(index_dir).parts[0]
                if first in INDEX_ENTRIES or (first.endswith(".tmp") and first[: -len(".tmp")] in INDEX_ENTRIES):
                    return index_dir
        return None

    def own(folder: str, name: str) -> bool:
        """Whether `folder/name` is an index's: skipped (and reported) if so."""
        if Path(folder, name).resolve() in excluded:
            skip(Path(folder, name), "the index itself (kept inside its documents folder)")
            return True
        if (index_dir := index_entry(Path(folder), name)) is not None:
            skip(
                Path(folder, name), f"a file of the index {index_dir} (the documents folder is its folder or inside it)"
            )
            return True
        return False

    paths: list[Path] = []
    for folder, subfolders, names in os.walk(docs_dir, onerror=skip_folder):
        subfolders[:] = [name for name in sorted(subfolders) if not name.startswith(".") and not own(folder, name)]
        paths.extend(Path(folder, name) for name in sorted(names) if not name.startswith(".") and not own(folder, name))
        if len(paths) > max_documents:
            raise DocumentLimitError(
                f"{docs_dir} holds more than {max_documents} files (max_documents); index it in parts or raise the limit"
            )

    files: list[SourceFile] = []
    for path in paths:
        source = path.relative_to(docs_dir).as_posix()
        try:
            source.encode("utf-8")
        except UnicodeEncodeError:
            skip(path, "file name is not valid UTF-8")
            continue
        outcome = _read_source(path, source, root, max_file_bytes)
        if isinstance(outcome, SourceFile):
            files.append(outcome)
        else:
            skip(path, outcome)
    if not files:
        raise ValueError(f"no readable text files in {docs_dir} ({len(skipped)} skipped)")
    return files, skipped


def _read_source(path: Path, source: str, root: Path, max_file_bytes: int) -> SourceFile | str:
    """The file as a `SourceFile`, or the reason it cannot be indexed (`root`: the resolved folder)."""
    try:
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            return f"a symbolic link to {path.resolve()}, outside the documents folder"
        if not path.is_file():
            return "not a regular file"
        if (size := path.stat().st_size) > max_file_bytes:
            return f"{size} bytes, over the {max_file_bytes}-byte limit (max_file_bytes)"
        with path.open("rb") as file:
            if b"\0" in file.read(_BINARY_SNIFF_BYTES):
                return f"binary (NUL byte in the first {_BINARY_SNIFF_BYTES} bytes)"
        data = path.read_bytes()
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if len(data) > max_file_bytes:  # grew since it was measured
        return f"{len(data)} bytes, over the {max_file_bytes}-byte limit (max_file_bytes)"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (invalid byte {data[exc.start : exc.start + 1]!r} at offset {exc.start})"
    if not text.strip():
        return "empty"
    return SourceFile(source=source, text=text, sha256=hashlib.sha256(data).hexdigest())
