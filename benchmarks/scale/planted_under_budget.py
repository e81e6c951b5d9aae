"""Planted facts under a disk budget: does an index whose caches do not all fit keep the facts the default keeps?

Runs `rag-kvcache bench` twice on the same planted questions, same settings (`epic_match`, the default, against
`full`; facts left where retrieval ranks them, best last): once with no budget (every chunk's two caches made at
indexing), once with `--kv-budget` at `--share` of the bytes the first run's caches took (the chunks most central
among the corpus' embeddings cached first; a retrieved chunk without a cache computed in the request behind the
prefix and stored if the budget admits it; no neighbour cache made later, as `serve` would when quiet). Then pairs
the two runs question by question: the facts `full` answers, and of those, the ones `epic_match` keeps in each run,
with the discordant pairs and an exact two-sided sign test (McNemar) on them.

    python benchmarks/scale/planted_under_budget.py ../shared/data/musique_dev.json --limit 40 --out /tmp/pub

writes `--out`/planted-under-budget.json (and prints it); the two bench folders stay under `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).with_name("rag-kvcache"))


def bench(dataset: Path, limit: int, out: Path, budget: int | None) -> None:
    """One `bench` run into `out` (resumed if `out` holds a finished part of the same run)."""
    command = [
        CLI, "bench", "--dataset", f"planted:{dataset}", "--limit", str(limit), "--chunk-tokens", "512",
        "--methods", "full,epic_match", "--baseline", "epic_match", "--evidence", "retrieved",
        "--chunk-order", "best_last", "--out", str(out),
    ]  # fmt: skip
    if budget is not None:
        command += ["--kv-budget", str(budget)]
    if (out / "records.jsonl").is_file():
        command.append("--resume")
    subprocess.run(command, check=True)


def cache_bytes(out: Path) -> int:
    """Bytes of the chunk caches of a bench run's index."""
    return sum(p.stat().st_size for p in (out / "work" / "index" / "kv").glob("??/*.safetensors"))


def hits(out: Path) -> dict[str, dict[str, bool]]:
    """question id -> method -> whether its answer holds the planted fact."""
    found: dict[str, dict[str, bool]] = {}
    for line in (out / "records.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        found.setdefault(r["id"], {})[r["method"]] = bool(r["exact_hit"])  # the label carries the variant's k
    return found


def sign_test(b: int, c: int) -> float:
    """Exact two-sided p of `b` against `c` discordant pairs under no difference."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("musique", type=Path, help="the MuSiQue dev set in CacheBlend's layout (datasets/musique.md)")
    parser.add_argument("--limit", type=int, default=40, help="questions (default 40)")
    parser.add_argument("--share", type=float, default=0.1, help="the budget, a share of the default's cache bytes")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    default_dir, budget_dir = args.out / "default", args.out / "budget"
    bench(args.musique, args.limit, default_dir, None)
    full_bytes = cache_bytes(default_dir)
    budget = int(args.share * full_bytes)
    bench(args.musique, args.limit, budget_dir, budget)

    default, under = hits(default_dir), hits(budget_dir)
    ids = sorted(default)
    if sorted(under) != ids:
        raise SystemExit(f"the two runs asked other questions: {sorted(set(default) ^ set(under))}")
    full_disagree = [i for i in ids if default[i]["full"] != under[i]["full"]]
    answered = [i for i in ids if default[i]["full"]]  # the facts `full` answers (the default run's)
    kept_default = {i for i in answered if default[i]["epic_match"]}
    kept_budget = {i for i in answered if under[i]["epic_match"]}
    only_default, only_budget = len(kept_default - kept_budget), len(kept_budget - kept_default)
    meta = json.loads((budget_dir / "results.json").read_text(encoding="utf-8")).get("meta", {})
    result = {
        "command": " ".join(sys.argv),
        "questions": len(ids),
        "default_cache_bytes": full_bytes,
        "budget_bytes": budget,
        "budget_cache_bytes_after": cache_bytes(budget_dir),
        "facts_full_answers": len(answered),
        "full_differs_between_runs": full_disagree,
        "kept_by_epic_match_default": len(kept_default),
        "kept_by_epic_match_under_budget": len(kept_budget),
        "kept_only_by_default": only_default,
        "kept_only_under_budget": only_budget,
        "sign_test_p": sign_test(only_default, only_budget),
        "budget_run_indexing": meta.get("indexing"),
    }
    (args.out / "planted-under-budget.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
