"""The same planted facts asked two ways: does `epic_match`'s lexical repair hold when the question does not use
the fact's words? Reads two `rag-kvcache bench` runs over the same passages and facts, one with
`--dataset planted:...` and one with `--dataset planted-paraphrased:...`, both with `full`, `cacheblend` and
`epic_match` (and, from runs of the same sets with `full,epic`, EPIC without the repair: several runs of one
set are given comma-separated, their records merged by question):

    python benchmarks/fusion-quality/paraphrase_pair.py LEXICAL_OUT[,LEXICAL_OUT2] PARAPHRASED_OUT[,...] [OUT.json]

Per set and method: planted-fact accuracy over the questions `full` answers right (Wilson 95% interval), mean
teacher-forced KL to `full` (bootstrap 95% interval), and the tokens the method recomputed (`epic_match`'s
repair adds the sentences echoing the question to EPIC's chunk heads: fewer echoes, fewer tokens; and
`epic_evidence`'s, from runs with `full,epic_evidence`, adds the sentences the embedder finds closest to
the question; `cacheblend@cached_neighbours` and `epic_match@cached_neighbours` run on caches computed behind
each chunk's most similar chunks' cached K/V, issue 33 item 1; `cacheblend@grouped` and `epic_match@grouped` on
caches cut from groups of similar chunks prefilled together). Paired over questions, on each set, with a bootstrap interval: TF KL differences between
the methods of `PAIRS` (where every question has both); and on the
questions `full` answers right both ways, each method's planted-fact hits on one set against the other.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

BOOT = 2000
METHODS = ("full", "cacheblend", "epic_match")
NEIGHBOURS = ("cacheblend@cached_neighbours", "epic_match@cached_neighbours")
GROUPED = ("cacheblend@grouped", "epic_match@grouped")
OPTIONAL = ("epic", "epic_evidence", *NEIGHBOURS, *GROUPED)  # reported where every question has it
PAIRS = (
    ("epic_match", "cacheblend"),
    ("epic_evidence", "cacheblend"),
    ("epic_evidence", "epic_match"),
    ("epic_evidence", "epic"),
    ("cacheblend@cached_neighbours", "cacheblend"),
    ("epic_match@cached_neighbours", "epic_match"),
    ("epic_match@cached_neighbours", "cacheblend"),
    ("epic_match@cached_neighbours", "cacheblend@cached_neighbours"),
    ("epic_match@grouped", "epic_match"),
    ("epic_match@grouped", "cacheblend"),
    ("epic_match@cached_neighbours", "epic_match@grouped"),
)


def records(outs: str) -> dict[str, dict[str, dict]]:
    """question id -> method (`method@caches` on other caches) -> record (the last one recorded), over the
    comma-separated runs `outs`."""
    by_q: dict[str, dict[str, dict]] = {}
    for out in outs.split(","):
        for line in (Path(out) / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            variant = r["method"] if r.get("caches") is None else f"{r['method']}@{r['caches']}"
            by_q.setdefault(r["id"], {})[variant] = r
    return {q: m for q, m in by_q.items() if all(k in m for k in METHODS)}


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p, z = k / n, 1.96
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def boot_mean(x: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    means = [x[rng.integers(0, len(x), len(x))].mean() for _ in range(BOOT)]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarise(by_q: dict[str, dict[str, dict]], rng: np.random.Generator) -> dict:
    right = [q for q, m in by_q.items() if m["full"]["exact_hit"]]
    out = {"questions": len(by_q), "full_right": len(right)}
    for method in (*METHODS[1:], *(m for m in OPTIONAL if all(m in by_q[q] for q in by_q))):
        k = sum(by_q[q][method]["exact_hit"] for q in right)
        kl = np.array([by_q[q][method]["tf_kl"] for q in by_q if by_q[q][method]["tf_kl"] is not None])
        out[method] = {
            "planted_accuracy": k / len(right) if right else None,
            "planted_right": k,
            "planted_ci": wilson(k, len(right)),
            "tf_kl": float(kl.mean()),
            "tf_kl_ci": boot_mean(kl, rng),
            "recomputed_tokens": float(np.mean([by_q[q][method]["recomputed_tokens"] for q in by_q])),
        }
    for a, b in PAIRS:  # paired over questions, where both were run
        diff = np.array(
            [
                m[a]["tf_kl"] - m[b]["tf_kl"]
                for m in by_q.values()
                if a in m and b in m and m[a]["tf_kl"] is not None and m[b]["tf_kl"] is not None
            ]
        )
        if len(diff) == len(by_q):
            out[f"{a}_minus_{b}_tf_kl"] = {"mean": float(diff.mean()), "ci": boot_mean(diff, rng)}
    return out


def main() -> None:
    lexical, paraphrased = records(sys.argv[1]), records(sys.argv[2])
    shared = sorted(lexical.keys() & paraphrased.keys())
    rng = np.random.default_rng(0)
    result = {
        name: summarise({q: runs[q] for q in shared}, rng)
        for name, runs in (("lexical", lexical), ("paraphrased", paraphrased))
    }
    both = [q for q in shared if lexical[q]["full"]["exact_hit"] and paraphrased[q]["full"]["exact_hit"]]
    methods = (
        *METHODS[1:],
        *(m for m in OPTIONAL if all(m in runs[q] for runs in (lexical, paraphrased) for q in shared)),
    )
    result["full_right_both"] = {"questions": len(both)} | {
        method: {
            "lexical": sum(lexical[q][method]["exact_hit"] for q in both),
            "paraphrased": sum(paraphrased[q][method]["exact_hit"] for q in both),
        }
        for method in methods
    }
    print(json.dumps(result, indent=1))
    if len(sys.argv) > 3:
        Path(sys.argv[3]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
