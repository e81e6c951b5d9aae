"""`rag-kvcache bench` with an index option the CLI does not expose (`chunk_prefill`).

    .venv/bin/python benchmarks/fusion-quality/bench.py --chunk-prefill behind_filler \\
        --dataset planted:/work/shared/data/musique_dev.json --limit 30 --methods full,reuse,cacheblend,epic \\
        --out /tmp/q13/bench-filler

Same protocol and report as the CLI's bench (`bench.runner.run_benchmark`): 128-token chunks, top-6,
32-token greedy answers, one torch thread, baseline cacheblend.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.runner import run_benchmark
from rag_kvcache.bench.variants import BenchSettings, parse_methods
from rag_kvcache.config import Config, IndexSettings, QueryConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--methods", default="full,reuse,cacheblend,epic")
    p.add_argument(
        "--chunk-prefill", default="behind_prefix", choices=["behind_prefix", "isolated", "behind_filler", "neighbours"]
    )
    p.add_argument("--context-chunks", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    config = Config(
        index=IndexSettings(chunk_tokens=128, chunk_prefill=args.chunk_prefill, context_chunks=args.context_chunks),
        query=QueryConfig(top_k=6),
    )
    config = config.with_query(generation=replace(config.query.generation, max_new_tokens=32))
    examples = load_dataset(args.dataset, top_k=config.query.top_k)[: args.limit]
    settings = BenchSettings(methods=parse_methods(args.methods), threads=1)
    run_benchmark(
        examples,
        args.out,
        config,
        settings,
        progress=False,
        meta={"command": shlex.join([sys.executable, *sys.argv]), "dataset": args.dataset},
    )
    print((args.out / "results.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
