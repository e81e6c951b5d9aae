"""What retrieval keeps on disk, table by table, per token of the corpus: `index.sqlite` (pages and the payload in
them, SQLite's `dbstat`) and `vectors.faiss`, for an existing index as it is and with its window table as this
package makes it now (`database.ensure_windows` moves a `WITHOUT ROWID` table's rows into a rowid one; the copy is
then vacuumed, as a new index's file would be laid out).

    python benchmarks/scale/retrieval_storage.py --index budget-trace/index --out retrieval-storage.json

`--index`: an index folder; nothing in it is changed (its SQLite file is copied with SQLite's backup).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
from pathlib import Path

from rag_kvcache.retrieval import database as db

TOKEN_BYTES = 4  # chunks.token_ids: int32


def tables(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
    """Pages (bytes) and payload (bytes) of each table and index, largest first."""
    rows = conn.execute("SELECT name, SUM(pgsize), SUM(payload) FROM dbstat GROUP BY name ORDER BY 2 DESC")
    return {name: {"page_bytes": pages, "payload_bytes": payload} for name, pages, payload in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    source = sqlite3.connect(f"{(args.index / db.DB_FILE).resolve().as_uri()}?mode=ro", uri=True)
    (tokens,) = source.execute("SELECT SUM(LENGTH(token_ids)) FROM chunks").fetchone()
    tokens //= TOKEN_BYTES
    faiss_bytes = (args.index / "vectors.faiss").stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / db.DB_FILE
        conn = sqlite3.connect(copy, isolation_level=None)
        source.backup(conn)
        source.close()
        as_is = {"file_bytes": copy.stat().st_size, "tables": tables(conn)}
        with db.transaction(conn, Path(tmp), "moving the window table"):
            db.ensure_windows(conn)
        conn.execute("VACUUM")
        now = {"file_bytes": copy.stat().st_size, "tables": tables(conn)}
        conn.close()
    result = {
        "index": str(args.index),
        "corpus_tokens": tokens,
        "vectors_faiss_bytes": faiss_bytes,
        "as_is": as_is,
        "window_table_as_made_now": now,
        "sqlite_bytes_per_token": {"as_is": as_is["file_bytes"] / tokens, "now": now["file_bytes"] / tokens},
        "retrieval_bytes_per_token": {
            "as_is": (as_is["file_bytes"] + faiss_bytes) / tokens,
            "now": (now["file_bytes"] + faiss_bytes) / tokens,
        },
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, run in (("as is", as_is), ("window table as made now", now)):
        print(f"{name:26s} index.sqlite {run['file_bytes']:>12,d} B = {run['file_bytes'] / tokens:5.1f} B/token")
        for table, size in list(run["tables"].items())[:4]:
            print(f"    {table:24s} pages {size['page_bytes']:>12,d} B, payload {size['payload_bytes']:>12,d} B")
    print(f"vectors.faiss {faiss_bytes:,d} B = {faiss_bytes / tokens:.1f} B/token; corpus {tokens:,d} tokens")


if __name__ == "__main__":
    main()
