"""What the neighbour table of a real index takes: on disk, per chunk and per token of the corpus, as SQLite
(`indexing.neighbours.NeighbourTable`) against the JSON it replaced, which spelled each neighbour's token ids out
for every chunk naming it; what a lookup costs (the query path makes one or two per chunk of a prompt); and, for
scale, what retrieval keeps beside it (`index.sqlite` with its write-ahead log, `vectors.faiss`).

    python benchmarks/scale/neighbour_table.py --index budget-trace/index --out neighbour-table.json

`--index`: an index folder (e.g. the one `budget_trace.py --work budget-trace` builds, whose every chunk has its
neighbours recorded). Nothing in it is changed: its table (`neighbours.sqlite`, or the `neighbours.json` of an index
made before the table was SQLite) is read, the JSON form is written to a temporary folder and moved into a fresh
SQLite table there, and both are measured.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from rag_kvcache.indexing.neighbours import LEGACY_FILE, NEIGHBOURS_DB, NeighbourTable, read_legacy

TOKEN_BYTES = 4  # index.sqlite's chunks.token_ids: int32


def on_disk(folder: Path) -> int:
    """Bytes of the SQLite table's files (after a checkpoint folds the write-ahead log in)."""
    with sqlite3.connect(folder / NEIGHBOURS_DB) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in folder.glob(f"{NEIGHBOURS_DB}*"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    legacy = args.index / LEGACY_FILE
    table = read_legacy(legacy) if legacy.is_file() else dict(NeighbourTable(args.index))
    with sqlite3.connect(f"{(args.index / 'index.sqlite').resolve().as_uri()}?mode=ro", uri=True) as db:
        chunks, corpus_tokens = db.execute("SELECT COUNT(*), SUM(LENGTH(token_ids)) FROM chunks").fetchone()
    corpus_tokens //= TOKEN_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / LEGACY_FILE).write_text(json.dumps({k: [list(ids) for ids in near] for k, near in table.items()}))
        json_bytes = (work / LEGACY_FILE).stat().st_size
        t0 = time.perf_counter()
        moved = NeighbourTable(work).import_json()
        import_s = time.perf_counter() - t0
        sqlite_bytes = on_disk(work)
        with sqlite3.connect(work / NEIGHBOURS_DB) as db:
            texts, text_tokens = db.execute("SELECT COUNT(*), SUM(LENGTH(ids)) FROM texts").fetchone()
        reader = NeighbourTable(work)
        keys = sorted(table)
        times = []
        for key in keys:  # every row once, each a cold read of its texts at first
            t = time.perf_counter()
            near = reader[key]
            times.append(time.perf_counter() - t)
            assert near == table[key], key
    retrieval = {  # what retrieval keeps beside it, for scale: the SQLite file with its WAL, and FAISS
        name: sum(p.stat().st_size for p in args.index.glob(f"{name}*")) for name in ("index.sqlite", "vectors.faiss")
    }
    result = {
        "index": str(args.index),
        "retrieval_bytes": retrieval,
        "retrieval_bytes_per_corpus_token": sum(retrieval.values()) / corpus_tokens,
        "chunks": chunks,
        "corpus_tokens": corpus_tokens,
        "rows": moved,
        "distinct_neighbour_texts": texts,
        "neighbour_text_tokens": text_tokens // TOKEN_BYTES,
        "json_bytes": json_bytes,
        "json_bytes_per_corpus_token": json_bytes / corpus_tokens,
        "sqlite_bytes": sqlite_bytes,
        "sqlite_bytes_per_corpus_token": sqlite_bytes / corpus_tokens,
        "sqlite_bytes_per_row": sqlite_bytes / moved,
        "json_over_sqlite": json_bytes / sqlite_bytes,
        "import_s": import_s,
        "lookup_median_us": statistics.median(times) * 1e6,
        "lookup_p99_us": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
