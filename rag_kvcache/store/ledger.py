"""`Ledger`: the disk tier's byte budget and the popularity that decides what it keeps, shared by every process
that opens the store.

The ledger is a SQLite database beside the cache files (`ledger.sqlite`) recording, for every entry on disk,
its bytes, its recompute cost and its priority, and for every key a prompt has read, how often. Admission and
eviction follow GDSF (Greedy-Dual-Size-Frequency, the policy RAGCache's PGDSF builds on): an entry's priority is

    H = clock + uses x cost / bytes

and a write that does not fit evicts the entries of lowest priority first, the clock rising to the priority of
the last one evicted (so entries not used since age out). A write whose priority is not above every entry it
would evict is refused (not stored: the caller keeps its cache for the prompt at hand), so one-off chunks never
flush the hot set, and indexing stops at the budget instead of churning.

The budget holds across processes and after `kill -9`: admission runs under a file lock (`.ledger.lock`,
released by the kernel when its holder dies), an entry's row is written before its file and deleted only after
its file, so the files on disk never take more than the rows count, and the rows never more than the budget.
Rows of writers that died before their file landed, and files without rows (written before the store had a
budget), are reconciled when a writable ledger opens.

Here an entry's cost is the tokens it holds, so cost / bytes is about the same for every chunk cache of a codec
and the priority is, in effect, uses with ageing (LFU-DA); a policy weighing other costs passes them to `reserve`.

The budget is the store's, recorded in the ledger: a process that opens the store with a budget records it
(evicting down to it), one that opens it without reads the recorded one.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ..errors import StorageFullError

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.sqlite"
_LOCK_FILE = ".ledger.lock"
_ACCESS_LOG_ROWS = 1_000_000  # the access log keeps this many most recent reads

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    cost REAL NOT NULL,      -- what recomputing it costs (tokens)
    priority REAL NOT NULL,  -- GDSF: clock at its last use + uses x cost / bytes
    writer INTEGER           -- pid of the process writing its file, NULL once the file is in place
);
CREATE INDEX IF NOT EXISTS entries_by_priority ON entries (priority);
CREATE TABLE IF NOT EXISTS uses (key TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value REAL);
CREATE TABLE IF NOT EXISTS accesses (t REAL NOT NULL, key TEXT NOT NULL, bytes INTEGER NOT NULL, hit INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class LedgerStats:
    """What the disk tier holds and how well it served (`Ledger.stats`)."""

    budget: int | None  # bytes; None: unbounded
    bytes: int  # on disk (or reserved by a writer), never above `budget`
    entries: int
    hits: int  # reads of an entry the disk held, since the ledger was created
    misses: int
    hit_bytes: int
    miss_bytes: int
    refused: int  # writes not admitted (their priority below every entry they would have evicted)
    evictions: int
    hot: tuple[tuple[str, int, int, float], ...]  # the highest-priority entries: (key, uses, bytes, priority)

    @property
    def hit_ratio(self) -> float:
        """Of the bytes prompts read from the disk tier, the share it held (0.0 before any read)."""
        total = self.hit_bytes + self.miss_bytes
        return self.hit_bytes / total if total else 0.0


class Ledger:
    """The byte budget and GDSF priorities of the disk tier under `root`; `path_of(key)` is an entry's file.

    `budget` (bytes) is recorded as the store's; None reads the recorded one (none recorded: unbounded, the
    ledger then only counts). Thread-safe; every method is one SQLite transaction, admission one under the
    cross-process lock."""

    def __init__(self, root: Path, path_of: Callable[[str], Path], budget: int | None = None) -> None:
        if budget is not None and budget <= 0:
            raise ValueError(f"a disk budget must be a positive number of bytes, got {budget!r}")
        self.root, self.path_of = Path(root), path_of
        self._mutex = threading.Lock()
        self._lock = FileLock(self.root / _LOCK_FILE)
        self._db = sqlite3.connect(self.root / LEDGER_FILE, timeout=60, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._admitting():
            for statement in filter(str.strip, _SCHEMA.split(";")):
                self._db.execute(statement)
            if budget is not None:
                self._set("budget", budget)
            self._reconcile()

    # ---- admission ------------------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """The store's byte budget (None: unbounded)."""
        with self._mutex:
            value = self._get("budget")
        return None if value is None else int(value)

    def reserve(self, key: str, nbytes: int, cost: float) -> bool:
        """Make room for a `nbytes`-byte entry under `key` that costs `cost` to recompute, evicting (deleting the
        files of) entries of lower priority; True when the entry may be written (its row now counts its bytes,
        so call `landed` or `abandon` after the write). False: it does not fit without evicting an entry of at
        least its priority, or is larger than the whole budget; nothing changed. A full disk raises `StorageFullError`."""
        try:
            return self._reserve(key, nbytes, cost)
        except sqlite3.OperationalError as err:
            if "full" in str(err):
                raise StorageFullError(
                    errno.ENOSPC, f"no space left for the ledger {self.root / LEDGER_FILE}: {err}"
                ) from err
            raise

    def _reserve(self, key: str, nbytes: int, cost: float) -> bool:
        """`reserve` in one transaction under the admission lock."""
        with self._admitting():
            clock = self._get("clock") or 0.0
            priority = clock + self._uses(key) * cost / max(nbytes, 1)
            victims = self._victims(key, nbytes, priority)
            if victims is None:
                self._bump("refused")
                return False
            for gone, _, _ in victims:  # the file goes before its row: the rows never count less than the disk holds
                self.path_of(gone).unlink(missing_ok=True)
            self._db.executemany("DELETE FROM entries WHERE key = ?", [(v,) for v, _, _ in victims])
            if victims:
                self._set("clock", max(clock, victims[-1][2]))
                self._bump("evictions", len(victims))
            self._db.execute(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?)", (key, nbytes, cost, priority, os.getpid())
            )
            return True

    def uses(self, key: str) -> int:
        """How often prompts have read `key` (held or not), as `used` counted them."""
        with self._mutex:
            return self._uses(key)

    def admits(self, key: str, nbytes: int, cost: float) -> bool:
        """Whether `reserve` would admit the entry now (nothing changes): to skip computing a cache the budget
        would not keep."""
        with self._mutex:
            priority = (self._get("clock") or 0.0) + self._uses(key) * cost / max(nbytes, 1)
            return self._victims(key, nbytes, priority) is not None

    def _victims(self, key: str, nbytes: int, priority: float) -> list[tuple[str, int, float]] | None:
        """The entries, lowest priority first, whose eviction makes room for `nbytes` under `key` (a rewrite
        replaces its own row): (key, bytes, priority) each; None when that would evict an entry of at least
        `priority`, or the entry is larger than the budget."""
        budget = self._get("budget")
        if budget is None:
            return []
        row = self._db.execute("SELECT bytes FROM entries WHERE key = ?", (key,)).fetchone()
        excess = self._used() - (row[0] if row else 0) + nbytes - budget
        victims = []
        for victim in self._lowest() if 0 < excess and nbytes <= budget else ():
            if victim[2] >= priority:
                break
            if victim[0] != key:
                victims.append(victim)
                excess -= victim[1]
            if excess <= 0:
                break
        return victims if excess <= 0 else None

    def landed(self, key: str) -> None:
        """The entry `reserve` admitted is written whole."""
        with self._transaction():
            self._db.execute("UPDATE entries SET writer = NULL WHERE key = ?", (key,))

    def abandon(self, key: str) -> None:
        """The entry `reserve` admitted was not written (the write failed): its bytes are free again."""
        self.forget(key)

    def forget(self, key: str) -> None:
        """The entry's file was removed (garbage collection, a corrupt entry dropped)."""
        with self._transaction():
            self._db.execute("DELETE FROM entries WHERE key = ?", (key,))

    def keys(self) -> set[str]:
        """The keys of every entry the ledger counts on disk."""
        with self._mutex:
            return {key for (key,) in self._db.execute("SELECT key FROM entries")}

    def room(self) -> int | None:
        """Bytes free under the budget without evicting anything (None: unbounded)."""
        with self._mutex:
            budget = self._get("budget")
            return None if budget is None else max(int(budget) - self._used(), 0)

    # ---- popularity -----------------------------------------------------------------------------------
    def used(self, reads: Mapping[str, int]) -> None:
        """A prompt reads these keys (key -> the bytes its entry takes, or would): each key's use counted, the
        priority of those on disk raised, and the reads counted as hits (on disk) or misses."""
        if not reads:
            return
        try:
            self._count(reads)
        except sqlite3.OperationalError as err:  # a full disk, a read-only mount: no answer is lost for its counts
            log.warning("could not count the reads of %d KV caches in %s: %s", len(reads), self.root / LEDGER_FILE, err)

    def _count(self, reads: Mapping[str, int]) -> None:
        now = time.time()
        with self._transaction():
            clock = self._get("clock") or 0.0
            held = dict(
                self._db.execute(
                    f"SELECT key, bytes FROM entries WHERE writer IS NULL AND key IN ({','.join('?' * len(reads))})",
                    list(reads),
                )
            )
            self._db.executemany(
                "INSERT INTO uses VALUES (?, 1) ON CONFLICT (key) DO UPDATE SET n = n + 1", [(k,) for k in reads]
            )
            self._db.executemany(
                "UPDATE entries SET priority = ? + (SELECT n FROM uses WHERE uses.key = entries.key) * cost / bytes "
                "WHERE key = ?",
                [(clock, k) for k in held],
            )
            rows = [(now, k, held.get(k, n), k in held) for k, n in reads.items()]
            self._db.executemany("INSERT INTO accesses VALUES (?, ?, ?, ?)", rows)
            hit_bytes = sum(b for _, _, b, hit in rows if hit)
            miss_bytes = sum(b for _, _, b, hit in rows if not hit)
            self._bump("hits", len(held))
            self._bump("misses", len(reads) - len(held))
            self._bump("hit_bytes", hit_bytes)
            self._bump("miss_bytes", miss_bytes)
            if (self._get("accesses_since_trim") or 0) > _ACCESS_LOG_ROWS // 10:
                self._db.execute(
                    "DELETE FROM accesses WHERE rowid <= (SELECT MAX(rowid) FROM accesses) - ?", (_ACCESS_LOG_ROWS,)
                )
                self._set("accesses_since_trim", 0)
            self._bump("accesses_since_trim", len(rows))

    def accesses(self, since: float = 0.0) -> Iterator[tuple[float, str, int, bool]]:
        """The reads `used` logged (the most recent million), oldest first: (time, key, bytes, hit)."""
        with self._mutex:
            rows = self._db.execute(
                "SELECT t, key, bytes, hit FROM accesses WHERE t >= ? ORDER BY rowid", (since,)
            ).fetchall()
        return ((t, k, b, bool(h)) for t, k, b, h in rows)

    def stats(self, hot: int = 10) -> LedgerStats:
        """The budget, the bytes held, the hit counters and the `hot` highest-priority entries."""
        with self._mutex:
            budget = self._get("budget")
            top = self._db.execute(
                "SELECT e.key, COALESCE(u.n, 0), e.bytes, e.priority FROM entries e LEFT JOIN uses u USING (key) "
                "ORDER BY e.priority DESC LIMIT ?",
                (hot,),
            ).fetchall()
            (entries,) = self._db.execute("SELECT COUNT(*) FROM entries").fetchone()
            counts = {name: int(self._get(name) or 0) for name in ("hits", "misses", "hit_bytes", "miss_bytes")}
            return LedgerStats(
                None if budget is None else int(budget),
                self._used(),
                entries,
                **counts,
                refused=int(self._get("refused") or 0),
                evictions=int(self._get("evictions") or 0),
                hot=tuple((k, n, b, p) for k, n, b, p in top),
            )

    def close(self) -> None:
        with self._mutex:
            self._db.close()

    # ---- the records ----------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Bring the rows in line with the files (under the lock): rows of writers that died are kept if their file
        landed and dropped if not; rows whose file is gone (a process killed between deleting a victim's file and
        its row, an entry removed without the ledger) are dropped; files without rows are counted, at the clock's
        priority; then entries are evicted, lowest priority first, until the budget holds."""
        rows = self._db.execute("SELECT key, writer FROM entries").fetchall()
        dead = {k for k, writer in rows if writer is not None and not alive(writer)}
        gone = [(k,) for k, writer in rows if (writer is None or k in dead) and not self.path_of(k).is_file()]
        self._db.executemany("DELETE FROM entries WHERE key = ?", gone)
        self._db.executemany("UPDATE entries SET writer = NULL WHERE key = ?", [(k,) for k in dead])  # landed first
        counted = {k for k, _ in rows} - {k for (k,) in gone}
        clock = self._get("clock") or 0.0
        found = [  # of unknown cost: the first to go
            (path.stem, size, 0.0, clock)
            for path in self.root.glob("??/*.safetensors")
            if not path.name.startswith(".") and path.stem not in counted and (size := _size(path)) is not None
        ]
        self._db.executemany("INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, NULL)", found)
        budget = self._get("budget")
        if budget is None or (excess := self._used() - budget) <= 0:
            return
        victims = []
        for key, nbytes, _ in self._lowest():
            victims.append(key)
            excess -= nbytes
            if excess <= 0:
                break
        for key in victims:
            self.path_of(key).unlink(missing_ok=True)
        self._db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in victims])
        self._bump("evictions", len(victims))
        log.info(
            "evicted %d KV cache entries from %s to bring it under its budget of %d bytes",
            len(victims),
            self.root,
            budget,
        )

    def _lowest(self) -> Iterator[tuple[str, int, float]]:
        """Entries whose file is in place, lowest priority first: (key, bytes, priority), read lazily."""
        return iter(
            self._db.execute("SELECT key, bytes, priority FROM entries WHERE writer IS NULL ORDER BY priority, key")
        )

    def _used(self) -> int:
        (used,) = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()
        return int(used)

    def _uses(self, key: str) -> int:
        row = self._db.execute("SELECT n FROM uses WHERE key = ?", (key,)).fetchone()
        return 0 if row is None else int(row[0])

    def _get(self, name: str) -> float | None:
        row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else float(row[0])

    def _set(self, name: str, value: float) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    def _bump(self, name: str, by: float = 1) -> None:
        self._db.execute(
            "INSERT INTO meta VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = value + excluded.value", (name, by)
        )

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction (SQLite serialises them across processes)."""
        with self._mutex:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def _admitting(self) -> Iterator[None]:
        """A transaction under the cross-process admission lock: no two processes choose victims at once, and the
        files a transaction deletes are gone before another admission counts the bytes."""
        with self._lock, self._transaction():
            yield


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` is running (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
