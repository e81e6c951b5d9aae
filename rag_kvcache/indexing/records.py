"""The JSON records an index keeps beside its caches, read and checked whole.

`neighbours.json`: each chunk's recorded neighbours (by `CacheAddressing.neighbour_key`: lists of token ids,
most similar first). `pending.json`: the caches a run is computing for chunks it has not committed yet (store
key -> [token ids, context token ids]). One that is not UTF-8 JSON of that shape raises `IndexFileError` naming
the file and what is wrong. Both can be dropped and the index stays sound (`rag-kvcache check --repair` does):
a chunk without neighbour records reads its behind-prefix cache until the next `index` run records its
neighbours again, and an interrupted run's caches become orphans that `gc` collects.

Each is written whole and atomically (`write_json`): a reader sees the old file or the new one, and a full disk
raises `StorageFullError` and leaves the old file as it was. `IndexRecords` holds one index folder's records as
a process uses them: the neighbour table in memory, read again when another process rewrote it, and the pending
caches.
"""

from __future__ import annotations

import errno
import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from ..errors import IndexFileError, StorageFullError

NEIGHBOURS_FILE = "neighbours.json"
PENDING_FILE = "pending.json"

Neighbours = dict[str, list[Sequence[int]]]  # chunk key -> its neighbours' token ids, most similar first
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


def read_neighbours(path: Path, interned: Interned | None = None) -> Neighbours:
    """The neighbour table at `path`: chunk key -> its neighbours' token ids, each distinct neighbour's held once
    (by `interned`, default a pool of its own); raises `IndexFileError` naming the file and the first entry that
    is not that."""
    table = _table(path, read_json(path), "chunk key -> lists of neighbour token ids")
    for key, value in table.items():
        if not (isinstance(value, list) and all(_ids(ids) for ids in value)):
            raise IndexFileError(f"{path}: entry {key!r} is {_short(value)}, not lists of neighbour token ids")
    interned = interned or Interned()
    return {key: [interned(ids) for ids in value] for key, value in cast("dict[str, list[list[int]]]", table).items()}


class Interned:
    """Token id sequences held once each, 4 bytes a token (`array`). A table of every chunk's k neighbours
    mentions each chunk k times on average; as Python lists of ints each mention would take a pointer and an int
    object a token (8 + 28 bytes, past the 256 small ints CPython shares)."""

    def __init__(self) -> None:
        self._held: dict[bytes, array[int]] = {}

    def __call__(self, ids: Sequence[int]) -> array[int]:
        a = array("i", ids)  # token ids are below 2**31
        return self._held.setdefault(a.tobytes(), a)


def _jsonable(value: object) -> list[int]:
    """An interned token id sequence (`Interned`), as JSON writes a list."""
    if isinstance(value, array):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


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
        tmp.write_text(json.dumps(data, default=_jsonable), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(
                err.errno, f"no space left on the device of {path.parent} while writing {path.name}: free space"
            ) from err
        raise


class IndexRecords:
    """The records of the index in folder `path` as one process holds them: `neighbours`, its neighbour table
    (one dict, changed in place only: a `CacheAddressing` reads it), and its pending caches, read when asked."""

    def __init__(self, path: Path) -> None:
        self.neighbours: Neighbours = {}
        self.intern = Interned()  # holds each neighbour's token ids once, read or recorded (`record`)
        self._neighbours_path = path / NEIGHBOURS_FILE
        self._neighbours_read: int | None = None  # the mtime of the neighbours.json `neighbours` holds
        self._pending_path = path / PENDING_FILE

    def refresh_neighbours(self) -> None:
        """Read `neighbours.json` (again, if another process rewrote it since); one `stat` when nothing changed."""
        try:
            mtime = self._neighbours_path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._neighbours_read:
            self.intern = Interned()  # the last table's neighbours go with it
            table = read_neighbours(self._neighbours_path, self.intern)
            self.neighbours.update(table)  # in place, new entries before stale ones go: the addressing reads it
            for stale in self.neighbours.keys() - table.keys():
                del self.neighbours[stale]
            self._neighbours_read = mtime

    def record(self, key: str, near: Sequence[Sequence[int]]) -> None:
        """Record chunk `key`'s neighbours `near` (token ids, most similar first); `write_neighbours` stores them."""
        self.neighbours[key] = [self.intern(ids) for ids in near]

    def write_neighbours(self) -> None:
        """Write the neighbour table (atomic: readers see the old table or the new one)."""
        write_json(self._neighbours_path, self.neighbours)

    def forget_neighbours(self, keep: set[str]) -> int:
        """Drop the neighbour table's entries whose chunk key is not in `keep`, and write it if any went;
        returns how many went."""
        stale = [key for key in self.neighbours if key not in keep]
        for key in stale:  # in place: the addressing reads this table
            del self.neighbours[key]
        if stale:
            self.write_neighbours()
        return len(stale)

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
