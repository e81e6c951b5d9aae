"""The JSON records an index keeps beside its caches, read and checked whole.

`pending.json`: the caches a run is computing for chunks it has not committed yet (store key -> [token ids,
context token ids]). One that is not UTF-8 JSON of that shape raises `IndexFileError` naming the file and what is
wrong. It can be dropped and the index stays sound (`rag-kvcache check --repair` does): an interrupted run's caches
become orphans that `gc` collects. It is written whole and atomically (`write_json`): a reader sees the old file or
the new one, and a full disk raises `StorageFullError` and leaves the old file as it was. (The neighbour table is
SQLite: `indexing.neighbours`.)
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import cast

from ..errors import IndexFileError, StorageFullError

PENDING_FILE = "pending.json"

Pending = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # store key -> (token ids, context token ids)


def read_json(path: Path) -> object:
    """The JSON value in the file at `path`; raises `IndexFileError` naming the file when it is not UTF-8 JSON."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise IndexFileError(f"{path} is not UTF-8 text: byte {e.object[e.start : e.start + 1]!r} at offset {e.start}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise IndexFileError(f"{path} is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def read_pending(path: Path) -> Pending:
    """The pending caches at `path`: store key -> (token ids, context token ids); raises `IndexFileError` naming
    the file and the first entry that is not that."""
    table = _table(path, read_json(path), "store key -> [token ids, context token ids]")
    for key, value in table.items():
        if not (isinstance(value, list) and len(value) == 2 and all(map(_ids, value))):
            raise IndexFileError(f"{path}: entry {key!r} is {_short(value)}, not [token ids, context token ids]")
    checked = cast("dict[str, tuple[list[int], list[int]]]", table)
    return {key: (tuple(ids), tuple(context)) for key, (ids, context) in checked.items()}


def write_json(path: Path, data: object) -> None:
    """Write `data` as JSON at `path` atomically (a temporary file renamed over it); a full disk raises
    `StorageFullError` and leaves the old file as it was."""
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(
                err.errno, f"no space left on the device of {path.parent} while writing {path.name}: free space"
            ) from err
        raise


class IndexRecords:
    """The pending caches of the index in folder `path` (`pending.json`), read when asked."""

    def __init__(self, path: Path) -> None:
        self._pending_path = path / PENDING_FILE

    def pending(self) -> Pending:
        """The pending caches (none without `pending.json`); `IndexFileError` naming it when it does not parse."""
        if not self._pending_path.is_file():
            return {}
        return read_pending(self._pending_path)

    def record_pending(self, pending: Pending) -> None:
        """Record a run's caches before it computes them: until it commits they are resumable work, not garbage."""
        write_json(self._pending_path, {key: [list(ids), list(ctx)] for key, (ids, ctx) in pending.items()})

    def clear_pending(self) -> None:
        """No caches are pending: the run that recorded them committed its chunks."""
        self._pending_path.unlink(missing_ok=True)


def _table(path: Path, data: object, what: str) -> dict[str, list[object]]:
    if not isinstance(data, dict):
        raise IndexFileError(f"{path} holds {_short(data)}, not a table of {what}")
    return data


def _ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
