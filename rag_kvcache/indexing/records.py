"""The JSON records an index keeps beside its caches, read and checked whole.

`neighbours.json`: each chunk's recorded neighbours (by `CacheAddressing.neighbour_key`: lists of token ids,
most similar first). `pending.json`: the caches a run is computing for chunks it has not committed yet (store
key -> [token ids, context token ids]). One that is not UTF-8 JSON of that shape raises `IndexFileError` naming
the file and what is wrong. Both can be dropped and the index stays sound (`rag-kvcache check --repair` does):
a chunk without neighbour records reads its behind-prefix cache until the next `index` run records its
neighbours again, and an interrupted run's caches become orphans that `gc` collects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

from ..errors import IndexFileError

NEIGHBOURS_FILE = "neighbours.json"
PENDING_FILE = "pending.json"


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


def read_neighbours(path: Path) -> dict[str, list[list[int]]]:
    """The neighbour table at `path`: chunk key -> its neighbours' token ids; raises `IndexFileError` naming the
    file and the first entry that is not that."""
    table = _table(path, read_json(path), "chunk key -> lists of neighbour token ids")
    for key, value in table.items():
        if not (isinstance(value, list) and all(_ids(ids) for ids in value)):
            raise IndexFileError(f"{path}: entry {key!r} is {_short(value)}, not lists of neighbour token ids")
    return cast("dict[str, list[list[int]]]", table)


def read_pending(path: Path) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The pending caches at `path`: store key -> (token ids, context token ids); raises `IndexFileError` naming
    the file and the first entry that is not that."""
    table = _table(path, read_json(path), "store key -> [token ids, context token ids]")
    for key, value in table.items():
        if not (isinstance(value, list) and len(value) == 2 and all(map(_ids, value))):
            raise IndexFileError(f"{path}: entry {key!r} is {_short(value)}, not [token ids, context token ids]")
    checked = cast("dict[str, tuple[list[int], list[int]]]", table)
    return {key: (tuple(ids), tuple(context)) for key, (ids, context) in checked.items()}


def _table(path: Path, data: object, what: str) -> dict[str, list[object]]:
    if not isinstance(data, dict):
        raise IndexFileError(f"{path} holds {_short(data)}, not a table of {what}")
    return data


def _ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
