"""The neighbour table: each chunk's recorded neighbours (most similar first), in `neighbours.sqlite`.

It names a chunk's neighbour cache (the chunk computed behind them), so it holds their token ids, not references
into the chunk index: a neighbour cache stays named while the chunks it was computed behind are edited or gone,
and `grouped` records a group before its chunks are committed. Each distinct neighbour's token ids are held once
(`texts`: 4 bytes a token, by a 64-bit hash of them), and a chunk's row is the hashes of its neighbours (`near`):
a few tens of bytes a chunk beside the texts, where a table that spelled each neighbour out for every chunk naming
it took about 18 bytes a token of the corpus. Nothing of it is held in memory but the texts last read (`_TEXTS`).

SQLite in WAL mode: a record is one transaction, readers see the table as the last one committed, in this
process or another (a server opened before an `index` run reads what it records, from the next lookup on), and
never wait for a writer. The table can be dropped (`rag-kvcache check --repair` does, when it fails SQLite's
integrity check): a chunk without a row reads its behind-prefix cache until the next `index` run records its
neighbours again. An index made when the table was `neighbours.json` is moved into it by the first writer that
opens it (`import_json`).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
import xxhash

from ..errors import IndexFileError
from ..retrieval.database import io_error, transaction
from .records import _ids, _short, read_json

NEIGHBOURS_DB = "neighbours.sqlite"
LEGACY_FILE = "neighbours.json"  # the table before it was SQLite: chunk key -> its neighbours' token ids
_TOKENS = np.dtype("<i4")  # a text's token ids as stored
_REFS = np.dtype("<i8")  # a chunk's neighbours as stored: their texts' hashes, most similar first
_TEXTS = 256  # texts held decoded (content-addressed, so never stale): a prompt reads a few dozen
_BATCH = 500  # keys a statement binds (under SQLite's bound-parameter limit)
log = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS texts (hash INTEGER PRIMARY KEY, ids BLOB NOT NULL)",
    "CREATE TABLE IF NOT EXISTS near (chunk TEXT PRIMARY KEY, refs BLOB NOT NULL) WITHOUT ROWID",
)

Near = list[tuple[int, ...]]  # a chunk's neighbours' token ids, most similar first


def text_hash(blob: bytes) -> int:
    """The key of a text's token ids (`_TOKENS` bytes): 64 bits of xxh3, as SQLite's signed integer."""
    return int(np.int64(np.uint64(xxhash.xxh3_64_intdigest(blob))))


class NeighbourTable(Mapping[str, Near]):
    """The neighbour table of the index in folder `path`: chunk key (`CacheAddressing.neighbour_key`) -> its
    neighbours' token ids, most similar first. A `Mapping` read from SQLite at each lookup; `record` and
    `forget` write it. Thread-safe (the server's backfill thread reads it beside the request thread)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path) / NEIGHBOURS_DB
        self._db: sqlite3.Connection | None = None
        self._writing = False
        self._mutex = threading.Lock()
        self._text = lru_cache(maxsize=_TEXTS)(self._read_text)

    # ---- reading --------------------------------------------------------------------------------------
    def __getitem__(self, chunk: str) -> Near:
        with self._mutex:
            db = self._reader()
            row = None if db is None else db.execute("SELECT refs FROM near WHERE chunk = ?", (chunk,)).fetchone()
            if row is None:
                raise KeyError(chunk)
            return [self._text(h) for h in np.frombuffer(row[0], dtype=_REFS).tolist()]

    def __contains__(self, chunk: object) -> bool:
        with self._mutex:
            db = self._reader()
            return db is not None and db.execute("SELECT 1 FROM near WHERE chunk = ?", (chunk,)).fetchone() is not None

    def __bool__(self) -> bool:
        with self._mutex:
            db = self._reader()
            return db is not None and db.execute("SELECT 1 FROM near LIMIT 1").fetchone() is not None

    def __len__(self) -> int:
        with self._mutex:
            db = self._reader()
            return 0 if db is None else int(db.execute("SELECT COUNT(*) FROM near").fetchone()[0])

    def __iter__(self) -> Iterator[str]:
        with self._mutex:
            db = self._reader()
            chunks = [] if db is None else [c for (c,) in db.execute("SELECT chunk FROM near")]
        return iter(chunks)

    def _read_text(self, h: int) -> tuple[int, ...]:
        """The token ids stored under hash `h` (the caller holds the mutex)."""
        assert self._db is not None
        row = self._db.execute("SELECT ids FROM texts WHERE hash = ?", (h,)).fetchone()
        if row is None:
            raise IndexFileError(f"{self.path}: a chunk names neighbour text {h}, which the table does not hold")
        return tuple(np.frombuffer(row[0], dtype=_TOKENS).tolist())

    def _reader(self) -> sqlite3.Connection | None:
        """The connection, opened once the file exists (None before: no chunk has neighbours recorded)."""
        if self._db is None and self.path.is_file():
            self._db = _open(self.path)
        return self._db

    # ---- writing --------------------------------------------------------------------------------------
    def record(self, rows: Iterable[tuple[str, Sequence[Sequence[int]]]]) -> None:
        """Record each chunk's neighbours (chunk key, their token ids most similar first), replacing any recorded
        before, in one transaction: readers see all of them or none."""
        texts: dict[int, bytes] = {}
        near: list[tuple[str, bytes]] = []
        for chunk, neighbours in rows:
            blobs = [np.asarray(ids, dtype=_TOKENS).tobytes() for ids in neighbours]
            hashes = [text_hash(b) for b in blobs]
            texts.update(zip(hashes, blobs, strict=True))
            near.append((chunk, np.asarray(hashes, dtype=_REFS).tobytes()))
        if not near:
            return
        with self._transaction("recording chunks' neighbours") as db:
            db.executemany("INSERT OR IGNORE INTO texts (hash, ids) VALUES (?, ?)", texts.items())
            db.executemany("INSERT OR REPLACE INTO near (chunk, refs) VALUES (?, ?)", near)

    def forget(self, keep: set[str]) -> int:
        """Drop the rows of chunks not in `keep`, and the texts no row names any more; returns how many rows went."""
        with self._transaction("dropping chunks' neighbours") as db:
            stale = [c for (c,) in db.execute("SELECT chunk FROM near") if c not in keep]
            for start in range(0, len(stale), _BATCH):
                batch = stale[start : start + _BATCH]
                db.execute(f"DELETE FROM near WHERE chunk IN ({', '.join('?' * len(batch))})", batch)
            if stale:
                named = {
                    h for (refs,) in db.execute("SELECT refs FROM near") for h in np.frombuffer(refs, _REFS).tolist()
                }
                unnamed = [(h,) for (h,) in db.execute("SELECT hash FROM texts") if h not in named]
                db.executemany("DELETE FROM texts WHERE hash = ?", unnamed)
        return len(stale)

    def import_json(self) -> int:
        """Move a `neighbours.json` beside the table (an index made before the table was SQLite) into it, then
        delete the file, if this process may write the folder (else warn); returns how many chunks' rows it held.
        `IndexFileError` naming the file when it is not a table of chunk key -> lists of token ids (`check --repair`
        drops it)."""
        legacy = self.path.with_name(LEGACY_FILE)
        if not legacy.is_file():
            return 0
        if not os.access(legacy.parent, os.W_OK):
            log.warning(
                "%s is the neighbour table, which this process may not move into %s: chunks read their behind-prefix "
                "caches until a process that may write the folder opens the index",
                legacy,
                NEIGHBOURS_DB,
            )
            return 0
        table = read_legacy(legacy)
        self.record(table.items())
        legacy.unlink(missing_ok=True)  # another writer may have moved it meanwhile
        return len(table)

    @contextmanager
    def _transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """One write transaction under the mutex (`database.transaction`: committed if the block succeeds, rolled
        back if it or the commit fails; a full disk raises `StorageFullError` naming the folder and `what`)."""
        with self._mutex:
            try:
                db = self._writer()
            except sqlite3.DatabaseError as exc:
                raise io_error(exc, self.path.parent, what) from exc
            with transaction(db, self.path.parent, what):
                yield db

    def _writer(self) -> sqlite3.Connection:
        """The connection, (re)opened for writing and the schema made (the caller holds the mutex)."""
        if self._writing and self._db is not None:
            return self._db
        if self._db is not None:
            self._db.close()
        self._db = db = _connect(self.path, "rwc")
        db.execute("PRAGMA journal_mode=WAL")
        for statement in _SCHEMA:
            db.execute(statement)
        self._writing = True
        return db

    def close(self) -> None:
        with self._mutex:
            if self._db is not None:
                self._db.close()
            self._db, self._writing = None, False


def _open(path: Path) -> sqlite3.Connection:
    """The neighbour table at `path` opened to read: read-only, or immutable where even that cannot be (WAL needs
    its shared-memory file, which a full disk or a read-only folder cannot hold) provided its write-ahead log holds
    no commits the file lacks. `IndexFileError` naming the file when it is not a neighbour table."""
    db = _connect(path, "ro")
    try:
        db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()  # opens the WAL's shared memory
    except sqlite3.OperationalError as e:
        db.close()
        wal = path.with_name(f"{path.name}-wal")
        if wal.is_file() and wal.stat().st_size > 0:
            raise OSError(
                errno.EIO,
                f"{path} cannot be opened to read ({e}) and its write-ahead log holds commits the file lacks",
                str(path),
            ) from e
        log.warning("%s cannot be opened the ordinary way (%s); reading it as an immutable file", path, e)
        db = _connect(path, "ro", immutable=True)
    except sqlite3.DatabaseError as e:
        db.close()
        raise IndexFileError(f"{path} is not a neighbour table ({e}): `rag-kvcache check --repair` drops it") from e
    try:
        db.execute("SELECT refs FROM near LIMIT 0").fetchall()
        db.execute("SELECT hash, ids FROM texts LIMIT 0").fetchall()
    except sqlite3.DatabaseError as e:
        db.close()
        raise IndexFileError(f"{path} is not a neighbour table ({e}): `rag-kvcache check --repair` drops it") from e
    return db


def _connect(path: Path, mode: str, immutable: bool = False) -> sqlite3.Connection:
    uri = f"{path.resolve().as_uri()}?mode={mode}" + ("&immutable=1" if immutable else "")
    return sqlite3.connect(uri, uri=True, timeout=60, isolation_level=None, check_same_thread=False)


def read_legacy(path: Path) -> dict[str, Near]:
    """A `neighbours.json` (chunk key -> lists of neighbour token ids); `IndexFileError` naming the file and the
    first entry that is not that."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise IndexFileError(f"{path} holds {_short(data)}, not a table of chunk key -> lists of neighbour token ids")
    for key, value in data.items():
        if not (isinstance(value, list) and all(_ids(ids) for ids in value)):
            raise IndexFileError(f"{path}: entry {key!r} is {_short(value)}, not lists of neighbour token ids")
    return {key: [tuple(ids) for ids in value] for key, value in data.items()}


def check(path: Path) -> list[str]:
    """What is wrong with the neighbour table in index folder `path` (nothing: []): a `neighbours.json` that does
    not parse, a `neighbours.sqlite` that is not a neighbour table or fails SQLite's integrity check."""
    legacy = path / LEGACY_FILE
    if legacy.is_file():
        try:
            read_legacy(legacy)
        except IndexFileError as e:
            return [str(e)]
    db_path = path / NEIGHBOURS_DB
    if not db_path.is_file():
        return []
    try:
        db = _open(db_path)
    except IndexFileError as e:
        return [str(e)]
    try:
        return [f"{db_path}: {row[0]}" for row in db.execute("PRAGMA integrity_check") if row[0] != "ok"]
    finally:
        db.close()


def drop(path: Path) -> list[Path]:
    """Delete the neighbour table of index folder `path` (its SQLite files and a `neighbours.json`); returns the
    files deleted."""
    gone = []
    for p in (path / LEGACY_FILE, *(path / f"{NEIGHBOURS_DB}{s}" for s in ("", "-wal", "-shm"))):
        if p.is_file():
            p.unlink()
            gone.append(p)
    return gone
