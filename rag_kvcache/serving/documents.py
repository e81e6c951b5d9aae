"""`POST /v1/documents`: where a posted document may be written in the folder the index mirrors, and the
write and sync."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..index import KVIndex
from .errors import APIError

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


def write_and_sync(index: KVIndex, docs_dir: Path, paths: list[Path], texts: list[str]):
    """Write the documents and sync the index with the folder (on the engine's thread)."""
    for path, text in zip(paths, texts, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return index.update(docs_dir, progress=False)
