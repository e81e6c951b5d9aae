"""Does a method's drift estimate say which questions it will get wrong? And what does bounding them
(`drift_limit`: those questions recomputed, i.e. answered as `full`) buy and cost? For CacheBlend (its
check-layer estimate of the deviation its selection leaves) and `epic_match` (the K deviation of the chunk tokens
it recomputes).

Reads a `rag-kvcache bench` run with `full` and the method; its records carry each question's `drift`
(`epic_match` estimates only with a limit: run it as `epic_match:drift=1000`, a limit that never fires):

    python benchmarks/fusion-quality/drift_bound.py BENCH_OUT [--method epic_match] [--limit X] \
        [--json OUT.json] [--plot PLOT.png]

- Rank correlation (Spearman) of the estimate with the question's teacher-forced KL to `full`, with a
  bootstrap 95% interval; the same against losing a planted fact `full` answers.
- The bound, calibrated on the first half of the questions (limit = the estimate's 75th percentile there) and
  judged on the second half, or, with `--limit`, a limit calibrated elsewhere judged on every question: how
  often it fires, the mean KL and planted-fact accuracy with and without it, and the mean TTFT. A bounded
  question's answer is exact (tested: `test_cacheblend_over_its_drift_limit_equals_full`,
  `test_epic_match_over_its_drift_limit_equals_prefix_and_under_it_is_its_own`), so its KL is 0, its fact is
  full's, and its TTFT is taken as `full`'s measured TTFT on that question (the bounded run also did the
  method's own forward, CacheBlend's first layers or all of `epic_match`'s: an underestimate of the cost).
- The same trade-off for every limit: mean KL against mean TTFT over all questions (the plot).

The drift estimates and `drift_limit` have since been removed from the package (neither estimate predicted which
questions drift: this script's finding); it reads the records of bench runs made before (each with `drift` and
`bounded`), and a current run's records carry neither.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from rag_kvcache.bench.metrics import spearman, spearman_ci

QUANTILE = 0.75  # the calibration half's drift quantile taken as the limit: about a quarter of questions bounded


def bounded(rows: list[dict], limit: float) -> dict:
    """Mean KL, planted accuracy (over the facts full answers) and TTFT of the method with `limit`, from the
    measured rows (a bounded question takes full's answer and TTFT)."""
    fired = [r["drift"] > limit for r in rows]
    kl = [0.0 if f else r["kl"] for r, f in zip(rows, fired)]
    ttft = [r["full_ttft"] if f else r["ttft"] for r, f in zip(rows, fired)]
    facts = [(r["full_hit"] if f else r["hit"]) for r, f in zip(rows, fired) if r["full_hit"]]
    return {
        "fired": float(np.mean(fired)),
        "tf_kl": float(np.mean(kl)),
        "ttft_s": float(np.mean(ttft)),
        "planted": float(np.mean(facts)) if facts else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_out", type=Path)
    parser.add_argument("--method", default="cacheblend", choices=("cacheblend", "epic_match"))
    parser.add_argument("--limit", type=float, help="a limit calibrated elsewhere, judged on every question")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    out_dir = args.bench_out
    records = [json.loads(line) for line in (out_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    full = {r["id"]: r for r in records if r["method"] == "full"}
    rows = [
        {
            "id": r["id"],
            "drift": r["drift"],
            "kl": r["tf_kl"],
            "ttft": r["ttft_s"],
            "hit": r["exact_hit"],
            "full_hit": full[r["id"]]["exact_hit"],
            "full_ttft": full[r["id"]]["ttft_s"],
        }
        for r in records
        if r["method"] == args.method and r["drift"] is not None and not r["bounded"] and r["tf_kl"] is not None
    ]
    if not rows:
        parser.error(f"{out_dir} has no {args.method} rows with a drift estimate and no bound fired")
    drift, kl = np.array([r["drift"] for r in rows]), np.array([r["kl"] for r in rows])
    result: dict = {
        "questions": len(rows),
        "spearman_drift_tf_kl": spearman(drift, kl),
        "spearman_drift_tf_kl_ci": spearman_ci(drift, kl),
    }
    with_fact = [r for r in rows if r["full_hit"]]
    if with_fact and len({r["hit"] for r in with_fact}) > 1:
        lost = np.array([not r["hit"] for r in with_fact], dtype=float)
        result["spearman_drift_fact_lost"] = spearman(np.array([r["drift"] for r in with_fact]), lost)

    half = len(rows) // 2
    calibration, held_out = (rows[:half], rows[half:]) if args.limit is None else ([], rows)
    limit = float(np.quantile([r["drift"] for r in calibration], QUANTILE)) if args.limit is None else args.limit
    result |= {
        "limit": limit,
        "held_out_questions": len(held_out),
        "held_out_without_bound": bounded(held_out, float("inf")),
        "held_out_with_bound": bounded(held_out, limit),
        "held_out_full_ttft_s": float(np.mean([r["full_ttft"] for r in held_out])),
    }
    limits = sorted({0.0, *drift.tolist()})
    result["curve"] = [{"limit": x, **bounded(rows, x)} for x in [*limits, float("inf")]]
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        curve = result["curve"]
        ax.plot(
            [c["ttft_s"] for c in curve],
            [c["tf_kl"] for c in curve],
            "o-",
            ms=3,
            label=f"{args.method}, bounded by drift",
        )
        order = np.argsort(-kl)  # an oracle: bound the questions with the largest KL first
        oracle = [
            (
                np.mean([r["full_ttft"] if i in set(order[:n]) else r["ttft"] for i, r in enumerate(rows)]),
                np.mean([0.0 if i in set(order[:n]) else r["kl"] for i, r in enumerate(rows)]),
            )
            for n in range(len(rows) + 1)
        ]
        ax.plot(*zip(*oracle), ":", color="grey", label="oracle (bound the largest KL first)")
        ends = curve[-1], curve[0]  # no bound, every question bounded: a random choice's expected line between
        ax.plot([c["ttft_s"] for c in ends], [c["tf_kl"] for c in ends], "--", color="grey", label="random questions")
        ax.set_xlabel("mean TTFT (s)")
        ax.set_ylabel("mean teacher-forced KL to full")
        ax.set_title(f"{len(rows)} questions; Spearman(drift, KL) = {result['spearman_drift_tf_kl']:.2f}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
