"""`POST /v1/documents`: where a posted document may be written in the folder the index mirrors, the checks
a request passes as a whole before anything is written, and the write and sync, all or nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from ..index import KVIndex
from ..indexing.staging import SyncReport
from .errors import APIError

log = logging.getLogger(__name__)

NAME_MAX = 255  # bytes in a file name (ext4, APFS, NTFS)


def document_path(docs_dir: Path, source: str) -> Path:
    """Where a posted document goes: a relative path inside `docs_dir`, no hidden or parent parts, no
    control characters, each name short enough for its temporary file's (`.NAME.tmp`), through folders
    (not files, not links) only: a link inside the folder once let a document land outside it."""
    rel = PurePosixPath(source)  # "." and "./" have no parts: the folder itself, written over by the document
    if (
        not rel.parts
        or rel.is_absolute()
        or "\\" in source
        or any(part in ("", "..") or part.startswith(".") for part in rel.parts)
    ):
        raise _bad_source(source, "a relative path inside the documents folder, without hidden or '..' parts")
    if any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise _bad_source(source, "without control characters")
    if any(len(part.encode()) > NAME_MAX - len("..tmp") for part in rel.parts):
        raise _bad_source(source, f"with names of at most {NAME_MAX - len('..tmp')} bytes")
    path = docs_dir
    for i, part in enumerate(rel.parts):
        path = path / part
        if path.is_symlink():
            raise _bad_source(source, f"not through a link ({'/'.join(rel.parts[: i + 1])!r} is one)")
        last = i == len(rel.parts) - 1
        if path.is_dir() if last else path.exists() and not path.is_dir():
            raise _bad_source(
                source,
                f"a path through folders to a file ({'/'.join(rel.parts[: i + 1])!r} is "
                f"{'a folder' if last else 'a file'})",
            )
    return path


def _bad_source(source: str, rule: str) -> APIError:
    return APIError(400, f"source must be {rule}; got {source!r}", param="documents.source", code="invalid_source")


def checked_documents(docs_dir: Path, documents: Sequence[tuple[str, str]], max_file_bytes: int) -> list[Path]:
    """Where each posted `(source, text)` goes, once the request is valid as a whole: every source a valid
    `document_path`, no two naming the same file or one naming a folder of another (`pa` and `pa/b.md`), and
    every text one the index would read (at most `max_file_bytes` bytes, no NUL byte, not only whitespace).
    Raises an `APIError` (400) naming every source at fault; nothing has been written."""
    paths = [document_path(docs_dir, source) for source, _ in documents]
    sources = [source for source, _ in documents]
    seen: dict[PurePosixPath, str] = {}
    for source, path in zip(sources, paths, strict=True):
        rel = PurePosixPath(path.relative_to(docs_dir).as_posix())
        if rel in seen:
            raise _bad_source(source, f"named once per request ({seen[rel]!r} names the same file)")
        seen[rel] = source
    for rel, source in seen.items():
        for parent in rel.parents:
            if parent in seen:
                raise _bad_source(
                    source,
                    f"not inside another document of the request ({seen[parent]!r} is a file, {source!r} needs it as a folder)",
                )
    refused = {
        "larger than the index's max_file_bytes": [s for s, t in documents if len(t.encode()) > max_file_bytes],
        "holding a NUL byte (read as binary: never indexed)": [s for s, t in documents if "\0" in t],
        "holding only whitespace (nothing to index)": [s for s, t in documents if not t.removeprefix("\ufeff").strip()],
    }
    for reason, bad in refused.items():
        if bad:
            detail = f" ({max_file_bytes} bytes)" if "max_file_bytes" in reason else ""
            code = "document_too_large" if "max_file_bytes" in reason else "invalid_text"
            raise APIError(400, f"documents {bad} are {reason}{detail}", param="documents.text", code=code)
    return paths


def write_and_sync(index: KVIndex, docs_dir: Path, paths: list[Path], texts: list[str]) -> SyncReport:
    """Write the documents and sync the index with the folder (on the engine's thread), all or nothing: every
    text is first written beside its file (`.NAME.tmp`), then each put in place (a file it replaces kept as
    `.NAME.bak` until the sync is done); if any step fails, the folder is put back as it was (new files and
    folders removed, replaced files restored) and the error raised."""
    staged: list[tuple[Path, Path]] = []  # (temporary file, its document)
    placed: list[tuple[Path, Path | None]] = []  # (document, the file it replaced, kept aside)
    made: list[Path] = []  # folders created, outermost first
    try:
        for path, text in zip(paths, texts, strict=True):
            for folder in reversed([path.parent, *path.parent.parents]):
                if folder.is_relative_to(docs_dir) and not folder.exists():
                    folder.mkdir()
                    made.append(folder)
            tmp = path.with_name(f".{path.name}.tmp")
            staged.append((tmp, path))
            tmp.write_text(text, encoding="utf-8")
        for tmp, path in staged:
            backup = path.with_name(f".{path.name}.bak") if path.exists() else None
            if backup is not None:
                path.replace(backup)
            placed.append((path, backup))
            tmp.replace(path)
        report = index.update(docs_dir, progress=False)
    except BaseException:
        _restore(staged, placed, made)
        raise
    for _, backup in placed:
        if backup is not None:
            backup.unlink(missing_ok=True)
    return report


def _restore(staged: list[tuple[Path, Path]], placed: list[tuple[Path, Path | None]], made: list[Path]) -> None:
    """Undo a partial `write_and_sync`: documents put back or removed, temporary files and new folders removed."""
    for path, backup in reversed(placed):
        if backup is not None:
            backup.replace(path)
        else:
            path.unlink(missing_ok=True)
    for tmp, _ in staged:
        tmp.unlink(missing_ok=True)
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:  # not empty: something else was written into it meanwhile
            log.warning("left folder %s in place: not empty", folder)
