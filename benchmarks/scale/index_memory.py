"""What an index's bookkeeping holds in memory, per token of the corpus: the Python allocations at their peak
(`tracemalloc`) while each pass every `index`, `delete`, `gc` or `check` run makes over all of a corpus' chunks
runs, on an existing index. These grow with the corpus; a pass that holds tens of bytes a token needs tens of
GB for a team's gigabytes of text.

    python benchmarks/scale/index_memory.py --index budget-trace/index --out index-memory.json

`--index`: an index folder (e.g. the one `budget_trace.py --work budget-trace` builds). Nothing in it is changed
but what opening it does (an index whose neighbour table is `neighbours.json` has it moved into SQLite). `--batch`:
the chunks a pass holds at a time, to show what is bounded by it rather than by the corpus.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import subprocess
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path

from rag_kvcache.index import KVIndex
from rag_kvcache.indexing import maker as maker_module


def peak(run: Callable[[], object]) -> tuple[int, object]:
    """The peak of Python's traced allocations (bytes) while `run` runs and its result is held, and the result."""
    gc.collect()
    tracemalloc.start()
    try:
        result = run()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, help="chunks a pass holds at a time (default: the package's `maker.BATCH`)")
    args = ap.parse_args()
    if args.batch is not None:
        maker_module.BATCH = args.batch
    index = KVIndex.open(args.index)
    maker = index.maker
    tokens = sum(map(len, index.chunks.token_ids()))
    passes: dict[str, Callable[[], object]] = {
        "live_keys (index, delete: what the run may collect)": maker.live_keys,
        "kept (gc, check: what is not an orphan)": maker.kept,
        "hot_set (index: what to cache first)": maker.hot_set,
        # the chunks lacking neighbour caches, whose neighbours `index` records (none here: all are recorded)
        "record_lacking (index: chunks without neighbour caches)": (
            partial(maker.record_lacking, set())
            if hasattr(maker, "record_lacking")
            else maker.chunks_without_neighbour_caches  # before record_lacking, `index` held this list
        ),
    }
    rows = {}
    for name, run in passes.items():
        nbytes, result = peak(run)
        rows[name] = {"peak_bytes": nbytes, "bytes_per_corpus_token": nbytes / tokens, "items": len(result)}  # type: ignore[arg-type]
        if isinstance(result, list):  # chunks, in the order the pass gives them: the same across commits?
            rows[name]["chunk_ids_sha1"] = hashlib.sha1("".join(c.id for c in result).encode()).hexdigest()
        print(f"{name:55s} {nbytes / 2**20:8.1f} MiB  {nbytes / tokens:6.2f} B/token  ({len(result)} items)")  # type: ignore[arg-type]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    batch = getattr(maker_module, "BATCH", None)  # None: a commit whose passes held the whole corpus
    out = {"commit": commit, "batch": batch, "chunks": len(index.chunks), "corpus_tokens": tokens, "passes": rows}
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
