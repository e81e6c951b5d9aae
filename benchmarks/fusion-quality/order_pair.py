"""The same planted questions with the retrieved chunks laid out two ways: in rank order (`--chunk-order rank`) and
as their caches were computed (`--chunk-order cache`, the default: a grouped index's retrieved chunks of one group
together, in indexed order). The order changes `full`'s prompt too, so both are reported. Reads two `rag-kvcache
bench` runs over the same questions, each with `full` and `METHOD`:

    python benchmarks/fusion-quality/order_pair.py RANK_OUT CACHE_OUT [METHOD] [OUT.json]

For each run: the planted facts `full` answers and `METHOD` answers (of all questions), and the share of `full`'s
that `METHOD` keeps (Wilson 95% interval). Paired over questions (bootstrap 95% intervals, 2,000 resamples): the
difference in facts answered, for `full` and for `METHOD`, and in `METHOD`'s teacher-forced KL to its run's `full`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

BOOT = 2000


def records(out: Path, method: str) -> dict[str, dict[str, dict]]:
    by_id: dict[str, dict[str, dict]] = {}
    for line in (out / "records.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        if r["method"] in ("full", method) and not r["params"].get("kv"):
            by_id.setdefault(r["id"], {})[r["method"]] = r
    return by_id


def wilson(hits: int, n: int) -> list[float]:
    if n == 0:
        return [math.nan, math.nan]
    p, z = hits / n, 1.96
    mid, half = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n),
    )
    return [round(mid - half, 3), round(mid + half, 3)]


def paired(diffs: np.ndarray, rng: np.random.Generator) -> dict[str, float | list[float]]:
    """The mean difference over questions and its bootstrap 95% interval."""
    means = diffs[rng.integers(0, len(diffs), (BOOT, len(diffs)))].mean(1)  # [BOOT]
    return {"mean": float(diffs.mean()), "ci95": [float(q) for q in np.quantile(means, [0.025, 0.975])]}


def main() -> None:
    rank_out, cache_out = Path(sys.argv[1]), Path(sys.argv[2])
    method = sys.argv[3] if len(sys.argv) > 3 else "epic_match"
    rank, cache = records(rank_out, method), records(cache_out, method)
    ids = sorted(set(rank) & set(cache))
    if not ids:
        raise SystemExit(f"{rank_out} and {cache_out} share no question")
    rng = np.random.default_rng(0)
    hit = lambda runs, m: np.array([bool(runs[i][m]["exact_hit"]) for i in ids])  # noqa: E731  [Q]
    report: dict = {"questions": len(ids), "method": method}
    for name, runs in (("rank", rank), ("cache", cache)):
        full, fused = hit(runs, "full"), hit(runs, method)
        kept = int((full & fused).sum())
        report[name] = {
            "full_facts": int(full.sum()),
            f"{method}_facts": int(fused.sum()),
            "kept_of_full": kept,
            "kept_share": round(kept / max(1, int(full.sum())), 3),
            "kept_share_wilson95": wilson(kept, int(full.sum())),
            "tf_kl_mean": float(np.mean([runs[i][method]["tf_kl"] for i in ids])),
        }
    for m in ("full", method):
        a, b = hit(rank, m), hit(cache, m)
        report[f"{m}_facts_cache_minus_rank"] = paired(b.astype(float) - a.astype(float), rng) | {
            "gained": int((b & ~a).sum()),
            "lost": int((a & ~b).sum()),
        }
    kl = np.array([cache[i][method]["tf_kl"] - rank[i][method]["tf_kl"] for i in ids])  # [Q]
    report["tf_kl_cache_minus_rank"] = paired(kl, rng)
    text = json.dumps(report, indent=1)
    if len(sys.argv) > 4:
        Path(sys.argv[4]).write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
