"""An index's writer lock: one process at a time changes an index; another that asks waits for it.

The lock is the file `.writer.lock` in the index's folder (hidden: a folder indexed in place does not read it),
held across processes and released when its holder leaves the `with` block or dies. `KVIndex` holds it while it
creates an index and indexes or deletes documents, `rag-kvcache gc` while it collects and `check --repair` while it
repairs; readers take no lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)


@contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Exclusive right to change the index at `path` (across processes); waits for the holder."""
    lock = FileLock(path / ".writer.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is updating %s; waiting for it to finish", path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
