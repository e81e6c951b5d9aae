"""Reading a documents folder: every non-hidden UTF-8 text file, with the reason for each file skipped."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_BINARY_SNIFF_BYTES = 8192


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


def read_documents(docs_dir: Path) -> tuple[list[SourceFile], list[Skipped]]:
    """Read every non-hidden text file under `docs_dir`, recursively and in sorted order.

    Binary, non-UTF-8, unreadable and empty files are skipped with a warning and reported.
    """
    docs_dir = Path(docs_dir)
    if not docs_dir.exists():
        raise FileNotFoundError(f"documents folder not found: {docs_dir}")
    if not docs_dir.is_dir():
        raise NotADirectoryError(f"documents path is not a folder: {docs_dir}")

    files: list[SourceFile] = []
    skipped: list[Skipped] = []

    def skip(path: Path, reason: str) -> None:
        entry = Skipped(path.relative_to(docs_dir).as_posix(), reason)
        logger.warning("skipping %s: %s", entry.source, reason)
        skipped.append(entry)

    def skip_folder(error: OSError) -> None:
        skip(Path(error.filename), f"unreadable folder ({error.strerror})")

    for folder, subfolders, names in os.walk(docs_dir, onerror=skip_folder):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = Path(folder, name)
            outcome = _read_source(path, path.relative_to(docs_dir).as_posix())
            if isinstance(outcome, SourceFile):
                files.append(outcome)
            else:
                skip(path, outcome)
    if not files:
        raise ValueError(f"no readable text files in {docs_dir} ({len(skipped)} skipped)")
    return files, skipped


def _read_source(path: Path, source: str) -> SourceFile | str:
    """The file as a `SourceFile`, or the reason it cannot be indexed."""
    try:
        if not path.is_file():
            return "not a regular file"
        data = path.read_bytes()
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if b"\0" in data[:_BINARY_SNIFF_BYTES]:
        return f"binary (NUL byte in the first {_BINARY_SNIFF_BYTES} bytes)"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (invalid byte {data[exc.start : exc.start + 1]!r} at offset {exc.start})"
    if not text.strip():
        return "empty"
    return SourceFile(source=source, text=text, sha256=hashlib.sha256(data).hexdigest())
