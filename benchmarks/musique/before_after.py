"""The default path's speed before and after a change: `rag-kvcache bench` run from two commits, same arguments,
one after the other on one machine, paired question by question.

Each commit is checked out into a git worktree under `--work` and its `bench` run with `PYTHONPATH` pointing there
(the venv's dependencies, the commit's package). Both runs index the same passages and ask the same questions;
for each method, the report gives its median TTFT in each run and the geometric mean of the per-question ratio
after / before with a bootstrap 95% interval. `full` is the machine's control: its ratio should be about 1.0, and a
method's ratio is to be read against it.

    python benchmarks/musique/before_after.py d667763 HEAD --work /tmp/ba -- \\
        --dataset ../shared/data/musique_dev.json --limit 10 --chunk-tokens 512 --methods full,epic_match --baseline full

writes `--work`/before-after.json (and prints it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def checkout(commit: str, work: Path) -> Path:
    """A worktree of `commit` under `work` (made once)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], check=True, capture_output=True, text=True)
    tree = work / f"tree-{sha.stdout.strip()[:7]}"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True)
    return tree


def run(tree: Path, out: Path, bench_args: list[str]) -> dict[str, dict[str, float]]:
    """`bench` from `tree` into `out`: question id -> method -> TTFT (s)."""
    if not (out / "results.json").is_file():
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(
            [sys.executable, "-m", "rag_kvcache", "bench", *bench_args, "--out", str(out)], env=env, check=True
        )
    ttft: dict[str, dict[str, float]] = {}
    for line in (out / "records.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        ttft.setdefault(r["id"], {})[r["method"]] = r["ttft_s"]
    return ttft


def geomean_ratio(pairs: list[tuple[float, float]], rounds: int = 10_000, seed: int = 0) -> dict[str, float]:
    """Geometric mean of after / before over the pairs, with a bootstrap 95% interval."""
    logs = [math.log(a / b) for b, a in pairs]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(rounds))
    return {
        "ratio": math.exp(statistics.fmean(logs)),
        "ci_low": math.exp(means[int(0.025 * rounds)]),
        "ci_high": math.exp(means[int(0.975 * rounds) - 1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the commit before the change")
    parser.add_argument("after", help="the commit after it")
    parser.add_argument("--work", type=Path, required=True, help="worktrees and the two bench runs")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    bench_args = argv[cut + 1 :]  # after --: bench's arguments (no --out)
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {name: checkout(commit, args.work) for name, commit in (("before", args.before), ("after", args.after))}
    runs = {name: run(tree, args.work / name, bench_args) for name, tree in trees.items()}
    ids = sorted(set(runs["before"]) & set(runs["after"]))
    methods = sorted({m for q in ids for m in runs["before"][q]} & {m for q in ids for m in runs["after"][q]})
    result: dict[str, object] = {"command": " ".join(sys.argv), "questions": len(ids), "methods": {}}
    for m in methods:
        pairs = [(runs["before"][q][m], runs["after"][q][m]) for q in ids]
        result["methods"][m] = {  # type: ignore[index]
            "median_ttft_before_s": statistics.median(b for b, _ in pairs),
            "median_ttft_after_s": statistics.median(a for _, a in pairs),
            "after_over_before": geomean_ratio(pairs),
        }
    (args.work / "before-after.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
