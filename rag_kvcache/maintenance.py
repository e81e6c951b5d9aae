"""`rag-kvcache check` and `gc`: verify every file of an index, and rebuild what can be rebuilt.

`check` reads everything an index holds: SQLite (its own `integrity_check`, then every chunk row
against what it was derived from), `vectors.faiss` (its recorded checksum and its id set), and every
KV cache the index holds (each tensor's checksum, by reading it whole), and counts the caches not made
(yet, or evicted by the store's budget: made when a prompt needs them, no damage), the orphan caches and the
temporary files `gc` would delete. With `repair` it fixes what it found, and only that: a chunk
row whose embedding alone is damaged is re-embedded from its text; a row that is not what its id
says is dropped with its document (the next `index` run of its folder reads it again); `vectors.faiss`
is rebuilt from SQLite's stored embeddings (no re-embedding); a corrupt cache is recomputed;
orphans and temporary files are collected. SQLite's own corruption (a failed `integrity_check`)
cannot be repaired here: the report says to re-index.

The records an index is opened with are checked first (`check_records`, which `rag-kvcache check` runs before
it opens the index): its recorded settings (`index.sqlite`'s meta), its neighbour table (`neighbours.sqlite`, or
the `neighbours.json` of an index made before it was SQLite) and `pending.json`. One that does not parse or fails
SQLite's integrity check is named with what is wrong; `repair` drops the neighbour table or `pending.json` (the
index stays sound without them: `indexing.neighbours`, `indexing.records`), and cannot rebuild the settings (the
report says to re-index).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from .errors import IndexFileError
from .index import Collected, KVIndex
from .indexing import neighbours
from .indexing.lock import writer_lock
from .indexing.provenance import recorded_settings
from .indexing.records import PENDING_FILE, read_pending
from .retrieval import vectors as faiss_file
from .retrieval.chunk_index import ChunkIndex
from .retrieval.database import DB_FILE
from .store.addressing import Context
from .store.backend import CorruptEntryError

log = logging.getLogger(__name__)


@dataclass
class CheckReport:
    """What `check` found (`problems`, and `garbage`), what it repaired, and what it could not."""

    problems: list[str] = field(default_factory=list)
    garbage: list[str] = field(default_factory=list)  # orphan caches and temp files: no damage, `gc` deletes them
    resumable: list[str] = field(default_factory=list)  # an interrupted run's caches: kept for its resumption
    repaired: list[str] = field(default_factory=list)
    unrepaired: list[str] = field(default_factory=list)
    caches_checked: int = 0
    caches_cold: int = 0  # caches the index names and does not hold (not made yet, or evicted by its budget)
    reembedded: int = 0  # chunk embeddings recomputed
    recomputed: int = 0  # KV caches recomputed
    collected: Collected | None = None

    repair: bool = False

    @property
    def ok(self) -> bool:
        """Whether the index is sound now: nothing found, or (`repair`) all of it repaired."""
        return not self.unrepaired and (self.repair or not self.problems)


def check_records(index_dir: Path, repair: bool = False) -> CheckReport:
    """Check the records the index at `index_dir` is opened with, before it is opened (one that does not parse
    fails the opening): its recorded settings, its neighbour table and `pending.json`; with `repair`, drop those of
    the last two that do not parse (holding its writer lock), after which the index opens. `check` continues the
    report this returns (its `found`)."""
    report = CheckReport(repair=repair)
    if not repair:
        _check_records(Path(index_dir), report, repair)
        return report
    with writer_lock(Path(index_dir)):
        _check_records(Path(index_dir), report, repair)
    return report


def check(index: KVIndex, repair: bool = False, progress: bool = True, found: CheckReport | None = None) -> CheckReport:
    """Verify every file of `index`; with `repair`, fix what was found (holding its writer lock). `found`: what
    `check_records` found before the index was opened, continued. A record that does not parse and is not
    repaired ends the check there (the rest reads it)."""
    if index.foreign:
        raise ValueError(
            f"{index.path} was built with model {index.recorded.model!r}, not {index.config.index.model!r}: "
            "check it with its own model (KVIndex.open without a config), which addresses its caches"
        )
    report = found or CheckReport(repair=repair)
    if not repair:
        _check_records(index.path, report, repair)
        if not report.problems:
            _check(index, report, repair, progress)
        return report
    with index.writer_lock():
        _check_records(index.path, report, repair)
        if report.unrepaired:
            return report
        _check(index, report, repair, progress)
        report.collected = collected = index.collect()
    if collected:
        report.repaired.append(str(collected))
    return report


def gc(index: KVIndex) -> Collected:
    """Delete the orphan caches and the temporary files of killed writers (`KVIndex.collect`)."""
    with index.writer_lock():
        return index.collect()


def _check_records(index_dir: Path, report: CheckReport, repair: bool) -> None:
    """`check_records` (the caller holds the writer lock when `repair`)."""
    try:
        recorded_settings(ChunkIndex.read_meta(index_dir), index_dir)
    except IndexFileError as e:
        report.problems.append(str(e))
        report.unrepaired.append(
            f"the settings {DB_FILE} records cannot be rebuilt: restore the index from a backup or build a new one "
            "from the documents (`rag-kvcache index`)"
        )
    if found := neighbours.check(index_dir):
        report.problems.extend(found)
        if repair:
            for path in neighbours.drop(index_dir):
                report.repaired.append(
                    f"dropped {path} (chunks read their behind-prefix caches until the next `rag-kvcache index` "
                    "records their neighbours and makes their neighbour caches again)"
                )
    path = index_dir / PENDING_FILE
    try:
        if path.is_file():
            read_pending(path)
    except IndexFileError as e:
        report.problems.append(str(e))
        if repair:
            path.unlink()
            report.repaired.append(f"dropped {path} (an interrupted run's caches are orphans now: `gc` deletes them)")


def _check(index: KVIndex, report: CheckReport, repair: bool, progress: bool) -> None:
    verified = index.chunks.verify()
    for message in verified.integrity:
        report.problems.append(f"index.sqlite: {message}")
    if verified.integrity:
        report.unrepaired.append(
            "index.sqlite fails SQLite's integrity check: build a new index from the documents (`rag-kvcache index`)"
        )
    for row in verified.bad_rows:
        report.problems.append(
            f"index.sqlite: {row.source}" + (f" chunk {row.chunk}" if row.chunk else "") + f": {row.reason}"
        )
    if verified.vectors is not None:
        report.problems.append(f"{faiss_file.VECTORS_FILE} {verified.vectors}")
    if verified.orphan_windows:
        report.problems.append(f"index.sqlite: {verified.orphan_windows} window embeddings of chunks it does not hold")
    if repair and not verified.integrity:
        _repair_rows(index, verified.bad_rows, report)
        if verified.orphan_windows or (verified.vectors is not None and not verified.bad_rows):  # else rewritten
            index.chunks.rewrite_vectors()
            report.repaired.append(
                f"rebuilt {faiss_file.VECTORS_FILE} from the stored window embeddings (no re-embedding)"
                + (f", dropping {verified.orphan_windows} orphan window rows" if verified.orphan_windows else "")
            )
    _check_caches(index, report, repair, progress)
    _count_garbage(index, report)


def _repair_rows(index: KVIndex, bad_rows, report: CheckReport) -> None:
    reembed = [row.chunk for row in bad_rows if row.embedding_only]
    dropped = sorted({row.source for row in bad_rows if not row.embedding_only})
    if reembed:
        report.reembedded = index.chunks.reembed(reembed)
        report.repaired.append(f"re-embedded {report.reembedded} chunks whose stored embedding was damaged")
    if dropped:
        index.chunks.delete(dropped)
        report.repaired.append(
            f"dropped {len(dropped)} damaged documents ({', '.join(dropped)}): run `rag-kvcache index` on their "
            "folder to index them again"
        )


def _check_caches(index: KVIndex, report: CheckReport, repair: bool, progress: bool) -> None:
    """Read every cache the index holds whole (each tensor's checksum verified); a corrupt one is removed by the
    store as it is found; with `repair`, the corrupt ones are recomputed (where the budget admits them). A cache
    the index names and does not hold is cold, not damage: it is made when a prompt needs it."""
    seen: set[str] = set()
    bad: dict[str, tuple[tuple[int, ...], tuple[Context, ...]]] = {}  # store key -> (token ids, contexts)
    for key, ids, contexts in tqdm(index.maker.live(), desc="checking KV caches", unit="cache", disable=not progress):
        if key in seen:  # a text indexed twice: its caches once
            continue
        seen.add(key)
        if key not in index.store.disk:
            report.caches_cold += 1
        elif (problem := _cache_problem(index, key)) is not None:
            report.problems.append(f"KV cache {key} ({len(ids)} tokens): {problem}")
            bad[key] = ids, contexts
    report.caches_checked = len(seen) - report.caches_cold
    if not repair:
        return
    for key, (ids, contexts) in bad.items():  # made as the index makes each (behind cached K/V, a stored mean)
        index.store.put(key, index.maker.make(ids, contexts))
        report.recomputed += 1
    if report.recomputed:
        report.repaired.append(f"recomputed {report.recomputed} corrupt KV caches")


def _cache_problem(index: KVIndex, key: str) -> str | None:
    """What is wrong with the disk cache `key`, or None: every layer read and verified."""
    entry = index.store.disk.open(key)  # None: the header failed its check (the entry is removed)
    if entry is None:
        return "corrupt header (removed)"
    try:
        for layer in range(entry.n_layers):
            entry.layer(layer)
    except CorruptEntryError as err:
        return f"corrupt ({err}; removed)"
    return None


def _count_garbage(index: KVIndex, report: CheckReport) -> None:
    """List the orphan caches and the temporary vectors files that `gc` (or `check --repair`) deletes:
    garbage, not damage (a prompt head cached at query time is an orphan too)."""
    if pending := index.maker.pending():
        report.resumable.append(
            f"{len(pending)} KV caches of an interrupted `index` run: kept, and read again when "
            "the same command runs (it resumes)"
        )
    if orphans := index.orphans():
        size = sum(path.stat().st_size for path in orphans) / 2**20
        report.garbage.append(f"{len(orphans)} orphan KV caches ({size:.1f} MiB) that no indexed chunk uses")
    if temp := [path.name for path in index.path.glob(f".{faiss_file.VECTORS_FILE}.*")]:
        report.garbage.append(f"{len(temp)} temporary files of killed writers: {', '.join(temp)}")
