"""Write a planted-fact set (datasets/planted.md) as JSONL, from a MuSiQue file in the CacheBlend layout.

    .venv/bin/python datasets/planted.py MUSIQUE_JSON OUT.jsonl [--paraphrased] [--top-k 6] [--seed 0]

The set is the one `rag-kvcache bench --dataset planted:MUSIQUE_JSON` generates with the same --top-k and seed;
`bench --dataset OUT.jsonl` reads it back the same.
"""

from __future__ import annotations

import argparse

from rag_kvcache.bench.datasets import load_musique, planted_facts, write_jsonl


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("musique", help="a MuSiQue file in the CacheBlend layout")
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--paraphrased", action="store_true", help="ask each fact in words it does not use")
    p.add_argument("--top-k", type=int, default=6, help="the retrieval depth the facts' ranks are drawn for")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    planted = planted_facts(load_musique(args.musique), top_k=args.top_k, seed=args.seed, paraphrased=args.paraphrased)
    write_jsonl(planted, args.out)
    print(f"{len(planted)} planted facts -> {args.out}")


if __name__ == "__main__":
    main()
