"""The tables of RESULTS.md from the bench's records and explore.py's records, paired by question.

    python tables.py BENCH_DIR/records.jsonl EXPLORE.jsonl [PROBE.jsonl]

Every row: mean over the questions both files scored, bootstrap 95% CI, and the paired difference
from the bench's `cacheblend r=0.15` on the same question (same index, same retrieved chunks).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from rag_kvcache.bench.metrics import bootstrap_ci


def fmt(values) -> str:
    lo, hi = bootstrap_ci(values)
    return f"{np.mean(values):.4f} [{lo:.4f}, {hi:.4f}]"


def main() -> None:
    bench = [json.loads(line) for line in open(sys.argv[1])]
    explore = [json.loads(line) for line in open(sys.argv[2])]
    rows: dict[str, dict[str, dict]] = {}
    for r in bench:
        rows.setdefault(r["label"], {})[r["id"]] = {
            "tf_kl": r["tf_kl"],
            "tf_top1": r["tf_top1"],
            "hit": r["exact_hit"],
            "compute_fraction": r["compute_fraction"],
            "ttft_s": r["ttft_s"],
        }
    for r in explore:
        rows.setdefault(r["variant"] + " (neighbours)", {})[r["id"]] = r
    full = rows["full"]
    ids = sorted(set.intersection(*(set(v) for v in rows.values())))
    base = rows["cacheblend r=0.15"]
    print(f"{len(ids)} questions scored by every row; full answers {sum(full[q]['hit'] for q in ids)} of them\n")
    print(
        "| method | TF KL [95% CI] | KL - cacheblend [95% CI] | TF top-1 | planted acc (of full's) | compute fraction | TTFT median (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, by_id in rows.items():
        if name == "full":
            continue
        kl = [by_id[q]["tf_kl"] for q in ids]
        diff = [by_id[q]["tf_kl"] - base[q]["tf_kl"] for q in ids]
        planted = [by_id[q]["hit"] for q in ids if full[q]["hit"]]
        ttft = f"{np.median([by_id[q]['ttft_s'] for q in ids]):.2f}" if "ttft_s" in by_id[ids[0]] else "-"
        print(
            f"| {name} | {fmt(kl)} | {'-' if by_id is base else fmt(diff)} | {np.mean([by_id[q]['tf_top1'] for q in ids]):.3f} | "
            f"{np.mean(planted):.2f} ({sum(planted)}/{len(planted)}) | {np.mean([by_id[q]['compute_fraction'] for q in ids]):.3f} | {ttft} |"
        )
    print(f"| full | 0 | | 1 | 1 | 1.000 | {np.median([full[q]['ttft_s'] for q in ids]):.2f} |")
    if len(sys.argv) > 3:
        dev = {json.loads(line)["id"]: json.loads(line)["deviation"] for line in open(sys.argv[3])}
        both = [q for q in ids if q in dev]
        d, kl = np.array([dev[q] for q in both]), np.array([base[q]["tf_kl"] for q in both])
        rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
        print(
            f"\nGate probe over {len(both)} questions: relative K deviation at the check layer {d.min():.4f}..{d.max():.4f}; "
            f"cacheblend TF KL {kl.min():.3f}..{kl.max():.3f}; Spearman rank correlation {np.corrcoef(rank(d), rank(kl))[0, 1]:.2f}"
        )


if __name__ == "__main__":
    main()
