"""Side by side: `budget_trace.py` runs of the same stream from the same store, one per `serve --backfill-slice`
(how long a request may wait for the chunk caches the server makes between requests under a disk budget).

    python benchmarks/scale/slices_plot.py --out benchmarks/scale/budget-trace-slices.png \
        "no bound=benchmarks/scale/budget-trace-slice-inf.json" "1 s=benchmarks/scale/budget-trace-slice-1.json" ...

Plots each run's median time to the first token over a sliding window of requests, with its byte hit ratio and
Belady's in the legend, and prints a table of the runs' summaries.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=PATH of a budget_trace.py JSON")
    ap.add_argument("--out", type=Path, required=True, help="the plot (.png)")
    ap.add_argument("--window", type=int, default=50)
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    print(
        "| slice | byte hit ratio / Belady's | median TTFT, first half after warm-up / second half | full's, second half |"
    )
    print("|---|---:|---:|---:|")
    for run in args.runs:
        label, _, path = run.partition("=")
        result = json.loads(Path(path).read_text())
        ttft = [r["ttft_s"] for r in result["rows"]]
        medians = [statistics.median(ttft[max(0, i - args.window + 1) : i + 1]) for i in range(len(ttft))]
        hit, best = result["byte_hit_ratio"], result["belady_byte_hit_ratio"]
        ax.plot(range(len(ttft)), medians, label=f"{label}: byte hit ratio {hit:.2f} (Belady's {best:.2f})")
        print(
            f"| {label} | {hit:.2f} / {best:.2f} ({result['hit_ratio_of_belady']:.2f}) | "
            f"{result['median_ttft_first_half_s']:.2f} / {result['median_ttft_second_half_s']:.2f} s | "
            f"{result['median_full_ttft_second_half_s']:.2f} s |"
        )
    ax.set(
        xlabel="request",
        ylabel=f"median TTFT of the last {args.window} (s)",
        title="serve --backfill-slice: one Zipf stream from one store, a disk budget of 10%",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
